"""The errors a user meets first say what was wrong in the user's own terms, and the fix."""

import pytest
import torch

import moe_comm
from moe_comm import AllToAllvDynamic, CapacityError, EPBuffer


def test_epbuffer_dtype_error_names_the_constructor_argument():
    (g,) = moe_comm.init(backend="loopback", world_size=1)
    ep = EPBuffer(g, num_experts=2, hidden=128, max_tokens_per_rank=2, topk=1)   # bfloat16
    x = torch.randn(2, 128, dtype=torch.float16)
    with pytest.raises(TypeError, match=r"x has dtype torch.float16.*EPBuffer\(\.\.\., dtype=torch.float16\)"):
        ep.dispatch(x, torch.zeros(2, 1, dtype=torch.int64))


def test_alltoallv_dtype_error_names_the_constructor_argument():
    (g,) = moe_comm.init(backend="loopback", world_size=1)
    op = AllToAllvDynamic(g, 2, (4,), torch.bfloat16)
    with pytest.raises(TypeError, match=r"AllToAllvDynamic\(group, .*dtype=torch.float32\)"):
        op(torch.randn(2, 4), torch.tensor([1]))


def test_alltoallv_count_past_the_input_reports_that_peers_own_count():
    """4 rows, send_counts [2, 3]: rank 1's count is 3 and only 2 rows are left for it (not a running
    total of 5 of 4), and the message speaks of AllToAllvDynamic's arguments, not of EPBuffer experts."""
    groups = moe_comm.init(backend="loopback", world_size=2)
    ops = [AllToAllvDynamic(g, 4, (4,), torch.float32) for g in groups]
    counts = [torch.tensor([2, 3]), torch.tensor([0, 0])]
    for op, c in zip(ops, counts):
        op(torch.randn(4, 4), c, phase="send")
    with pytest.raises(CapacityError) as info:
        ops[0](phase="recv")
    ops[1](phase="recv")
    err = info.value
    assert (err.rank, err.peer, err.value, err.capacity) == (0, 1, 3, 2), str(err)
    msg = str(err)
    assert msg.startswith("AllToAllvDynamic: rank 0: send_counts[1] is 3, but only 2 rows"), msg
    assert "max_rows_per_peer" in msg and "sum(send_counts) <= send.shape[0]" in msg
    assert "expert" not in msg and "EPBuffer" not in msg


def test_alltoallv_count_over_capacity_reports_the_capacity():
    (g,) = moe_comm.init(backend="loopback", world_size=1)
    op = AllToAllvDynamic(g, 2, (4,), torch.float32)
    with pytest.raises(CapacityError, match=r"send_counts\[0\] is 5, but only 2 rows") as info:
        op(torch.randn(6, 4), torch.tensor([5]))
    assert "expert" not in str(info.value)
