"""The fp8 quantizer every dispatch kernel uses (``triton_kernels.quant.quantize_e4m3_groups``) against
``reference.quantize_fp8``, bitwise, in Triton's interpreter, in every scale format (``moe_comm.formats``:
float32 amax / 448, power-of-two float32, packed UE8M0), on inputs chosen to break a quantizer that
rounds anywhere differently: many magnitudes, e4m3 rounding ties and their neighbours, binade and
subnormal boundaries, zeros of both signs, single nonzero groups, group maxima at float32 extremes, and
for the power-of-two scales group maxima within a few ulps of 448 * 2**k (where amax / 448 crosses a
power of two). Also: the reference is DeepEP's low-latency formulas (computed here once more in NumPy
float32, the UE8M0 packing as DeepEP's byte layout), and controls show these inputs tell those formulas
apart from the near misses (x / scale, torch's 448 / amax; a float32 log2, the exponent rounded down).
The sm_90 PTX of the dispatch kernels holds no float64 (tests/test_compile_sm90.py).
"""

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from moe_comm import formats, reference
from moe_comm.interpreter import kernel_for
from moe_comm.triton_kernels.quant import quantize_e4m3_groups

GROUP = 128
ROWS, GROUPS = 16, 4   # one launch quantizes a [16, 512] tile: 64 groups (a whole UE8M0 word per row)


@triton.jit
def _quantize_tile(x_ptr, q_ptr, s_ptr, ROWS: tl.constexpr, GROUPS: tl.constexpr, SCALE: tl.constexpr,
                   S_COLS: tl.constexpr):
    r = tl.arange(0, ROWS)
    c = tl.arange(0, GROUPS * 128)
    g = tl.arange(0, S_COLS)
    q, s = quantize_e4m3_groups(tl.load(x_ptr + r[:, None] * (GROUPS * 128) + c[None, :]), ROWS, GROUPS, SCALE)
    tl.store(q_ptr + r[:, None] * (GROUPS * 128) + c[None, :], q)
    tl.store(s_ptr + r[:, None] * S_COLS + g[None, :], s)


def quantize_interpreted(x: torch.Tensor, fmt: str = formats.E4M3):
    """x float32 [n * ROWS, GROUPS * 128] -> (q float8_e4m3fn, scales of format ``fmt`` [n * ROWS, ...])."""
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    cols = formats.scale_columns(fmt, GROUPS * GROUP)
    s = torch.empty(x.shape[0], cols, dtype=formats.scale_dtype(fmt))
    kernel = kernel_for(_quantize_tile, "cpu")
    for r0 in range(0, x.shape[0], ROWS):
        kernel[(1,)](x[r0:r0 + ROWS].contiguous(), q[r0:r0 + ROWS], s[r0:r0 + ROWS], ROWS, GROUPS,
                     formats.scale_mode(fmt), cols)
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
    # Power-of-two scales: group maxima within 16 float32 ulps of 448 * 2**k, where amax * (1/448) crosses
    # 2**k (its exponent rounds up or not), each with values on the e4m3 ties of both candidate scales.
    for k in (-30, -9, -1, 0, 1, 7, 60, 119):
        top, maxima = np.float32(448.0 * 2.0 ** k), []
        for direction in (np.float32(0), np.float32(np.inf)):
            m = top
            for _ in range(16):
                m = np.nextafter(m, direction, dtype=np.float32)
                maxima.append(float(m))
        for m in [float(top)] + maxima:
            for e in (k, k + 1):
                parts.append(_groups_with_max((torch.cat([mids, -mids]) * 2.0 ** e).clamp(-m, m), m))
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


def deep_ep_formula(x: torch.Tensor, fmt: str = formats.E4M3):
    """DeepEP's low-latency quantizer (csrc/kernels: internode_ll.cu's cast, utils.cuh's
    calculate_fp8_scales and extract_required_scale_format), in NumPy float32 (each NumPy float32
    operation is one IEEE rounding): amax floored at kFP8Margin; without round_scale scale = kFP8Amax /
    amax, scale_inv = amax * kFP8AmaxInv; with it e = fast_log2_ceil(amax * kFP8AmaxInv) (exponent bits,
    +1 for a nonzero mantissa), scale = 2**-e, scale_inv = 2**e; data = cvt satfinite of x * scale; with
    use_ue8m0 the scale_inv's exponent byte (bits >> 23), four bytes per int32 in DeepEP's order."""
    xf = x.float().unflatten(-1, (-1, GROUP)).numpy()
    amax = np.maximum(np.abs(xf).max(axis=-1), np.float32(1e-4))
    if fmt == formats.E4M3:
        scale, scale_inv = np.float32(448.0) / amax, amax * np.float32(1.0 / 448.0)
    else:
        bits = (amax * np.float32(1.0 / 448.0)).view(np.uint32)
        e = ((bits >> 23) & 0xFF).astype(np.int32) - 127 + ((bits & 0x7FFFFF) != 0)
        scale, scale_inv = np.ldexp(np.float32(1), -e).astype(np.float32), np.ldexp(np.float32(1), e).astype(np.float32)
    v = np.clip(xf * scale[..., None], np.float32(-448.0), np.float32(448.0))
    q = torch.from_numpy(v).to(torch.float8_e4m3fn).flatten(-2)
    if fmt == formats.E4M3_UE8M0:
        exponent_bytes = (scale_inv.view(np.uint32) >> 23).astype(np.uint8)     # [..., G]
        return q, torch.from_numpy(np.ascontiguousarray(exponent_bytes).view("<i4").copy())
    return q, torch.from_numpy(scale_inv)


@pytest.mark.parametrize("fmt", formats.FP8_FORMATS)
def test_interpreted_kernel_matches_the_reference_bitwise(fmt):
    x = tiles(adversarial_groups())
    q, s = quantize_interpreted(x, fmt)
    want_q, want_s = reference.quantize_fp8(x, fmt=fmt)
    assert torch.equal(codes(q), codes(want_q)), int((codes(q) != codes(want_q)).sum())
    assert s.dtype == want_s.dtype and torch.equal(s.view(torch.int32), want_s.view(torch.int32))


@pytest.mark.parametrize("fmt", formats.FP8_FORMATS)
def test_the_reference_is_deep_eps_formula(fmt):
    x = tiles(adversarial_groups(1))
    q, s = reference.quantize_fp8(x, fmt=fmt)
    want_q, want_s = deep_ep_formula(x, fmt)
    assert torch.equal(codes(q), codes(want_q)) and torch.equal(s.view(torch.int32), want_s.view(torch.int32))


def test_power_of_two_scales():
    """e4m3-pow2 and e4m3-ue8m0 give the same codes; the scales are powers of two at least amax / 448
    (so no code exceeds 448) and below twice that, and the UE8M0 bytes are their exponents."""
    x = tiles(adversarial_groups(2))
    q2, s2 = reference.quantize_fp8(x, fmt=formats.E4M3_POW2)
    qu, su = reference.quantize_fp8(x, fmt=formats.E4M3_UE8M0)
    assert torch.equal(codes(q2), codes(qu)) and torch.equal(reference.unpack_ue8m0(su), s2)
    mantissa, _ = np.frexp(s2.numpy())
    assert (mantissa == 0.5).all()
    amax = x.unflatten(-1, (-1, GROUP)).abs().amax(-1).clamp(min=reference.FP8_AMAX_MIN)
    t = amax * torch.tensor(1 / 448, dtype=torch.float32)
    assert bool((s2 >= t).all() and (s2 < 2 * t).all())
    assert su.shape == (x.shape[0], GROUPS // 4) and su.dtype == torch.int32


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


@pytest.mark.parametrize("variant", ["float32 log2, then ceil", "exponent rounded down"])
def test_control_the_inputs_tell_power_of_two_near_misses_apart(variant):
    """Power-of-two scales computed in ways a quantizer might plausibly use instead (ceil of a float32
    log2, which rounds k + tiny to k for large k; floor instead of ceil) give other scales on these
    inputs, so the bitwise tests above can fail. (amax / 448 divided exactly instead of amax *
    float32(1/448) is no near miss: no float32 amax tells the two apart.)"""
    x = tiles(adversarial_groups())
    amax = x.unflatten(-1, (-1, GROUP)).abs().amax(dim=-1).clamp(min=reference.FP8_AMAX_MIN)
    t = amax * torch.tensor(1 / 448, dtype=torch.float32)
    e = torch.log2(t).ceil() if variant == "float32 log2, then ceil" else torch.log2(t.double()).floor()
    _, scales = reference.quantize_fp8(x, fmt=formats.E4M3_POW2)
    assert not torch.equal(torch.ldexp(torch.ones_like(t), e.float()), scales)
