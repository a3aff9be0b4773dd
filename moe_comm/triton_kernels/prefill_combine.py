"""Prefill combine device code: send phase (partial rows into this rank's own zone) and receive phase (pull
and sum at the source).

Nothing lands at the source: each rank's partial rows (one per received token, its local experts already
reduced) stay in its own zone, over recv_x (``planner.PrefillPlan``), and every source reads the rows of
its tokens from the ranks that hold them. So the op needs no combine landing zone: the memory of the
whole op is one dispatch zone.

Control words of the combine channel, ``ctrl[call % 2, rank, :]`` (int64) = (released, ready):
``ready`` = the rank's partial rows of the call are in its zone; ``released`` = the rank's combine has
finished reading every zone (the next dispatch's send waits for it, ``prefill_dispatch.wait_released``).

Send (grid = NBLK programs over the rows q = s * M + t of the zone): the rows of live sources' tokens that
hold a local expert (a recv_topk_idx entry >= 0) are copied from ``expert_out`` into the zone (skipped
when ``expert_out`` is recv_x itself, IN_PLACE); the last program publishes ``ready`` to every live rank.

Receive (grid = NBLK token blocks x HIDDEN / BH column blocks): wait (bounded) for every live rank's
``ready``, then ``y[t] = sum over ranks d = 0..WORLD-1 holding one of t's experts of partial_d[rank * M +
t]``, in float32 in ascending d, cast to the output dtype (rounding to nearest even): bitwise
reproducible from run to run. The last program publishes ``released`` to every live rank; if the call
failed it makes every row NaN instead (the error is raised).

FP8 (``combine_format="e4m3"``): the send quantizes each partial row into the zone as an fp8 row
(``formats.fp8_row_words``: e4m3 bytes, then a float32 scale per 128 columns; ``copy_rows(..., FP8=True)``)
and the receive dequantizes the rows it reads (``quant.dequantize_e4m3_groups``) before the sum: half the
bytes a source loads from its peers (``reference.prefill_combine(..., fp8=True)``). Never in place.
"""

import triton
import triton.language as tl

from .combine import expert_rows, fill_nan
from .copy import address, copy_rows, load_tile, row_pointers, store_tile
from .quant import cast_rne, dequantize_e4m3_groups
from .sync import S_EPOCH, arrive, as_ptr, flag_value, group_failed, live_ranks, publish_many, wait_flags

RELEASED = tl.constexpr(0)   # combine control words: (released, ready)
READY = tl.constexpr(1)


@triton.jit
def publish_released(ctrl_ptrs_ptr, call, grp, rank, WORLD: tl.constexpr, WORLD_P2: tl.constexpr):
    """``released`` of ``call`` to every live rank's combine control words."""
    w = tl.arange(0, WORLD_P2)
    live = live_ranks(grp, WORLD, WORLD_P2)
    ctrl = as_ptr(tl.load(ctrl_ptrs_ptr + w, mask=live, other=0), tl.int64)
    publish_many(ctrl + ((call % 2) * WORLD + rank) * 2 + RELEASED, flag_value(tl.load(grp + S_EPOCH), call), live)


@triton.jit
def prefill_release_kernel(ctrl_ptrs_ptr, recv_seq_ptr, grp, rank, WORLD: tl.constexpr, WORLD_P2: tl.constexpr):
    """A combine this rank aborted (an input error, ``Channel.abort`` has advanced the counts) read no zone:
    it releases them, so that when every rank aborted the call the next dispatch does not wait. Grid (1,)."""
    publish_released(ctrl_ptrs_ptr, tl.load(recv_seq_ptr), grp, rank, WORLD, WORLD_P2)


@triton.jit
def prefill_combine_send_kernel(
    expert_out_ptr,   # [R, HIDDEN] dtype: one partial row per received token (rows as recv_x), copied as words
    zone_ptr,         # int32 words: this rank's zone (PrefillPlan layout)
    src_tokens_ptr,   # int32 [WORLD]: tokens of every source in the dispatch being answered
    ctrl_ptrs_ptr,    # int64 [WORLD]: every rank's combine control words, int64 [2, WORLD, 2]
    seq_ptr,          # int64 [1]: the channel's send count (advanced here)
    done_ptr,         # int32 [WORLD + 2]: arrival counters ([WORLD]: this kernel's)
    grp, status_ptr, rank,
    WORLD: tl.constexpr, WORLD_P2: tl.constexpr, M: tl.constexpr, TOPK: tl.constexpr, TOPK_P2: tl.constexpr,
    OUT_WORDS: tl.constexpr, X_OFFSET: tl.constexpr, BR: tl.constexpr, BW: tl.constexpr, NBLK: tl.constexpr,
    IN_PLACE: tl.constexpr, ALIGNED: tl.constexpr,
    ROW_WORDS: tl.constexpr,   # words of a partial row in the zone: OUT_WORDS, or an fp8 row with FP8
    HIDDEN: tl.constexpr, FP8: tl.constexpr,   # FP8: rows quantized on the way (BW then counts elements)
):
    blk = tl.program_id(0)
    call = tl.load(seq_ptr) + 1
    failed = group_failed(grp, status_ptr, WORLD, WORLD_P2)
    w = tl.arange(0, WORLD_P2)
    live = live_ranks(grp, WORLD, WORLD_P2)
    tokens = tl.minimum(tl.maximum(tl.load(src_tokens_ptr + w, mask=live, other=0), 0), M)
    kk = tl.arange(0, TOPK_P2)
    if not IN_PLACE:
        for q0 in range(blk * BR, WORLD * M, NBLK * BR):
            q = q0 + tl.arange(0, BR)
            s = tl.minimum(q // M, WORLD - 1)
            n = tl.sum(tl.where(s[:, None] == w[None, :], tokens[None, :], 0), axis=1)
            row_live = (q < WORLD * M) & (q % M < n)
            ids = tl.load(zone_ptr + q[:, None].to(tl.int64) * TOPK + kk[None, :],
                          mask=row_live[:, None] & (kk < TOPK)[None, :], other=-1)
            mine = tl.where(failed, False, row_live & (tl.max(ids, axis=1) >= 0))
            dst = address(zone_ptr + X_OFFSET + q.to(tl.int64) * ROW_WORDS)[:, None]
            copy_rows(expert_rows(expert_out_ptr, q, OUT_WORDS, HIDDEN, FP8), mine, dst, mine[:, None],
                      HIDDEN if FP8 else OUT_WORDS, BW, 1, 1, ALIGNED, FP8)
    last, skipped = arrive(done_ptr + WORLD, NBLK, failed)
    if last:
        if skipped == 0:
            ctrl = as_ptr(tl.load(ctrl_ptrs_ptr + w, mask=live, other=0), tl.int64)
            publish_many(ctrl + ((call % 2) * WORLD + rank) * 2 + READY, flag_value(tl.load(grp + S_EPOCH), call),
                         live)
        tl.store(seq_ptr, call)


@triton.jit
def prefill_combine_recv_kernel(
    out_ptr,          # out [T, HIDDEN] dtype
    routed_ptr,       # int32 [M, TOPK]: 1 + the owner rank of slot (t, k) where the dispatch routed it, else 0
    data_ptrs_ptr,    # int64 [WORLD]: every rank's zone (the dispatch channel's data)
    ctrl_ptr,         # int64 [2, WORLD, 2]: this rank's combine control words
    ctrl_ptrs_ptr,    # int64 [WORLD]: every rank's combine control words
    seq_ptr,          # int64 [1]: the channel's receive count (advanced here)
    done_ptr,         # int32 [WORLD + 2]: arrival counters ([WORLD + 1]: this kernel's)
    grp, status_ptr, rank, num_tokens,
    OP: tl.constexpr, WORLD: tl.constexpr, WORLD_P2: tl.constexpr, M: tl.constexpr, TOPK: tl.constexpr,
    TOPK_P2: tl.constexpr, HIDDEN: tl.constexpr, ROW_BYTES: tl.constexpr, X_OFFSET: tl.constexpr, BT: tl.constexpr,
    BH: tl.constexpr, NBLK: tl.constexpr, ALIGNED: tl.constexpr,
    FP8: tl.constexpr,   # the partial rows are fp8 rows (ROW_BYTES of them), dequantized before the sum
):
    blk = tl.program_id(0)
    c0 = tl.program_id(1) * BH  # this program's columns: [c0, c0 + BH)
    call = tl.load(seq_ptr) + 1
    w = tl.arange(0, WORLD_P2)
    live = live_ranks(grp, WORLD, WORLD_P2)
    arrived = wait_flags(ctrl_ptr + ((call % 2) * WORLD + w) * 2 + READY, flag_value(tl.load(grp + S_EPOCH), call),
                         live, w, grp, status_ptr, OP, rank, WORLD, WORLD_P2)
    kk = tl.arange(0, TOPK_P2)
    DT: tl.constexpr = out_ptr.dtype.element_ty
    for t0 in range(blk * BT, num_tokens, NBLK * BT):
        t = t0 + tl.arange(0, BT)
        t_live = t < num_tokens
        owner = tl.load(routed_ptr + t[:, None] * TOPK + kk[None, :],
                        mask=t_live[:, None] & (kk < TOPK)[None, :], other=0) - 1     # [BT, TOPK_P2], -1 none
        acc = tl.zeros([BT, BH], dtype=tl.float32)
        for d in tl.static_range(WORLD):
            ok = tl.sum(tl.where(w == d, arrived.to(tl.int32), 0)) > 0
            use = tl.where(ok, tl.max((owner == d).to(tl.int32), axis=1) > 0, False)
            base = tl.load(data_ptrs_ptr + d, mask=ok, other=0) + X_OFFSET * 4
            if FP8:   # e4m3 bytes, then float32 scales
                rows = row_pointers(base + (rank * M + t).to(tl.int64) * ROW_BYTES, tl.uint8, ALIGNED)
                q = load_tile(rows, use, c0, HIDDEN, BH, ALIGNED).to(tl.float8e4nv, bitcast=True)
                scale = load_tile((rows + HIDDEN).to(tl.pointer_type(tl.float32)), use, c0 // 128, HIDDEN // 128,
                                  BH // 128, ALIGNED)
                v = dequantize_e4m3_groups(q, scale, BT, BH // 128)
            else:
                rows = row_pointers(base + (rank * M + t).to(tl.int64) * ROW_BYTES, DT, ALIGNED)
                v = load_tile(rows, use, c0, HIDDEN, BH, ALIGNED).to(tl.float32)
            acc = tl.where(use[:, None], acc + v, acc)
        store_tile(cast_rne(acc, DT), c0, HIDDEN, address(out_ptr + t.to(tl.int64) * HIDDEN)[:, None],
                   t_live[:, None], BH, 1, 1, ALIGNED)
    last, _ = arrive(done_ptr + WORLD + 1, tl.num_programs(0) * tl.num_programs(1), 0)
    if last:
        if group_failed(grp, status_ptr, WORLD, WORLD_P2):  # no partial sum (the error is raised)
            fill_nan(out_ptr, num_tokens, HIDDEN, BT, BH, ALIGNED)
        else:
            publish_released(ctrl_ptrs_ptr, call, grp, rank, WORLD, WORLD_P2)
        tl.store(seq_ptr, call)
