"""The NVFP4 quantizer every nvfp4 dispatch kernel uses (``triton_kernels.quant.quantize_nvfp4_groups``)
against ``reference.quantize_nvfp4``, bit for bit, in Triton's interpreter, on inputs chosen to break a
quantizer that rounds anywhere differently: every e2m1 rounding tie and its float32 neighbours at scales
that make the ties exact, block scales at e4m3 ties, subnormal and zero block scales, saturation (a global
scale too large for the data), zeros of both signs, single nonzero blocks, bf16 and float32 inputs over
many decades. Also: the reference against TensorRT-LLM's formula written out once more in NumPy float32,
the layout (nibble and byte order) on a hand-made row, the fp8 combine's dequantizer, and controls that
show these inputs tell the formula apart from its near misses.
"""

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from moe_comm import reference
from moe_comm.interpreter import kernel_for
from moe_comm.triton_kernels.quant import dequantize_e4m3_groups, quantize_e4m3_groups, quantize_nvfp4_groups

BLOCK = 16
ROWS, GROUPS = 8, 8   # one launch quantizes an [8, 128] tile: 64 blocks
E2M1 = torch.tensor(reference.E2M1_VALUES)


@triton.jit
def _quantize_tile(x_ptr, gs_ptr, v_ptr, s_ptr, ROWS: tl.constexpr, GROUPS: tl.constexpr):
    r = tl.arange(0, ROWS)
    c = tl.arange(0, GROUPS * 16)
    values, scales = quantize_nvfp4_groups(tl.load(x_ptr + r[:, None] * (GROUPS * 16) + c[None, :]),
                                           tl.load(gs_ptr), ROWS, GROUPS)
    w = tl.arange(0, GROUPS * 2)
    tl.store(v_ptr + r[:, None] * (GROUPS * 2) + w[None, :], values)
    g = tl.arange(0, GROUPS // 4)
    tl.store(s_ptr + r[:, None] * (GROUPS // 4) + g[None, :], scales)


def quantize_interpreted(x: torch.Tensor, gs: torch.Tensor):
    """x float32 [n * ROWS, GROUPS * 16] -> (values uint8 [.., GROUPS * 8], scales uint8 [.., GROUPS])."""
    v = torch.empty(x.shape[0], GROUPS * 2, dtype=torch.int32)
    s = torch.empty(x.shape[0], GROUPS // 4, dtype=torch.int32)
    kernel = kernel_for(_quantize_tile, "cpu")
    for r0 in range(0, x.shape[0], ROWS):
        kernel[(1,)](x[r0:r0 + ROWS].contiguous(), gs, v[r0:r0 + ROWS], s[r0:r0 + ROWS], ROWS, GROUPS)
    return v.view(torch.uint8), s.view(torch.uint8)


def _blocks(values: torch.Tensor, vmax: float) -> torch.Tensor:
    """``values`` in blocks of 15 plus one element holding ``vmax`` (the block's max magnitude is known)."""
    n = -(-values.numel() // (BLOCK - 1))
    body = torch.zeros(n * (BLOCK - 1))
    body[:values.numel()] = values
    return torch.cat([body.view(n, BLOCK - 1), torch.full((n, 1), vmax)], dim=1)


def adversarial_cases(seed: int = 0):
    """[(x float32 [N, 16] blocks, global scale float32 [1])], N a multiple of ROWS * GROUPS per case."""
    g = torch.Generator().manual_seed(seed)
    mids = (E2M1[1:] + E2M1[:-1]) / 2                                 # every rounding tie of e2m1
    near = torch.cat([torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)])
    exact = torch.cat([mids, near, E2M1, E2M1 * 1.0001, torch.tensor([6.5, 7.0, 100.0])])
    cases = []
    # gs = 1, vmax = 6 * 2**k: the block scale is 2**k exactly (6 * f32(1/6) rounds to 1), the inverse 2**-k,
    # so x = tie * 2**k lands exactly on each tie; k spans normal and subnormal e4m3 scales.
    one = torch.ones(1)
    for k in (-9, -7, -3, 0, 4, 8):
        s = 2.0 ** k
        cases.append((_blocks(torch.cat([exact, -exact]).clamp(-6, 6) * s, 6 * s), one))
    # Block scales at e4m3 rounding ties and their neighbours: gs * vmax / 6 = an e4m3 midpoint.
    e4 = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float().sort().values
    e4mids = (e4[1:] + e4[:-1]) / 2
    sf = torch.cat([e4mids, torch.nextafter(e4mids, e4mids + 1), torch.nextafter(e4mids, e4mids - 1)])
    vmax = (sf * 6).float()
    x = torch.rand(vmax.numel(), BLOCK, generator=g) * 2 - 1
    x = x * vmax[:, None]
    x[:, 3] = vmax
    cases.append((x, one))
    # Realistic: bf16 and float32 normals over many decades, global scale from the batch, coarser and finer.
    for p in range(-20, 21, 4):
        xr = torch.randn(4, BLOCK * 8, generator=g) * 10.0 ** p
        for xx in (xr, xr.bfloat16().float()):
            base = reference.nvfp4_global_scale(xx)
            for f in (1.0, 0.3, 7.0):   # 7x: saturated blocks (values past 6 after scaling)
                cases.append((xx.view(-1, BLOCK), base * f))
    # Zeros of both signs, single nonzero blocks, a block whose scale rounds to zero, tiny values.
    z = torch.zeros(8, BLOCK)
    z[1] = -0.0
    z[2, 5] = 3.5
    z[3, 0] = -1e-30
    z[4, ::2] = -0.0
    z[5] = torch.linspace(-1e-6, 1e-6, BLOCK)
    z[6, 15] = 1e3
    cases.append((z, torch.tensor([1.0])))
    cases.append((z, torch.tensor([448.0 * 6 / 1e3])))
    out = []
    for xx, gs in cases:
        pad = -xx.shape[0] % (ROWS * GROUPS)
        xx = torch.cat([xx, torch.randn(pad, BLOCK, generator=g)])
        out.append((xx.reshape(-1, GROUPS * BLOCK).float().contiguous(), gs.float().reshape(1)))
    return out


def trt_formula(x: torch.Tensor, gs: float):
    """TensorRT-LLM's cvt_warp_fp16_to_fp4 (quantization.cuh) in NumPy float32, its rcp.approx replaced by
    correctly rounded division (each NumPy float32 operation is one IEEE rounding): the codes and the e4m3
    scale bytes."""
    xf = x.numpy().astype(np.float32).reshape(-1, BLOCK)
    gs = np.float32(gs)
    vmax = np.abs(xf).max(axis=1)
    sf = np.minimum(gs * (vmax * np.float32(1.0 / 6.0)), np.float32(448.0))
    sf8 = torch.from_numpy(sf).to(torch.float8_e4m3fn)
    sff = sf8.float().numpy()
    with np.errstate(divide="ignore"):
        out_scale = np.where(sff != 0, np.float32(1.0) / (sff * (np.float32(1.0) / gs)), np.float32(0.0))
    v = xf * out_scale[:, None].astype(np.float32)
    a = np.abs(v)
    table = E2M1.numpy()
    # nearest e2m1, ties to the even code (the lower of two codes whose magnitude code is even)
    dist = np.abs(a[..., None] - table[None, None, :])
    best = dist.argmin(axis=-1)
    tie = np.isclose(dist.min(axis=-1), np.sort(dist, axis=-1)[..., 1], rtol=0, atol=0)
    best = np.where(tie & (best % 2 == 1), best + 1, best)            # argmin takes the lower: go to even
    best = np.where(a > 6, 7, best)
    codes = best | (np.signbit(v).astype(np.int64) << 3)
    codes = codes.reshape(x.shape[0], -1)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return torch.from_numpy(packed), sf8.view(torch.uint8).reshape(x.shape[0], -1)


def test_interpreted_kernel_matches_the_reference_bitwise():
    for i, (x, gs) in enumerate(adversarial_cases()):
        v, s = quantize_interpreted(x, gs)
        want_v, want_s = reference.quantize_nvfp4(x, gs)
        assert torch.equal(v, want_v), (i, int((v != want_v).sum()))
        assert torch.equal(s, want_s.view(torch.uint8)), (i, int((s != want_s.view(torch.uint8)).sum()))


def test_the_reference_is_tensorrt_llms_formula():
    for i, (x, gs) in enumerate(adversarial_cases(1)):
        v, s = reference.quantize_nvfp4(x, gs)
        want_v, want_s = trt_formula(x, float(gs))
        assert torch.equal(v, want_v) and torch.equal(s.view(torch.uint8), want_s), i


def test_layout_on_a_hand_made_row():
    """One block [0.5, -1, 1.5, 2, 3, 4, 6, -6, 0, -0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 5] with gs = 1: vmax 6,
    scale 1.0 (e4m3 0x38); element 2j in the low nibble of byte j; the ties go to the even codes."""
    x = torch.tensor([[0.5, -1, 1.5, 2, 3, 4, 6, -6, 0, -0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 5]])
    v, s = reference.quantize_nvfp4(x, torch.ones(1))
    codes = [1, 8 | 2, 3, 4, 5, 6, 7, 8 | 7, 0, 8 | 0, 0, 2, 2, 4, 4, 6]
    assert v.tolist() == [[codes[2 * j] | codes[2 * j + 1] << 4 for j in range(8)]]
    assert s.view(torch.uint8).tolist() == [[0x38]]
    deq = reference.dequantize_nvfp4(v, s, torch.ones(1))
    assert deq.tolist() == [[0.5, -1, 1.5, 2, 3, 4, 6, -6, 0, -0.0, 0, 1, 1, 2, 2, 4]]


@pytest.mark.parametrize("variant", ["half away from zero", "x / scale", "scale not rounded to e4m3",
                                     "zero-scale guard before rounding"])
def test_control_the_inputs_tell_near_miss_formulas_apart(variant):
    """Formulas a quantizer could plausibly compute instead give other codes or scales on these inputs, so
    the bitwise tests above can fail."""
    differs = False
    for x, gs in adversarial_cases():
        want_v, want_s = reference.quantize_nvfp4(x, gs)
        xf = x.view(-1, BLOCK)
        g = gs.reshape(())
        vmax = xf.abs().amax(dim=1)
        sf_raw = (g * (vmax * torch.tensor(1 / 6, dtype=torch.float32))).clamp(max=448)
        sf = sf_raw.to(torch.float8_e4m3fn).float()
        if variant == "scale not rounded to e4m3":
            sf = sf_raw
        if variant == "x / scale":
            v = torch.where(sf[:, None] != 0, xf / (sf / g)[:, None], 0.0)
        elif variant == "zero-scale guard before rounding":
            v = xf * torch.where(sf_raw != 0, 1 / (sf * (1 / g)), 0.0)[:, None]
        else:
            v = xf * torch.where(sf != 0, 1 / (sf * (1 / g)), 0.0)[:, None]
        a = v.abs()
        away = variant == "half away from zero"   # every tie rounds up in magnitude
        mag = sum(((a >= t) if inc or away else (a > t)).int() for t, inc in reference.E2M1_THRESHOLDS)
        codes = (mag | (((v.view(torch.int32) >> 31) & 1) << 3)).reshape(x.shape[0], -1)
        packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
        if not torch.equal(packed, want_v):
            differs = True
            break
    assert differs, variant


@triton.jit
def _fp8_round_trip(x_ptr, y_ptr, ROWS: tl.constexpr, GROUPS: tl.constexpr):
    r = tl.arange(0, ROWS)
    c = tl.arange(0, GROUPS * 128)
    q, s = quantize_e4m3_groups(tl.load(x_ptr + r[:, None] * (GROUPS * 128) + c[None, :]), ROWS, GROUPS)
    tl.store(y_ptr + r[:, None] * (GROUPS * 128) + c[None, :], dequantize_e4m3_groups(q, s, ROWS, GROUPS))


def test_fp8_combine_round_trip_matches_the_reference_bitwise():
    """What the fp8 combine adds to its sum for a row (quantize then dequantize in registers, as its receive
    does for the rows it reads in place) is reference.fp8_round_trip of the row, bit for bit."""
    g = torch.Generator().manual_seed(5)
    x = torch.cat([torch.randn(8, 256, generator=g) * 10.0 ** p for p in (-6, -1, 0, 3)]).bfloat16().float()
    x[3, 7] = 1e4   # an outlier in one group
    y = torch.empty_like(x)
    for r0 in range(0, x.shape[0], 8):
        kernel_for(_fp8_round_trip, "cpu")[(1,)](x[r0:r0 + 8].contiguous(), y[r0:r0 + 8], 8, 2)
    assert torch.equal(y.view(torch.int32), reference.fp8_round_trip(x).view(torch.int32))
