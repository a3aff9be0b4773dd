"""The counts-driven row copy (moe_comm/triton_kernels/copy_rows.py) and the ops-path dispatch that uses
it: valid rows copied exactly, rows past a count never touched, bad counts clamped."""

import pytest
import torch

import moe_comm
from moe_comm import ops
from moe_comm.ep import EPBuffer
from moe_comm.triton_kernels.copy_rows import copy_valid_rows

POISON = -7


@pytest.mark.parametrize("dtype,width", [(torch.bfloat16, 96), (torch.float8_e4m3fn, 128),
                                         (torch.float32, 3), (torch.int32, None)])
def test_copies_exactly_the_valid_rows(dtype, width):
    E, rows = 5, 7
    g = torch.Generator().manual_seed(0)
    shape = (E, rows) if width is None else (E, rows, width)
    src = torch.randint(-100, 100, shape, generator=g).to(dtype)
    dst = torch.full(shape, POISON, dtype=torch.float32).to(dtype)
    counts = torch.tensor([0, 3, rows, rows + 4, -2], dtype=torch.int32)   # empty, some, full, over, negative
    copy_valid_rows(src, dst, counts)
    for e, n in enumerate(counts.clamp(0, rows).tolist()):
        assert torch.equal(dst[e, :n].float(), src[e, :n].float()), e
        assert (dst[e, n:].float() == POISON).all(), e


def test_rejects_rows_that_are_not_whole_words_and_bad_counts():
    x = torch.zeros(2, 3, 3, dtype=torch.bfloat16)  # 6-byte rows
    with pytest.raises(ValueError, match="multiple of 4"):
        copy_valid_rows(x, x.clone(), torch.zeros(2, dtype=torch.int32))
    y = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="int32"):
        copy_valid_rows(y, y.clone(), torch.zeros(2, dtype=torch.int64))


@pytest.mark.parametrize("fp8", [False, True])
def test_ops_dispatch_writes_the_valid_rows_only(fp8):
    """The op path gives what EPBuffer.dispatch gives on every valid row; rows past the counts keep what
    the caller's tensors held (no copy of the whole receive buffer)."""
    E, H, M, K = 4, 128, 4, 2
    (grp,) = moe_comm.init(backend="loopback", world_size=1)
    ep = EPBuffer(grp, E, H, M, K, fp8_dispatch=fp8)
    ref = EPBuffer(grp, E, H, M, K, fp8_dispatch=fp8)
    ep_id = ops.register(ep)
    try:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(3, H, generator=g).to(torch.bfloat16)
        idx = torch.tensor([[0, 2], [2, -1], [0, 2]])
        out = ops.dispatch(ep_id, x, idx)                     # allocates; then poison and call again
        out.x.view(torch.uint8).fill_(0x7F)
        out.src.fill_(POISON)
        if fp8:
            out.scales.fill_(POISON)
        got = ops.dispatch(ep_id, x, idx, out=out)
        want = ref.dispatch(x, idx)
        assert torch.equal(got.counts, want.counts)
        for e, n in enumerate(want.counts.tolist()):
            assert torch.equal(got.x[e, :n].view(torch.uint8), want.x[e, :n].view(torch.uint8)), e
            assert torch.equal(got.src[e, :n], want.src[e, :n]), e
            assert (got.x[e, n:].view(torch.uint8) == 0x7F).all() and (got.src[e, n:] == POISON).all(), e
            if fp8:
                assert torch.equal(got.scales[e, :n], want.scales[e, :n]) and (got.scales[e, n:] == POISON).all()
        ops.combine(ep_id, torch.zeros_like(got.x, dtype=torch.bfloat16), torch.ones(3, K))
        ops.combine(ep_id, torch.zeros_like(got.x, dtype=torch.bfloat16), torch.ones(3, K))
    finally:
        ops.unregister(ep_id)
