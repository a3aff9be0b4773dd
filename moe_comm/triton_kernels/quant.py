"""Low-precision rounding shared by the kernels: FP8 (e4m3) quantization with one float32 scale per
128 columns, and float32 -> bfloat16 rounding.

Format (the one DeepEP and DeepGEMM use): for each row and each group of 128 columns,
``scale = amax / 448`` (1.0 when the group is all zeros) and ``q = fp8_e4m3(x / scale)`` rounded to
nearest, ties to even, so ``x ~= q * scale``. ``moe_comm.reference.quantize_fp8`` is the torch twin.

The rounding to the e4m3 grid is done here in float32 arithmetic, and only exactly representable values
are converted: the conversion instruction's own rounding is then never exercised, which keeps compiled
kernels, Triton's interpreter (whose float8 conversion mis-rounds at binade boundaries) and torch bitwise
equal. For the same reason x / scale is computed in float64 (as x times the float64 reciprocal of the
scale, one division per group) and rounded once to float32: a quotient of two float32 values is never
within 2**-49 (relative) of a float32 rounding midpoint, far more than the float64 error, so this is the
correctly rounded float32 quotient that torch computes (compiled float32 ``/`` is approximate, and
``div_rn`` compiles to a subroutine with a stack frame).
"""

import triton
import triton.language as tl

FP8_E4M3_MAX = tl.constexpr(448.0)
FP8_E4M3_MIN_NORMAL = tl.constexpr(0.015625)  # 2**-6; below it the grid is uniform with step 2**-9


@triton.jit
def round_to_e4m3(v):
    """Round float32 ``v`` (|v| <= 448) to the nearest float8 e4m3 value, ties to even, in float32."""
    bits = v.to(tl.int32, bitcast=True)
    # Normal range: keep 3 mantissa bits of float32's 23, rounding to nearest even on the dropped 20.
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    # Subnormal range: multiples of 2**-9. Adding and subtracting 1.5 * 2**23 rounds to an integer
    # (ties to even) in float32; the sign is copied back so that -0 stays -0.
    scaled = v * 512.0
    rounded = ((scaled + 12582912.0) - 12582912.0) * 0.001953125
    sub = (tl.abs(rounded).to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)
    r = tl.where(tl.abs(v) >= FP8_E4M3_MIN_NORMAL, normal, sub)
    return tl.minimum(tl.maximum(r, -FP8_E4M3_MAX), FP8_E4M3_MAX)


@triton.jit
def quantize_e4m3_groups(x, BLOCK_T: tl.constexpr, GROUPS: tl.constexpr):
    """Quantize float32 ``x`` [BLOCK_T, GROUPS * 128] per 128-column group.

    Returns (q [BLOCK_T, GROUPS * 128] float8e4nv, scale [BLOCK_T, GROUPS] float32).
    """
    x3 = tl.reshape(x, (BLOCK_T, GROUPS, 128))
    amax = tl.max(tl.abs(x3), axis=2)
    scale = tl.where(amax > 0, (amax.to(tl.float64) / FP8_E4M3_MAX).to(tl.float32), 1.0)
    inverse = 1.0 / scale.to(tl.float64)  # one division per group; x * inverse rounds like x / scale
    v = (x3.to(tl.float64) * inverse[:, :, None]).to(tl.float32)
    q = round_to_e4m3(v).to(tl.float8e4nv)
    return tl.reshape(q, (BLOCK_T, GROUPS * 128)), scale


@triton.jit
def round_to_bf16(x):
    """float32 -> bfloat16, round to nearest even. Rounds in integer arithmetic and converts only exact
    values: Triton's interpreter truncates in its own conversion, compiled code rounds to nearest even."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return tl.where(x == x, rounded, x).to(tl.bfloat16)  # NaN passes through unchanged


@triton.jit
def cast_rne(x, DTYPE: tl.constexpr):
    """float32 ``x`` to DTYPE, rounding to nearest even on every backend."""
    if DTYPE == tl.bfloat16:
        return round_to_bf16(x)
    else:
        return x.to(DTYPE)
