"""moe_comm.ops: the custom ops under torch.compile(fullgraph=True) give what eager calls give.

CPU only: loopback groups (one process, phase by phase) and shm ranks through moe_comm.launch.
"""

import pytest
import torch

import moe_comm
from moe_comm import ops, reference

from budget import SWEEP
from moe_cases import close, make_inputs, reference_moe, toy_experts

from moe_comm.ep import EPBuffer

E, TOPK, HIDDEN, MAXT = 4, 2, 64, 4


def test_ops_are_registered_with_mutated_outputs():
    expected = {
        "ep_dispatch": {"recv_x", "recv_scales", "recv_counts", "recv_src"},
        "ep_combine": {"out"},
        "alltoallv": {"recv", "recv_counts"},
        "alltoallv_combine": {"out"},
    }
    for name, mutated in expected.items():
        schema = getattr(torch.ops.moe_comm, name).default._schema
        assert schema.is_mutable, name
        got = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        assert got == mutated, name
        assert len(schema.returns) == 0, name


def test_unknown_id_and_combine_without_dispatch_raise():
    with pytest.raises(ValueError, match="not a registered"):
        ops.combine(12345, torch.zeros(1), torch.zeros(1, 1))
    (g,) = moe_comm.init(backend="loopback", world_size=1)
    a2a_id = ops.register(moe_comm.AllToAllvDynamic(g, 2, (8,), torch.float32))
    try:
        with pytest.raises(RuntimeError, match="no forward call"):
            ops.alltoallv_combine(a2a_id, torch.zeros(1, 2, 8), num_rows=2)
    finally:
        ops.unregister(a2a_id)


def _a2a_roundtrip(a2a_id, send, counts):
    recv, recv_counts = ops.alltoallv(a2a_id, send, counts)
    back = ops.alltoallv_combine(a2a_id, recv * 3, num_rows=send.shape[0])
    return recv, recv_counts, back


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_alltoallv_ops_compiled_equal_eager(backend):
    (g,) = moe_comm.init(backend="loopback", world_size=1)
    a2a = moe_comm.AllToAllvDynamic(g, 4, (8,), torch.float32)
    a2a_id = ops.register(a2a)
    fn = torch.compile(_a2a_roundtrip, fullgraph=True, backend=backend)
    try:
        for seed, n in ((0, 3), (1, 0), (2, 4)):
            send = torch.randn(5, 8, generator=torch.Generator().manual_seed(seed))
            counts = torch.tensor([n], dtype=torch.int32)
            exp_recv, exp_counts = reference.alltoallv([send], [counts], 4)[0]
            for recv, recv_counts, back in (_a2a_roundtrip(a2a_id, send, counts), fn(a2a_id, send, counts)):
                assert torch.equal(recv_counts, exp_counts)
                assert torch.equal(recv[0, :n], exp_recv[0, :n])
                assert torch.equal(back[:n], send[:n] * 3)
    finally:
        ops.unregister(a2a_id)


def test_alltoallv_op_passes_opcheck():
    (g,) = moe_comm.init(backend="loopback", world_size=1)
    a2a_id = ops.register(moe_comm.AllToAllvDynamic(g, 4, (8,), torch.float32))
    try:
        args = (a2a_id, torch.randn(4, 8), torch.tensor([3], dtype=torch.int32),
                torch.empty(1, 4, 8), torch.empty(1, dtype=torch.int32), "both")
        torch.library.opcheck(torch.ops.moe_comm.alltoallv.default, args,
                              test_utils=("test_schema", "test_faketensor"))
    finally:
        ops.unregister(a2a_id)


def _moe_block(ep_id, local_experts, x, topk_idx, topk_weights):
    d = ops.dispatch(ep_id, x, topk_idx)
    return ops.combine(ep_id, toy_experts(0, local_experts, d.x), topk_weights), d.counts


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_ep_ops_compiled_equal_eager_world1(backend):
    (g,) = moe_comm.init(backend="loopback", world_size=1)
    ep = EPBuffer(g, E, HIDDEN, MAXT, TOPK, dtype=torch.bfloat16)
    ep_id = ops.register(ep)
    fn = torch.compile(_moe_block, fullgraph=True, backend=backend, dynamic=False)
    try:
        for seed, t in ((0, MAXT), (1, 1), (2, 3)):
            (x,), (idx,), (w,) = make_inputs(1, [t], E, TOPK, HIDDEN, seed)
            expected = reference_moe(x, idx, w)
            counts = torch.bincount(idx[idx >= 0], minlength=E).to(torch.int32)
            for y, got_counts in (_moe_block(ep_id, E, x, idx, w), fn(ep_id, E, x, idx, w)):
                assert torch.equal(got_counts, counts)
                assert close(y, expected)
    finally:
        ops.unregister(ep_id)


def _two_ranks_phase_by_phase(ids, local_experts, xs, idxs, ws):
    """Both ranks of a loopback world in one graph: sends, then receives (the order the ops must keep)."""
    outs = [ops.dispatch(i, x, idx, phase="send") for i, x, idx in zip(ids, xs, idxs)]
    outs = [ops.dispatch(i, None, None, out=o, phase="recv") for i, o in zip(ids, outs)]
    ys = []
    for r, (i, o, w) in enumerate(zip(ids, outs, ws)):
        ys.append(ops.combine(i, toy_experts(r, local_experts, o.x), w, phase="send"))
    return [ops.combine(i, None, None, out=y, phase="recv") for i, y in zip(ids, ys)]


def test_ep_ops_phase_by_phase_compiled_world2():
    groups = moe_comm.init(backend="loopback", world_size=2)
    ids = [ops.register(EPBuffer(g, E, HIDDEN, MAXT, TOPK, dtype=torch.bfloat16)) for g in groups]
    fn = torch.compile(_two_ranks_phase_by_phase, fullgraph=True, backend="aot_eager", dynamic=False)
    try:
        for seed in (0, 1):
            xs, idxs, ws = make_inputs(2, [MAXT, 3], E, TOPK, HIDDEN, seed)
            for ys in (_two_ranks_phase_by_phase(ids, E // 2, xs, idxs, ws),
                       fn(ids, E // 2, xs, idxs, ws)):
                for r in range(2):
                    assert close(ys[r], reference_moe(xs[r], idxs[r], ws[r])), f"rank {r}"
    finally:
        for i in ids:
            ops.unregister(i)


def _shm_rank(group, seed):
    """One shm rank: eager and compiled (inductor) MoE block against the reference; returns mismatches."""
    world, rank = group.world_size, group.rank
    ep_id = ops.register(EPBuffer(group, E, HIDDEN, MAXT, TOPK, dtype=torch.bfloat16))

    def block(x, idx, w):
        d = ops.dispatch(ep_id, x, idx)
        return ops.combine(ep_id, toy_experts(rank, E // world, d.x), w)

    compiled = torch.compile(block, fullgraph=True, dynamic=False)
    errs = []
    for step in range(2):
        xs, idxs, ws = make_inputs(world, [MAXT, 2, 1][:world], E, TOPK, HIDDEN, seed + step)
        expected = reference_moe(xs[rank], idxs[rank], ws[rank])
        for name, fn in (("eager", block), ("compiled", compiled)):
            if not close(fn(xs[rank], idxs[rank], ws[rank]), expected):
                errs.append(f"rank {rank} step {step} {name}")
    return errs


@SWEEP
@pytest.mark.timeout(300)
def test_ep_ops_compiled_shm_world2():
    errs = moe_comm.launch(_shm_rank, 2, 0, backend="shm", timeout_s=120)
    assert [e for r in errs for e in r] == []
