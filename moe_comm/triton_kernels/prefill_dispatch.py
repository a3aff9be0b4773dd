"""Prefill dispatch device code: send phase (routing + payload straight into the output) and receive phase.

The landing zone of every rank is the output (one zone, symmetric int32 words; layout in
``planner.PrefillPlan``): row ``q = source * M + t`` of the planes recv_topk_idx [R, K], recv_topk_weights
[R, K], recv_x [R, X_WORDS] (and recv_scales [R, S_WORDS] with FP8). Control words
``ctrl[call % 2, source, :]`` (int64) = (tokens T of the source, L per-local-expert slot counts from it,
flag), written by ``dispatch.count_and_check`` as for the decode dispatch.

Send (grid = NBLK token blocks x column blocks, ``EPPlan.send_grid``): first every program waits until
every live rank released the zones of the previous call (the ``released`` word of the combine channel
holds the combine count of that rank, ``prefill_combine.py``): nothing is written into a zone a rank may
still read. Then, for each token t of the program's range, the K local ids (-1 where the slot's expert
is on another rank) and K weights (0 there) go to row ``rank * M + t`` of every live rank (column block
0), and the payload to the same row of each live rank holding one of its experts, once per rank however
many of its experts live there (``routing.token_destinations``), through ``copy.py``'s one copy loop
(FP8 and NVFP4: quantized in registers by ``quant.py`` first, one column block per program). One program writes
the control words; the last one to finish publishes every live rank's flag and advances the send count.

Receive (grid (1,)): wait (bounded) for the flag of every live source, then write the per-source token
counts and the per-local-expert slot counts (clamped: no peer value can exceed M or M * K). Nothing is
copied: the rows are already in place. A failed call leaves counts of zero (no stale rows are valid).
"""

import triton
import triton.language as tl

from .copy import as_words, copy_rows, load_tile, store_nvfp4_tile, store_tile
from .dispatch import count_and_check
from .quant import quantize_e4m3_groups
from .routing import load_topk_chunk, token_destinations
from .sync import (S_EPOCH, arrive, as_ptr, flag_value, group_failed, live_ranks, publish_many, wait_flags)


@triton.jit
def wait_released(released_ptr, combine_seq_ptr, grp, status_ptr, op, rank, WORLD: tl.constexpr,
                  WORLD_P2: tl.constexpr):
    """Wait until every live rank's ``released`` word (int64 [2, WORLD, 2] combine control words, word 0)
    shows this rank's combine count: each rank has finished reading every zone. Nothing to wait for before
    the first combine. Returns False if the wait failed (the group failed: send nothing)."""
    done = tl.load(combine_seq_ptr)
    w = tl.arange(0, WORLD_P2)
    live = tl.where(done > 0, live_ranks(grp, WORLD, WORLD_P2), False)
    ok = wait_flags(released_ptr + ((done % 2) * WORLD + w) * 2, flag_value(tl.load(grp + S_EPOCH), done), live, w,
                    grp, status_ptr, op, rank, WORLD, WORLD_P2)
    return tl.min(tl.where(live, ok, True).to(tl.int32)) > 0


@triton.jit
def prefill_dispatch_send_kernel(
    x_ptr,            # [T, HIDDEN] dtype: the tokens (plain: copied as int32 words [T, X_WORDS])
    idx_ptr,          # [T, TOPK] int32/int64 expert ids, -1 = not routed
    weights_ptr,      # [T, TOPK] float32 topk_weights
    routed_ptr,       # out int32 [M, TOPK]: 1 + the owner rank where slot (t, k) is routed (the combine's mask), else 0
    excluded_ptr,     # int64 [1]: slots whose expert's rank is excluded (accumulated)
    data_ptrs_ptr,    # int64 [WORLD]: every rank's zone (int32 words, PrefillPlan layout)
    ctrl_ptrs_ptr,    # int64 [WORLD]: every rank's control words, int64 [2, WORLD, CTRL_WORDS]
    released_ptr,     # int64 [2, WORLD, 2]: this rank's combine control words (word 0: released)
    combine_seq_ptr,  # int64 [1]: this rank's combine receive count
    seq_ptr,          # int64 [1]: the channel's send count (advanced here)
    done_ptr,         # int32 [WORLD + 2]: arrival counters ([WORLD]: this kernel's), zero between launches
    grp, status_ptr, rank, num_tokens, num_experts,
    OP: tl.constexpr, WORLD: tl.constexpr, WORLD_P2: tl.constexpr, M: tl.constexpr, TOPK: tl.constexpr,
    TOPK_P2: tl.constexpr, EXPERTS_PER_RANK: tl.constexpr, HIDDEN: tl.constexpr, X_WORDS: tl.constexpr,
    S_WORDS: tl.constexpr, X_OFFSET: tl.constexpr, CTRL_WORDS: tl.constexpr, BT: tl.constexpr, BW: tl.constexpr,
    ROUTE_T: tl.constexpr, BINS: tl.constexpr, FP8: tl.constexpr, FP8_GROUPS: tl.constexpr, NBLK: tl.constexpr,
    ALIGNED: tl.constexpr,
    gscale_ptr,       # float32 [1]: the NVFP4 global scale (read with NVFP4 only)
    NVFP4: tl.constexpr, NVFP4_GROUPS: tl.constexpr,  # NVFP4: quantized in column blocks of NVFP4_GROUPS * 16
):
    blk = tl.program_id(0)
    col = tl.program_id(1)  # column block of the payload (FP8: of FP8_GROUPS * 128 columns; else the row)
    call = tl.load(seq_ptr) + 1
    zone = call % 2          # of the control words; the data has one zone
    R: tl.constexpr = WORLD * M
    released = wait_released(released_ptr, combine_seq_ptr, grp, status_ptr, OP, rank, WORLD, WORLD_P2)
    failed = group_failed(grp, status_ptr, WORLD, WORLD_P2) | (released == 0)  # a failed group sends nothing
    peer = tl.arange(0, WORLD_P2)
    peer_live = tl.where(failed, False, live_ranks(grp, WORLD, WORLD_P2))
    zone_all = as_ptr(tl.load(data_ptrs_ptr + peer, mask=peer_live, other=0), tl.int32)   # [WORLD_P2]

    if (blk == NBLK - 1) & (col == 0):   # the combine's mask, excluded slots, bad ids, control words
        # (id_base: the put layout's, never written without PUT: routed_ptr stands in)
        count_and_check(idx_ptr, routed_ptr, excluded_ptr, routed_ptr, ctrl_ptrs_ptr, ctrl_ptrs_ptr,
                        (zone * WORLD + rank) * CTRL_WORDS,
                        grp, rank, num_tokens, num_experts, failed == 0, OP, WORLD, WORLD_P2, TOPK, TOPK_P2,
                        EXPERTS_PER_RANK, ROUTE_T, BINS, CTRL_WORDS, False)

    per_program = tl.cdiv(num_tokens, NBLK)
    t_begin = tl.minimum(blk * per_program, num_tokens)
    t_end = tl.minimum(t_begin + per_program, num_tokens)
    for t0 in range(t_begin, t_end, BT):
        ts, ks, idx, live, valid, bad = load_topk_chunk(idx_ptr, t0, t_end, num_experts, TOPK, TOPK_P2, BT)
        owner = tl.where(valid, idx // EXPERTS_PER_RANK, -1)
        q = (rank * M + ts).to(tl.int64)                                        # the token's row everywhere
        if col == 0:   # ids and weights to every live rank: local id / weight where the expert is there
            here = owner[None, :] == peer[:, None]                              # [WORLD_P2, BT * TOPK_P2]
            w = tl.load(weights_ptr + ts.to(tl.int64) * TOPK + ks, mask=live, other=0.0)
            slot = zone_all[:, None] + (q * TOPK + ks)[None, :]
            put = peer_live[:, None] & live[None, :]
            tl.store(slot, tl.where(here, (idx % EXPERTS_PER_RANK)[None, :], -1), mask=put)
            tl.store((slot + R * TOPK).to(tl.pointer_type(tl.float32)), tl.where(here, w[None, :], 0.0), mask=put)

        t = t0 + tl.arange(0, BT)
        to, write = token_destinations(owner, t < t_end, grp, failed, BT, TOPK_P2)
        base = tl.load(data_ptrs_ptr + to, mask=write, other=0)                 # [BT, TOPK_P2] zone addresses
        row = (rank * M + t).to(tl.int64)[:, None]
        dst = base + (X_OFFSET + row * X_WORDS) * 4                             # bytes
        read = tl.max(write.to(tl.int32), axis=1) > 0
        if FP8:  # column block `col` of the row: quantized in registers, stored to every destination
            COLS: tl.constexpr = FP8_GROUPS * 128
            xs = load_tile(x_ptr + t.to(tl.int64) * HIDDEN, read, col * COLS, HIDDEN, COLS, ALIGNED)
            qx, scale = quantize_e4m3_groups(xs.to(tl.float32), BT, FP8_GROUPS)
            store_tile(qx, col * COLS, HIDDEN, dst, write, COLS, TOPK, TOPK_P2, ALIGNED)
            sdst = base + (X_OFFSET + R * X_WORDS + row * S_WORDS) * 4
            store_tile(scale, col * FP8_GROUPS, S_WORDS, sdst, write, FP8_GROUPS, TOPK, TOPK_P2,
                       ALIGNED & (S_WORDS % 4 == 0))
        elif NVFP4:  # the same for NVFP4 (value words into recv_x, scale words into recv_scales)
            NCOLS: tl.constexpr = NVFP4_GROUPS * 16
            xs = load_tile(x_ptr + t.to(tl.int64) * HIDDEN, read, col * NCOLS, HIDDEN, NCOLS, ALIGNED)
            store_nvfp4_tile(xs, col, tl.load(gscale_ptr), dst, base + (X_OFFSET + R * X_WORDS + row * S_WORDS) * 4,
                             write, X_WORDS, S_WORDS, NVFP4_GROUPS, TOPK, TOPK_P2, ALIGNED)
        else:
            copy_rows(as_words(x_ptr) + t.to(tl.int64) * X_WORDS, read, dst, write, X_WORDS, BW, TOPK, TOPK_P2,
                      ALIGNED)

    # The last program publishes to every live rank, unless a program skipped its part, and advances the
    # send count.
    last, skipped = arrive(done_ptr + WORLD, NBLK * tl.num_programs(1), failed)
    if last:
        if skipped == 0:
            ctrl = as_ptr(tl.load(ctrl_ptrs_ptr + peer, mask=peer_live, other=0), tl.int64)
            publish_many(ctrl + (zone * WORLD + rank) * CTRL_WORDS + CTRL_WORDS - 1,
                         flag_value(tl.load(grp + S_EPOCH), call), peer_live)
        tl.store(seq_ptr, call)


@triton.jit
def prefill_dispatch_recv_kernel(
    src_tokens_ptr,   # out int32 [WORLD]: tokens T_s of every source (rows [s*M, s*M + T_s) are its)
    counts_ptr,       # out int32 [EXPERTS_PER_RANK]: valid slots per local expert, all sources
    stats_ptr,        # int64 [EXPERTS_PER_RANK]: the same, accumulated over calls
    ctrl_ptr,         # int64 [2, WORLD, CTRL_WORDS]: this rank's control words
    seq_ptr,          # int64 [1]: the channel's receive count (advanced here)
    grp, status_ptr, rank,
    OP: tl.constexpr, WORLD: tl.constexpr, WORLD_P2: tl.constexpr, M: tl.constexpr, TOPK: tl.constexpr,
    EXPERTS_PER_RANK: tl.constexpr, EXPERTS_P2: tl.constexpr, CTRL_WORDS: tl.constexpr,
):
    call = tl.load(seq_ptr) + 1
    ctrl = ctrl_ptr + (call % 2) * WORLD * CTRL_WORDS
    w = tl.arange(0, WORLD_P2)
    live = live_ranks(grp, WORLD, WORLD_P2)
    arrived = wait_flags(ctrl + w * CTRL_WORDS + CTRL_WORDS - 1, flag_value(tl.load(grp + S_EPOCH), call), live, w,
                         grp, status_ptr, OP, rank, WORLD, WORLD_P2)
    arrived = tl.where(group_failed(grp, status_ptr, WORLD, WORLD_P2), False, arrived)
    e = tl.arange(0, EXPERTS_P2)
    e_live = e < EXPERTS_PER_RANK
    counts = tl.load(ctrl + w[:, None] * CTRL_WORDS + 1 + e[None, :], mask=arrived[:, None] & e_live[None, :],
                     other=0)   # published before the flags: plain loads
    counts = tl.sum(tl.minimum(tl.maximum(counts, 0), M * TOPK), axis=0).to(tl.int32)
    tokens = tl.load(ctrl + w * CTRL_WORDS, mask=arrived, other=0)
    tl.store(src_tokens_ptr + w, tl.minimum(tl.maximum(tokens, 0), M).to(tl.int32), mask=w < WORLD)
    tl.store(counts_ptr + e, counts, mask=e_live)
    tl.store(stats_ptr + e, tl.load(stats_ptr + e, mask=e_live) + counts.to(tl.int64), mask=e_live)
    tl.store(seq_ptr, call)
