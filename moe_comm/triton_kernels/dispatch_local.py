"""EP dispatch at world 1, in one kernel: every expert is local, so nothing needs a landing zone or a flag.

The two-phase dispatch (``dispatch.py``) stages rows in a symmetric landing zone because a receiver can
only pack rows by (source, token, k) once every source's counts have arrived. With one rank there is
one source: a slot's row in d.x is its routing position, which each program computes itself from the
token ids alone (``routing.py``). So each program writes its tokens' rows straight into d.x (quantized
on the way with FP8) and the metadata the combine needs, and one program writes the per-expert counts.
No program waits for another. The outputs are those of the two-phase dispatch at world 1, bit for bit.

Grid = (NBLK + 1, column blocks). Program (blk < NBLK, col) takes a contiguous range of tokens and copies
column block ``col`` of their rows (column block 0 also writes src and row_of): at decode sizes one token's
14 KB row is spread over several SMs instead of walked by one. Program (NBLK, 0) does the bookkeeping on
its own, so that its id scan overlaps the copies: the counts (a histogram of the valid ids, clamped to the
capacity), the statistics, the combine's mask and the token count, and it records the first bad id and
any capacity overflow. Programs (NBLK, col > 0) and those without tokens (T < NBLK) do nothing.
"""

import triton
import triton.language as tl

from .copy import address, as_words, load_tile, store_nvfp4_tile, store_tile
from .quant import quantize_e4m3_groups
from .routing import chunk_positions, histogram_of_tokens, load_topk_chunk, scan_ids
from .sync import ERR_CAPACITY, record_error


@triton.jit
def dispatch_local_kernel(
    x_ptr,            # [T, HIDDEN] dtype: the tokens (plain: copied as int32 words [T, X_WORDS])
    idx_ptr,          # [T, TOPK] int32/int64 expert ids, -1 = not routed
    out_x_ptr,        # out [EXPERTS * CAP, X_WORDS] int32 words (plain, NVFP4) or float8 [.., HIDDEN] (FP8): d.x
    out_scales_ptr,   # out [EXPERTS * CAP, S_WORDS] float32 / int32 (FP8; int32: packed UE8M0) or int32 words
    #                   (NVFP4): d.scales
    out_src_ptr,      # out int32 [EXPERTS * CAP]: token index of each row (source rank 0)
    out_counts_ptr,   # out int32 [EXPERTS]: valid rows per expert
    row_of_ptr,       # out int32 [M, TOPK]: e * CAP + row of slot (t, k); -1 not routed, -2 dropped
    src_tokens_ptr,   # out int32 [1]: T
    routed_ptr,       # out int32 [M, TOPK]: 1 + the owner rank (0 at world 1) where slot (t, k) is routed, else 0
    stats_ptr,        # int64 [EXPERTS]: rows received per expert, accumulated over calls
    excluded_ptr,     # int64 [1]: slots whose expert's rank is excluded (none at world 1; kept for the shared scan)
    grp,              # group state (moe_comm/protocol.py): where errors are recorded
    num_tokens, num_experts,
    OP: tl.constexpr, CAP: tl.constexpr, TOPK: tl.constexpr, TOPK_P2: tl.constexpr, HIDDEN: tl.constexpr,
    X_WORDS: tl.constexpr, S_WORDS: tl.constexpr, BT: tl.constexpr, BW: tl.constexpr,
    ROUTE_T: tl.constexpr, BINS: tl.constexpr, FP8: tl.constexpr, FP8_GROUPS: tl.constexpr,
    SCALE: tl.constexpr, S_BLOCK: tl.constexpr, NBLK: tl.constexpr, ALIGNED: tl.constexpr,
    gscale_ptr,       # float32 [1]: the NVFP4 global scale (read with NVFP4 only)
    NVFP4: tl.constexpr, NVFP4_GROUPS: tl.constexpr,  # NVFP4: quantized in column blocks of NVFP4_GROUPS * 16
    COPY: tl.constexpr = True,   # False: the metadata only, no payload to d.x (moe_comm.MoELayer reads x itself)
):
    # SCALE: the scale format (quant.py); S_BLOCK: scale words of one FP8 column block (EPPlan.scale_block_words)
    blk = tl.program_id(0)
    col = tl.program_id(1)
    per_program = tl.cdiv(num_tokens, NBLK)
    t_begin = tl.minimum(blk * per_program, num_tokens)
    t_end = tl.minimum(t_begin + per_program, num_tokens)
    if blk == NBLK:
        if col == 0:  # 1. Bookkeeping.
            counts = scan_ids(idx_ptr, routed_ptr, excluded_ptr, grp, 0, num_tokens, num_experts, OP, TOPK,
                              TOPK_P2, BINS, ROUTE_T, BINS, ONE_RANK=True)  # BINS >= E: every owner is rank 0
            e = tl.arange(0, BINS)
            e_live = e < num_experts
            kept = tl.minimum(counts, CAP)
            tl.store(out_counts_ptr + e, kept, mask=e_live)
            # The only writer of the statistics: an add without a returned value waits for no load.
            tl.atomic_add(stats_ptr + e, kept.to(tl.int64), mask=e_live, sem="relaxed")
            tl.store(src_tokens_ptr, num_tokens)
            # Slots of tokens past T: not routed (as the two-phase receive writes them), never stale.
            i = tl.arange(0, ROUTE_T * TOPK_P2)
            for t0 in range(num_tokens, CAP, ROUTE_T):  # CAP = M at world 1
                t = t0 + i // TOPK_P2
                k = i % TOPK_P2
                tl.store(row_of_ptr + t * TOPK + k, -1, mask=(t < CAP) & (k < TOPK))
            if tl.max(counts) > CAP:
                record_error(grp, ERR_CAPACITY, OP, 0, tl.argmax(counts, axis=0), tl.max(counts), CAP)
    elif t_begin < t_end:
        # 2. This program's tokens, BT at a time: positions, metadata, then column block `col` of each
        # token's row into its experts' rows. The block of x is loaded first, for every token of the chunk
        # (not only those with a routed slot: that mask would wait for the ids), so that it is in flight
        # while the earlier tokens' ids are counted and the chunk's own are read (bench/NOTES.md 20).
        COLS: tl.constexpr = FP8_GROUPS * 128  # FP8: divides HIDDEN, every column block is full
        NCOLS: tl.constexpr = NVFP4_GROUPS * 16  # NVFP4: the same
        before = tl.zeros([BINS], dtype=tl.int32)
        for t0 in range(t_begin, t_end, BT):
            t = t0 + tl.arange(0, BT)
            if not COPY:
                pass
            elif FP8:
                v = load_tile(x_ptr + t.to(tl.int64) * HIDDEN, t < t_end, col * COLS, HIDDEN, COLS, ALIGNED)
            elif NVFP4:
                v = load_tile(x_ptr + t.to(tl.int64) * HIDDEN, t < t_end, col * NCOLS, HIDDEN, NCOLS, ALIGNED)
            else:
                v = load_tile(as_words(x_ptr) + t.to(tl.int64) * X_WORDS, t < t_end, col * BW, X_WORDS, BW, ALIGNED)
            if t0 == t_begin:
                before = histogram_of_tokens(idx_ptr, 0, t_begin, num_experts, TOPK, TOPK_P2, ROUTE_T, BINS)
            ts, ks, idx, live, valid, bad = load_topk_chunk(idx_ptr, t0, t_end, num_experts, TOPK, TOPK_P2, BT)
            pos, before = chunk_positions(idx, ts * TOPK + ks, before, BINS)
            ok = valid & (pos < CAP)
            dst = tl.where(ok, idx * CAP + pos, 0)
            if col == 0:
                tl.store(row_of_ptr + ts * TOPK + ks, tl.where(ok, dst, tl.where(valid, -2, -1)), mask=live)
                tl.store(out_src_ptr + dst, ts, mask=ok)

            dst2 = tl.reshape(dst, (BT, TOPK_P2)).to(tl.int64)
            ok2 = tl.reshape(ok, (BT, TOPK_P2))
            if not COPY:
                pass
            elif FP8:
                q, scale = quantize_e4m3_groups(v.to(tl.float32), BT, FP8_GROUPS, SCALE)
                # One tile stored to each of the token's k rows in turn (copy.py).
                store_tile(q, col * COLS, HIDDEN, address(out_x_ptr) + dst2 * HIDDEN, ok2, COLS, TOPK, TOPK_P2,
                           ALIGNED)
                store_tile(scale, col * S_BLOCK, S_WORDS, address(out_scales_ptr) + dst2 * (S_WORDS * 4), ok2,
                           S_BLOCK, TOPK, TOPK_P2, ALIGNED)
            elif NVFP4:
                store_nvfp4_tile(v, col, tl.load(gscale_ptr), address(out_x_ptr) + dst2 * (X_WORDS * 4),
                                 address(out_scales_ptr) + dst2 * (S_WORDS * 4), ok2, X_WORDS, S_WORDS, NVFP4_GROUPS,
                                 TOPK, TOPK_P2, ALIGNED)
            else:
                store_tile(v, col * BW, X_WORDS, address(out_x_ptr) + dst2 * (X_WORDS * 4), ok2, BW, TOPK, TOPK_P2,
                           ALIGNED)
