"""Which error a call reports does not depend on the order its programs run in (docs/testing.md,
"Which error is reported"): several bad counts name the lowest destination; with two peers dead a
timeout names the lower one. Each case runs in grid order, reversed, and in a random order
(MOE_COMM_INTERPRET_ORDER, set before the ops are built), with the GPU launch shapes where the CPU plan would
be a single program."""

import pytest
import torch

import moe_comm
from moe_comm import AllToAllvDynamic, CapacityError, CommTimeoutError, EPBuffer, interpret_order, planner

ORDERS = ("asis", "reverse", "random")
TIMEOUT_S = 0.3
CAP = 3
E, H, M, K = 6, 128, 3, 2   # world 3: experts 0-1 on rank 0, 2-3 on rank 1, 4-5 on rank 2


@pytest.fixture(params=ORDERS)
def order(request, monkeypatch):
    monkeypatch.setenv(interpret_order.ORDER_ENV, request.param)
    monkeypatch.setenv(interpret_order.DELAY_ENV, "0")
    return request.param


def _a2a(world=3):
    groups = moe_comm.init(backend="loopback", world_size=world, device="cpu", timeout_s=TIMEOUT_S)
    return [AllToAllvDynamic(g, CAP, (4,), torch.float32) for g in groups]


def test_several_bad_counts_name_the_lowest_destination(order):
    """Rank 0 sends too many rows to ranks 1 and 2: the error names rank 1 (its own program records it)
    whichever of the two send programs runs first."""
    ops = _a2a()
    counts = [torch.tensor([1, CAP + 1, CAP + 2]), torch.tensor([1, 1, 1]), torch.tensor([1, 1, 1])]
    for op, c in zip(ops, counts):
        op(torch.randn(int(c.sum()), 4), c, phase="send")
    with pytest.raises(CapacityError, match=rf"rank 0: send_counts\[1\] is {CAP + 1}, but only {CAP} rows") as info:
        ops[0](phase="recv")
    assert (info.value.rank, info.value.peer) == (0, 1)
    for op in ops[1:]:
        assert op(phase="recv").recv_counts.tolist() == [CAP, 1, 1]


def test_alltoallv_timeout_names_the_lowest_dead_peer(order):
    """Ranks 1 and 2 never send: rank 0's receive (one program per source) names rank 1."""
    ops = _a2a()
    ops[0](torch.randn(3, 4), torch.tensor([1, 1, 1]), phase="send")
    with pytest.raises(CommTimeoutError, match="alltoallv: rank 0 timed out .* waiting for peer rank 1 "):
        ops[0](phase="recv")


def test_combine_timeout_names_the_lowest_dead_peer(order, monkeypatch):
    """Ranks 1 and 2 skip their combine: rank 0's combine (GPU launch shapes: one program per token)
    names rank 1, even when the program of token 2, whose experts are all on rank 2, times out first."""
    monkeypatch.setenv(planner.SHAPES_ENV, "gpu")
    groups = moe_comm.init(backend="loopback", world_size=3, device="cpu", timeout_s=TIMEOUT_S)
    eps = [EPBuffer(g, E, H, M, K) for g in groups]
    assert eps[0].plan.reduce_grid[0] == M
    g = torch.Generator().manual_seed(0)
    idxs = [torch.randint(0, E, (M, K), generator=g) for _ in eps]
    idxs[0][M - 1] = torch.tensor([4, 5])
    for ep, i in zip(eps, idxs):
        ep.dispatch(torch.randn(M, H, generator=g).to(torch.bfloat16), i, phase="send")
    ds = [ep.dispatch(phase="recv") for ep in eps]
    eps[0].combine(ds[0].x, torch.rand(M, K, generator=g), ds[0].handle, phase="send")
    with pytest.raises(CommTimeoutError, match="combine: rank 0 timed out .* waiting for peer rank 1 "):
        eps[0].combine(phase="recv")
