"""The fused MoE layer's first kernel: dispatch receive + gate/up GEMM + SwiGLU, driven by arrival.

Rows of local expert e are those of the dispatch's d.x (``dispatch.py``): sorted by (source rank, token,
k), source s's at ``base[s, e] = sum over s' < s of count[s', e]``, with ``count[s, e]`` the control word
source s published with its flag. That flag is the arrival word of (e, s) for every local expert e: the
source's send stored its rows and counts before releasing it. So a program needs no receive kernel
before it: it reads its rows straight from the landing zone, where they landed.

Grid = (I / BN column blocks, L local experts). Program (n, e) walks e's rows in tiles of BM:

- it waits (bounded, ``sync.wait_flags``) for the flags of sources 0, 1, ... in turn, and computes each
  tile as soon as the sources it has seen cover it (a tile needs the counts of the sources before its
  rows to place them, and those came with their flags). A tile of early sources' rows is computed while
  later sources are still in flight; the last, partial tile waits for every source (a later source may
  add rows to it). Each wait is one vector of acquire loads over every peer's flag, masked to the one
  source (so that a timeout names the lowest missing peer whichever program times out first);
- the landing row of tile row i (source s, position p = i - base[s, e]) is the row whose routing word
  for some k is ``e + L * p`` (``dispatch.py``: each (source, expert, position) once): a search over the
  source's routing words, SCAN slots per step, only over the sources the tile holds;
- it multiplies the gathered rows by w13[e] (``serving.experts.expert_tile``: the GEMM tile of every expert
  kernel, so the bits are those of the masked batched experts), applies SiLU(gate) * up in float32 and
  stores the tile rounded once to the dtype into h[e, rows].

A put source's landing rows are packed (row j is the j-th token routed here, ``dispatch.py``): the same
search finds them, since the routing words sit in the packed rows. An excluded source sends nothing
(count 0, not waited for). A failed wait (timeout, abort, desync, a failed group) records its group-wide
error and the program stops; the dispatch receive that runs next adopts the error and zeroes the
counts, and nothing downstream sends (``moe_down_combine.py``). The receive count is not advanced here:
the dispatch receive kernel, launched after this one, does that and the rest of the dispatch's
bookkeeping (row_of, src, counts, statistics, capacity errors, the flight recorder).

At world 1 there is no landing zone: the world-1 dispatch (``dispatch_local.py``) has written src and the
counts, and the rows are read from the tokens x (row i of expert e is x[src[e, i]]); nothing waits.
"""

import triton
import triton.language as tl

from ..serving.experts import W_BLOCK, expert_tile
from ..triton_kernels.quant import cast_rne
from .sync import S_EPOCH, flag_value, group_failed, is_live, wait_flags


@triton.jit
def _landing_rows(data_ptr, zone, e, i, live, bases, counts, tokens, s_first, s_last,
                  WORLD: tl.constexpr, WORLD_P2: tl.constexpr, M: tl.constexpr, TOPK: tl.constexpr,
                  TOPK_P2: tl.constexpr, EXPERTS_PER_RANK: tl.constexpr, ROW_WORDS: tl.constexpr,
                  META: tl.constexpr, BM: tl.constexpr, SCAN: tl.constexpr):
    """(int64 [BM] word offsets of the landing rows of d.x rows ``i`` of expert e, int1 [BM] found): row i
    is source s's position i - bases[s] (s: the source whose rows [bases[s], bases[s] + counts[s]) hold it,
    one of s_first..s_last), found by its routing word among the source's ``tokens[s]`` landing rows."""
    w = tl.arange(0, WORLD_P2)
    in_s = (bases[None, :] <= i[:, None]) & (i[:, None] < (bases + counts)[None, :])   # [BM, WORLD_P2]
    src = tl.sum(tl.where(in_s, w[None, :], 0), axis=1)
    want = e + EXPERTS_PER_RANK * (i - tl.sum(tl.where(in_s, bases[None, :], 0), axis=1))   # the routing word
    row = tl.zeros([BM], dtype=tl.int64)
    found = i < 0   # [BM] False
    j = tl.arange(0, SCAN)
    for s in range(s_first, s_last + 1):
        n = tl.sum(tl.where(w == s, tokens, 0))
        landing = (zone * WORLD + s).to(tl.int64) * M * ROW_WORDS
        mine = live & (src == s)
        for j0 in range(0, n * TOPK_P2, SCAN):
            slot = j0 + j
            t, k = slot // TOPK_P2, slot % TOPK_P2
            word = tl.load(data_ptr + landing + t.to(tl.int64) * ROW_WORDS + META + k,
                           mask=(t < n) & (k < TOPK), other=-1)
            hit = mine[:, None] & (word[None, :] == want[:, None])                        # [BM, SCAN]
            row += tl.sum(tl.where(hit, landing + t[None, :].to(tl.int64) * ROW_WORDS, 0), axis=1)
            found = found | (tl.max(hit.to(tl.int32), axis=1) > 0)
    return row, found


@triton.jit
def _tile(a_base, a_rows, live, i, b_base, s_base, h_base, n0, HIDDEN: tl.constexpr, INTER: tl.constexpr,
          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr, W_FP8: tl.constexpr):
    """SiLU(A @ gate) * (A @ up) of the rows at ``a_base + a_rows`` ([BM] element offsets; where ``live``),
    columns [n0, n0 + BN) of I, rounded once and stored to rows ``i`` of h (``h_base``: expert e's rows).
    W_FP8: expert e's w13 is fp8 with its block scales at ``s_base`` (up's block rows follow gate's)."""
    acc = expert_tile(a_base, a_rows, live, b_base, b_base + INTER * HIDDEN, n0, HIDDEN, INTER, 1, 1, HIDDEN, True, BM, BN,
                      BK, PRECISION, W_FP8, s_base, 0, tl.cdiv(INTER, W_BLOCK))
    rn = n0 + tl.arange(0, BN)
    tl.store(h_base + i[:, None].to(tl.int64) * INTER + rn[None, :], cast_rne(acc, h_base.dtype.element_ty),
             mask=live[:, None] & (rn < INTER)[None, :])


@triton.jit
def moe_gate_up_kernel(
    data_ptr,     # int32 [2, WORLD, M, ROW_WORDS]: this rank's dispatch landing zone (WORLD > 1)
    ctrl_ptr,     # int64 [2, WORLD, CTRL_WORDS]: its control words (rows of the source, L counts, ..., flag)
    seq_ptr,      # int64 [1]: the dispatch channel's receive count (this call is count + 1; not advanced here)
    x_ptr,        # [T, HIDDEN] dtype: the tokens (WORLD == 1 only)
    src_ptr,      # int32 [L * CAP]: token of each d.x row (WORLD == 1 only; the world-1 dispatch wrote it)
    counts_ptr,   # int32 [L]: rows per local expert (WORLD == 1 only)
    w13_ptr,      # [L, 2 * INTER, HIDDEN] dtype (W_FP8: float8_e4m3fn): gate (rows [0, INTER)) and up (rows
    #               [INTER, 2 * INTER))
    w13_scale_ptr,  # W_FP8: float32 [L, 2 * ceil(INTER / 128), ceil(HIDDEN / 128)], w13's block scales (gate's
    #                 block rows, then up's); else None
    h_ptr,        # out [L, CAP, INTER] dtype: SiLU(x @ gate.T) * (x @ up.T) of rows < the expert's count
    grp, status_ptr, rank,
    OP: tl.constexpr, WORLD: tl.constexpr, WORLD_P2: tl.constexpr, M: tl.constexpr, CAP: tl.constexpr,
    TOPK: tl.constexpr, TOPK_P2: tl.constexpr, EXPERTS_PER_RANK: tl.constexpr, META: tl.constexpr,
    ROW_WORDS: tl.constexpr, CTRL_WORDS: tl.constexpr, HIDDEN: tl.constexpr, INTER: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SCAN: tl.constexpr, PRECISION: tl.constexpr,
    PUT: tl.constexpr,  # META: the routing words' first word in a landing row (payload words before it)
    W_FP8: tl.constexpr = False,   # fp8 weights with block scales, dequantized per tile (``expert_tile``)
):
    n0 = tl.program_id(0) * BN
    e = tl.program_id(1)
    b_base = w13_ptr + e.to(tl.int64) * (2 * INTER * HIDDEN)
    s_base = w13_scale_ptr
    if W_FP8:
        s_base = w13_scale_ptr + e.to(tl.int64) * (2 * tl.cdiv(INTER, W_BLOCK) * tl.cdiv(HIDDEN, W_BLOCK))
    h_base = h_ptr + e.to(tl.int64) * CAP * INTER
    if WORLD == 1:
        rows = tl.minimum(tl.maximum(tl.load(counts_ptr + e), 0), CAP)
        for m0 in range(0, rows, BM):
            i = m0 + tl.arange(0, BM)
            live = i < rows
            t = tl.minimum(tl.maximum(tl.load(src_ptr + e * CAP + i, mask=live, other=0), 0), M - 1)
            _tile(x_ptr, t.to(tl.int64) * HIDDEN, live, i, b_base, s_base, h_base, n0, HIDDEN, INTER, BM, BN, BK,
                  PRECISION, W_FP8)
    elif group_failed(grp, status_ptr, WORLD, WORLD_P2) == 0:   # a failed group's kernels neither wait nor send
        call = tl.load(seq_ptr) + 1
        zone = call % 2
        target = flag_value(tl.load(grp + S_EPOCH), call)
        ctrl = ctrl_ptr + zone * WORLD * CTRL_WORDS
        rows_of = data_ptr.to(tl.pointer_type(h_ptr.dtype.element_ty), bitcast=True)   # the landing zone's elements
        WORD_ELEMS: tl.constexpr = 32 // h_ptr.dtype.element_ty.primitive_bitwidth      # elements per int32 word
        w = tl.arange(0, WORLD_P2)
        bases = tl.zeros([WORLD_P2], dtype=tl.int32)    # rows of e before each source's
        counts = tl.zeros([WORLD_P2], dtype=tl.int32)   # rows of e from each source
        tokens = tl.zeros([WORLD_P2], dtype=tl.int32)   # landing rows of each source
        known = tl.zeros([], dtype=tl.int32)     # rows of e from the sources seen so far
        m0 = tl.zeros([], dtype=tl.int32)        # first row of the next tile to compute
        s_first = tl.zeros([], dtype=tl.int32)   # a source at or before that of row m0
        ok = e >= 0                              # every wait so far got its flag
        for s in range(WORLD):
            if ok:
                # An excluded source sends nothing: no lane waits (the wait returns at once), no rows.
                live_s = is_live(grp, s)   # group state: the same in every thread
                got = wait_flags(ctrl + w * CTRL_WORDS + CTRL_WORDS - 1, target, tl.where(live_s, w == s, False), w,
                                 grp, status_ptr, OP, rank, WORLD, WORLD_P2, PUT=PUT)
                ok = tl.where(live_s, tl.max(got.to(tl.int32)) > 0, True)
                # Published before the flag, read after the wait's barrier: plain loads, block-uniform.
                c = tl.minimum(tl.maximum(tl.load(ctrl + s * CTRL_WORDS + 1 + e), 0), M * TOPK).to(tl.int32)
                n = tl.minimum(tl.maximum(tl.load(ctrl + s * CTRL_WORDS), 0), M).to(tl.int32)
                c = tl.where(live_s, c, 0)
                if ok:
                    bases = tl.where(w == s, known, bases)
                    counts = tl.where(w == s, c, counts)
                    tokens = tl.where(w == s, tl.where(live_s, n, 0), tokens)
                    known += c
                    end = tl.minimum(known, CAP)
                    while m0 + BM <= end:   # every tile the sources seen so far cover
                        i = m0 + tl.arange(0, BM)
                        rows, found = _landing_rows(data_ptr, zone, e, i, i < end, bases, counts, tokens, s_first,
                                                    s, WORLD, WORLD_P2, M, TOPK, TOPK_P2, EXPERTS_PER_RANK,
                                                    ROW_WORDS, META, BM, SCAN)
                        _tile(rows_of, rows * WORD_ELEMS, found, i, b_base, s_base, h_base, n0, HIDDEN, INTER, BM, BN,
                              BK, PRECISION, W_FP8)
                        m0 += BM
                        s_first = s
        end = tl.minimum(known, CAP)
        if ok & (m0 < end):   # the last, partial tile: every source seen
            i = m0 + tl.arange(0, BM)
            rows, found = _landing_rows(data_ptr, zone, e, i, i < end, bases, counts, tokens, s_first,
                                        WORLD - 1, WORLD, WORLD_P2, M, TOPK, TOPK_P2, EXPERTS_PER_RANK, ROW_WORDS,
                                        META, BM, SCAN)
            _tile(rows_of, rows * WORD_ELEMS, found, i, b_base, s_base, h_base, n0, HIDDEN, INTER, BM, BN, BK, PRECISION,
                  W_FP8)


def _compile_configs() -> list[dict]:
    """DeepSeek-V3 decode (256 experts, hidden 7168, intermediate 2048, top-8, 128 tokens per rank) with the
    planner's GPU shapes, EP8 over stores and over puts (NVSHMEM linked: a failed wait's status broadcast)
    and EP1: what ``compile_report`` compiles for sm_90 without a GPU."""
    import torch  # noqa: PLC0415

    from ..planner import next_pow2, plan_ep, plan_moe_layer  # noqa: PLC0415
    types = dict(data_ptr="*i32", ctrl_ptr="*i64", seq_ptr="*i64", x_ptr="*bf16", src_ptr="*i32", counts_ptr="*i32",
                 w13_ptr="*bf16", h_ptr="*bf16", grp="*i64", status_ptr="*i64", rank="i32")
    out = []
    for world, put in ((8, False), (8, True), (1, False)):
        p = plan_ep(world, 256, 7168, 128, 8, torch.bfloat16, False, "cuda")
        p = p.with_put() if put else p
        lp = plan_moe_layer(p, 2048, "cuda")
        for fp8 in (False, True):   # bf16 weights, or DeepSeek's fp8 weights with 128x128 block scales
            out.append(dict(kernel="moe_gate_up_kernel", label=f"DSV3 EP{world} bf16" + (" put" if put else "")
                            + (" " + FP8_WEIGHTS_LABEL if fp8 else ""),
                            types=dict(types, w13_ptr="*fp8e4nv", w13_scale_ptr="*fp32") if fp8 else types,
                            nvshmem=put, constexprs=dict(
                                OP=2, WORLD=world, WORLD_P2=next_pow2(world), M=128, CAP=p.capacity, TOPK=8, TOPK_P2=8,
                                EXPERTS_PER_RANK=p.experts_per_rank, META=p.x_words + p.scale_words,
                                ROW_WORDS=p.row_words, CTRL_WORDS=p.dispatch_ctrl_words, HIDDEN=7168, INTER=2048,
                                BM=lp.block_rows, BN=lp.gate_cols, BK=lp.block_k, SCAN=lp.scan_slots, PRECISION="tf32",
                                PUT=put, W_FP8=fp8, **({} if fp8 else dict(w13_scale_ptr=None)))))
    return out


FP8_WEIGHTS_LABEL = "e4m3-weights"   # the label word of the W_FP8 configs (the tokens stay bf16)


COMPILE_CONFIGS = _compile_configs()
