"""The fp8 dispatch formats: what ``fp8_dispatch=`` accepts, and what each format sends and returns.

Every format sends float8_e4m3fn codes and one scale per 128 columns of a row, ``x ~= code * scale``;
they differ in the scale (DeepEP's low-latency ``use_fp8`` / ``round_scale`` / ``use_ue8m0``). Per row
and 128-column group, in float32 (``reference.quantize_fp8`` is the definition, bit for bit;
``triton_kernels/quant.py`` the kernels' twin):

    amax = max(max |x|, 1e-4)

    fp8_dispatch      DeepEP                     scale s                              codes      scales per row
    ----------------  -------------------------  -----------------------------------  ---------  -------------------
    False / None      use_fp8=False              (the dtype is sent)                  -          -
    True, "e4m3"      use_fp8=True               amax * (1/448)                       x * (448   float32 [H/128]
                                                                                      / amax)
    "e4m3-pow2"       round_scale=True           2**e, e = ceil(log2(amax * (1/448))) x * 2**-e  float32 [H/128]
    "e4m3-ue8m0"      round_scale=True,          2**e, as e4m3-pow2 (the same codes)  x * 2**-e  int32 [H/512]
                      use_ue8m0=True

UE8M0 is the scale's exponent alone, ``e + 127`` in one byte (an unsigned 8-bit float with no mantissa:
the format DeepGEMM's Blackwell kernels take), packed four to an int32 as DeepEP packs them: byte j
(bits 8j..8j+7) of word i holds group 4i + j. It needs hidden % 512 == 0 (whole words, as DeepEP).
Power-of-two scales make the dequantization exact in the scale (a multiply by 2**e) at a cost of up to
one bit of the codes' precision (the codes of a group use [224, 448] of the e4m3 range, not all of it).
"""

from __future__ import annotations

import torch

GROUP = 128                                   # columns per scale
E4M3, E4M3_POW2, E4M3_UE8M0 = "e4m3", "e4m3-pow2", "e4m3-ue8m0"
FORMATS = (E4M3, E4M3_POW2, E4M3_UE8M0)
UE8M0_PER_WORD = 4                            # UE8M0 exponents packed in one int32
UE8M0_BIAS = 127                              # a UE8M0 byte holds e + 127 (float32's exponent field)
# The quantizer's SCALE constexpr (triton_kernels/quant.py): how the scale is made and what is stored.
SCALE_FLOAT, SCALE_POW2, SCALE_UE8M0 = 0, 1, 2
_SCALE_MODE = {E4M3: SCALE_FLOAT, E4M3_POW2: SCALE_POW2, E4M3_UE8M0: SCALE_UE8M0}
_CHOICES = "False, True (= 'e4m3'), " + ", ".join(repr(f) for f in FORMATS)


def parse(fp8_dispatch) -> str | None:
    """The format named by an ``fp8_dispatch`` argument: None (no fp8), or one of ``FORMATS``
    (True means "e4m3", the format ``fp8_dispatch=True`` always meant)."""
    if fp8_dispatch is None or fp8_dispatch is False:
        return None
    if fp8_dispatch is True:
        return E4M3
    if isinstance(fp8_dispatch, str) and fp8_dispatch in FORMATS:
        return fp8_dispatch
    raise ValueError(f"fp8_dispatch={fp8_dispatch!r} is not a dispatch format: use one of {_CHOICES}")


def scale_mode(fmt: str | None) -> int:
    """The quantizer's SCALE constexpr for format ``fmt`` (SCALE_FLOAT without fp8: never used then)."""
    return _SCALE_MODE.get(fmt, SCALE_FLOAT)


def scale_columns(fmt: str | None, hidden: int) -> int:
    """Scale elements (4-byte words) per row of ``hidden`` columns: H/128 float32, H/512 packed int32."""
    if fmt is None:
        return 0
    return hidden // (GROUP * UE8M0_PER_WORD) if fmt == E4M3_UE8M0 else hidden // GROUP


def scale_dtype(fmt: str | None) -> torch.dtype:
    """The scales' dtype: int32 for packed UE8M0, else float32."""
    return torch.int32 if fmt == E4M3_UE8M0 else torch.float32


def hidden_multiple(fmt: str | None) -> int:
    """What hidden must be a multiple of for format ``fmt`` (1 without fp8)."""
    if fmt is None:
        return 1
    return GROUP * UE8M0_PER_WORD if fmt == E4M3_UE8M0 else GROUP


def check_hidden(fmt: str | None, hidden: int) -> None:
    """ValueError naming the fix when ``hidden`` does not hold whole scale words of format ``fmt``."""
    m = hidden_multiple(fmt)
    if hidden % m:
        what = ("four 128-column groups per packed int32 scale word, as DeepEP's use_ue8m0" if fmt == E4M3_UE8M0
                else "one scale per 128 columns")
        fix = ("use fp8_dispatch='e4m3' or 'e4m3-pow2' (hidden % 128 == 0)" if fmt == E4M3_UE8M0 and hidden % GROUP == 0
               else "dispatch bf16 (fp8_dispatch=False)")
        raise ValueError(f"fp8_dispatch={fmt!r} needs hidden % {m} == 0 ({what}), got hidden={hidden}: pad hidden to "
                         f"{-(-hidden // m) * m}, or {fix}")
