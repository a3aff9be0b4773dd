"""The launches an op builds once (``moe_comm/launches.py``: kernel, grid and every argument that does not
depend on a call's inputs) stay right: they are rebuilt when the op's plan is replaced, they survive
``reset()`` and ``exclude()`` (what those change lives in device memory the kernels read, or is updated in
place), they carry the group's flight-recorder setting, and nothing derived from a caller's tensor is kept:
every call passes new tensors, of another T and, every other call, starting off a 16-byte boundary."""

import inspect
import threading

import pytest
import torch

import moe_comm
from moe_comm import AllToAllvDynamic, EPBuffer, launches
from moe_comm.planner import SHAPES_ENV, plan_alltoallv, plan_ep

from ep_cases import offset_copy, record_launches
from fault_cases import CAP_A2A, E_PER_RANK, H, K, M, ROW, check_rank, expert, step_inputs

WORLD = 3


def _step(eps, a2as, live, step, excluded=()) -> list[str]:
    """One serving step on the live ranks of a loopback world (phase by phase): dispatch -> combine and an
    AllToAllvDynamic round trip, with new input tensors; the mismatches against the references."""
    world = len(eps)
    xs, idxs, ws, sends, counts = step_inputs(7000 + step, world, E_PER_RANK * world, M, K, H, CAP_A2A, ROW)
    if step % 2:   # the same values in tensors that start 4 bytes off a 16-byte boundary
        xs, sends = [offset_copy(x) for x in xs], [offset_copy(s) for s in sends]
    for r in live:
        eps[r].dispatch(xs[r], idxs[r], phase="send")
    ds = {r: eps[r].dispatch(phase="recv") for r in live}
    for r in live:
        eps[r].combine(expert(ds[r].x), ws[r], ds[r].handle, phase="send")
    ys = {r: eps[r].combine(phase="recv") for r in live}
    for r in live:
        a2as[r](sends[r], counts[r], phase="send")
    res = {r: a2as[r](phase="recv") for r in live}
    for r in live:
        a2as[r].combine(res[r].recv * 3, res[r].handle, phase="send")
    backs = {r: a2as[r].combine(phase="recv") for r in live}
    inputs = (xs, idxs, ws, sends, counts)
    return [f"step {step} rank {r}: {e}" for r in live
            for e in check_rank(r, inputs, ds[r], ys[r], res[r], backs[r], E_PER_RANK * world, M, CAP_A2A,
                                excluded=excluded)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("trace", [0, 2])
def test_exact_with_new_inputs_across_reset_and_exclude(trace):
    """World 3, EPBuffer and AllToAllvDynamic: exact at every step with new inputs (T from 0 to M, aligned
    and not), after ``reset()``, and after ``exclude([2])`` among the survivors (rank 2's experts unrouted,
    its rows dropped). With the flight recorder on, every receive kernel counted its waits."""
    groups = moe_comm.init(backend="loopback", world_size=WORLD, device="cpu", timeout_s=5.0, trace=trace)
    eps = [EPBuffer(g, E_PER_RANK * WORLD, H, M, K) for g in groups]
    a2as = [AllToAllvDynamic(g, CAP_A2A, ROW, torch.float32) for g in groups]
    everyone, errs = list(range(WORLD)), []
    for step in range(3):
        errs += _step(eps, a2as, everyone, step)
    for g in groups:
        g.reset()
    for step in range(3, 6):
        errs += _step(eps, a2as, everyone, step)
    survivors = groups[:2]
    threads = [threading.Thread(target=g.exclude, args=([2],)) for g in survivors]   # one thread per rank
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [g.live_ranks for g in survivors] == [[0, 1], [0, 1]]
    for step in range(6, 9):
        errs += _step(eps, a2as, [0, 1], step, excluded=(2,))
    assert errs == []
    waits = [int(op.dispatch_wait_stats[1].sum() + op.combine_wait_stats[1].sum()) for op in eps[:2]] + \
            [int(op.wait_stats[1].sum() + op.combine_wait_stats[1].sum()) for op in a2as[:2]]
    assert all(w > 0 for w in waits) if trace else waits == [0] * 4, waits
    for g in groups:
        g.close()


def test_a_replaced_plan_is_launched(monkeypatch):
    """An op given another plan after it has run launches that plan's grids (its launches are rebuilt),
    and stays exact. Both ops take the GPU launch plan (many programs, run by the interpreter)."""
    launched = record_launches(monkeypatch, lambda fn, args, grid: (fn.fn.__name__, tuple(grid)))
    monkeypatch.delenv(SHAPES_ENV, raising=False)   # the ops start on the CPU shapes, whatever the run's mode
    groups = moe_comm.init(backend="loopback", world_size=2, device="cpu", timeout_s=5.0)
    eps = [EPBuffer(g, E_PER_RANK * 2, H, M, K) for g in groups]
    a2as = [AllToAllvDynamic(g, CAP_A2A, ROW, torch.float32) for g in groups]
    assert _step(eps, a2as, [0, 1], 0) == []
    cpu_ep, cpu_a2a = eps[0].plan, a2as[0].plan
    for ep in eps:
        ep.plan = plan_ep(2, E_PER_RANK * 2, H, M, K, torch.bfloat16, False, "cuda")
    for op in a2as:
        op.plan = plan_alltoallv(2, CAP_A2A, ROW, torch.float32, torch.device("cuda"))
    gpu_ep, gpu_a2a = eps[0].plan, a2as[0].plan
    assert (gpu_ep.send_grid, gpu_ep.reduce_grid) != (cpu_ep.send_grid, cpu_ep.reduce_grid)
    assert gpu_a2a.copy.blocks_per_peer != cpu_a2a.copy.blocks_per_peer
    launched.clear()
    assert _step(eps, a2as, [0, 1], 1) == []
    grids = {name: {grid for n, grid in launched if n == name} for name, _ in launched}
    assert grids["dispatch_send_kernel"] == {gpu_ep.send_grid}, grids
    assert grids["combine_recv_kernel"] == {gpu_ep.reduce_grid}, grids
    assert grids["a2a_send_kernel"] == {(2, gpu_a2a.copy.blocks_per_peer)}, grids


def test_a_plan_that_resizes_allocated_buffers_is_refused_and_launch_shapes_follow(monkeypatch):
    """Once an op's buffers exist, a plan that sizes them differently is refused at once with the fix
    (setting a plan is local to one rank; reallocating symmetric buffers is collective), the op keeps its
    plan and stays exact. A plan that changes only launch shapes is taken, PrefillBuffer's included (its
    zones' launches are rebuilt: the new grids run). Before the first call of an EPBuffer any plan goes."""
    from moe_comm import PrefillBuffer
    from moe_comm.planner import plan_prefill
    launched = record_launches(monkeypatch, lambda fn, args, grid: (fn.fn.__name__, tuple(grid)))
    monkeypatch.delenv(SHAPES_ENV, raising=False)
    groups = moe_comm.init(backend="loopback", world_size=2, device="cpu", timeout_s=5.0)
    eps = [EPBuffer(g, E_PER_RANK * 2, H, M, K) for g in groups]
    a2as = [AllToAllvDynamic(g, CAP_A2A, ROW, torch.float32) for g in groups]
    assert _step(eps, a2as, [0, 1], 0) == []
    ep_plan, a2a_plan = eps[0].plan, a2as[0].plan
    with pytest.raises(ValueError, match=rf"EPBuffer: the new plan sizes the buffers differently \(max_tokens {M} "
                                         rf"-> {M + 3}.*close\(\) the op and build a new one"):
        eps[0].plan = plan_ep(2, E_PER_RANK * 2, H, M + 3, K, torch.bfloat16, False, "cpu")
    with pytest.raises(ValueError, match=rf"AllToAllvDynamic: .*max_rows_per_peer {CAP_A2A} -> {CAP_A2A + 1}"):
        a2as[0].plan = plan_alltoallv(2, CAP_A2A + 1, ROW, torch.float32, torch.device("cpu"))
    with pytest.raises(TypeError, match="AllToAllvDynamic.plan must be a AllToAllvPlan, got EPPlan"):
        a2as[0].plan = ep_plan
    assert eps[0].plan is ep_plan and a2as[0].plan is a2a_plan
    assert _step(eps, a2as, [0, 1], 1) == []

    fresh = EPBuffer(groups[0], E_PER_RANK * 2, H, M, K)   # no call yet: nothing allocated, any plan goes
    fresh.plan = plan_ep(2, E_PER_RANK * 2, H, M + 3, K, torch.bfloat16, False, "cpu")
    assert fresh.plan.max_tokens == M + 3

    bufs = [PrefillBuffer(g, E_PER_RANK * 2, H, M, K) for g in groups]
    for b in bufs:
        b._ensure_allocated()
    gpu = plan_prefill(2, E_PER_RANK * 2, H, M, K, torch.bfloat16, False, "cuda")
    assert gpu.ep.send_grid != bufs[0].plan.ep.send_grid and gpu.copy_programs != bufs[0].plan.copy_programs
    with pytest.raises(ValueError, match=r"PrefillBuffer: .*zones 1 -> 2"):
        bufs[0].plan = plan_prefill(2, E_PER_RANK * 2, H, M, K, torch.bfloat16, False, "cpu", zones=2)
    for b in bufs:
        b.plan = gpu
    launched.clear()
    xs, idxs, ws, _, _ = step_inputs(99, 2, E_PER_RANK * 2, M, K, H, CAP_A2A, ROW)
    ws = [torch.rand(i.shape) for i in idxs]
    for b, x, i, w in zip(bufs, xs, idxs, ws):
        b.dispatch(x, i, w, phase="send")
    ds = [b.dispatch(phase="recv") for b in bufs]
    for b, d in zip(bufs, ds):
        b.combine(d.recv_x, d.handle, phase="send")
    ys = [b.combine(phase="recv") for b in bufs]
    grids = {name: {grid for n, grid in launched if n == name} for name, _ in launched}
    assert grids["prefill_dispatch_send_kernel"] == {gpu.ep.send_grid}, grids
    assert grids["prefill_combine_send_kernel"] == {(gpu.copy_programs,)}, grids
    for r in range(2):   # each expert returns its row: a token's sum is its row times the ranks it reached
        reached = [len({int(e) // E_PER_RANK for e in row if e >= 0}) for row in idxs[r]]
        expect = xs[r].float() * torch.tensor(reached, dtype=torch.float32)[:, None]
        assert torch.equal(ys[r].float(), expect.bfloat16().float()), r
    for g in groups:
        g.check()


def test_a_launch_takes_exactly_its_call_arguments():
    """A launch's call arguments are keyword-only, each kernel parameter is given once: a missing or an
    unknown one raises TypeError before anything is launched (no parameter can be left unset)."""
    from moe_comm.triton_kernels.sync import drain_kernel
    names = list(inspect.signature(drain_kernel.fn).parameters)
    static = {n: 0 for n in names[1:]}
    launch = launches.Launch(drain_kernel, "cpu", (1,), **static)
    assert launch.per_call == (names[0],)
    with pytest.raises(TypeError):
        launch.run()
    with pytest.raises(TypeError):
        launch.run(**{names[0]: 0, "not_a_parameter": 1})
