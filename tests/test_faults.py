"""The fault model (docs/faults.md): after any fault, the next call on every rank either
raises a named error or returns results equal to the reference, never anything else, and the group
recovers with ``group.reset()``. One test per finding of the multi-rank review, each checking what the
*next* calls do, on loopback (one process, phases driven by hand) and shm (one process per rank)."""

import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch

import moe_comm
from moe_comm import (AllToAllvDynamic, CapacityError, ClosedError, CommAbortedError, CommTimeoutError, EPBuffer,
                      reference)
from moe_comm.planner import plan_ep

from shm_files import own_shm_files

E, H, M, K = 8, 128, 3, 2   # experts, hidden, max tokens per rank, top-k of the EP cases below


def _inputs(world, seed, tokens=M):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(tokens, H, generator=g).to(torch.bfloat16) for _ in range(world)]
    idxs = [torch.randint(-1, E, (tokens, K), generator=g) for _ in range(world)]
    ws = [torch.rand(tokens, K, generator=g) for _ in range(world)]
    return xs, idxs, ws


def _expert(d):
    """A deterministic 'expert': every valid row doubled (exact in bf16)."""
    return (d.x.float() * 2).to(torch.bfloat16)


def _exact_round(eps, seed):
    """One loopback dispatch -> combine round, checked exactly against the reference."""
    world = len(eps)
    xs, idxs, ws = _inputs(world, seed)
    for ep, x, i in zip(eps, xs, idxs):
        ep.dispatch(x, i, phase="send")
    ds = [ep.dispatch(phase="recv") for ep in eps]
    exp = reference.dispatch(xs, idxs, E, M)
    for d, e in zip(ds, exp):
        assert torch.equal(d.counts, e["counts"])
        for ex, n in enumerate(e["counts"].tolist()):
            assert torch.equal(d.x[ex, :n], e["x"][ex, :n])
    eos = [_expert(d) for d in ds]
    for ep, eo, w, d in zip(eps, eos, ws, ds):
        ep.combine(eo, w, d.handle, phase="send")
    ys = [ep.combine(phase="recv") for ep in eps]
    for y, e in zip(ys, reference.combine(eos, ws, idxs, E, M)):
        assert torch.equal(y, e)


def _loopback_eps(world=2, timeout_s=1.0):
    groups = moe_comm.init(backend="loopback", world_size=world, device="cpu", timeout_s=timeout_s)
    return groups, [EPBuffer(g, E, H, M, K) for g in groups]


def _reset(groups):
    for g in groups:
        g.reset()


# ---- 1. one rank's error must not desynchronize the group ------------------------------------------

def test_one_rank_input_error_fails_the_group_loudly_until_reset():
    """Rank 0 passes x of the wrong dtype (TypeError before any send) while rank 1 makes the call: rank 0
    took part by aborting, so rank 1 raises CommAbortedError naming it, every later call on both ranks
    raises a GroupError (never the previous round's tokens), and after reset() rounds are exact."""
    groups, eps = _loopback_eps()
    _exact_round(eps, 0)
    xs, idxs, _ = _inputs(2, 1)
    with pytest.raises(TypeError, match="dtype"):
        eps[0].dispatch(xs[0].float(), idxs[0], phase="send")
    eps[1].dispatch(xs[1], idxs[1], phase="send")
    with pytest.raises(CommAbortedError, match="rank 1 got an abort from peer rank 0"):
        eps[1].dispatch(phase="recv")
    for seed in (2, 3):  # sticky: both ranks raise the same named error at every later call
        xs, idxs, _ = _inputs(2, seed)
        for ep, x, i in zip(eps, xs, idxs):
            ep.dispatch(x, i, phase="send")
        for ep in eps:
            with pytest.raises(CommAbortedError, match="dispatch: rank 1 got an abort from peer rank 0"):
                ep.dispatch(phase="recv")
    _reset(groups)
    for seed in (4, 5):
        _exact_round(eps, seed)


def test_symmetric_input_error_leaves_the_group_usable():
    """Every rank sees the same input error: every rank aborts, nobody waits, no reset is needed."""
    groups, eps = _loopback_eps()
    xs, idxs, _ = _inputs(2, 1)
    for ep, x, i in zip(eps, xs, idxs):
        with pytest.raises(TypeError, match="dtype"):
            ep.dispatch(x.float(), i, phase="send")
    for seed in (2, 3):
        _exact_round(eps, seed)
    for g in groups:
        g.check()


def test_data_error_found_by_a_receive_carries_the_result_and_the_group_goes_on():
    """A CapacityError recorded by rank 1's dispatch receive (7 slots name expert 4, whose capacity is
    world * M = 6) is raised at the end of that dispatch with the result; the caller logs it and
    combines with err.result.handle: both combines are exact (the 7th slot counts as a zero row) and
    the next rounds too."""
    groups, eps = _loopback_eps(timeout_s=1.0)
    xs, _, ws = _inputs(2, 7, tokens=2)
    idxs = [torch.tensor([[4, 4], [4, 4]]), torch.tensor([[4, 4], [4, -1]])]
    for ep, x, i in zip(eps, xs, idxs):
        ep.dispatch(x, i, phase="send")
    d0 = eps[0].dispatch(phase="recv")
    with pytest.raises(CapacityError, match="peer/expert 0 needs 7 rows, only 6") as info:
        eps[1].dispatch(phase="recv")
    ds = [d0, info.value.result]
    eos = [_expert(d) for d in ds]
    for ep, eo, w, d in zip(eps, eos, ws, ds):
        ep.combine(eo, w, d.handle, phase="send")
    ys = [ep.combine(phase="recv") for ep in eps]
    # The reference keeps the first 6 rows of expert 4 (sorted by source, token, k); the 7th is a zero row.
    exp = reference.combine(eos, ws, idxs, E, M)
    assert torch.equal(ys[0], exp[0]) and torch.equal(ys[1], exp[1])
    for g in groups:
        g.check()
    _exact_round(eps, 8)


STICKY_TIMEOUT_S = 1.5   # the one wait that times out; the later receives of the failed group must not wait


# ---- 3. after a timeout, no wait silently gives up and no stale data comes back ------------------

@pytest.mark.parametrize("shapes", ["cpu_plan", "gpu_plan"])
def test_timeout_is_sticky_poisons_and_recovers(shapes):
    """Rank 1 skips its combine: rank 0's combine raises CommTimeoutError naming it, and the output it was
    given is NaN (not the landing zone of an older call). Every later call on both ranks raises the same
    named error; after reset() rounds are exact.

    With the GPU launch shapes (one token per combine program, run by the interpreter) a program waits
    only for the ranks whose rows its tokens read: token 2, whose experts are all on rank 0, waits for
    nobody (program (0, 0), token 0's, waits for every rank), and its row must be NaN too."""
    groups, eps = _loopback_eps(timeout_s=STICKY_TIMEOUT_S)
    if shapes == "gpu_plan":
        for ep in eps:
            ep.plan = plan_ep(2, E, H, M, K, torch.bfloat16, False, "cuda")
        assert eps[0].plan.reduce_grid[0] == M   # one program per token
    _exact_round(eps, 0)
    xs, idxs, ws = _inputs(2, 1)
    idxs[0][2] = torch.tensor([0, 1])            # rank 0's experts only
    idxs[0][1] = torch.tensor([5, 6])            # rank 1's experts
    for ep, x, i in zip(eps, xs, idxs):
        ep.dispatch(x, i, phase="send")
    ds = [ep.dispatch(phase="recv") for ep in eps]
    out = torch.zeros(M, H, dtype=torch.bfloat16)
    eps[0].combine(_expert(ds[0]), ws[0], ds[0].handle, out=out, phase="send")
    with pytest.raises(CommTimeoutError, match=f"combine: rank 0 timed out after {STICKY_TIMEOUT_S:g} s waiting for peer rank 1"):
        eps[0].combine(phase="recv")
    assert torch.isnan(out.float()).all()
    for seed in (2, 3):
        xs, idxs, _ = _inputs(2, seed)
        for ep, x, i in zip(eps, xs, idxs):
            ep.dispatch(x, i, phase="send")
        t0 = time.monotonic()
        for ep in eps:
            with pytest.raises(CommTimeoutError, match="combine: rank 0 timed out .* peer rank 1"):
                ep.dispatch(phase="recv")
        # A failed group does not wait again: a wait would take the timeout per rank; the interpreted
        # programs alone take ~0.2-0.4 s with the GPU launch shapes on 2 cores.
        assert time.monotonic() - t0 < STICKY_TIMEOUT_S
    _reset(groups)
    for seed in (4, 5, 6):
        _exact_round(eps, seed)


def test_alltoallv_failed_receive_returns_no_partial_counts():
    """A missing source fails the whole receive: every recv_count is 0, the error names the source."""
    groups = moe_comm.init(backend="loopback", world_size=3, device="cpu", timeout_s=0.3)
    ops = [AllToAllvDynamic(g, 4, (8,), torch.float32) for g in groups]
    sends = [torch.randn(3, 8) for _ in groups]
    counts = torch.tensor([1, 1, 1])
    for op, s in zip(ops[:2], sends):
        op(s, counts, phase="send")
    with pytest.raises(CommTimeoutError, match="peer rank 2") :
        ops[0](phase="recv")
    assert ops[0]._meta[0]["recv_counts"].tolist() == [0, 0, 0]
    with pytest.raises(CommTimeoutError):
        ops[1](phase="recv")
    ops[2](sends[2], counts, phase="send")
    with pytest.raises(CommTimeoutError):
        ops[2](phase="recv")
    _reset(groups)
    for op, s in zip(ops, sends):
        op(s, counts, phase="send")
    res = [op(phase="recv") for op in ops]
    for i in range(3):
        assert res[i].recv_counts.tolist() == [1, 1, 1]
        for j in range(3):
            assert torch.equal(res[i].recv[j, 0], sends[j][i])


# ---- 5. the receive phase does not depend on the send kernel's counter ------------------------------

def test_receive_owns_its_call_counter():
    """On CUDA the phases may run on different streams, so the receive may run before the next send
    advanced its counter (or after a later one did). The receive counts its own calls: scrambling the
    send counters between the phases changes nothing."""
    groups, eps = _loopback_eps()
    for seed in range(3):
        xs, idxs, ws = _inputs(2, seed)
        for ep, x, i in zip(eps, xs, idxs):
            ep.dispatch(x, i, phase="send")
        for ep in eps:
            ep._dispatch_ch.send_seq += 7  # what a later send on another stream would have done, or worse
        ds = [ep.dispatch(phase="recv") for ep in eps]
        exp = reference.dispatch(xs, idxs, E, M)
        assert all(torch.equal(d.counts, e["counts"]) for d, e in zip(ds, exp))
        for ep in eps:
            ep._dispatch_ch.send_seq -= 7


# ---- 6. the error word ---------------------------------------------------------------------------

def test_an_error_found_while_another_is_pending_is_not_silent():
    """Rank 0's forward send records a CapacityError that is not raised until its receive; meanwhile a
    second op records another: the first is raised, saying more were found, and nothing is left
    pending afterwards."""
    (g,) = moe_comm.init(backend="loopback", world_size=1, device="cpu")
    a, b = AllToAllvDynamic(g, 2, (4,), torch.float32), AllToAllvDynamic(g, 2, (4,), torch.float32)
    x = torch.randn(5, 4)
    a(x, torch.tensor([5]), phase="send")  # count 5 > capacity 2: recorded, not raised yet
    with pytest.raises(CapacityError, match=r"send_counts\[0\] is 5, but only 2 rows .*further device errors"):
        b(x, torch.tensor([4]))
    res = a(phase="recv")
    assert res.recv_counts.tolist() == [2]
    g.check()


# ---- 9. use after close ------------------------------------------------------------------------------

def _use_after_close(group, what):
    a2a = AllToAllvDynamic(group, 2, (4,), torch.float32)
    x, c = torch.randn(2, 4), torch.ones(group.world_size, dtype=torch.int32)
    a2a(x[:group.world_size], c)
    (a2a if what == "a2a" else group).close()
    try:
        a2a(x[:group.world_size], c)
    except ClosedError as e:
        return "ClosedError", str(e)
    return None, None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", ["a2a", "group"])
def test_use_after_close_raises_instead_of_crashing(what):
    results = moe_comm.launch(_use_after_close, 2, what, backend="shm", timeout_s=5)
    assert [r[0] for r in results] == ["ClosedError", "ClosedError"], results


def test_loopback_group_close_closes_its_ops():
    groups = moe_comm.init(backend="loopback", world_size=2, device="cpu")
    eps = [EPBuffer(g, E, H, M, K) for g in groups]
    _exact_round(eps, 0)
    groups[0].close()
    with pytest.raises(ClosedError):
        eps[0].dispatch(*[t[0] for t in _inputs(2, 1)[:2]], phase="send")
    with pytest.raises(ClosedError):
        groups[0].check()


# ---- 10. smaller findings ----------------------------------------------------------------------------

def test_topk_weights_given_only_at_the_receive_phase():
    groups, eps = _loopback_eps()
    xs, idxs, ws = _inputs(2, 3)
    for ep, x, i in zip(eps, xs, idxs):
        ep.dispatch(x, i, phase="send")
    ds = [ep.dispatch(phase="recv") for ep in eps]
    eos = [_expert(d) for d in ds]
    for ep, eo, d in zip(eps, eos, ds):
        ep.combine(eo, None, d.handle, phase="send")
    with pytest.raises(ValueError, match="topk_weights has shape"):  # a bad receive input loses nothing
        eps[0].combine(topk_weights=ws[0][:1], phase="recv")
    ys = [ep.combine(topk_weights=w, phase="recv") for ep, w in zip(eps, ws)]
    assert all(torch.equal(y, e) for y, e in zip(ys, reference.combine(eos, ws, idxs, E, M)))


def test_alltoallv_combine_refuses_another_objects_handle():
    (g,) = moe_comm.init(backend="loopback", world_size=1, device="cpu")
    a, b = AllToAllvDynamic(g, 2, (4,), torch.float32), AllToAllvDynamic(g, 2, (4,), torch.float32)
    r = a(torch.randn(2, 4), torch.tensor([2]))
    with pytest.raises(TypeError, match="of this AllToAllvDynamic"):
        b.combine(r.recv, r.handle)
    assert torch.equal(a.combine(r.recv, r.handle), r.recv[0, :2])


@pytest.mark.parametrize("timeout_s", [float("inf"), float("nan"), 0, -1])
def test_init_rejects_non_finite_timeouts(timeout_s):
    with pytest.raises(ValueError, match="finite number > 0"):
        moe_comm.init(backend="loopback", world_size=1, timeout_s=timeout_s)


def _sleep_forever(group, pid_dir):
    with open(os.path.join(pid_dir, f"rank{group.rank}"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)


LAUNCHER = """
import sys
sys.path.insert(0, sys.argv[2])
import moe_comm, test_faults
moe_comm.launch(test_faults._sleep_forever, 2, sys.argv[1], backend="shm", timeout_s=5)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_rank_processes_die_with_the_launching_process(sig):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as pid_dir:
        parent = subprocess.Popen([sys.executable, "-c", LAUNCHER, pid_dir, os.path.join(root, "tests")], cwd=root,
                                  env=dict(os.environ, PYTHONPATH=root))
        deadline = time.monotonic() + 90
        while len(os.listdir(pid_dir)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        pids = [int(open(os.path.join(pid_dir, f)).read()) for f in sorted(os.listdir(pid_dir))]
        assert len(pids) == 2
        parent.send_signal(sig)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 15
        alive = pids
        while alive and time.monotonic() < deadline:
            time.sleep(0.2)
            alive = [p for p in alive if _alive(p)]
        assert alive == [], f"rank processes {alive} outlived the launcher"


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not reaped by its dead parent yet) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


# ---- shm, one process per rank -----------------------------------------------------------------------

def _third_rank_overflow(group):
    """Finding 7: rank 0 sends 10 rows with counts [1, 7, 2] (7 > capacity 4), the others [1, 1, 1]."""
    a2a = AllToAllvDynamic(group, 4, (8,), torch.float32)
    rows = 10 if group.rank == 0 else 3
    send = torch.arange(rows * 8, dtype=torch.float32).view(rows, 8) + 1000 * group.rank
    counts = torch.tensor([1, 7, 2] if group.rank == 0 else [1, 1, 1], dtype=torch.int32)
    try:
        res = a2a(send, counts)
        err = None
    except CapacityError as e:
        res, err = e.result, (e.rank, e.peer, e.value, e.capacity)
    n = res.recv_counts.tolist()
    got = [res.recv[i, :n[i]].clone() for i in range(3)]
    back = a2a.combine(res.recv, res.handle)
    return err, n, got, back, send


@pytest.mark.timeout(240)
def test_over_capacity_count_never_shifts_another_ranks_rows():
    results = moe_comm.launch(_third_rank_overflow, 3, backend="shm", timeout_s=10)
    sends = [r[4] for r in results]
    err0, n0, *_ = results[0]
    assert err0 == (0, 1, 7, 4)                       # rank 0 raised, naming its destination 1
    assert [r[0] for r in results[1:]] == [None, None]
    assert results[1][1] == [4, 1, 1]                 # rows 1..4 of rank 0, then one each
    assert torch.equal(results[1][2][0], sends[0][1:5])
    assert results[2][1] == [2, 1, 1]
    assert torch.equal(results[2][2][0], sends[0][8:10])  # rows 8, 9: not 5, 6 (rank 1's excess)
    back0 = results[0][3]
    assert torch.equal(back0[[0, 1, 2, 3, 4, 8, 9]], sends[0][[0, 1, 2, 3, 4, 8, 9]])
    assert own_shm_files() == []


def _late_to_barrier(group):
    """Rank 1 comes to a barrier long after rank 0 gave up on it; then both recover and run exact."""
    if group.rank == 1:
        time.sleep(2.5 * group.timeout_s)
    seen = None
    try:
        group.barrier()
    except CommTimeoutError as e:
        seen = str(e)
    group.reset()
    ep = EPBuffer(group, E, H, M, K)
    xs, idxs, ws = _inputs(2, 11)
    d = ep.dispatch(xs[group.rank], idxs[group.rank])
    exp = reference.dispatch(xs, idxs, E, M)[group.rank]
    exact = torch.equal(d.counts, exp["counts"]) and all(
        torch.equal(d.x[e, :n], exp["x"][e, :n]) for e, n in enumerate(exp["counts"].tolist()))
    return seen, exact


@pytest.mark.parametrize("ranks_per_node", [None, 1])
def test_a_peer_late_to_a_barrier_that_timed_out_raises_too(monkeypatch, ranks_per_node):
    """A host barrier that times out fails the group for every rank: the late rank, which finds everyone
    arrived, raises the same named error instead of going on alone into a group that is recovering. On
    emulated nodes (ranks_per_node=1) the late rank does not map rank 0's status: the record reaches it
    through the control plane (heap.post_failure)."""
    if ranks_per_node is not None:
        monkeypatch.setenv("MOE_COMM_RANKS_PER_NODE", str(ranks_per_node))
    seen = moe_comm.launch(_late_to_barrier, 2, backend="shm", timeout_s=1.0)
    for rank, (msg, exact) in enumerate(seen):
        assert msg is not None and "barrier: rank 0 timed out" in msg and "peer rank 1" in msg, (rank, msg)
        assert exact, rank
