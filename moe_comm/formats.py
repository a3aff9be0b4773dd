"""The payload formats of EPBuffer and PrefillBuffer: what the dispatch and the combine put on the wire.

One vocabulary for both directions, named by what crosses the link (docs/formats.md has the bytes, the
errors and when to use each):

dispatch_format (a token's row from its rank to the ranks holding its experts)
    None          the buffer's dtype, bit for bit
    "e4m3"        fp8: float8_e4m3fn + one float32 scale (amax / 448) per 128 columns, DeepEP's low-latency
                  ``use_fp8`` (``fp8_dispatch=True`` is the same format)
    "e4m3-pow2"   the same codes' format with the scale rounded up to a power of two, float32: DeepEP's
                  ``round_scale``
    "e4m3-ue8m0"  those powers of two as UE8M0 exponents packed four per int32 (hidden % 512 == 0):
                  DeepEP's ``use_ue8m0``, what DeepGEMM's Blackwell kernels take
    "nvfp4"       e2m1 values packed two per byte + one float8_e4m3fn scale per 16 columns + the caller's
                  float32 global scale: TensorRT-LLM's NVFP4 with linear scales (``reference.quantize_nvfp4``)
combine_format (an expert's output row back to its token's rank)
    None          the buffer's dtype: the weighted sum sees each row bit for bit as the expert wrote it
    "e4m3"        the fp8 combine: "e4m3" rows, quantized by the rank holding the expert, dequantized and
                  summed in float32 at the token's rank (``reference.fp8_round_trip``)

The fp8 dispatch formats, per row and 128-column group, in float32 (``reference.quantize_fp8`` is the
definition, bit for bit; ``triton_kernels/quant.py`` the kernels' twin):

    amax = max(max |x|, 1e-4)

    dispatch_format   DeepEP                     scale s                              codes      scales per row
    ----------------  -------------------------  -----------------------------------  ---------  -------------------
    "e4m3"            use_fp8=True               amax * (1/448)                       x * (448   float32 [H/128]
                                                                                      / amax)
    "e4m3-pow2"       round_scale=True           2**e, e = ceil(log2(amax * (1/448))) x * 2**-e  float32 [H/128]
    "e4m3-ue8m0"      round_scale=True,          2**e, as e4m3-pow2 (the same codes)  x * 2**-e  int32 [H/512]
                      use_ue8m0=True

UE8M0 is the scale's exponent alone, ``e + 127`` in one byte (an unsigned 8-bit float with no mantissa),
packed four to an int32 as DeepEP packs them: byte j (bits 8j..8j+7) of word i holds group 4i + j.
Power-of-two scales make the dequantization exact in the scale (a multiply by 2**e) at a cost of up to
one bit of the codes' precision (the codes of a group use [224, 448] of the e4m3 range, not all of it).

Every check here reads only sizes and names, so a bad combination raises when the buffer is built,
before anything is sent, naming the fix.
"""

from __future__ import annotations

import torch

E4M3, E4M3_POW2, E4M3_UE8M0, NVFP4 = "e4m3", "e4m3-pow2", "e4m3-ue8m0", "nvfp4"
FP8_FORMATS = (E4M3, E4M3_POW2, E4M3_UE8M0)      # float8_e4m3fn codes, one scale per 128 columns
DISPATCH_FORMATS = (None, *FP8_FORMATS, NVFP4)
COMBINE_FORMATS = (None, E4M3)
FP8_GROUP = 128             # columns per fp8 scale (every fp8 format, dispatch and combine)
UE8M0_PER_WORD = 4          # UE8M0 exponents packed in one int32
UE8M0_BIAS = 127            # a UE8M0 byte holds e + 127 (float32's exponent field)
NVFP4_GROUP = 16            # columns per e4m3 scale (nvfp4)
NVFP4_WORD_COLS = 64        # columns whose four e4m3 scales fill one 4-byte word (rows move as words)
FP8_COMBINE_DTYPES = (torch.bfloat16, torch.float16)
# The fp8 quantizer's SCALE constexpr (triton_kernels/quant.py): how the scale is made and what is stored.
SCALE_FLOAT, SCALE_POW2, SCALE_UE8M0 = 0, 1, 2
_SCALE_MODE = {E4M3: SCALE_FLOAT, E4M3_POW2: SCALE_POW2, E4M3_UE8M0: SCALE_UE8M0}


def fp8_name(fp8) -> str | None:
    """The fp8 format an ``fp8`` argument of the references (``reference.dispatch(..., fp8=)``) names: None
    for False/None, "e4m3" for True, an fp8 format name as itself."""
    if fp8 is None or fp8 is False:
        return None
    if fp8 is True:
        return E4M3
    if fp8 in FP8_FORMATS:
        return fp8
    raise ValueError(f"fp8={fp8!r} is not an fp8 format: use False, True (= 'e4m3') or one of {FP8_FORMATS}")


def dispatch_format_of(fp8_dispatch, dispatch_format) -> str | None:
    """The dispatch format a buffer's ``fp8_dispatch`` and ``dispatch_format`` name together (names only,
    no sizes): ValueError naming the fix for an unknown name or two conflicting ones."""
    if dispatch_format not in DISPATCH_FORMATS:
        hint = " (fp8 is 'e4m3': the formats are named by their element type)" if dispatch_format == "fp8" else ""
        raise ValueError(f"dispatch_format must be one of {DISPATCH_FORMATS}, got {dispatch_format!r}{hint}")
    if fp8_dispatch is None:
        fp8_dispatch = False
    if not isinstance(fp8_dispatch, bool):
        fix = (f"dispatch_format={fp8_dispatch!r}" if fp8_dispatch in DISPATCH_FORMATS
               else f"dispatch_format= one of {DISPATCH_FORMATS}")
        raise ValueError(f"fp8_dispatch is True or False (True = dispatch_format='e4m3'), got {fp8_dispatch!r}: "
                         f"name a format with {fix}")
    if fp8_dispatch and dispatch_format not in (None, E4M3):
        raise ValueError(f"fp8_dispatch=True and dispatch_format={dispatch_format!r} name two formats: pass "
                         f"dispatch_format={dispatch_format!r} alone (fp8_dispatch=True is dispatch_format='e4m3')")
    return E4M3 if fp8_dispatch else dispatch_format


def resolve(hidden: int, dtype: torch.dtype, fp8_dispatch, dispatch_format, combine_format) -> tuple:
    """(dispatch_format, combine_format) of a buffer, checked: ValueError/TypeError naming the fix for an
    unknown name, a conflicting ``fp8_dispatch``, or sizes and dtypes a format cannot take."""
    fmt = dispatch_format_of(fp8_dispatch, dispatch_format)
    if combine_format not in COMBINE_FORMATS:
        hint = " (fp8 is 'e4m3': the formats are named by their element type)" if combine_format == "fp8" else ""
        raise ValueError(f"combine_format must be one of {COMBINE_FORMATS}, got {combine_format!r}{hint}")
    check_hidden(fmt, hidden)
    if combine_format == E4M3:
        if dtype not in FP8_COMBINE_DTYPES:
            raise TypeError(f"combine_format='e4m3' quantizes bfloat16/float16 expert outputs, this buffer's dtype "
                            f"is {dtype}: build it with dtype=torch.bfloat16 (or float16), or keep "
                            f"combine_format=None (a float32 buffer combines exactly)")
        if hidden % FP8_GROUP:
            raise ValueError(f"combine_format='e4m3' needs hidden % 128 == 0 (one scale per 128 columns), got "
                             f"{hidden}: use combine_format=None")
    return fmt, combine_format


# From this Triton on, the sm_90 build of the one-warp nvfp4 dispatch send reduces the peers' status tags
# with warp shuffles alone, which the block-uniform check (ptx_rules rule 3) cannot prove uniform; until it
# can, such a build is not offered (tests/test_compile_sm90.py keeps the finding in view).
NVFP4_UNPROVEN_TRITON = (3, 9)


def nvfp4_unproven(triton_version: str) -> bool:
    """True if ``triton_version`` compiles the nvfp4 dispatch send into code the uniformity check cannot pass."""
    major, minor = (int(v) for v in triton_version.split(".")[:2])
    return (major, minor) >= NVFP4_UNPROVEN_TRITON


def check_compiled(fmt: str | None, device) -> None:
    """ValueError naming the fix when format ``fmt`` has no verified compiled build for ``device`` with the
    installed Triton (CPU tensors run Triton's interpreter: every format)."""
    if fmt != NVFP4 or torch.device(device).type != "cuda":
        return
    import triton  # noqa: PLC0415
    if nvfp4_unproven(triton.__version__):
        raise ValueError(f"dispatch_format='nvfp4' on a GPU is verified with Triton 3.6-3.8, not {triton.__version__}: "
                         f"its compiled send fails the block-uniform check there (docs/formats.md). Install "
                         f"triton<3.9, or use dispatch_format='e4m3' (or a pow2/ue8m0 variant)")


def hidden_multiple(fmt: str | None) -> int:
    """What hidden must be a multiple of for dispatch format ``fmt`` (1 without one)."""
    return {None: 1, E4M3_UE8M0: FP8_GROUP * UE8M0_PER_WORD, NVFP4: NVFP4_WORD_COLS}.get(fmt, FP8_GROUP)


def check_hidden(fmt: str | None, hidden: int) -> None:
    """ValueError naming the fix when ``hidden`` does not hold whole scale words of dispatch format ``fmt``."""
    m = hidden_multiple(fmt)
    if hidden % m == 0:
        return
    pad = -(-hidden // m) * m
    if fmt == NVFP4:
        need = ("a multiple of 16 (one e4m3 scale per 16 columns)" if hidden % NVFP4_GROUP else
                "a multiple of 64 here (the 16-column scales move four to a 4-byte word)")
        raise ValueError(f"dispatch_format='nvfp4' needs hidden {need}, got {hidden}: pad the hidden size to {pad}, "
                         f"or use dispatch_format=None/'e4m3'")
    what = ("four 128-column groups per packed int32 scale word, as DeepEP's use_ue8m0" if fmt == E4M3_UE8M0
            else "one scale per 128 columns")
    fix = ("use dispatch_format='e4m3' or 'e4m3-pow2' (hidden % 128 == 0)"
           if fmt == E4M3_UE8M0 and hidden % FP8_GROUP == 0 else "dispatch the buffer's dtype (dispatch_format=None)")
    raise ValueError(f"dispatch_format={fmt!r} (fp8) needs hidden % {m} == 0 ({what}), got hidden={hidden}: pad hidden "
                     f"to {pad}, or {fix}")


def scale_mode(fmt: str | None) -> int:
    """The fp8 quantizer's SCALE constexpr for format ``fmt`` (SCALE_FLOAT otherwise: never used then)."""
    return _SCALE_MODE.get(fmt, SCALE_FLOAT)


def scale_columns(fmt: str | None, hidden: int) -> int:
    """Scale words (4 bytes) per dispatched row of ``hidden`` columns: H/128 float32, H/512 packed UE8M0
    int32, H/64 words of four e4m3 (nvfp4), 0 without a format."""
    if fmt is None:
        return 0
    if fmt == NVFP4:
        return hidden // NVFP4_WORD_COLS
    return hidden // (FP8_GROUP * UE8M0_PER_WORD) if fmt == E4M3_UE8M0 else hidden // FP8_GROUP


def scale_dtype(fmt: str | None) -> torch.dtype:
    """The fp8 scales' dtype: int32 for packed UE8M0, else float32."""
    return torch.int32 if fmt == E4M3_UE8M0 else torch.float32


def fp8_row_words(hidden: int) -> int:
    """int32 words of one fp8 combine row on the wire: hidden e4m3 bytes, then hidden / 128 float32 scales,
    padded to whole 16-byte vectors."""
    return -(-(hidden // 4 + hidden // FP8_GROUP) // 4) * 4
