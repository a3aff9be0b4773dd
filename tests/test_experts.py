"""The masked expert GEMMs (serving/experts.py) against torch on the valid rows; idle experts skipped.

Tolerance: float32 inputs within 1e-5 relative to the largest |output| of the expert (summation order
differs from torch.bmm); bfloat16 within 2e-2 (the kernel multiplies the gate and up products in float32
and rounds once, torch rounds each product to bf16 first).
"""


import pytest
import torch

from moe_comm.serving.experts import dense_expert_mlp, masked_bmm, masked_expert_mlp



def _close(got, want, rtol):
    if want.numel() == 0:
        return
    scale = want.abs().max().clamp(min=1e-6)
    assert ((got.float() - want.float()).abs().max() / scale) <= rtol


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_masked_expert_mlp_equals_torch_on_valid_rows(dtype, rtol):
    g = torch.Generator().manual_seed(0)
    E, R, H, inter = 6, 7, 40, 72  # odd sizes: tiles are partly masked in every dimension
    x = torch.randn(E, R, H, generator=g).to(dtype)
    gate = (torch.randn(E, H, inter, generator=g) / H ** 0.5).to(dtype)
    up = (torch.randn(E, H, inter, generator=g) / H ** 0.5).to(dtype)
    down = (torch.randn(E, inter, H, generator=g) / inter ** 0.5).to(dtype)
    # empty expert, full, partial, a count larger than R (a lying device value), negative, one row
    counts = torch.tensor([0, 7, 3, 1000, -5, 1], dtype=torch.int32)
    gate[0], up[0], down[0] = float("nan"), float("nan"), float("nan")  # expert 0 has no rows: never read
    gate[4] = float("nan")
    y = masked_expert_mlp(x, counts, gate, up, down, expected_rows=2)
    want = dense_expert_mlp(x.float(), counts, gate.float(), up.float(), down.float())
    for e, n in enumerate(counts.clamp(0, R).tolist()):
        _close(y[e, :n], want[e, :n], rtol)
        assert not y[e, :n].isnan().any()


def test_masked_bmm_row_tiles_and_untouched_rows():
    """Several row tiles per expert (R > BM), rows past a count left as they were (not written)."""
    g = torch.Generator().manual_seed(1)
    E, R, K, N = 3, 37, 20, 70
    a, b = torch.randn(E, R, K, generator=g), torch.randn(E, K, N, generator=g)
    counts = torch.tensor([37, 17, 0], dtype=torch.int32)
    c = masked_bmm(a, b, counts, expected_rows=R)  # 64-row tiles: one tile
    c16 = masked_bmm(a, b, counts, expected_rows=1)  # 16-row tiles: three tiles for expert 0
    want = torch.bmm(a, b)
    for e, n in enumerate(counts.tolist()):
        _close(c[e, :n], want[e, :n], 1e-5)
        _close(c16[e, :n], want[e, :n], 1e-5)


def test_active_expert_slots():
    """A grid of max_active expert slots computes the active experts in expert order: with the exact
    number of active experts every valid row is right; a smaller bound computes the first ones only."""
    g = torch.Generator().manual_seed(2)
    E, R, K, N = 9, 5, 24, 40
    a, b = torch.randn(E, R, K, generator=g), torch.randn(E, K, N, generator=g)
    counts = torch.tensor([0, 3, 0, 0, 5, 1, 0, 0, 2], dtype=torch.int32)  # active: 1, 4, 5, 8
    want = torch.bmm(a, b)
    c = masked_bmm(a, b, counts, max_active=4)
    for e, n in enumerate(counts.tolist()):
        _close(c[e, :n], want[e, :n], 1e-5)
    c = masked_bmm(a, b, torch.zeros(E, dtype=torch.int32) + 1, max_active=2)  # 9 active, 2 slots
    _close(c[:2, :1], want[:2, :1], 1e-5)
    assert masked_bmm(a, b, counts, max_active=0).shape == (E, R, N)  # nothing launched


def test_mismatched_shapes_and_strides_are_refused():
    a, b = torch.randn(3, 4, 8), torch.randn(3, 8, 16)
    counts = torch.ones(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="same strides"):
        masked_bmm(a, b, counts, b2=torch.randn(3, 16, 8).transpose(1, 2))  # same shape, other layout
    with pytest.raises(ValueError, match="need a"):
        masked_bmm(a, torch.randn(3, 9, 16), counts)
    with pytest.raises(ValueError, match="need a"):
        masked_bmm(a, b, torch.ones(2, dtype=torch.int32))
