"""Counts-driven row copy: ``dst[e, r] = src[e, r]`` for ``r < counts[e]`` only.

The ops path (``moe_comm.ops.dispatch``) hands its caller tensors of its own; copying the whole
``[E_local, world * max_tokens, hidden]`` receive buffer there would move every row of capacity (470 MB
per layer at DeepSeek-V3 EP8) where only the received rows are valid. This kernel reads the counts on
the device (no host sync; CUDA-graph capturable) and copies the valid rows alone, as 32-bit words
(16-byte vectors when a row is a multiple of 16 bytes: the word count is a constexpr multiple of 4 and
the base pointers are 16-byte aligned). Rows past a count are not touched.
"""

import torch
import triton
import triton.language as tl

from ..interpreter import kernel_for
from ..planner import vector_aligned
from .copy import address, copy_rows

GPU_TILE_WORDS = 4096   # words per program iteration on GPU (rows x columns of the tile)
CPU_TILE_WORDS = 1 << 16


@triton.jit
def copy_valid_rows_kernel(
    src_ptr,          # int32 words [E, ROWS, ROW_WORDS]
    dst_ptr,          # int32 words [E, ROWS, ROW_WORDS]
    counts_ptr,       # int32 [E]: rows [0, counts[e]) of expert e are copied (clamped to [0, ROWS])
    ROWS: tl.constexpr, ROW_WORDS: tl.constexpr, BR: tl.constexpr, BW: tl.constexpr,
    ALIGNED: tl.constexpr,  # rows of whole 16-byte vectors and both bases 16-byte aligned (copy.py)
):
    """Grid (E, cdiv(ROWS, BR)): program (e, b) copies the valid rows among rows [b*BR, (b+1)*BR) of e."""
    e = tl.program_id(0)
    r0 = tl.program_id(1) * BR
    n = tl.minimum(tl.maximum(tl.load(counts_ptr + e), 0), ROWS)
    if r0 < n:
        rows = r0 + tl.arange(0, BR)
        base = (e * ROWS + rows).to(tl.int64) * ROW_WORDS
        live = rows < n
        copy_rows(src_ptr + base, live, address(dst_ptr + base)[:, None], live[:, None], ROW_WORDS, BW, 1, 1,
                  ALIGNED)


def tile(rows: int, row_words: int, device: torch.device) -> tuple[int, int]:
    """(BR, BW): rows and words per program iteration."""
    words = GPU_TILE_WORDS if device.type == "cuda" else CPU_TILE_WORDS
    whole = row_words & -row_words   # the largest power of two dividing the row: blocks need no column mask
    bw = whole if whole >= 4 else triton.next_power_of_2(row_words)
    bw = min(bw, words)
    br = max(1, min(triton.next_power_of_2(rows), words // bw))
    return br, bw


def copy_valid_rows(src: torch.Tensor, dst: torch.Tensor, counts: torch.Tensor) -> None:
    """``dst[e, :counts[e]] = src[e, :counts[e]]`` for src/dst ``[E, rows, ...]`` contiguous, same dtype and
    shape, a row a whole number of 32-bit words; counts int32 [E] on the same device. Stream-ordered."""
    if src.shape != dst.shape or src.dtype != dst.dtype or not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError(f"copy_valid_rows: src {tuple(src.shape)} {src.dtype} and dst {tuple(dst.shape)} "
                         f"{dst.dtype} must be contiguous tensors of one shape and dtype")
    E, rows = src.shape[0], src.shape[1]
    row_bytes = src[0, 0].numel() * src.element_size() if src.numel() else 0
    if row_bytes % 4 or counts.shape != (E,) or counts.dtype != torch.int32:
        raise ValueError(f"copy_valid_rows: rows of {row_bytes} bytes (need a multiple of 4) or counts "
                         f"{tuple(counts.shape)} {counts.dtype} (need int32 [{E}])")
    if src.numel() == 0:
        return
    row_words = row_bytes // 4
    br, bw = tile(rows, row_words, src.device)
    kernel_for(copy_valid_rows_kernel, src.device)[(E, triton.cdiv(rows, br))](
        src.view(torch.int32), dst.view(torch.int32), counts, ROWS=rows, ROW_WORDS=row_words, BR=br, BW=bw,
        ALIGNED=row_words % 4 == 0 and vector_aligned(src, dst))
