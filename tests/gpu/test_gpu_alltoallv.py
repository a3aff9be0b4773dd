"""AllToAllvDynamic compiled on a GPU: nvshmem heap (world 1), loopback heap (world 2-4), CUDA graphs.

Skipped without CUDA (conftest). Same reference checks as the CPU tests, fresh inputs per case.
"""

import pytest
import torch

import moe_comm
from moe_comm import AllToAllvDynamic, reference

pytestmark = pytest.mark.gpu

CAP = 5


def _inputs(world, row_shape, dtype, seed, device):
    g = torch.Generator().manual_seed(seed)
    counts = [torch.randint(0, CAP + 1, (world,), generator=g, dtype=torch.int32) for _ in range(world)]
    sends = [torch.randn((int(c.sum()) + 1, *row_shape), generator=g).to(dtype) for c in counts]
    return counts, sends, [c.to(device) for c in counts], [s.to(device) for s in sends]


def _check(res_list, counts, sends):
    exp = reference.alltoallv(sends, counts, CAP)
    for r, res in enumerate(res_list):
        assert torch.equal(res.recv_counts.cpu(), exp[r][1])
        for j, n in enumerate(exp[r][1].tolist()):
            assert torch.equal(res.recv[j, :n].cpu(), exp[r][0][j, :n])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_world1_nvshmem(dtype):
    pytest.importorskip("nvshmem.core")
    with moe_comm.init(backend="nvshmem", timeout_s=10) as g:
        op = AllToAllvDynamic(g, CAP, (7168,), dtype)
        for seed in range(5):
            counts, sends, dcounts, dsends = _inputs(1, (7168,), dtype, seed, g.device)
            res = op(dsends[0], dcounts[0])
            back = op.combine(res.recv * 2, res.handle)
            torch.cuda.synchronize()
            g.check()
            _check([res], counts, sends)
            n = int(counts[0].sum())
            assert torch.equal(back[:n].cpu(), (sends[0][:n].to(g.device) * 2).cpu())
        op.close()


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("row_shape", [(64,), (3, 32), (7168,)])
def test_loopback_compiled(world, row_shape):
    groups = moe_comm.init(backend="loopback", world_size=world, device="cuda")
    ops = [AllToAllvDynamic(g, CAP, row_shape, torch.bfloat16) for g in groups]
    for seed in range(4):
        counts, sends, dcounts, dsends = _inputs(world, row_shape, torch.bfloat16, seed, "cuda")
        for r, op in enumerate(ops):
            op(dsends[r], dcounts[r], phase="send")
        res = [op(phase="recv") for op in ops]
        torch.cuda.synchronize()
        for g in groups:
            g.check()
        _check(res, counts, sends)


def test_cuda_graph_replay_with_new_counts():
    world = 2
    groups = moe_comm.init(backend="loopback", world_size=world, device="cuda")
    ops = [AllToAllvDynamic(g, CAP, (256,), torch.bfloat16) for g in groups]
    n_max = CAP * world
    static_send = [torch.zeros(n_max, 256, dtype=torch.bfloat16, device="cuda") for _ in range(world)]
    static_counts = [torch.zeros(world, dtype=torch.int32, device="cuda") for _ in range(world)]

    def step():
        for r, op in enumerate(ops):
            op(static_send[r], static_counts[r], phase="send")
        out = [op(phase="recv") for op in ops]
        # An even number of calls per replay keeps the output sets alternating the same way.
        for r, op in enumerate(ops):
            op(static_send[r], static_counts[r], phase="send")
        return out, [op(phase="recv") for op in ops]

    step()  # warm up (compiles the kernels) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, second = step()
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        counts = [torch.randint(0, CAP + 1, (world,), generator=g, dtype=torch.int32) for _ in range(world)]
        sends = [torch.randn(n_max, 256, generator=g).to(torch.bfloat16) for _ in range(world)]
        for r in range(world):
            static_counts[r].copy_(counts[r])
            static_send[r].copy_(sends[r])
        graph.replay()
        torch.cuda.synchronize()
        for grp in groups:
            grp.check()
        _check(second, counts, sends)
