"""moe_comm.metrics: what a scrape says matches what the calls did (the flight recorder's records, the
device counters, the references), with the recorder on and off; errors, epochs and exclusions are
counted once; device counters read through copies lag until the next check; the standalone exporter
answers over HTTP in a slow-rank and a dead-rank run; the serving adapters' registration reaches the
registry a framework serves (prometheus_client's, as vLLM and SGLang build it: tests/vllm and
tests/sglang run the frameworks' own code)."""

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

pytest.importorskip("prometheus_client")
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.multiprocess import MultiProcessCollector  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import moe_comm  # noqa: E402
from moe_comm import (AllToAllvDynamic, CommTimeoutError, EPBuffer, InvalidIndexError, LaunchError,  # noqa: E402
                      metrics, reference)
from moe_comm.serving import ep_group  # noqa: E402
from moe_comm.trace.recorder import channel_records  # noqa: E402

from fault_cases import slow_then_dead  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ROW = (8,)            # float32 AllToAllvDynamic rows: 32 bytes
CAP = 4
E, H, M, K = 6, 64, 2, 2


def samples(text: str) -> dict:
    """(sample name, frozenset of its labels) -> value, from Prometheus text (prometheus_client's parser)."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(got: dict, name: str, **labels):
    return got.get((name, frozenset((k, str(v)) for k, v in labels.items())))


def _a2a_round(ops, counts):
    """One forward and one reverse call on every loopback rank; counts[r] = rank r's send counts."""
    for op, c in zip(ops, counts):
        op(torch.randn(int(c.sum()), *ROW), c, phase="send")
    res = [op(phase="recv") for op in ops]
    for op, r in zip(ops, res):
        op.combine(r.recv, r.handle, phase="send")
    for op in ops:
        op.combine(phase="recv")


def _ep_round(eps, idxs):
    """One dispatch and combine on every loopback rank; returns the dispatch results."""
    for ep, i in zip(eps, idxs):
        ep.dispatch(torch.randn(i.shape[0], ep.hidden).to(torch.bfloat16), i, phase="send")
    ds = [ep.dispatch(phase="recv") for ep in eps]
    for ep, d, i in zip(eps, ds, idxs):
        ep.combine(d.x, torch.rand(i.shape[0], K), d.handle, phase="send")
    for ep in eps:
        ep.combine(phase="recv")
    return ds


def test_a_scrape_matches_the_recorded_calls_and_the_device_counters():
    """Loopback world 3, recorder on: two AllToAllvDynamic round trips and two dispatch/combine calls.
    Calls per op, rows and bytes per peer, the wait totals (= the channels' wait statistics), the
    per-call wait histogram (= the records' WAITED words) and the expert load (= the reference's counts)
    are exact; a second scrape adds nothing; a ring too small for the calls between two scrapes counts
    the calls it lost."""
    world = 3
    groups = moe_comm.init(backend="loopback", world_size=world, device="cpu", timeout_s=5.0, trace=8)
    exp = metrics.Exporter(groups)
    ops = [AllToAllvDynamic(g, CAP, ROW, torch.float32) for g in groups]
    eps = [EPBuffer(g, E, H, M, K) for g in groups]
    a2a_calls = [[torch.tensor([1, 0, 2]), torch.tensor([3, 1, 0]), torch.tensor([0, 2, 4])],
                 [torch.tensor([2, 2, 0]), torch.tensor([0, 0, 1]), torch.tensor([4, 1, 1])]]
    ep_calls = [[torch.tensor([[0, 5], [1, -1]]), torch.tensor([[4, 5]]), torch.tensor([[2, 3], [0, 1]])],
                [torch.tensor([[5, 4], [3, 2]]), torch.tensor([[1, -1], [0, 4]]), torch.tensor([[2, -1]])]]
    for counts, idxs in zip(a2a_calls, ep_calls):
        _a2a_round(ops, counts)
        _ep_round(eps, idxs)
    got = samples(exp.text())
    for r in range(world):
        for op in ("alltoallv", "alltoallv.combine", "dispatch", "combine"):
            assert value(got, "moe_comm_calls_total", rank=r, op=op) == 2
            assert value(got, "moe_comm_recorder_missed_calls_total", rank=r, op=op) == 0
        for j in range(world):
            sent = sum(int(c[r][j]) for c in a2a_calls)
            back = sum(int(c[j][r]) for c in a2a_calls)
            assert value(got, "moe_comm_rows_sent_total", rank=r, op="alltoallv", peer=j) == sent
            assert value(got, "moe_comm_rows_received_total", rank=r, op="alltoallv", peer=j) == back
            assert value(got, "moe_comm_bytes_sent_total", rank=r, op="alltoallv", peer=j) == 32 * sent
            assert value(got, "moe_comm_rows_received_total", rank=r, op="alltoallv.combine", peer=j) == sent
        for name, ch in (("alltoallv", ops[r]._fwd), ("dispatch", eps[r]._dispatch_ch),
                         ("combine", eps[r]._combine_ch)):
            ns, count = ch.wait_stats.tolist()
            recs = channel_records(ch)
            for j in range(world):
                total = value(got, "moe_comm_wait_seconds_total", rank=r, op=name, peer=j)
                n = value(got, "moe_comm_call_wait_seconds_count", rank=r, op=name, peer=j)
                s = value(got, "moe_comm_call_wait_seconds_sum", rank=r, op=name, peer=j)
                if j == r:   # its own flag is not a peer's
                    assert total is None and n is None
                    continue
                assert total == pytest.approx(ns[j] / 1e9) and count[j] == 2
                assert value(got, "moe_comm_waits_total", rank=r, op=name, peer=j) == 2
                assert n == 2 and s == pytest.approx(sum(x.waited[j] for x in recs) / 1e9)
        expected = [sum(int(reference.dispatch([torch.zeros(i.shape[0], H) for i in idxs], idxs, E, M)[r]["counts"][e])
                        for idxs in ep_calls) for e in range(E // world)]
        assert eps[r].expert_token_counts.tolist() == expected
        for e, n in enumerate(expected):
            assert value(got, "moe_comm_expert_rows_total", rank=r, op="dispatch", expert=r * E // world + e) == n
        assert value(got, "moe_comm_recorder_records", rank=r) == 8
        assert value(got, "moe_comm_epoch", rank=r) == 0 and value(got, "moe_comm_resets_total", rank=r) == 0
        assert value(got, "moe_comm_excluded_rows_total", rank=r, op="dispatch") == 0
    assert samples(exp.text()) == got   # no call since: nothing added

    small = moe_comm.init(backend="loopback", world_size=2, device="cpu", timeout_s=5.0, trace=2)
    exp = metrics.Exporter(small)
    a2as = [AllToAllvDynamic(g, CAP, ROW, torch.float32) for g in small]
    _a2a_round(a2as, [torch.tensor([1, 1]), torch.tensor([2, 0])])
    exp.refresh()
    for _ in range(3):   # 3 calls between two scrapes, a ring of 2: the first one's record is overwritten
        _a2a_round(a2as, [torch.tensor([1, 1]), torch.tensor([2, 0])])
    got = samples(exp.text())
    for r in range(2):
        assert value(got, "moe_comm_calls_total", rank=r, op="alltoallv") == 4
        assert value(got, "moe_comm_recorder_missed_calls_total", rank=r, op="alltoallv") == 1
        assert value(got, "moe_comm_rows_sent_total", rank=r, op="alltoallv", peer=0) == 3 * (1 if r == 0 else 2)
        assert value(got, "moe_comm_call_wait_seconds_count", rank=r, op="alltoallv", peer=1 - r) == 3
        assert value(got, "moe_comm_waits_total", rank=r, op="alltoallv", peer=1 - r) == 4   # totals: every call


def _a2a_calls(ops, counts, calls=1):
    """``calls`` AllToAllvDynamic forward calls on every live loopback rank of ``ops``; counts[r] = rank r's."""
    for _ in range(calls):
        for op, c in zip(ops, counts):
            op(torch.randn(int(c.sum()), *ROW), c, phase="send")
        for op in ops:
            op(phase="recv")


def _rows_received(got, ranks, world):
    return {r: [value(got, "moe_comm_rows_received_total", rank=r, op="alltoallv", peer=j) for j in range(world)]
            for r in ranks}


def test_per_call_metrics_keep_counting_after_a_reset_an_exclusion_and_an_abort():
    """Issue 46's reproducer, then the same after an exclusion and an abort: the ring is read in call order
    (epoch, call), whatever status bits a record carries, so a scrape after every call counts that call.
    Loopback world 2, recorder on (2 records: the ring wraps, so rows are reused), AllToAllvDynamic rank 0 sending [1, 1], rank 1 [1, 2]: one
    call, a scrape, ``reset()`` on both, three calls with a scrape after each: rank 1 has received 2/4,
    3/6, 4/8 rows from ranks 0/1 (it stayed at 2/4 when the first call of the new epoch, tagged DONE|STALE,
    outranked every later record). Then an aborted call (an input error on every rank, nothing recorded)
    and the call after it (STALE: its per-peer words are not its own): both missed, no rows; the next calls
    count again. A call not scraped before a reset, whose record the new epoch's calls overwrite, is missed
    (the calls of each ended epoch are known). World 3 with rank 2 silent: a timeout, ``exclude([2])``,
    then every call counts."""
    groups = moe_comm.init(backend="loopback", world_size=2, device="cpu", timeout_s=5.0, trace=2)
    exp = metrics.Exporter(groups)
    ops = [AllToAllvDynamic(g, CAP, ROW, torch.float32) for g in groups]
    counts = [torch.tensor([1, 1]), torch.tensor([1, 2])]
    _a2a_calls(ops, counts)
    assert _rows_received(samples(exp.text()), (1,), 2) == {1: [1, 2]}
    for g in groups:
        g.reset()
    for n in (2, 3, 4):
        _a2a_calls(ops, counts)
        got = samples(exp.text())
        assert _rows_received(got, (0, 1), 2) == {0: [n, n], 1: [n, 2 * n]}, n
        for r in range(2):
            assert value(got, "moe_comm_rows_sent_total", rank=r, op="alltoallv", peer=1) == n * (1 if r == 0 else 2)
            assert value(got, "moe_comm_bytes_received_total", rank=r, op="alltoallv", peer=0) == 32 * n
            assert value(got, "moe_comm_call_wait_seconds_count", rank=r, op="alltoallv", peer=1 - r) == n
            assert value(got, "moe_comm_recorder_missed_calls_total", rank=r, op="alltoallv") == 0
    for op in ops:   # an input error on every rank: each takes part by aborting, nobody waits
        with pytest.raises(TypeError, match="dtype"):
            op(torch.randn(2, *ROW).double(), torch.tensor([1, 1]), phase="send")
    _a2a_calls(ops, counts)      # on a row nobody prepared: STALE, its rows are not reported
    got = samples(exp.text())
    assert _rows_received(got, (0, 1), 2) == {0: [4, 4], 1: [4, 8]}
    for r in range(2):
        assert value(got, "moe_comm_recorder_missed_calls_total", rank=r, op="alltoallv") == 2
        assert value(got, "moe_comm_calls_total", rank=r, op="alltoallv") == 6
    for n in (5, 6):
        _a2a_calls(ops, counts)
        got = samples(exp.text())
        assert _rows_received(got, (0, 1), 2) == {0: [n, n], 1: [n, 2 * n]}, n
        assert value(got, "moe_comm_call_wait_seconds_count", rank=1, op="alltoallv", peer=0) == n
    _a2a_calls(ops, counts)      # not scraped before the reset: the new epoch's calls overwrite its record
    for g in groups:
        g.reset()
    _a2a_calls(ops, counts, calls=2)
    got = samples(exp.text())
    assert _rows_received(got, (0, 1), 2) == {0: [8, 8], 1: [8, 16]}
    assert value(got, "moe_comm_recorder_missed_calls_total", rank=1, op="alltoallv") == 3

    groups = moe_comm.init(backend="loopback", world_size=3, device="cpu", timeout_s=0.3, trace=8)
    exp = metrics.Exporter(groups)
    ops = [AllToAllvDynamic(g, CAP, ROW, torch.float32) for g in groups]
    counts = [torch.tensor([1, 2, 1]), torch.tensor([3, 1, 1]), torch.tensor([1, 1, 1])]
    _a2a_calls(ops, counts)
    exp.refresh()
    for op, c in zip(ops[:2], counts):   # rank 2 silent
        op(torch.randn(int(c.sum()), *ROW), c, phase="send")
    for op in ops[:2]:
        with pytest.raises(CommTimeoutError, match="waiting for peer rank 2"):
            op(phase="recv")
    exp.refresh()
    for g in groups[:2]:
        assert g.exclude([2]) == [2]
    for n in (1, 2, 3):
        _a2a_calls(ops[:2], counts[:2])
        got = samples(exp.text())   # the timed-out call received its rows from ranks 0 and 1 too
        assert _rows_received(got, (0, 1), 3) == {0: [2 + n, 6 + 3 * n, 1], 1: [4 + 2 * n, 2 + n, 1]}, n
        assert value(got, "moe_comm_rows_sent_total", rank=0, op="alltoallv", peer=2) == 2   # dropped since
        assert value(got, "moe_comm_recorder_missed_calls_total", rank=0, op="alltoallv") == 0


def test_with_the_recorder_off_calls_errors_and_expert_load_still_count():
    """Recorder off: calls, expert load and the group's state are exported; the recorder's metrics
    (rows, bytes, waits) have no series, and moe_comm_recorder_records says 0. Two buffers of one group
    (e.g. two layer shapes) add up under the same labels."""
    groups = moe_comm.init(backend="loopback", world_size=2, device="cpu", timeout_s=5.0, trace=0)
    exp = metrics.Exporter(groups)
    eps = [EPBuffer(g, E, H, M, K) for g in groups]
    others = [EPBuffer(g, E, 2 * H, M, K) for g in groups]
    _ep_round(eps, [torch.tensor([[0, 5], [1, 2]]), torch.tensor([[4, 3]])])
    exp.refresh()
    for _ in range(2):
        _ep_round(others, [torch.tensor([[3, 4]]), torch.tensor([[0, 1], [2, -1]])])
        exp.refresh()
    got = samples(exp.text())
    for r in range(2):
        assert value(got, "moe_comm_recorder_records", rank=r) == 0
        assert value(got, "moe_comm_calls_total", rank=r, op="dispatch") == 3
        assert value(got, "moe_comm_calls_total", rank=r, op="combine") == 3
        load = (eps[r].expert_token_counts + others[r].expert_token_counts).tolist()
        assert [value(got, "moe_comm_expert_rows_total", rank=r, op="dispatch", expert=r * 3 + e)
                for e in range(3)] == load == ([3, 3, 3] if r == 0 else [3, 3, 1])
        assert value(got, "moe_comm_peer_excluded", rank=r, peer=1 - r) == 0
    recorder = {s.name for s in metrics.SPECS if s.recorder}
    assert not [k for k in got if any(k[0].startswith(n.removesuffix("_total")) for n in recorder)], got


def test_errors_epochs_and_exclusions_are_counted_once():
    """Loopback world 3, rank 2 silent: ranks 0 and 1 time out waiting for it (raised again at every
    check: counted once); they exclude it (epoch 1, one reset, peer 2 excluded); then an expert id out of
    range raises InvalidIndexError at each of two calls (counted twice), and a slot routed to rank 2's
    expert is not sent (counted). (A reset that cannot meet a rank is counted the same way, as a timeout
    of op "reset": loopback meetings cannot miss a rank, the shm test's recovery can.)"""
    groups = moe_comm.init(backend="loopback", world_size=3, device="cpu", timeout_s=0.3, trace=0)
    exp = metrics.Exporter(groups)
    eps = [EPBuffer(g, E, H, M, K) for g in groups]
    _ep_round(eps, [torch.tensor([[0, 1]])] * 3)   # allocates every rank's buffers (collective)
    ops = [AllToAllvDynamic(g, CAP, ROW, torch.float32) for g in groups]
    for op in ops[:2]:
        op(torch.randn(2, *ROW), torch.tensor([1, 1, 0]), phase="send")
    for op in ops[:2]:
        with pytest.raises(CommTimeoutError, match="waiting for peer rank 2"):
            op(phase="recv")
    exp.refresh()
    for g in groups[:2]:
        for _ in range(3):
            with pytest.raises(CommTimeoutError):
                g.check()
    for g in groups[:2]:
        assert g.exclude([2]) == [2]
    got = samples(exp.text())
    for r in (0, 1):
        errors = {dict(k[1])["kind"] + " " + dict(k[1])["op"] + " " + dict(k[1])["peer"]: v
                  for k, v in got.items() if k[0] == "moe_comm_errors_total" and ("rank", str(r)) in k[1]}
        assert errors == {"timeout alltoallv 2": 1}, errors
        assert value(got, "moe_comm_epoch", rank=r) == 1 and value(got, "moe_comm_resets_total", rank=r) == 1
        assert [value(got, "moe_comm_peer_excluded", rank=r, peer=j) for j in range(3)] == [0, 0, 1]

    for _ in range(2):
        idxs = [torch.tensor([[99, 4]]), torch.tensor([[0, 1]])]   # 99: out of range; 4: rank 2's expert
        for ep, i in zip(eps[:2], idxs):
            ep.dispatch(torch.randn(1, H).to(torch.bfloat16), i, phase="send")
        with pytest.raises(InvalidIndexError):
            eps[0].dispatch(phase="recv")
        eps[1].dispatch(phase="recv")
    got = samples(exp.text())
    for r in (0, 1):   # calls of both epochs: the reset zeroed the device's count, not the metric
        assert value(got, "moe_comm_calls_total", rank=r, op="dispatch") == 3
        assert value(got, "moe_comm_calls_total", rank=r, op="alltoallv") == 1
    assert value(got, "moe_comm_errors_total", rank=0, op="dispatch", kind="invalid_index", peer="") == 2
    assert value(got, "moe_comm_excluded_rows_total", rank=0, op="dispatch") == 2
    assert value(got, "moe_comm_excluded_rows_total", rank=1, op="dispatch") == 0


def test_device_counters_read_through_copies_lag_until_the_next_check():
    """The CUDA path on the CPU: with copies (``DeviceReads(copy=True)``) a refresh never reads a device
    counter itself; it asks for copies (``group.on_check``) that the next ``check()`` makes (on CUDA: a
    non-blocking copy on a side stream; here a plain copy). So the first scrape has no calls and no
    expert load, the next one (after a check) has them. What this cannot show: the side stream, pinned
    memory, and that nothing waits for the compute stream (the GPU check script does)."""
    groups = moe_comm.init(backend="loopback", world_size=2, device="cpu", trace=0)
    exp = metrics.Exporter(groups)
    for g in groups:
        exp.state(g, copy=True)
    eps = [EPBuffer(g, E, H, M, K) for g in groups]
    _ep_round(eps, [torch.tensor([[0, 1], [1, 5]]), torch.tensor([[3, -1]])])
    got = samples(exp.text())
    assert value(got, "moe_comm_calls_total", rank=0, op="dispatch") is None
    assert value(got, "moe_comm_expert_rows_total", rank=0, op="dispatch", expert=1) is None
    assert all(g.on_check is not None for g in groups)   # the copies asked for
    groups[0].check()                                   # what the end of the next op call (or a step) runs
    assert groups[0].on_check is None and groups[1].on_check is not None
    got = samples(exp.text())
    assert value(got, "moe_comm_calls_total", rank=0, op="dispatch") == 1
    assert [value(got, "moe_comm_expert_rows_total", rank=0, op="dispatch", expert=e) for e in range(3)] == [1, 2, 0]
    assert value(got, "moe_comm_calls_total", rank=1, op="dispatch") is None


SLOW, DEAD, SLEEP_S, CALLS = 1, 2, 1.2, 2


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        return r.read().decode()


def _exported_run(group):
    """World 3 with the standalone exporter in every rank: CALLS calls with rank SLOW sleeping before each
    send; then rank DEAD dies before the next call, the others time out waiting for it; each survivor
    then scrapes its own /metrics over HTTP and returns the text."""
    server = metrics.serve(0, addr="127.0.0.1")
    slow_then_dead(group, SLOW, DEAD, SLEEP_S, CALLS)
    text = _scrape(server.port)
    server.close()
    return text


@pytest.mark.timeout(300)
def test_standalone_exporter_names_the_slow_and_the_dead_rank_over_http(monkeypatch):
    """Shm processes, world 3, recorder on, each rank serving moe_comm.metrics.serve(): over HTTP, the
    survivors' scrapes show the slow rank's wait (most of the sleeps, in the totals and the histogram)
    above the other peer's, and one timeout naming the dead rank, whose expired wait is in the
    histogram over 1 s (the totals count only waits that got the flag)."""
    monkeypatch.setenv("MOE_COMM_TRACE", "8")
    with pytest.raises(LaunchError) as info:
        moe_comm.launch(_exported_run, 3, backend="shm", timeout_s=4)
    assert list(info.value.failures) == [DEAD]
    for r in (0,):   # rank 0: waits for SLOW; rank SLOW: its own waits are not on itself
        got = samples(info.value.results[r])
        slow = value(got, "moe_comm_wait_seconds_total", rank=r, op="alltoallv", peer=SLOW)
        other = value(got, "moe_comm_wait_seconds_total", rank=r, op="alltoallv", peer=DEAD)
        # a quarter of the sleeps at least: a rank starved of CPU (2 cores, 3 interpreted ranks) reaches
        # its wait late and waits less
        assert slow > 0.25 * CALLS * SLEEP_S and slow > 2 * other, (slow, other)
        waits = value(got, "moe_comm_call_wait_seconds_sum", rank=r, op="alltoallv", peer=SLOW)
        assert waits >= slow * (1 - 1e-12), (waits, slow)   # the same waits and more, summed in another order
    for r in (0, SLOW):
        got = samples(info.value.results[r])
        assert value(got, "moe_comm_errors_total", rank=r, op="alltoallv", kind="timeout", peer=DEAD) == 1
        assert value(got, "moe_comm_calls_total", rank=r, op="alltoallv") == CALLS + 1
        # the expired wait (about the 4 s timeout) is in the histogram's top buckets, not in the totals
        waits = value(got, "moe_comm_call_wait_seconds_count", rank=r, op="alltoallv", peer=DEAD)
        assert waits - value(got, "moe_comm_call_wait_seconds_bucket", rank=r, op="alltoallv", peer=DEAD, le=1.0) >= 1
        assert value(got, "moe_comm_waits_total", rank=r, op="alltoallv", peer=DEAD) == waits - 1


def test_serving_adapters_register_in_the_process_registry():
    """The adapters' group (``ep_group.process_group``) registers the exporter in prometheus_client's
    REGISTRY: what vLLM serves when its engine runs in the API server's process (its
    get_prometheus_registry() without PROMETHEUS_MULTIPROC_DIR). tests/vllm checks vLLM's own function."""
    (g,) = moe_comm.init(backend="loopback", world_size=1, device="cpu")
    ep_group.use_group(g)
    assert ep_group.process_group() is g
    got = samples(generate_latest(REGISTRY).decode())
    assert value(got, "moe_comm_epoch", rank=0) is not None


def _multiprocess_rank(group):
    """A serving rank in prometheus_client's multiprocess mode: the adapter's group, one dispatch and
    combine; the values reach the shared directory by the refresher thread."""
    ep_group.use_group(group)
    ep_group.process_group()
    assert metrics.multiprocess_mode() and metrics.exporter().refresher is not None
    ep = EPBuffer(group, E, H, M, K)
    idx = torch.tensor([[0, 5], [3, -1]])
    d = ep.dispatch(torch.randn(2, H).to(torch.bfloat16), idx)
    ep.combine(d.x, torch.rand(2, K), d.handle)
    exp, deadline = metrics.exporter(), time.monotonic() + 30
    done = exp.refreshes + 2   # the refresher's second refresh from now began after these calls
    while exp.refreshes < done and time.monotonic() < deadline:   # every MOE_COMM_METRICS_INTERVAL_S
        time.sleep(0.1)
    return ep.expert_token_counts.tolist()


@pytest.mark.timeout(300)
def test_serving_adapters_reach_a_multiprocess_registry(tmp_path, monkeypatch):
    """PROMETHEUS_MULTIPROC_DIR set (SGLang with --enable-metrics, vLLM with several API servers): two
    shm ranks through the adapters' group; the registry the server builds (a CollectorRegistry with a
    MultiProcessCollector over the directory: SGLang's add_prometheus_middleware, vLLM's
    get_prometheus_registry; their own code runs in tests/sglang and tests/vllm) holds both ranks'
    calls and expert load."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setenv(metrics.ENV_INTERVAL, "0.2")
    counts = moe_comm.launch(_multiprocess_rank, 2, backend="shm", timeout_s=60)
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp_path))
    got = samples(generate_latest(registry).decode())
    for r in range(2):
        assert value(got, "moe_comm_calls_total", rank=r, op="dispatch") == 1
        for e, n in enumerate(counts[r]):
            assert value(got, "moe_comm_expert_rows_total", rank=r, op="dispatch", expert=r * 3 + e) == n


# One rank's process in prometheus_client's multiprocess mode (the directory set before the import): rank 0
# of a loopback world 2, which excludes rank 1 if told to (epoch 1, peer 1 excluded), then one refresh.
_RANK_PROCESS = """
import sys
import moe_comm
from moe_comm import metrics
assert metrics.multiprocess_mode()
groups = moe_comm.init(backend="loopback", world_size=2, device="cpu")
if sys.argv[1] == "exclude":
    assert groups[0].exclude([1]) == [1]
metrics.exporter().refresh()
"""


@pytest.mark.timeout(300)
def test_a_restarted_rank_process_sets_its_gauges_in_multiprocess_mode(tmp_path):
    """PROMETHEUS_MULTIPROC_DIR set: rank 0's process excludes rank 1 (moe_comm_epoch 1,
    moe_comm_peer_excluded 1) and exits; the restarted rank 0 (a new process, a new group: epoch 0, nobody
    excluded) refreshes. The registry the server builds over the directory shows the restarted process's
    values: the gauges keep the most recent value (``multiprocess_mode="mostrecent"``), not the largest
    value any process of the rank ever wrote (with "max" the epoch could never go down, nor an exclusion
    be cleared). Each process is a fresh interpreter, as a restarted rank is."""
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    for how in ("exclude", "restart"):
        subprocess.run([sys.executable, "-c", _RANK_PROCESS, how], env=env, check=True, timeout=240)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(tmp_path))
        got = samples(generate_latest(registry).decode())
        excluded = how == "exclude"
        assert value(got, "moe_comm_epoch", rank=0) == (1 if excluded else 0), how
        assert value(got, "moe_comm_peer_excluded", rank=0, peer=1) == (1 if excluded else 0), how
        assert value(got, "moe_comm_resets_total", rank=0) == 1, how   # a counter: both processes' resets


def test_observe_many_equals_observe_one_value_at_a_time():
    """``metrics.observe_many`` (one update per bucket) leaves a histogram exactly as observe() per value
    does, bucket bounds included (a value equal to a bound counts in that bucket)."""
    import numpy as np  # noqa: PLC0415
    from prometheus_client import Histogram  # noqa: PLC0415

    values = np.array([0.0, 1e-6, 2e-6, 1e-5, 3e-4, 1e-3, 0.5, 1.0, 10.0, 11.0, 3e-4])
    one, many = (Histogram("h", "h", ["peer"], registry=None, buckets=metrics.WAIT_BUCKETS_S) for _ in range(2))
    for v in values.tolist():
        one.labels("1").observe(v)
    metrics.observe_many(many.labels("1"), values)
    assert [(s.name, s.labels, s.value) for f in one.collect() for s in f.samples if not s.name.endswith("_created")] \
        == [(s.name, s.labels, s.value) for f in many.collect() for s in f.samples if not s.name.endswith("_created")]
