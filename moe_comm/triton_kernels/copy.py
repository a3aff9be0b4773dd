"""The one payload copy loop, and the one tile store, that every kernel moves rows with.

A row is copied as a tile of ``[R, BW]`` elements per iteration: the next block's load is issued before
this block's stores (one block in flight), and each block is stored to up to ``NDST`` destinations in a
static loop (one register tile, one pointer vector per destination; never a ``[R, NDST, BW]`` pointer
tile). Destinations are int64 *byte addresses* ``dst[r, d]`` of row starts, so one form serves every
caller: a per-row output row (NDST = 1), a token's rows on its top-k ranks or experts (NDST = K), the
same row on every rank of a list.

16-byte accesses: a row address whose alignment comes from a value loaded from memory (a peer's base)
or a run-time offset cannot be proven aligned by the compiler, which then moves 4 bytes (or 1) at a
time. With ``ALIGNED`` every tile of pointers says so itself (``row_tile``: ``tl.multiple_of`` on the
``[R, C]`` tile the load or store uses) and the column mask is constant over whole blocks, so every access
is a 16-byte vector. The hint sits on the tile, not on the row addresses: a hint lives on the operation
that made its value, and Triton 3.9 folds ``int_to_ptr(ptr_to_int(p))`` (a row address made by
``address`` and turned back by ``row_pointers``) into ``p``, dropping a hint placed there. The caller
passes ALIGNED only when it holds (``planner.vector_aligned`` on the host: every row length in bytes and
every base a multiple of 16); otherwise the same code runs with narrower accesses. The interpreter
ignores hints.

The same loop moves rows that are quantized on the way (``copy_rows(..., FP8=True)``: the fp8 combine):
each block is quantized in registers by ``quant.py`` before its stores (``store_fp8_tile``); the nvfp4
dispatch kernels quantize and store a column block with ``store_nvfp4_tile``.
"""

import triton
import triton.language as tl

from .. import protocol
from .quant import quantize_e4m3_groups, quantize_nvfp4_groups

VEC_BYTES = tl.constexpr(protocol.VEC_BYTES)


@triton.jit
def row_pointers(addr, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """int64 byte addresses ``addr`` (any shape) as pointers to DTYPE, declared 16-byte aligned when
    ALIGNED."""
    ptrs = addr.to(tl.pointer_type(DTYPE))
    if ALIGNED:
        ptrs = tl.multiple_of(ptrs, VEC_BYTES)
    return ptrs


@triton.jit
def row_tile(rows, C: tl.constexpr, ALIGNED: tl.constexpr):
    """Pointers ``[R, C]`` to elements ``[0, C)`` of the rows starting at pointers ``rows`` [R]. With
    ALIGNED (every row start 16-byte aligned) the tile is declared so: along a row, its C contiguous
    elements start at a multiple of 16 bytes; down a column, nothing beyond 1 is claimed (the compiler's
    own figure there is the element size; only the contiguous axis decides the vector width)."""
    tile = rows[:, None] + tl.arange(0, C)[None, :]
    if ALIGNED:
        tile = tl.multiple_of(tile, [1, VEC_BYTES])
    return tile


@triton.jit
def as_words(ptr):
    """A pointer to any element type as a pointer to int32 words at the same address. A kernel that copies
    a caller's rows as words takes the caller's tensor as it is (a ``.view(torch.int32)`` per call costs the
    host ~0.8 us); the rows' 16-byte alignment is the caller's (the launch's ``ALIGNED``)."""
    return ptr.to(tl.pointer_type(tl.int32), bitcast=True)


@triton.jit
def address(ptr):
    """A pointer (scalar or tensor) as its int64 byte address, for ``dst`` tiles."""
    return ptr.to(tl.int64)


@triton.jit
def pick(tile, d, NDST_P2: tl.constexpr):
    """Column ``d`` of ``tile`` [R, NDST_P2] (a register select: the column index is static)."""
    dd = tl.arange(0, NDST_P2)
    return tl.sum(tl.where(dd[None, :] == d, tile, tl.zeros_like(tile)), axis=1)


@triton.jit
def store_tile(v, col, ncols, dst, write, C: tl.constexpr, NDST: tl.constexpr, NDST_P2: tl.constexpr,
               ALIGNED: tl.constexpr):
    """Store ``v`` [R, C] at element columns ``col + [0, C)`` (those below ``ncols``) of row r of every
    destination d < NDST where ``write[r, d]``: row start address ``dst[r, d]`` (int64 bytes, [R, NDST_P2]),
    elements of v's dtype. When ``ncols`` is a multiple of C the column mask is constant (whole blocks)."""
    c = tl.arange(0, C)
    c_live = ((col + c < ncols) | (ncols % C == 0))[None, :]
    for d in tl.static_range(NDST):
        if NDST == 1:
            rows, use = tl.reshape(dst, (dst.shape[0],)), tl.reshape(write, (write.shape[0],))
        else:
            rows, use = pick(dst, d, NDST_P2), pick(write.to(tl.int32), d, NDST_P2) != 0
        tl.store(row_tile(row_pointers(rows, v.dtype, ALIGNED), C, ALIGNED) + col, v, mask=use[:, None] & c_live)


@triton.jit
def load_tile(src, read, col, ncols, BW: tl.constexpr, ALIGNED: tl.constexpr):
    """Elements ``col + [0, BW)`` (those below ``ncols``) of the rows starting at pointers ``src`` [R],
    where ``read`` [R]; 0 elsewhere. Returns [R, BW] of src's element type."""
    c = tl.arange(0, BW)
    m = read[:, None] & ((col + c < ncols) | (ncols % BW == 0))[None, :]
    return tl.load(row_tile(src, BW, ALIGNED) + col, mask=m, other=0)


@triton.jit
def store_fp8_tile(v, col, ncols, dst, write, C: tl.constexpr, NDST: tl.constexpr, NDST_P2: tl.constexpr,
                   ALIGNED: tl.constexpr):
    """``store_tile`` of ``v`` [R, C] (any float dtype; C a multiple of 128, col too) quantized to fp8
    (``quant.quantize_e4m3_groups``): its e4m3 bytes at byte columns ``col + [0, C)`` of the fp8 row of
    ``ncols`` columns (a multiple of 128), its float32 scales at byte ``ncols + 4 * (col // 128)`` on."""
    GROUPS: tl.constexpr = C // 128
    q, scale = quantize_e4m3_groups(v.to(tl.float32), v.shape[0], GROUPS)
    store_tile(q, col, ncols, dst, write, C, NDST, NDST_P2, ALIGNED)
    store_tile(scale, col // 128, ncols // 128, dst + ncols, write, GROUPS, NDST, NDST_P2, ALIGNED)


@triton.jit
def store_nvfp4_tile(v, col, global_scale, dst, sdst, write, X_WORDS: tl.constexpr, S_WORDS: tl.constexpr,
                     GROUPS: tl.constexpr, NDST: tl.constexpr, NDST_P2: tl.constexpr, ALIGNED: tl.constexpr):
    """``v`` [R, GROUPS * 16] (any float dtype): column block ``col`` of R rows, quantized to NVFP4 with the
    float32 scalar ``global_scale`` (``quant.quantize_nvfp4_groups``) and stored to every destination d <
    NDST where ``write``: the value words at row ``dst[:, d]`` (of X_WORDS words), the scale words at row
    ``sdst[:, d]`` (of S_WORDS words; int64 byte addresses). What every nvfp4 dispatch kernel stores a block
    with."""
    values, scales = quantize_nvfp4_groups(v.to(tl.float32), global_scale, v.shape[0], GROUPS)
    store_tile(values, col * (GROUPS * 2), X_WORDS, dst, write, GROUPS * 2, NDST, NDST_P2, ALIGNED)
    store_tile(scales, col * (GROUPS // 4), S_WORDS, sdst, write, GROUPS // 4, NDST, NDST_P2, ALIGNED)


@triton.jit
def copy_rows(src, read, dst, write, ROW: tl.constexpr, BW: tl.constexpr, NDST: tl.constexpr,
              NDST_P2: tl.constexpr, ALIGNED: tl.constexpr, FP8: tl.constexpr = False):
    """Copy ROW elements of each row: from pointer ``src[r]`` ([R] pointers; read where ``read[r]``, zeros
    elsewhere) to address ``dst[r, d]`` ([R, NDST_P2] int64 bytes) of every destination d < NDST where
    ``write[r, d]``. A row with ``write`` but not ``read`` is stored as zeros. With FP8, ``src`` points to
    float elements (ROW of them, BW a multiple of 128) and each destination row gets them as an fp8 row
    (``store_fp8_tile``: e4m3 bytes, then float32 scales; ``formats.fp8_row_words``)."""
    v_next = load_tile(src, read, 0, ROW, BW, ALIGNED)
    for c0 in range(0, ROW, BW):  # the next block's load is issued before this block's stores
        v = v_next
        v_next = load_tile(src, tl.where(c0 + BW < ROW, read, False), c0 + BW, ROW, BW, ALIGNED)
        if FP8:
            store_fp8_tile(v, c0, ROW, dst, write, BW, NDST, NDST_P2, ALIGNED)
        else:
            store_tile(v, c0, ROW, dst, write, BW, NDST, NDST_P2, ALIGNED)
