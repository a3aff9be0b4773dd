"""The payload formats of EPBuffer and PrefillBuffer: what the dispatch and the combine put on the wire.

One vocabulary for both directions: a format is named by what crosses the link.

dispatch_format (a token's row from its rank to the ranks holding its experts)
    None     the buffer's dtype, bit for bit
    "e4m3"   fp8: float8_e4m3fn + one float32 scale (amax / 448) per 128 columns, DeepEP's low-latency
             format (``fp8_dispatch=True`` is the same; ``reference.quantize_fp8``)
    "nvfp4"  e2m1 values packed two per byte + one float8_e4m3fn scale per 16 columns + the caller's float32
             global scale: TensorRT-LLM's NVFP4 with linear scales (``reference.quantize_nvfp4``)
combine_format (an expert's output row back to its token's rank)
    None     the buffer's dtype: the weighted sum sees each row bit for bit as the expert wrote it
    "e4m3"   the fp8 combine: the same e4m3 rows as the dispatch's, quantized by the rank holding the
             expert, dequantized and summed in float32 at the token's rank (``reference.fp8_round_trip``)

docs/formats.md has the bytes of each and the measured error of the fp8 combine. Every check here reads
only sizes and names, so a bad combination raises when the buffer is built, before anything is sent.
"""

from __future__ import annotations

import torch

E4M3, NVFP4 = "e4m3", "nvfp4"
DISPATCH_FORMATS = (None, E4M3, NVFP4)
COMBINE_FORMATS = (None, E4M3)
FP8_GROUP = 128             # columns per float32 scale (fp8 dispatch and combine)
NVFP4_GROUP = 16            # columns per e4m3 scale (nvfp4)
NVFP4_WORD_COLS = 64        # columns whose four e4m3 scales fill one 4-byte word (rows move as words)
FP8_COMBINE_DTYPES = (torch.bfloat16, torch.float16)


def resolve(hidden: int, dtype: torch.dtype, fp8_dispatch, dispatch_format, combine_format) -> tuple:
    """(dispatch_format, combine_format) of a buffer, checked: ValueError/TypeError naming the fix for an
    unknown name, a conflicting ``fp8_dispatch``, or sizes and dtypes a format cannot take."""
    for name, value, allowed in (("dispatch_format", dispatch_format, DISPATCH_FORMATS),
                                 ("combine_format", combine_format, COMBINE_FORMATS)):
        if value not in allowed:
            hint = " (fp8 is 'e4m3': the formats are named by their element type)" if value == "fp8" else ""
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}{hint}")
    if fp8_dispatch and dispatch_format not in (None, E4M3):
        raise ValueError(f"fp8_dispatch=True and dispatch_format={dispatch_format!r} name two formats: pass "
                         f"dispatch_format={dispatch_format!r} alone (fp8_dispatch=True is dispatch_format='e4m3')")
    fmt = E4M3 if fp8_dispatch else dispatch_format
    if fmt == E4M3 and hidden % FP8_GROUP:
        raise ValueError(f"fp8_dispatch needs hidden % 128 == 0 (one scale per 128 columns), got {hidden}")
    if fmt == NVFP4 and hidden % NVFP4_WORD_COLS:
        need = "a multiple of 16 (one e4m3 scale per 16 columns)" if hidden % NVFP4_GROUP else \
            "a multiple of 64 here (the 16-column scales move four to a 4-byte word)"
        raise ValueError(f"dispatch_format='nvfp4' needs hidden {need}, got {hidden}: pad the hidden size to "
                         f"{-(-hidden // NVFP4_WORD_COLS) * NVFP4_WORD_COLS}, or use dispatch_format=None/'e4m3'")
    if combine_format == E4M3:
        if dtype not in FP8_COMBINE_DTYPES:
            raise TypeError(f"combine_format='e4m3' quantizes bfloat16/float16 expert outputs, this buffer's dtype "
                            f"is {dtype}: build it with dtype=torch.bfloat16 (or float16), or keep "
                            f"combine_format=None (a float32 buffer combines exactly)")
        if hidden % FP8_GROUP:
            raise ValueError(f"combine_format='e4m3' needs hidden % 128 == 0 (one scale per 128 columns), got "
                             f"{hidden}: use combine_format=None")
    return fmt, combine_format


def fp8_row_words(hidden: int) -> int:
    """int32 words of one fp8 row on the wire: hidden e4m3 bytes, then hidden / 128 float32 scales, padded to
    whole 16-byte vectors."""
    return -(-(hidden // 4 + hidden // FP8_GROUP) // 4) * 4
