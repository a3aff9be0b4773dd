"""The decode engine under faults, on CPU ranks over shared memory (fused EP backend).

- A rank late by more than the timeout in one decode step: every rank recovers with ``group.reset()``,
  replays the failed step, and every request's logits equal the reference model's.
- The late rank comes on time to the reset but late to the exchange that follows it (after the others
  decided it without it): it raises ExcludedError there; the others recover again, exclude it and finish
  exactly without its experts.
- A rank killed mid-run: the survivors find at the reset that it is gone, ``exclude`` it and finish; their
  logits equal the reference's with the dead rank's experts unrouted from the step they resumed at (a
  one-layer model, whose KV cache does not depend on the experts, so the reference is exact: with more
  layers the cache of earlier positions keeps the experts it was computed with).
"""

import os
import time
from datetime import timedelta

import pytest
import torch

import moe_comm
from moe_comm import LaunchError
from moe_comm.group import _EXCHANGE
from moe_comm.trace import analyze
from moe_comm.serving import (DecodeEngine, Generation, MoEDecoder, ReferenceModel, Request, build_weights,
                              check_generation, make_comms, model_config)

TIMEOUT_S, MAX_BATCH, RTOL = 2.0, 4, 1e-4


class FaultyComm:
    """A MoE comm backend that injects ``fault()`` before its ``at``-th dispatch (send phases counted)."""

    def __init__(self, inner, at: int, fault):
        self.inner, self.at, self.fault, self.calls = inner, at, fault, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def dispatch(self, x, topk_idx, phase="both"):
        if phase != "recv":
            self.calls += 1
            if self.calls == self.at:
                self.fault()
        return self.inner.dispatch(x, topk_idx, phase)

    def combine(self, *args, **kw):
        return self.inner.combine(*args, **kw)


def _requests(rank, vocab):
    g = torch.Generator().manual_seed(11 + rank)
    return [Request(torch.randint(0, vocab, (1 + (2 * i + rank) % 3,), generator=g).tolist(), 6) for i in range(2)]


def _config():
    return model_config("mixtral", "cpu", num_layers=1, num_experts=6)  # top-2 of 6: 2 experts per rank


EXCHANGE_DECIDED = "test/exchange-decided"   # store key: rank 0's first exchange meeting has its decision


def _late_to_the_exchange(group, fault_rank):
    """Rank 0 sets EXCHANGE_DECIDED once its first exchange meeting is decided; rank ``fault_rank``
    waits for it before its first exchange."""
    store = group.heap._control.store
    if group.rank == 0:
        agree = group.heap.agree

        def signalling(live, payload):
            try:
                return agree(live, payload)
            finally:
                if payload[0] == _EXCHANGE:
                    group.heap.agree = agree
                    store.set(EXCHANGE_DECIDED, b"1")
        group.heap.agree = signalling
    elif group.rank == fault_rank:
        exchange = group.exchange

        def late(values):
            store.wait([EXCHANGE_DECIDED], timedelta(seconds=120))
            return exchange(values)
        group.exchange = late


def _serve(group, fault_rank, at, kind, trace_dir=None):
    torch.set_num_threads(1)
    cfg = _config()
    full = build_weights(cfg)
    (comm,) = make_comms("fused", [group], cfg, MAX_BATCH)
    if kind == "late_exchange":
        _late_to_the_exchange(group, fault_rank)
    if group.rank == fault_rank:
        fault = (lambda: time.sleep(TIMEOUT_S * 1.3)) if kind.startswith("late") else (lambda: os._exit(9))
        comm = FaultyComm(comm, at, fault)
    model = MoEDecoder(full.for_rank(group.rank, group.world_size), comm, MAX_BATCH)
    engine = DecodeEngine([model], trace_dir=trace_dir)
    (gens,) = engine.generate([_requests(group.rank, cfg.vocab)], record_logits=True)
    return [(g.tokens, g.logits) for g in gens], engine.recoveries, engine.lost_ranks, group.live_ranks


def _check_against_reference(rank, outs, excluded_from=None, excluded=frozenset()):
    """Each step's logits against the reference; from decode step ``excluded_from`` on, without the
    ``excluded`` experts. Returns the worst relative error."""
    cfg = _config()
    ref = ReferenceModel(build_weights(cfg), "torch")
    worst = 0.0
    for req, (tokens, logits) in zip(_requests(rank, cfg.vocab), outs):
        if excluded_from is None:
            worst = max(worst, check_generation(ref, req, Generation(tokens, logits), RTOL, f"rank {rank}"))
            continue
        seq = list(req.prompt)
        for n, tok in enumerate(tokens):  # row n: prefill (n = 0) or decode step n - 1
            gone = excluded if n - 1 >= excluded_from else frozenset()
            want = ref.logits(seq, gone)[-1]
            err = ((logits[n] - want).abs().max() / want.abs().max()).item()
            assert err <= RTOL, f"rank {rank} token {n}: {err}"
            assert tok == int(want.argmax()), f"rank {rank} token {n}"
            worst = max(worst, err)
            seq.append(tok)
    return worst


@pytest.mark.timeout(600)
def test_engine_recovers_from_a_late_rank_and_stays_exact():
    results = moe_comm.launch(_serve, 3, 1, 4, "late", backend="shm", timeout_s=TIMEOUT_S)
    for rank, (outs, recoveries, lost, live) in enumerate(results):
        assert recoveries and lost == [] and live == [0, 1, 2], (rank, recoveries)
        _check_against_reference(rank, outs)


@pytest.mark.timeout(600)
def test_engine_excludes_a_rank_that_comes_after_the_exchange_was_decided():
    with pytest.raises(LaunchError) as info:
        moe_comm.launch(_serve, 3, 1, 4, "late_exchange", backend="shm", timeout_s=TIMEOUT_S, grace_s=300)
    err = info.value
    assert sorted(err.failures) == [1] and "ExcludedError: exchange: rank 1 came to the recovery meeting after " \
        "the ranks [0, 2] had decided without it" in err.failures[1], err.failures
    local = _config().num_experts // 3
    for rank in (0, 2):
        outs, recoveries, lost, live = err.results[rank]
        assert lost == [1] and live == [0, 2], (rank, recoveries)
        where, step, _, resume = recoveries[-1]
        assert resume <= step
        _check_against_reference(rank, outs, resume, frozenset(range(local, 2 * local)))


@pytest.mark.timeout(600)
def test_engine_excludes_a_killed_rank_and_the_survivors_finish_exactly(tmp_path, monkeypatch):
    """... and, asked to (``trace_dir``, recorder on), dumps the survivors' flight recorders at the
    fault, from which the analyzer names the dead rank as the one that never published a dispatch."""
    monkeypatch.setenv("MOE_COMM_TRACE", "8")
    with pytest.raises(LaunchError) as info:
        moe_comm.launch(_serve, 3, 2, 4, "kill", str(tmp_path), backend="shm", timeout_s=TIMEOUT_S, grace_s=300)
    err = info.value
    assert sorted(err.failures) == [2]
    cfg = _config()
    local = cfg.num_experts // 3
    for rank in (0, 1):
        outs, recoveries, lost, live = err.results[rank]
        assert lost == [2] and live == [0, 1], (rank, recoveries)
        where, step, _, resume = recoveries[-1]
        assert where == "decode" and resume <= step
        _check_against_reference(rank, outs, resume, frozenset(range(2 * local, 3 * local)))
    last_fault = tmp_path / f"fault{len(err.results[0][1])}"   # (a loaded machine may time out earlier too)
    diag = analyze.analyze(analyze.load_dumps(str(last_fault)))
    assert diag.ranks == [0, 1] and diag.missing == [2]
    assert {(x["rank"], x["op"]) for x in diag.never_published} == {(2, "dispatch")}, diag.lines
