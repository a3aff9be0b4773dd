"""moe_comm.compat.deep_ep's normal (high-throughput) mode on a PrefillBuffer, against moe_comm.reference.

DeepEP's call sequence (get_dispatch_layout -> dispatch -> experts -> combine) on one rank (loopback) and
on three shm ranks in separate processes (uneven and empty ranks, all tokens to one expert, -1 slots,
two rounds): the packed receive (rows in (source rank, token) order, local ids, weights, per-expert
counts with alignment) and the combine, bitwise; the same with DeepEP's pre-quantized fp8 input (float32
scales and packed UE8M0 int32 scales, row- and column-major: the codes and scales arrive bit for bit),
and with ``num_worst_tokens`` (the fixed-size receive: the first N rows exact, -1 ids past them, the
combine exact with the rows past N poisoned, a receive over the bound a named CapacityError carrying the
outputs, and the next call exact); then what does not map raises by name.
"""

from __future__ import annotations

import pytest
import torch

import moe_comm
from moe_comm import CapacityError, PrefillBuffer, reference
from moe_comm.compat import deep_ep

HIDDEN, M, L, K = 64, 5, 3, 3   # hidden, tokens per rank (capacity), experts per rank, top-k
FP8_HIDDEN = 512                # the fp8 rounds: one packed UE8M0 word per row


def make_inputs(world: int, seed: int, tokens=None, one_expert=None, hidden=HIDDEN):
    """Per rank (x [T, H] bf16, topk_idx int64 [T, K] distinct experts with ~1/5 slots -1, weights)."""
    E = L * world
    out = []
    for r in range(world):
        g = torch.Generator().manual_seed(seed * 10 + r)
        T = (tokens or [M, 0, 3, 1])[r]
        x = torch.randn(T, hidden, generator=g).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else \
            torch.zeros(0, K, dtype=torch.int64)
        idx[torch.rand(idx.shape, generator=g) < 0.2] = -1
        if one_expert is not None:
            idx = torch.full((T, K), -1, dtype=torch.int64)
            idx[:, 1] = one_expert
        out.append((x, idx, torch.rand(T, K, generator=g)))
    return out


def experts(x, local_idx, weights, rank):
    """Toy experts: global expert g multiplies by (g + 1) / 4; one partial row per row (float32 sum in k
    order, rounded once)."""
    acc = torch.zeros(x.shape, dtype=torch.float32)
    for k in range(local_idx.shape[1]):
        g = local_idx[:, k].long() + rank * L
        scaled = (x.float() * ((g.float() + 1) / 4)[:, None]).to(x.dtype).float()
        acc += torch.where(local_idx[:, k, None] >= 0, weights[:, k, None] * scaled, 0.0)
    return acc.to(x.dtype)


def quantized(inputs, fmt):
    """The inputs with x as DeepEP's pre-quantized tuple (codes, scales) of format ``fmt``
    (reference.quantize_fp8); "e4m3" scales column-major (strides (1, T)), as SGLang's quantizer gives them."""
    out = []
    for x, idx, w in inputs:
        q, s = reference.quantize_fp8(x, fmt=fmt)
        out.append(((q, s.t().contiguous().t() if fmt == "e4m3" else s), idx, w))
    return out


def as_rows(x):
    """bf16 rows of a receive: x, or the dequantized (codes, scales)."""
    return x if not isinstance(x, tuple) else reference.dequantize_fp8(*x).to(torch.bfloat16)


def run_round(buf, rank, inputs, align=1, worst=0):
    """One DeepEP-style round on ``buf`` for this rank (``num_worst_tokens=worst``); returns a list of
    mismatches. ``inputs``' x may be pre-quantized tuples (``quantized``)."""
    world = len(inputs)
    E = L * world
    xs, idxs, ws = (list(t) for t in zip(*inputs))
    x, idx, w = inputs[rank]
    errs = []
    per_rank, rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    owners = [reference.prefill_owners(ids, E, world) for ids in idx.tolist()]
    want_in_rank = torch.tensor([[r in o for r in range(world)] for o in owners], dtype=torch.bool).view(-1, world)
    if rdma is not None or not torch.equal(in_rank, want_in_rank) or \
            per_rank.tolist() != want_in_rank.sum(0).tolist() or \
            per_expert.tolist() != torch.bincount(idx[idx >= 0], minlength=E).tolist():
        errs.append(f"rank {rank}: layout")
    recv_x, recv_idx, recv_w, counts, handle, event = buf.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=idx, topk_weights=w, expert_alignment=align, num_worst_tokens=worst)
    want = reference.prefill_dispatch(xs, idxs, ws, E, M)[rank]
    valid = want["valid"]
    n = int(valid.sum())
    rows = recv_x if not isinstance(recv_x, tuple) else recv_x[0]
    if worst:   # fixed size: the first n rows are the packed receive, ids -1 past them, no host counts
        if rows.shape[0] != worst or recv_idx.shape[0] != worst or not bool((recv_idx[n:] == -1).all()) or \
                counts != []:
            errs.append(f"rank {rank}: fixed-size receive {tuple(rows.shape)} counts {counts}")
        cut = slice(0, n)
    else:
        cut = slice(None)
        if counts != [-(-c // align) * align for c in want["expert_counts"].tolist()]:
            errs.append(f"rank {rank}: counts {counts}")
    got_x = rows[cut] if not isinstance(recv_x, tuple) else (recv_x[0][cut], recv_x[1][cut])
    same_x = (torch.equal(got_x, want["x"][valid]) if not isinstance(recv_x, tuple) else
              torch.equal(got_x[0].view(torch.uint8), want["x"][valid].view(torch.uint8))
              and got_x[1].dtype == want["scales"].dtype and torch.equal(got_x[1], want["scales"][valid]))
    if not (same_x and recv_idx.dtype == torch.int64 and torch.equal(recv_idx[cut], want["topk_idx"][valid].long())
            and torch.equal(recv_w[cut], want["topk_weights"][valid])):
        errs.append(f"rank {rank}: received rows")
    out = experts(as_rows(recv_x), recv_idx, recv_w, rank)
    out[n:] = float("nan")   # rows past the received count (fixed size) must not be read
    y, combined_w, _ = buf.combine(out, handle)
    partials = [experts(as_rows((d["x"], d["scales"]) if d["scales"] is not None else d["x"]), d["topk_idx"],
                        d["topk_weights"], r) for r, d in enumerate(reference.prefill_dispatch(xs, idxs, ws, E, M))]
    if combined_w is not None or not torch.equal(y, reference.prefill_combine(partials, idxs, E, M)[rank]):
        errs.append(f"rank {rank}: combine")
    return errs


def make_buffer(group, hidden=HIDDEN):
    """A Buffer whose budget buys exactly M tokens per rank in every input format (bf16 and the fp8 tuples
    the hidden allows: one capacity shared by all, ``Buffer.get_normal_size_hint``)."""
    budget = deep_ep.Buffer.get_normal_size_hint(M, hidden, group.world_size, L * group.world_size, K)
    return deep_ep.Buffer(group, num_nvl_bytes=budget, num_rdma_bytes=0, low_latency_mode=False)


def _rank(group, rounds=4):
    """Rounds: uneven and empty ranks (expert_alignment 1, then 2), all tokens to the last expert, every
    rank empty (the shm run takes the first and the third); then a fixed-size receive
    (num_worst_tokens = world * M, DeepEP's worst case), the last rank's tokens all on one expert."""
    buf = make_buffer(group)
    world, last = group.world_size, L * group.world_size - 1
    cases = [(make_inputs(world, 0), 1), (make_inputs(world, 1), 2), (make_inputs(world, 7, one_expert=last), 1),
             (make_inputs(world, 8, tokens=[0] * world), 1)]
    errs = []
    for inputs, align in (cases if rounds == 4 else cases[0:3:2]):
        errs += run_round(buf, group.rank, inputs, align)
    errs += run_round(buf, group.rank, make_inputs(world, 9, one_expert=last), worst=world * M)
    if buf._prefill[(HIDDEN, L * world, K, None)].max_tokens_per_rank != M:   # the budget bought exactly M tokens
        errs.append(f"rank {group.rank}: capacity")
    return errs


def _fp8_rank(group):
    """One Buffer, as DeepEP's serves every format (issue 46 item 8): bf16 input first, then DeepEP's
    pre-quantized fp8 input, float32 scales (column-major) and packed UE8M0 scales, a fixed-size receive of
    each, and bf16 again; every format at the full capacity M the budget was sized for."""
    world = group.world_size
    buf = make_buffer(group, FP8_HIDDEN)
    errs = [f"bf16: {e}" for e in run_round(buf, group.rank, make_inputs(world, 19, hidden=FP8_HIDDEN))]
    for seed, fmt in enumerate(("e4m3", "e4m3-ue8m0")):
        inputs = quantized(make_inputs(world, 20 + seed, hidden=FP8_HIDDEN), fmt)
        errs += [f"{fmt}: {e}" for e in run_round(buf, group.rank, inputs)]
        errs += [f"{fmt} worst: {e}" for e in run_round(buf, group.rank, inputs, worst=world * M + 1)]
    errs += [f"bf16 again: {e}" for e in run_round(buf, group.rank, make_inputs(world, 23, hidden=FP8_HIDDEN))]
    capacities = {fmt: b.max_tokens_per_rank for (_, _, _, fmt), b in buf._prefill.items()}
    if capacities != {None: M, "e4m3": M, "e4m3-ue8m0": M}:
        errs.append(f"rank {group.rank}: capacities {capacities}")
    return errs


def test_normal_mode_world1_equals_reference():
    (g,) = moe_comm.init(backend="loopback", world_size=1, device="cpu")
    assert _rank(g) == []
    assert _fp8_rank(g) == []


@pytest.mark.timeout(300)
def test_normal_mode_shm_world3_equals_reference():
    errs = moe_comm.launch(_rank, 3, 2, backend="shm", timeout_s=120)
    assert [e for r in errs for e in r] == []


@pytest.mark.timeout(300)
def test_normal_mode_fp8_shm_world3_equals_reference():
    errs = moe_comm.launch(_fp8_rank, 3, backend="shm", timeout_s=120)
    assert [e for r in errs for e in r] == []


def _overflow_rank(group):
    """Every rank's tokens all go to rank 0's expert 0, num_worst_tokens one short there: rank 0 raises
    CapacityError (its outputs, the first rows, attached) and still answers with its combine; the other
    ranks' calls are exact; then the next call, with room, is exact on every rank."""
    world, rank = group.world_size, group.rank
    buf = make_buffer(group)
    inputs = make_inputs(world, 30, tokens=[M] * world, one_expert=0)
    x, idx, w = inputs[rank]
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, L * world)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                  topk_idx=idx, topk_weights=w, num_worst_tokens=world * M - 1)
    out = {}
    try:
        outputs = buf.dispatch(x, **layout)
        out["raised"] = None
    except CapacityError as e:
        outputs, out["raised"] = e.result, str(e)
    recv_x, recv_idx, recv_w = outputs[:3]
    buf.combine(experts(recv_x, recv_idx, recv_w, rank), outputs[4])
    out["next"] = run_round(buf, rank, make_inputs(world, 31, tokens=[M] * world, one_expert=0), worst=world * M)
    return out


@pytest.mark.timeout(300)
def test_num_worst_tokens_overflow_is_a_named_capacity_error_then_exact():
    res = moe_comm.launch(_overflow_rank, 2, backend="shm", timeout_s=120)
    assert "received 10 rows, num_worst_tokens is 9" in res[0]["raised"] and res[1]["raised"] is None, res
    assert [r["next"] for r in res] == [[], []]


def test_the_budget_is_shared_by_every_input_format():
    """Issue 46 item 8: a budget fixed up front (as DeepEP's callers size its one buffer) serves bf16 and
    then fp8 tuples: the first call of a shape reserves one capacity for every input format (the largest
    whose buffers all fit), not the whole budget for the first format, so the fp8 call after a bf16 one is
    not refused; the reservation is the size hint of that capacity, within the budget."""
    (g,) = moe_comm.init(backend="loopback", world_size=1, device="cpu")
    hint = deep_ep.Buffer.get_normal_size_hint(M, FP8_HIDDEN, 1, L, K)
    assert hint == sum(PrefillBuffer.required_bytes(1, L, FP8_HIDDEN, M, K, dispatch_format=f)
                       for f in (None, "e4m3", "e4m3-ue8m0"))
    assert deep_ep.Buffer.get_normal_size_hint(M, HIDDEN, 1, L, K) == PrefillBuffer.required_bytes(1, L, HIDDEN, M, K)
    buf = deep_ep.Buffer(g, num_nvl_bytes=hint + hint // 3, num_rdma_bytes=0, low_latency_mode=False)
    assert run_round(buf, 0, make_inputs(1, 40, hidden=FP8_HIDDEN)) == []
    assert run_round(buf, 0, quantized(make_inputs(1, 41, hidden=FP8_HIDDEN), "e4m3")) == []
    assert run_round(buf, 0, quantized(make_inputs(1, 42, hidden=FP8_HIDDEN), "e4m3-ue8m0")) == []
    caps = {b.max_tokens_per_rank for b in buf._prefill.values()}
    assert len(buf._prefill) == 3 and len(caps) == 1 and caps.pop() >= M
    assert buf._nvl_bytes_used <= buf.num_nvl_bytes


class _SpyEvent(deep_ep.EventOverlap):
    """An EventOverlap holding an event whose wait is recorded (on CPU there is no CUDA event to wait on)."""

    def __init__(self, log):
        super().__init__(event=object())
        self.log = log

    def current_stream_wait(self) -> None:
        self.log.append("waited")


def test_previous_event_is_waited_on_before_the_call():
    """Issue 46 item 8: DeepEP's previous_event orders the call after the work it marks: get_dispatch_layout,
    dispatch and combine make the caller's stream wait on it before launching (recorded here by a spy, as
    the CPU has no CUDA event); one without an event (no async_finish) waits on nothing; anything else is
    a TypeError before anything is launched, and the next call is exact."""
    (g,) = moe_comm.init(backend="loopback", world_size=1, device="cpu")
    buf = make_buffer(g)
    x, idx, w = make_inputs(1, 43)[0]
    log, launched = [], []
    spy = _SpyEvent(log)
    original = PrefillBuffer.dispatch
    PrefillBuffer.dispatch = lambda self, *a, **k: (launched.append(list(log)), original(self, *a, **k))[1]
    try:
        _, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, L, previous_event=spy)
        assert log == ["waited"]
        layout = dict(num_tokens_per_expert=per_expert, is_token_in_rank=in_rank, topk_idx=idx, topk_weights=w)
        recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(x, previous_event=spy, **layout)
        assert launched == [["waited", "waited"]]   # waited before the dispatch was launched
        buf.combine(experts(recv_x, recv_idx, recv_w, 0), handle, previous_event=spy)
        assert log == ["waited"] * 3
        with pytest.raises(TypeError, match="previous_event must be an EventOverlap"):
            buf.dispatch(x, previous_event=object(), **layout)
        assert len(launched) == 1
        _, _, _, _, handle, _ = buf.dispatch(x, previous_event=deep_ep.EventOverlap(), **layout)
        buf.combine(experts(*buf_outputs(handle), 0), handle)
    finally:
        PrefillBuffer.dispatch = original
    assert run_round(buf, 0, make_inputs(1, 44)) == []


def buf_outputs(handle):
    """(rows, local ids, weights) a normal-mode handle's dispatch returned."""
    r = handle.recv
    return r.x, r.topk_idx, r.topk_weights


def test_what_does_not_map_raises_by_name():
    (g,) = moe_comm.init(backend="loopback", world_size=1, device="cpu")
    buf = make_buffer(g)
    x, idx, w = make_inputs(1, 3)[0]
    layout = dict(num_tokens_per_expert=torch.zeros(L, dtype=torch.int32), topk_idx=idx, topk_weights=w)
    with pytest.raises(NotImplementedError, match="cached dispatch"):
        buf.dispatch(x, handle=object(), **layout)
    with pytest.raises(ValueError, match=r"x\[1\] \(the scales\) is torch.float32 \(5, 1\); the normal mode takes "
                                         r"float32 \[5, 64 // 128\]"):
        buf.dispatch((x.to(torch.float8_e4m3fn), torch.ones(x.shape[0], 1)), **layout)
    with pytest.raises(NotImplementedError, match=r"without topk_idx"):   # internode_dispatch is dispatch (any group)
        buf.internode_dispatch(x)
    with pytest.raises(NotImplementedError, match=r"without topk_idx \(DeepEP's with_topk=False"):
        buf.dispatch(x, num_tokens_per_expert=layout["num_tokens_per_expert"])
    with pytest.raises(ValueError, match="needs num_tokens_per_expert"):
        buf.dispatch(x, topk_idx=idx)
    big = torch.randn(M + 1, HIDDEN).bfloat16()
    with pytest.raises(ValueError, match=r"raise num_nvl_bytes to deep_ep.Buffer.get_normal_size_hint\(6, 64, 1, 3, 3\)"):
        buf.dispatch(big, **dict(layout, topk_idx=torch.zeros(M + 1, K, dtype=torch.int64), topk_weights=None))
    recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(x, **layout)
    with pytest.raises(NotImplementedError, match="backward pass"):
        buf.combine(recv_x, handle, topk_weights=recv_w)
    with pytest.raises(NotImplementedError, match="bias"):
        buf.combine(recv_x, handle, bias=recv_x)
    y, _, _ = buf.combine(experts(recv_x, recv_idx, recv_w, 0), handle)   # still answers its dispatch
    assert y.shape == x.shape
    with pytest.raises(ValueError, match="num_nvl_bytes=16 is too small"):
        deep_ep.Buffer(g, num_nvl_bytes=16).dispatch(x, **layout)
    groups = moe_comm.init(backend="loopback", world_size=2, device="cpu")
    with pytest.raises(NotImplementedError, match="no receive hook"):
        make_buffer(groups[0]).get_dispatch_layout(idx, 2 * L)
