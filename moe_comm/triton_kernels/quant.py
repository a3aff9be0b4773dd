"""Low-precision rounding shared by the kernels: FP8 (e4m3) quantization with one float32 scale per
128 columns, and float32 -> bfloat16 rounding.

FP8 format: DeepEP's low-latency dispatch format, bit for bit. For each row and each group of 128
columns, all in float32 with every operation rounded to nearest even:

    amax  = max(max |x|, 1e-4)               1e-4 as float32 (DeepEP's kFP8Margin)
    inv   = 448 / amax                       one correctly rounded division per group
    q     = e4m3(x * inv)                    the float32 product rounded to e4m3, ties to even
                                             (|x * inv| <= 448 + 2**-15: nothing to saturate)
    scale = amax * (1 / 448)                 1/448 rounded to float32 first (DeepEP's kFP8AmaxInv)

so that x ~= q * scale (the dequantization), within half an e4m3 step plus a few float32 ulps.

Power-of-two scales (``SCALE`` constexpr, ``moe_comm.formats``: DeepEP's ``round_scale`` and ``use_ue8m0``),
from the same amax, with no division:

    t     = amax * (1 / 448)                 one float32 rounding (DeepEP's kFP8AmaxInv)
    e     = ceil(log2(t))                    from t's bits: its exponent, plus 1 if its mantissa is not 0
    q     = e4m3(x * 2**-e)                  the product is exact (a power of two); ties to even
                                             (|x * 2**-e| <= amax / t <= 448 * (1 + 2**-23): rounds to 448)
    scale = 2**e (SCALE_POW2, float32), or the byte e + 127 (SCALE_UE8M0) packed four per int32 word,
            group 4i + j in bits 8j..8j+7 of word i (DeepEP's packing)

amax >= 1e-4 keeps e in [-22, 120]: 2**e and 2**-e are normal float32 numbers.
``moe_comm.reference.quantize_fp8`` is the torch twin. The 1e-4 floor is DeepEP's: a group whose
largest magnitude is below 1e-4 is quantized as if it were 1e-4 (its smaller values lose precision,
below about 2.2e-10 they become 0), and an all-zero group gets q = 0, scale = 1e-4 * (1/448) in
float32 (~2.23e-7) rather than a special case. The floor also keeps 448 / amax finite (without it an
amax under ~1.3e-36 would give an infinite inverse and 0 * inf = NaN codes). Inputs must be finite:
a group holding an inf or a NaN gets unspecified codes and scale (backends differ there; the other
groups are unaffected).

Compiled kernels, Triton's interpreter and torch agree bitwise on finite inputs because every step
is a single IEEE float32 operation (no float64 anywhere): the division is ``tl.math.div_rn``
(``div.rn.f32``; Triton's ``/`` compiles to the approximate ``div.full.f32``; ptxas keeps a slow-path
call for rare operands but no stack frame and no spills in the dispatch kernels), and the rounding to the
e4m3 grid is done in float32 integer arithmetic (``round_to_e4m3``) so that only exactly
representable values are converted: the conversion instruction's own rounding is never exercised,
and Triton's interpreter (whose float8 conversion mis-rounds at binade boundaries) agrees. (The one
multiply-add the compiler fuses there, v * 512 + c, is exact either way: v * 512 is.)
"""

import triton
import triton.language as tl

from .. import formats
from .sync import ERR_SCALE, record_error

FP8_E4M3_MAX = tl.constexpr(448.0)
FP8_E4M3_MAX_INV = tl.constexpr(1.0 / 448.0)  # rounded to float32 where used, as DeepEP's kFP8AmaxInv
FP8_AMAX_MIN = tl.constexpr(1e-4)  # rounded to float32 where used, as DeepEP's kFP8Margin
FP8_E4M3_MIN_NORMAL = tl.constexpr(0.015625)  # 2**-6; below it the grid is uniform with step 2**-9
SCALE_FLOAT = tl.constexpr(formats.SCALE_FLOAT)   # scale = amax / 448, float32
SCALE_POW2 = tl.constexpr(formats.SCALE_POW2)     # scale = 2**ceil(log2(amax / 448)), float32
SCALE_UE8M0 = tl.constexpr(formats.SCALE_UE8M0)   # the same power of two as its UE8M0 byte, packed in int32 words
UE8M0_PER_WORD = tl.constexpr(formats.UE8M0_PER_WORD)
F32_MANTISSA_BITS = tl.constexpr(23)
F32_MANTISSA_MASK = tl.constexpr(0x7FFFFF)
F32_EXPONENT_MASK = tl.constexpr(0xFF)
F32_EXPONENT_BIAS = tl.constexpr(127)


@triton.jit
def round_to_e4m3(v):
    """Round float32 ``v``, |v| < 464, to the nearest float8 e4m3 value, ties to even, in float32.

    (464 is the tie between 448, the largest e4m3 value, and 480, which e4m3fn lacks: values from it up
    come out as 480, not saturated. quantize_e4m3_groups never passes one, see there.)"""
    bits = v.to(tl.int32, bitcast=True)
    # Normal range: keep 3 mantissa bits of float32's 23, rounding to nearest even on the dropped 20.
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    # Subnormal range: multiples of 2**-9. Adding and subtracting 1.5 * 2**23 rounds to an integer
    # (ties to even) in float32; the sign is copied back so that -0 stays -0.
    scaled = v * 512.0
    rounded = ((scaled + 12582912.0) - 12582912.0) * 0.001953125
    sub = (tl.abs(rounded).to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(v) >= FP8_E4M3_MIN_NORMAL, normal, sub)


@triton.jit
def quantize_e4m3_groups(x, BLOCK_T: tl.constexpr, GROUPS: tl.constexpr, SCALE: tl.constexpr = SCALE_FLOAT):
    """Quantize float32 ``x`` [BLOCK_T, GROUPS * 128] per row and 128-column group (module docstring),
    with the scales of ``SCALE`` (SCALE_FLOAT, SCALE_POW2 or SCALE_UE8M0).

    Returns (q [BLOCK_T, GROUPS * 128] float8e4nv, scale), x ~= q * scale: scale is float32 [BLOCK_T,
    GROUPS], or with SCALE_UE8M0 int32 [BLOCK_T, GROUPS // 4] packed exponents (GROUPS % 4 == 0).
    Finite x needs no saturation: |x| <= amax and inv <= (448 / amax) * (1 + 2**-24) give
    |x * inv| <= 448 + 2**-15 (one float32 ulp over 448), which rounds to 448 (the power-of-two bound
    is in the module docstring).
    """
    x3 = tl.reshape(x, (BLOCK_T, GROUPS, 128))
    amax = tl.maximum(tl.max(tl.abs(x3), axis=2), FP8_AMAX_MIN)
    if SCALE == SCALE_FLOAT:
        inverse = tl.math.div_rn(tl.full((BLOCK_T, GROUPS), FP8_E4M3_MAX, tl.float32), amax)  # once per group
        scale = amax * FP8_E4M3_MAX_INV
    else:
        bits = (amax * FP8_E4M3_MAX_INV).to(tl.int32, bitcast=True)   # t > 0: no sign bit
        # e + 127 = t's biased exponent, rounded up when t is not a power of two; in [105, 247]
        biased = ((bits >> F32_MANTISSA_BITS) & F32_EXPONENT_MASK) + ((bits & F32_MANTISSA_MASK) != 0).to(tl.int32)
        inverse = ((-biased + 2 * F32_EXPONENT_BIAS) << F32_MANTISSA_BITS).to(tl.float32, bitcast=True)   # 2**-e
        if SCALE == SCALE_POW2:
            scale = (biased << F32_MANTISSA_BITS).to(tl.float32, bitcast=True)                          # 2**e
        else:   # four bytes to a word, group 4i + j in byte j (DeepEP's packing)
            scale = pack_codes(biased, BLOCK_T, GROUPS // UE8M0_PER_WORD, UE8M0_PER_WORD)
    q = round_to_e4m3(x3 * inverse[:, :, None]).to(tl.float8e4nv)
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


@triton.jit
def dequantize_e4m3_groups(q, scale, BLOCK_T: tl.constexpr, GROUPS: tl.constexpr):
    """float32 [BLOCK_T, GROUPS * 128] = q * scale per 128-column group: the inverse of
    ``quantize_e4m3_groups`` (q [BLOCK_T, GROUPS * 128] float8e4nv, or its values in float32; scale
    [BLOCK_T, GROUPS] float32), one float32 multiply per element, as ``reference.dequantize_fp8``."""
    v = tl.reshape(q.to(tl.float32), (BLOCK_T, GROUPS, 128)) * scale[:, :, None]
    return tl.reshape(v, (BLOCK_T, GROUPS * 128))


# ---- NVFP4: e2m1 values, one e4m3 scale per 16 elements, one float32 global scale ---------------------
#
# TensorRT-LLM's NVFP4 quantization (``cvt_warp_fp16_to_fp4``, scale layout LINEAR), every step one
# float32 operation rounded to nearest even; its two approximate reciprocals (``rcp.approx.ftz``) are
# correctly rounded divisions here (``tl.math.div_rn``), which the interpreter and torch can reproduce:
#
#     vmax  = max |x| over the 16 elements of a block          (exact)
#     sf    = e4m3(min(gs * (vmax * f32(1/6)), 448))            block scale, ties to even, saturated
#     inv   = 1 / (sf * (1 / gs))  if sf != 0  else 0           (two correctly rounded divisions)
#     q     = e2m1(x * inv)                                     ties to even, saturated at +-6
#
# so that x ~= e2m1(q) * sf / gs. e2m1 is {0, 0.5, 1, 1.5, 2, 3, 4, 6} with a sign bit; a value rounds to
# the nearest, ties to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4,
# 5 -> 4), keeping its sign (a negative value that rounds to zero is -0, code 8). The rounding is a count
# of thresholds passed, in float32 comparisons: no conversion instruction is involved, so the interpreter,
# compiled code and ``reference.quantize_nvfp4`` agree bit for bit. One deviation from TensorRT-LLM
# besides the exact reciprocals: TensorRT-LLM tests the scale before its rounding to e4m3 for zero; a
# block whose scale rounds to zero (gs * vmax / 6 < 2**-10) would divide by zero there, here its codes
# are 0. ``gs`` is the caller's global scale (TensorRT-LLM's ``448 * 6 / amax``), finite and positive.
#
# Layout (TensorRT-LLM's, linear scales): element 2j of a row in the low nibble of byte j, element 2j+1 in
# the high nibble; block b's scale is byte b of the row's scales. Here 8 codes per int32 word (element i
# of a word at bits 4i..4i+3) and 4 scale codes per word (block i at bits 8i..8i+7): the same bytes.
NVFP4_GROUP = tl.constexpr(16)              # elements per e4m3 block scale
E2M1_MAX = tl.constexpr(6.0)
NVFP4_RCP6 = tl.constexpr(1.0 / 6.0)        # rounded to float32 where used (TensorRT-LLM's rcp of 6)


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit
def round_to_e2m1(v):
    """int32 e2m1 codes (sign << 3 | magnitude code) of float32 ``v``: nearest, ties to the even code,
    saturated at 6 (see above). The magnitude code is the number of rounding thresholds |v| passes."""
    a = tl.abs(v)
    mag = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
           + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))
    sign = (v.to(tl.int32, bitcast=True) >> 31) & 1
    return mag | (sign << 3)


@triton.jit
def pack_codes(codes, BLOCK_T: tl.constexpr, WORDS: tl.constexpr, PER_WORD: tl.constexpr):
    """int32 [BLOCK_T, WORDS * PER_WORD] codes of 32 // PER_WORD bits -> int32 [BLOCK_T, WORDS] words, code i
    of a word at bits i * (32 // PER_WORD) up (little-endian: the bytes of the codes in order)."""
    c = tl.reshape(codes, (BLOCK_T, WORDS, PER_WORD))
    shift = tl.arange(0, PER_WORD) * (32 // PER_WORD)
    return tl.reduce(c << shift[None, None, :], 2, _bit_or)


@triton.jit
def quantize_nvfp4_groups(x, global_scale, BLOCK_T: tl.constexpr, GROUPS: tl.constexpr):
    """Quantize float32 ``x`` [BLOCK_T, GROUPS * 16] per row and 16-column block to NVFP4 (above), with the
    float32 scalar ``global_scale``. GROUPS is a multiple of 4. Returns (values int32 [BLOCK_T, GROUPS * 2]:
    8 e2m1 codes per word, scales int32 [BLOCK_T, GROUPS // 4]: 4 e4m3 codes per word), the row's bytes in
    TensorRT-LLM's order."""
    x3 = tl.reshape(x, (BLOCK_T, GROUPS, 16))
    vmax = tl.max(tl.abs(x3), axis=2)
    sf = round_to_e4m3(tl.minimum(global_scale * (vmax * NVFP4_RCP6), FP8_E4M3_MAX))   # >= 0, exact e4m3
    one = tl.full((BLOCK_T, GROUPS), 1.0, tl.float32)
    inv_gs = tl.math.div_rn(one, tl.full((BLOCK_T, GROUPS), 1.0, tl.float32) * global_scale)
    inverse = tl.where(sf != 0, tl.math.div_rn(one, tl.where(sf != 0, sf, 1.0) * inv_gs), 0.0)
    codes = round_to_e2m1(x3 * inverse[:, :, None])
    values = pack_codes(tl.reshape(codes, (BLOCK_T, GROUPS * 16)), BLOCK_T, GROUPS * 2, 8)
    sf_codes = sf.to(tl.float8e4nv).to(tl.int8, bitcast=True).to(tl.int32) & 0xFF
    return values, pack_codes(sf_codes, BLOCK_T, GROUPS // 4, 4)


# The global scale is one per call and the same on every rank (every row of an expert is dequantized
# with the receiver's): each nvfp4 source sends its scale's bits in a control word, and the receive checks
# them against its own send's (which it reads from its own control words: no extra argument).
@triton.jit
def check_scales(scale_words, arrived, src, grp, op, rank):
    """The receive's program that waited for every source, after its acquire: ``scale_words`` [WORLD_P2]
    pointers to each source's global-scale control word (published before the flag it acquired; read
    only where ``arrived``), ``src`` their source ranks. A source whose scale differs from this rank's
    records a data error (GlobalScaleError: the first such source, its bits, this rank's bits); the rows
    are kept as sent. The branch is on values every thread loaded alike (block-uniform)."""
    bits = tl.load(scale_words, mask=arrived, other=0)
    own_arrived = tl.max(tl.where(src == rank, arrived, False).to(tl.int32)) > 0
    own = tl.sum(tl.where((src == rank) & arrived, bits, 0))
    odd = tl.where(own_arrived, arrived & (bits != own), False)
    if tl.max(odd.to(tl.int32)) > 0:
        first = tl.min(tl.where(odd, src, 1 << 30))
        record_error(grp, ERR_SCALE, op, rank, first, tl.sum(tl.where(src == first, bits, 0)), own)
