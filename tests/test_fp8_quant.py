"""The fp8 quantizer every dispatch kernel uses (``triton_kernels.quant.quantize_e4m3_groups``) against
``reference.quantize_fp8``, bitwise, in Triton's interpreter, on inputs chosen to break a quantizer that
rounds anywhere differently: many magnitudes, e4m3 rounding ties and their neighbours, binade and
subnormal boundaries, zeros of both signs, single nonzero groups, group maxima at float32 extremes.
Also: the reference is DeepEP's low-latency formula (computed here once more in NumPy float32), and a
control shows these inputs tell that formula apart from the near misses (x / scale, torch's 448 / amax).
The sm_90 PTX of the dispatch kernels holds no float64 (tests/test_compile_sm90.py).
"""

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from moe_comm import reference
from moe_comm.interpreter import kernel_for
from moe_comm.triton_kernels.quant import quantize_e4m3_groups

GROUP = 128
ROWS, GROUPS = 16, 2   # one launch quantizes a [16, 256] tile: 32 groups


@triton.jit
def _quantize_tile(x_ptr, q_ptr, s_ptr, ROWS: tl.constexpr, GROUPS: tl.constexpr):
    r = tl.arange(0, ROWS)
    c = tl.arange(0, GROUPS * 128)
    g = tl.arange(0, GROUPS)
    q, s = quantize_e4m3_groups(tl.load(x_ptr + r[:, None] * (GROUPS * 128) + c[None, :]), ROWS, GROUPS)
    tl.store(q_ptr + r[:, None] * (GROUPS * 128) + c[None, :], q)
    tl.store(s_ptr + r[:, None] * GROUPS + g[None, :], s)


def quantize_interpreted(x: torch.Tensor):
    """x float32 [n * ROWS, GROUPS * 128] -> (q float8_e4m3fn, scales float32 [n * ROWS, GROUPS])."""
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    s = torch.empty(x.shape[0], GROUPS, dtype=torch.float32)
    kernel = kernel_for(_quantize_tile, "cpu")
    for r0 in range(0, x.shape[0], ROWS):
        kernel[(1,)](x[r0:r0 + ROWS].contiguous(), q[r0:r0 + ROWS], s[r0:r0 + ROWS], ROWS, GROUPS)
    return q, s


def _e4m3_values() -> torch.Tensor:
    """Every finite non-negative e4m3 value, ascending (float32)."""
    v = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return v.sort().values


def _f32(a) -> torch.Tensor:
    return torch.as_tensor(np.asarray(a, dtype=np.float32))


def _groups_with_max(values: torch.Tensor, amax: float) -> torch.Tensor:
    """``values`` laid out in groups of 127 plus one column holding ``amax`` (so the group's max is known)."""
    n = -(-values.numel() // (GROUP - 1))
    body = torch.zeros(n * (GROUP - 1))
    body[:values.numel()] = values
    return torch.cat([body.view(n, GROUP - 1), torch.full((n, 1), amax)], dim=1)


def adversarial_groups(seed: int = 0) -> torch.Tensor:
    """float32 [N, 128] groups of the kinds the module docstring lists (N a multiple of ROWS * GROUPS)."""
    g = torch.Generator().manual_seed(seed)
    e4 = _e4m3_values()
    mids = (e4[1:] + e4[:-1]) / 2                                  # every rounding tie between codes
    near = torch.cat([torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)])
    binades = 2.0 ** torch.arange(-12, 9).float()
    edges = torch.cat([binades, torch.nextafter(binades, binades + 1), torch.nextafter(binades, binades - 1)])
    sub = torch.arange(0, 17).float() * 2.0 ** -10                  # subnormal steps and their midpoints
    exact = torch.cat([mids, near, edges, sub, e4])
    parts = []
    # amax = 448 * 2**k gives inv = 2**-k exactly: the ties above land exactly, at several scales.
    for k in (-20, -3, 0, 5, 40):
        parts.append(_groups_with_max(torch.cat([exact, -exact]) * 2.0 ** k, 448.0 * 2.0 ** k))
    # Other maxima: the x whose product x * inv falls nearest each tie (x = tie / inv and its float32
    # neighbours, kept under the group's max), where a second rounding of the product would show.
    for amax in (3.7, 0.0031415, 12345.6, 1.5e-4):
        inv = _f32(448.0) / _f32(amax)
        x0 = (mids / inv).float()
        x = torch.cat([x0, torch.nextafter(x0, x0 + 1), torch.nextafter(x0, x0 - 1)]).clamp(max=amax)
        parts.append(_groups_with_max(torch.cat([x, -x]), amax))
    # Random normals over 60 decades, in bf16 (the dispatch's input) and in float32.
    for p in range(-30, 31, 3):
        x = torch.randn(4, GROUP, generator=g) * 10.0 ** p
        parts += [x, x.bfloat16().float()]
    # Group maxima at float32 extremes and around the 1e-4 floor; values spread under each maximum.
    fmax, tiny = torch.finfo(torch.float32).max, torch.finfo(torch.float32).smallest_normal
    floor = float(_f32(reference.FP8_AMAX_MIN))
    for m in (1e-30, 1e30, fmax, tiny, 1e-45, floor, float(np.nextafter(np.float32(floor), np.float32(0))),
              float(np.nextafter(np.float32(floor), np.float32(1))), 3e-5, 2e-4, 1.0, 447.9, 449.0):
        x = (torch.rand(2, GROUP, generator=g) * 2 - 1) * m
        x[:, 5] = m
        parts.append(x)
    z = torch.zeros(6, GROUP)
    z[1] = -0.0                                                   # a group of negative zeros
    z[2, 7] = 3.5                                                 # single nonzero
    z[3, 0] = -1e-20
    z[4, 127] = 1e20
    z[5, ::2] = -0.0
    parts.append(z)
    x = torch.cat(parts)
    pad = -x.shape[0] % (ROWS * GROUPS)
    return torch.cat([x, torch.randn(pad, GROUP, generator=g)])


def tiles(groups: torch.Tensor) -> torch.Tensor:
    """[N, 128] groups -> [N / GROUPS, GROUPS * 128] rows (consecutive groups share a row)."""
    return groups.reshape(-1, GROUPS * GROUP)


def codes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def deep_ep_formula(x: torch.Tensor):
    """DeepEP's low-latency quantizer (csrc/kernels/internode_ll.cu: amax floored at kFP8Margin,
    scale = kFP8Amax / amax, cvt with satfinite of x * scale, scale_inv = amax * kFP8AmaxInv), in NumPy
    float32 (each NumPy float32 operation is one IEEE rounding)."""
    xf = x.float().unflatten(-1, (-1, GROUP)).numpy()
    amax = np.maximum(np.abs(xf).max(axis=-1), np.float32(1e-4))
    inv = np.float32(448.0) / amax
    v = np.clip(xf * inv[..., None], np.float32(-448.0), np.float32(448.0))
    q = torch.from_numpy(v).to(torch.float8_e4m3fn).flatten(-2)
    return q, torch.from_numpy(amax * np.float32(1.0 / 448.0))


def test_interpreted_kernel_matches_the_reference_bitwise():
    x = tiles(adversarial_groups())
    q, s = quantize_interpreted(x)
    want_q, want_s = reference.quantize_fp8(x)
    assert torch.equal(codes(q), codes(want_q)), int((codes(q) != codes(want_q)).sum())
    assert torch.equal(s.view(torch.int32), want_s.view(torch.int32))


def test_the_reference_is_deep_eps_formula():
    x = tiles(adversarial_groups(1))
    q, s = reference.quantize_fp8(x)
    want_q, want_s = deep_ep_formula(x)
    assert torch.equal(codes(q), codes(want_q)) and torch.equal(s.view(torch.int32), want_s.view(torch.int32))


def test_all_zero_and_tiny_groups_use_the_floor():
    x = torch.zeros(1, 4 * GROUP)
    x[0, GROUP:2 * GROUP] = -0.0
    x[0, 2 * GROUP + 3] = 1e-30
    x[0, 3 * GROUP + 9] = -1e-5
    q, s = reference.quantize_fp8(x)
    floor_scale = _f32(reference.FP8_AMAX_MIN) * _f32(1 / 448)
    assert torch.equal(s, floor_scale.expand(1, 4)), s
    assert codes(q)[0, GROUP:2 * GROUP].eq(0x80).all() and codes(q)[0, 2 * GROUP + 3] == 0
    assert reference.dequantize_fp8(q, s)[0, 3 * GROUP + 9] == pytest.approx(-1e-5, rel=2 ** -4)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_a_non_finite_value_stays_in_its_group():
    """inf and NaN are outside the bitwise guarantee (module docstring of triton_kernels/quant.py), but
    every other group of the row is quantized exactly as without them."""
    x = tiles(torch.randn(ROWS * GROUPS, GROUP, generator=torch.Generator().manual_seed(3)))
    x[0, 5], x[1, GROUP + 7] = float("inf"), float("nan")
    q, s = quantize_interpreted(x)
    want_q, want_s = reference.quantize_fp8(x)
    finite = torch.ones(x.shape[0], GROUPS, dtype=torch.bool)
    finite[0, 0] = finite[1, 1] = False
    cols = finite.repeat_interleave(GROUP, dim=1)
    assert torch.equal(codes(q)[cols], codes(want_q)[cols]) and torch.equal(s[finite], want_s[finite])


@pytest.mark.parametrize("variant", ["x / scale", "torch 448 / amax"])
def test_control_the_inputs_tell_near_miss_formulas_apart(variant):
    """Formulas a quantizer could plausibly compute instead give other codes on these inputs, so the
    bitwise test above can fail."""
    x = tiles(adversarial_groups())
    xg = x.unflatten(-1, (-1, GROUP))
    amax = xg.abs().amax(dim=-1).clamp(min=reference.FP8_AMAX_MIN)
    _, scales = reference.quantize_fp8(x)
    if variant == "x / scale":
        v = xg / scales.unsqueeze(-1)
    else:
        v = xg * (448.0 / amax).unsqueeze(-1)   # computed by torch as amax.reciprocal() * 448
    q = v.clamp(-448, 448).to(torch.float8_e4m3fn).flatten(-2)
    assert not torch.equal(codes(q), codes(reference.quantize_fp8(x)[0]))
