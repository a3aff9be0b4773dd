"""AllToAllvDynamic against the reference: shm ranks (separate processes) and loopback (one process)."""

import os
import time

import pytest
import torch

import moe_comm
from moe_comm import AllToAllvDynamic, CapacityError, CommTimeoutError, LaunchError, reference
from moe_comm.planner import plan_alltoallv

from a2a_cases import make_counts, make_sends, poison, run_loopback_cases, run_shm_cases
from budget import size, sweep
from shm_files import own_shm_files


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", size([1, 2, sweep(4)], [1, 2, 3, 4]))   # world 3: loopback, and shm under test-long
def test_matrix_shm(world):
    """bf16/float32/int32 x rows (64,)/(3,32) x random/zeros/one-destination/full counts, both directions."""
    errs = moe_comm.launch(run_shm_cases, world, backend="shm", timeout_s=60)
    assert [e for r in errs for e in r] == []
    assert own_shm_files() == []


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2, 3, sweep(4)])
def test_matrix_loopback(world):
    assert run_loopback_cases(moe_comm.init(backend="loopback", world_size=world)) == []


def _consecutive(group, calls):
    """Back-to-back calls: results of call i stay valid through call i+1; then `calls` checked calls."""
    world, rank, cap = group.world_size, group.rank, 4
    op = AllToAllvDynamic(group, cap, (8,), torch.float32)
    errs = []
    c1, c2 = make_counts("random", world, cap, 1), make_counts("random", world, cap, 2)
    s1, s2 = make_sends(c1, (8,), torch.float32, 1), make_sends(c2, (8,), torch.float32, 2)
    r1 = op(s1[rank], c1[rank])
    r2 = op(s2[rank], c2[rank])  # must not disturb r1
    for res, s, c, tag in ((r1, s1, c1, "first"), (r2, s2, c2, "second")):
        exp_recv, exp_counts = reference.alltoallv(s, c, cap)[rank]
        if not torch.equal(res.recv_counts, exp_counts):
            errs.append(f"{tag}: counts")
        for j, n in enumerate(exp_counts.tolist()):
            if not torch.equal(res.recv[j, :n], exp_recv[j, :n]):
                errs.append(f"{tag}: rows from {j}")
    b1 = op.combine(r1.recv * 3, r1.handle)  # the older handle is still valid
    n1 = int(c1[rank].sum())
    if not torch.equal(b1[:n1], s1[rank][:n1] * 3):
        errs.append("combine with the older handle")
    for i in range(calls):
        c = make_counts("random", world, cap, 100 + i)
        s = make_sends(c, (8,), torch.float32, 100 + i)
        res = op(s[rank], c[rank])
        exp_recv, exp_counts = reference.alltoallv(s, c, cap)[rank]
        ok = torch.equal(res.recv_counts, exp_counts) and all(
            torch.equal(res.recv[j, :n], exp_recv[j, :n]) for j, n in enumerate(exp_counts.tolist()))
        back = op.combine(res.recv - 1, res.handle)
        n = int(c[rank].sum())
        if not ok or not torch.equal(back[:n], s[rank][:n] - 1):
            errs.append(f"call {i}")
    return errs


@pytest.mark.timeout(300)
@pytest.mark.parametrize("calls", size([10, sweep(40)], [200]))
def test_back_to_back_and_many_calls_shm(calls):
    errs = moe_comm.launch(_consecutive, 2, calls, backend="shm", timeout_s=60)
    assert errs == [[], []]


def _die_or_wait(group):
    op = AllToAllvDynamic(group, 2, (16,), torch.float32)
    counts = torch.ones(group.world_size, dtype=torch.int32)
    op(torch.ones(group.world_size, 16), counts)  # one healthy call: kernels warm on every rank
    if group.rank == 1:
        os._exit(3)  # dies between two calls
    t0 = time.monotonic()
    try:
        op(torch.ones(group.world_size, 16), counts)
    except CommTimeoutError as e:
        return (type(e).__name__, e.peer, e.op, time.monotonic() - t0, str(e))
    return ("no error", None, None, time.monotonic() - t0, "")


@pytest.mark.timeout(120)
def test_dead_peer_gives_comm_timeout_naming_it():
    timeout_s = 3.0
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as info:
        moe_comm.launch(_die_or_wait, 3, backend="shm", timeout_s=timeout_s)
    err = info.value
    assert set(err.failures) == {1} and "exit code 3" in err.failures[1]
    for r in (0, 2):
        name, peer, op, waited, msg = err.results[r]
        assert (name, peer, op) == ("CommTimeoutError", 1, "alltoallv"), err.results[r]
        assert timeout_s * 0.9 <= waited <= 2 * timeout_s, waited
        assert "peer rank 1" in msg
    assert time.monotonic() - t0 < 60
    assert own_shm_files() == []


def test_lying_device_counts_write_nothing_out_of_bounds():
    """Counts over capacity, negative, or past N: clamped in the kernel, CapacityError, no stray writes."""
    cap, world = 3, 3
    groups = moe_comm.init(backend="loopback", world_size=world)
    ops = [AllToAllvDynamic(g, cap, (4,), torch.float32) for g in groups]
    sentinel = -12345.0
    for op in ops:
        op._fwd.data.local.view(torch.float32).fill_(sentinel)
        poison(op)
    lies = [torch.tensor([cap + 5, 1, 0], dtype=torch.int32),    # over capacity to rank 0
            torch.tensor([0, -4, 2], dtype=torch.int64),         # negative count to rank 1
            torch.tensor([2, 2, 2], dtype=torch.int32)]          # fine counts, but N is only 3 rows
    sends = [torch.randn(cap + 6, 4), torch.randn(2, 4), torch.randn(3, 4)]
    # A data error is raised at the end of the op (the receive phase; on CPU the error word is read right
    # after the kernels), naming the rank and the destination whose count was bad, with the completed
    # (clamped) result attached: the call itself went through on every rank.
    for r, op in enumerate(ops):
        op(sends[r], lies[r], phase="send")
    bad_peer = {0: 0, 1: 1, 2: 1}  # rank 2: rows for rank 1 are the first to run past N
    res = []
    for r, op in enumerate(ops):
        with pytest.raises(CapacityError) as info:
            op(phase="recv")
        assert (info.value.rank, info.value.peer) == (r, bad_peer[r]), str(info.value)
        res.append(info.value.result)
    # What each receiver must see: clamped counts, and rows taken only from inside each sender's N, at
    # the offsets of the counts as given (rank 0's excess to rank 0 does not shift its row for rank 1).
    assert res[0].recv_counts.tolist() == [cap, 0, 2]
    assert res[1].recv_counts.tolist() == [1, 0, 1]   # rank 2 had 3 rows: 2 to rank 0, 1 to rank 1
    assert res[2].recv_counts.tolist() == [0, 2, 0]
    assert torch.equal(res[0].recv[0, :cap], sends[0][:cap])
    assert torch.equal(res[1].recv[0, :1], sends[0][cap + 5:cap + 6])
    assert torch.equal(res[1].recv[2, :1], sends[2][2:3])
    # Landing zones: nothing past a clamped count was written (every zone row past it keeps the sentinel).
    for i, op in enumerate(ops):
        zone = op._fwd.data.local.view(torch.float32).view(2, world, cap, 4)
        for j in range(world):
            n = int(res[i].recv_counts[j])
            assert (zone[:, j, n:] == sentinel).all()
    for g in groups:
        g.check()  # each error was raised once and cleared


def test_loopback_world1_both_and_phase_errors():
    (g,) = moe_comm.init(backend="loopback", world_size=1)
    op = AllToAllvDynamic(g, 2, (4,), torch.bfloat16)
    x = torch.randn(3, 4).to(torch.bfloat16)
    res = op(x, torch.tensor([2]))
    assert res.recv_counts.tolist() == [2] and torch.equal(res.recv[0, :2], x[:2])
    with pytest.raises(RuntimeError, match="preceding phase='send'"):
        op(phase="recv")
    op(x, torch.tensor([1]), phase="send")
    with pytest.raises(RuntimeError, match="phase='recv' has not run"):
        op(x, torch.tensor([1]))
    groups = moe_comm.init(backend="loopback", world_size=2)
    op2 = AllToAllvDynamic(groups[0], 2, (4,), torch.bfloat16)
    with pytest.raises(ValueError, match="phase='send' on every"):
        op2(x, torch.tensor([1, 1]))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [1, 2])
def test_gpu_launch_shapes_in_the_interpreter(world):
    """The GPU plan (one row per program iteration, several programs per peer; at world 1 the one-kernel
    path) run by the interpreter on a loopback world, both directions: the same results as the reference."""
    cap = 9
    groups = moe_comm.init(backend="loopback", world_size=world)
    assert plan_alltoallv(world, cap, (64,), torch.bfloat16, torch.device("cuda")).copy.blocks_per_peer > 1
    cases = [(dtype, shape, pattern, seed) for dtype, shape in ((torch.bfloat16, (64,)), (torch.int32, (3, 32)))
             for pattern, seed in (("random", 1), ("full", 2), ("one_destination", 3))]
    assert run_loopback_cases(groups, cap=cap, plan_device="cuda", cases=cases) == []


def test_world1_one_kernel_clamps_lying_counts():
    """World 1 runs one kernel per direction; a count over the capacity, negative, or past N is clamped
    there as in the two-phase kernels, named in CapacityError, and the reverse returns only kept rows."""
    (g,) = moe_comm.init(backend="loopback", world_size=1)
    op = AllToAllvDynamic(g, 2, (4,), torch.float32)
    x = torch.randn(3, 4)
    for counts, n_rows, kept in (([5], 3, 2), ([-1], 3, 0), ([2], 1, 1)):
        poison(op)
        op(x[:n_rows], torch.tensor(counts), phase="send")
        with pytest.raises(CapacityError) as info:
            op(phase="recv")
        assert (info.value.rank, info.value.peer) == (0, 0)
        res = info.value.result
        assert res.recv_counts.tolist() == [kept] and res.handle.send_counts.tolist() == [kept]
        assert torch.equal(res.recv[0, :kept], x[:kept])
        back = op.combine(res.recv * 2, res.handle)
        assert back.shape == (n_rows, 4) and torch.equal(back[:kept], 2 * x[:kept])
    g.check()


@pytest.mark.parametrize("bad, exc, match", [
    (dict(send=torch.randn(3, 4)), TypeError, "dtype"),                                  # float32, op is bf16
    (dict(send=torch.randn(3, 5).bfloat16()), ValueError, r"send must be \[N"),           # row shape
    (dict(send=torch.randn(3).bfloat16()), ValueError, r"send must be \[N"),              # no row dims
    (dict(send=[[1.0]]), TypeError, "torch.Tensor"),
    (dict(send_counts=torch.tensor([1, 1, 1])), ValueError, "shape"),                     # wrong length
    (dict(send_counts=torch.tensor([1.0, 1.0])), TypeError, "dtype"),                     # float counts
    (dict(send_counts=torch.tensor([[1, 1]])), ValueError, "shape"),
    (dict(send_counts=torch.tensor([1, 1], device="meta")), ValueError, "meta"),         # wrong device
])
def test_malformed_inputs_raise_before_launch(bad, exc, match):
    groups = moe_comm.init(backend="loopback", world_size=2)
    op = AllToAllvDynamic(groups[0], 2, (4,), torch.bfloat16)
    args = dict(send=torch.randn(3, 4).bfloat16(), send_counts=torch.tensor([1, 1]))
    args.update(bad)
    with pytest.raises(exc, match=match):
        op(args["send"], args["send_counts"], phase="send")
    # Nothing pending; the rank took part in the call by aborting (tests/test_faults.py: what peers see):
    # the send side is done, the receive side is owed to the channel's next launch (tests/test_abort_order.py).
    assert op._fwd_op.pending is None and int(op._fwd.send_seq) == 1 and int(op._fwd.recv_seq) == 0
    assert op._fwd._drain_op is not None


def test_combine_rejects_bad_rows_and_stale_handles():
    (g,) = moe_comm.init(backend="loopback", world_size=1)
    op = AllToAllvDynamic(g, 2, (4,), torch.float32)
    x = torch.randn(2, 4)
    r0 = op(x, torch.tensor([2]))
    with pytest.raises(ValueError, match="shape"):
        op.combine(torch.zeros(1, 3, 4), r0.handle)
    with pytest.raises(TypeError, match="A2AHandle"):
        op.combine(r0.recv, None)
    op(x, torch.tensor([1]))
    op(x, torch.tensor([1]))  # r0's metadata set is now reused
    with pytest.raises(ValueError, match="stale handle"):
        op.combine(r0.recv, r0.handle)


@pytest.mark.parametrize("kw, exc", [
    (dict(max_rows_per_peer=0, row_shape=(4,), dtype=torch.float32), ValueError),
    (dict(max_rows_per_peer=2, row_shape=(0,), dtype=torch.float32), ValueError),
    (dict(max_rows_per_peer=2, row_shape=(4,), dtype="float32"), TypeError),
])
def test_bad_construction(kw, exc):
    (g,) = moe_comm.init(backend="loopback", world_size=1)
    with pytest.raises(exc):
        AllToAllvDynamic(g, **kw)
