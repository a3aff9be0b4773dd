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

Across nodes (PUT, docs/prefill.md "Across nodes"): ``ready`` goes by stores to the ranks of this node,
as a bare signal to every live rank of another node whose rail here is not this rank. The forward kernel
(send phase, after the send kernel) reduces inside the node: a rail waits for ``ready`` from its node,
sums, for each token of each source it serves that came to the node, the partial rows of its node's
ranks holding one of the token's experts (ascending rank, float32), rounds the sum to the output dtype
over its own row, puts it into the source's node inbox at [this node, t], and signals ``ready`` to the
source. The receive then sums node by node in ascending node order: this node's ranks' rows (float32,
ascending rank, as above), another node's inbox row. ``released`` reaches other nodes as a signal.

FP8 (``combine_format="e4m3"``): the send quantizes each partial row into the zone as an fp8 row
(``formats.fp8_row_words``: e4m3 bytes, then a float32 scale per 128 columns; ``copy_rows(..., FP8=True)``)
and the receive dequantizes the rows it reads (``quant.dequantize_e4m3_groups``) before the sum: half the
bytes a source loads from its peers (``reference.prefill_combine(..., fp8=True)``). Never in place. One node
only: across nodes the forward kernel sums rows of the dtype (PrefillBuffer refuses the fp8 combine there).
"""

import triton
import triton.language as tl

from .combine import expert_rows, fill_nan
from .copy import address, as_words, copy_rows, load_tile, row_pointers, store_tile
from .nvshmem_device import SIGNAL_SET, putmem_nbi_block, signal_op
from .prefill_dispatch import rail_of, rails_of
from .quant import cast_rne, dequantize_e4m3_groups
from .sync import (S_EPOCH, arrive, as_ptr, check_failed, flag_value, group_failed, is_live, live_ranks,
                   publish_many, wait_flags)
from .transport import put_peers, store_only

RELEASED = tl.constexpr(0)   # combine control words: (released, ready)
READY = tl.constexpr(1)


@triton.jit
def signal_each(ctrl_ptrs_ptr, word, flag, grp, rank, G: tl.constexpr, G_P2: tl.constexpr, WORLD: tl.constexpr,
                PUT: tl.constexpr, RAILS: tl.constexpr):
    """Signal ``flag`` at ``word`` of this rank's row of the combine control words (a symmetric offset) to
    every live rank reached by puts: all of them (RAILS = 0), those whose rail on this node is this rank
    (RAILS = 1), or the others (RAILS = -1). Scalar control flow, every thread; not quieted here."""
    own = as_ptr(tl.load(ctrl_ptrs_ptr + rank), tl.int64) + word
    for p in range(WORLD):
        if is_live(grp, p) & put_peers(grp, p, True, WORLD, PUT):
            mine = rail_of(grp, p, rank // G, G, G_P2) == rank
            if RAILS == 1:
                go = mine
            elif RAILS == -1:
                go = mine == 0
            else:
                go = mine | (mine == 0)
            if go:
                signal_op(own, flag, SIGNAL_SET, p)


@triton.jit
def publish_released(ctrl_ptrs_ptr, call, grp, rank, WORLD: tl.constexpr, WORLD_P2: tl.constexpr,
                     PUT: tl.constexpr = False, G: tl.constexpr = 1, G_P2: tl.constexpr = 1):
    """``released`` of ``call`` to every live rank's combine control words: by stores to this node's
    ranks, with PUT as a signal to the others."""
    w = tl.arange(0, WORLD_P2)
    near = store_only(put_peers(grp, w, w < WORLD, WORLD, PUT), live_ranks(grp, WORLD, WORLD_P2), PUT)
    ctrl = as_ptr(tl.load(ctrl_ptrs_ptr + w, mask=near, other=0), tl.int64)
    word = ((call % 2) * WORLD + rank) * 2 + RELEASED
    flag = flag_value(tl.load(grp + S_EPOCH), call)
    publish_many(ctrl + word, flag, near)
    if PUT:   # bare signals: they carry their value, nothing is staged, nothing waits for them
        signal_each(ctrl_ptrs_ptr, word, flag, grp, rank, G, G_P2, WORLD, PUT, 0)


@triton.jit
def prefill_release_kernel(ctrl_ptrs_ptr, send_seq_ptr, grp, rank, WORLD: tl.constexpr, WORLD_P2: tl.constexpr,
                           PUT: tl.constexpr = False, G: tl.constexpr = 1, G_P2: tl.constexpr = 1):
    """A combine this rank aborted (an input error) read no zone: it releases them, so that when every rank
    aborted the call the next dispatch does not wait. Run right after ``Channel.abort``, which advanced
    the send count to the aborted call (the receive count still names the call before: its drain is owed
    to the channel's next launch), so the release is of ``send_seq``'s call, the one the next dispatch
    waits for once that drain ran. Grid (1,)."""
    publish_released(ctrl_ptrs_ptr, tl.load(send_seq_ptr), grp, rank, WORLD, WORLD_P2, PUT, G, G_P2)


@triton.jit
def prefill_combine_send_kernel(
    expert_out_ptr,   # [R, HIDDEN] dtype: one partial row per received token (rows as recv_x), copied as words
    zone_ptr,         # int32 words: this rank's zone (PrefillPlan layout)
    src_tokens_ptr,   # int32 [WORLD]: tokens of every source in the dispatch being answered
    ctrl_ptrs_ptr,    # int64 [WORLD]: every rank's combine control words, int64 [2, WORLD, 2]
    seq_ptr,          # int64 [1]: the channel's send count (advanced here)
    done_ptr,         # int32 [WORLD + 3]: arrival counters ([WORLD]: this kernel's)
    grp, status_ptr, rank,
    WORLD: tl.constexpr, WORLD_P2: tl.constexpr, M: tl.constexpr, TOPK: tl.constexpr, TOPK_P2: tl.constexpr,
    OUT_WORDS: tl.constexpr, X_OFFSET: tl.constexpr, BR: tl.constexpr, BW: tl.constexpr, NBLK: tl.constexpr,
    IN_PLACE: tl.constexpr, ALIGNED: tl.constexpr, PUT: tl.constexpr, G: tl.constexpr, G_P2: tl.constexpr,
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
            near = store_only(put_peers(grp, w, w < WORLD, WORLD, PUT), live, PUT)
            ctrl = as_ptr(tl.load(ctrl_ptrs_ptr + w, mask=near, other=0), tl.int64)
            word = ((call % 2) * WORLD + rank) * 2 + READY
            flag = flag_value(tl.load(grp + S_EPOCH), call)
            publish_many(ctrl + word, flag, near)
            if PUT:   # a bare ready to the other nodes' ranks whose rail here is another rank (aborts, drains)
                signal_each(ctrl_ptrs_ptr, word, flag, grp, rank, G, G_P2, WORLD, PUT, -1)
        tl.store(seq_ptr, call)


@triton.jit
def prefill_combine_forward_kernel(
    rows_ptr,         # [R, HIDDEN] dtype: this rank's partial rows (its zone's combine layout), written in place
    zone_ptr,         # int32 words: this rank's zone (the routing plane)
    data_ptrs_ptr,    # int64 [WORLD]: every rank's zone (those of this node mapped)
    inbox_ptr,        # [NODES * M, HIDDEN] dtype: this rank's node inbox of the zone (the puts' symmetric
    #                   destination, in the source's copy)
    src_tokens_ptr,   # int32 [WORLD]: tokens of every source in the dispatch being answered
    stamp_ptr,        # int64 [1]: the zone's stamp (the flag of that dispatch)
    ctrl_ptr,         # int64 [2, WORLD, 2]: this rank's combine control words
    ctrl_ptrs_ptr,    # int64 [WORLD]: every rank's combine control words
    seq_ptr,          # int64 [1]: the channel's send count (the send kernel advanced it to this call)
    done_ptr,         # int32 [WORLD + 3]: arrival counters ([WORLD]: the send phase's)
    grp, status_ptr, rank,
    OP: tl.constexpr, WORLD: tl.constexpr, WORLD_P2: tl.constexpr, M: tl.constexpr, TOPK: tl.constexpr,
    TOPK_P2: tl.constexpr, EXPERTS_PER_RANK: tl.constexpr, HIDDEN: tl.constexpr, OUT_WORDS: tl.constexpr,
    X_OFFSET: tl.constexpr, ROUTE_OFFSET: tl.constexpr, RW: tl.constexpr, G: tl.constexpr, G_P2: tl.constexpr,
    BT: tl.constexpr, BH: tl.constexpr, ALIGNED: tl.constexpr, PUT: tl.constexpr,
):
    """The node reduction of a rail (grid (programs, WORLD); PUT only). Every program first waits (bounded)
    for ``ready`` of every live rank of this node. Program (b, s) takes source s if it is a live rank of
    another node whose rail here is this rank, token blocks b, b + programs, ... of its T_s tokens: a
    token whose routing row here carries the zone's stamp came to this node; its partial rows on the
    ranks of this node holding one of its experts are summed in ascending rank order, in float32, rounded
    to the output dtype over this rank's row s*M + t (no other rank reads it). The last program puts each
    into its source's node inbox at [this node, t], then signals ``ready`` to every source served (unless
    the group failed); nothing is quieted."""
    blk = tl.program_id(0)
    s = tl.program_id(1)
    call = tl.load(seq_ptr)
    w = tl.arange(0, WORLD_P2)
    near = store_only(put_peers(grp, w, w < WORLD, WORLD, PUT), live_ranks(grp, WORLD, WORLD_P2), PUT)
    flag = flag_value(tl.load(grp + S_EPOCH), call)
    # (only this node's ranks are waited for, and candidates for the name: peer id WORLD_P2 for the others)
    ok = wait_flags(ctrl_ptr + ((call % 2) * WORLD + w) * 2 + READY, flag, near, tl.where(near, w, WORLD_P2), grp,
                    status_ptr, OP, rank, WORLD, WORLD_P2, PUT=PUT)
    failed = group_failed(grp, status_ptr, WORLD, WORLD_P2) | (tl.min(tl.where(near, ok, True).to(tl.int32)) == 0)
    node = rank // G
    serve = is_live(grp, s) & put_peers(grp, s, True, WORLD, PUT) & (rail_of(grp, s, node, G, G_P2) == rank)
    n_tokens = tl.where(serve & (failed == 0), tl.minimum(tl.maximum(tl.load(src_tokens_ptr + s), 0), M), 0)
    stamp = tl.load(stamp_ptr)
    DT: tl.constexpr = rows_ptr.dtype.element_ty
    kk = tl.arange(0, TOPK_P2)
    for t0 in range(blk * BT, n_tokens, tl.num_programs(0) * BT):
        t = t0 + tl.arange(0, BT)
        t_live = t < n_tokens
        q = (s * M + t).to(tl.int64)
        route = zone_ptr + ROUTE_OFFSET + q * RW
        ids = tl.load(route[:, None] + kk[None, :], mask=t_live[:, None] & (kk < TOPK)[None, :], other=-1)
        came = tl.load((route + 2 * TOPK).to(tl.pointer_type(tl.int64)), mask=t_live, other=0) == stamp
        owner = tl.where(came[:, None] & (ids >= 0), ids // EXPERTS_PER_RANK, -1)
        for c0 in range(0, HIDDEN, BH):
            acc = tl.zeros([BT, BH], dtype=tl.float32)
            for j in tl.static_range(G):
                d = node * G + j
                use = tl.where(is_live(grp, d), tl.max((owner == d).to(tl.int32), axis=1) > 0, False)   # boolean
                base = tl.load(data_ptrs_ptr + d, mask=is_live(grp, d), other=0) + X_OFFSET * 4
                v = load_tile(row_pointers(base + q * OUT_WORDS * 4, DT, ALIGNED), use, c0, HIDDEN, BH, ALIGNED)
                acc = tl.where(use[:, None], acc + v.to(tl.float32), acc)
            store_tile(cast_rne(acc, DT), c0, HIDDEN, address(rows_ptr + q * HIDDEN)[:, None], came[:, None], BH, 1, 1,
                       ALIGNED)
    # The last program puts every served source's reduced rows, then its ``ready``: one program, so the rows
    # to a source and its signal travel in order on one queue pair (nothing waits for them: the rows are
    # rewritten only by the source's next dispatch into this zone, which waits for its own ``released``,
    # published after it saw this ``ready``).
    last, skipped = arrive(done_ptr + WORLD, tl.num_programs(0) * tl.num_programs(1), failed)
    if last:
        if skipped == 0:
            for src in range(WORLD):
                mine = rail_of(grp, src, node, G, G_P2) == rank
                if is_live(grp, src) & put_peers(grp, src, True, WORLD, PUT) & mine:
                    n = tl.minimum(tl.maximum(tl.load(src_tokens_ptr + src), 0), M)
                    for i in range(0, n):
                        qi = tl.cast(src * M + i, tl.int64)
                        stamped = zone_ptr + ROUTE_OFFSET + qi * RW + 2 * TOPK   # the token came to this node
                        if tl.load(stamped.to(tl.pointer_type(tl.int64))) == stamp:
                            putmem_nbi_block(inbox_ptr + tl.cast(node * M + i, tl.int64) * HIDDEN,
                                             rows_ptr + qi * HIDDEN, OUT_WORDS * 4, src)
            signal_each(ctrl_ptrs_ptr, ((call % 2) * WORLD + rank) * 2 + READY, flag, grp, rank, G, G_P2, WORLD, PUT,
                        1)


@triton.jit
def prefill_combine_recv_kernel(
    out_ptr,          # out [T, HIDDEN] dtype
    routed_ptr,       # int32 [M, TOPK]: 1 + the owner rank of slot (t, k) where the dispatch routed it, else 0
    data_ptrs_ptr,    # int64 [WORLD]: every rank's zone (the dispatch channel's data)
    inbox_ptr,        # [NODES * M, HIDDEN] dtype (PUT): this rank's node inbox of the zone
    ctrl_ptr,         # int64 [2, WORLD, 2]: this rank's combine control words
    ctrl_ptrs_ptr,    # int64 [WORLD]: every rank's combine control words
    seq_ptr,          # int64 [1]: the channel's receive count (advanced here)
    done_ptr,         # int32 [WORLD + 3]: arrival counters ([WORLD + 1]: this kernel's)
    grp, status_ptr, rank, num_tokens,
    OP: tl.constexpr, WORLD: tl.constexpr, WORLD_P2: tl.constexpr, M: tl.constexpr, TOPK: tl.constexpr,
    TOPK_P2: tl.constexpr, HIDDEN: tl.constexpr, ROW_BYTES: tl.constexpr, X_OFFSET: tl.constexpr, BT: tl.constexpr,
    BH: tl.constexpr, NBLK: tl.constexpr, ALIGNED: tl.constexpr, PUT: tl.constexpr, G: tl.constexpr,
    G_P2: tl.constexpr,
    FP8: tl.constexpr,   # the partial rows are fp8 rows (ROW_BYTES of them), dequantized before the sum
):
    blk = tl.program_id(0)
    c0 = tl.program_id(1) * BH  # this program's columns: [c0, c0 + BH)
    call = tl.load(seq_ptr) + 1
    w = tl.arange(0, WORLD_P2)
    live = live_ranks(grp, WORLD, WORLD_P2)
    NODES: tl.constexpr = WORLD // G
    if PUT:   # this node's ranks, and this rank's rail on every other node (its node reduction's ready)
        put = put_peers(grp, w, w < WORLD, WORLD, PUT)
        mine = rails_of(grp, tl.zeros([WORLD_P2], dtype=tl.int32) + rank, w // G, G, G_P2) == w
        need = tl.where(put, mine, True) & live
    else:
        put = w < 0
        need = live
    arrived = wait_flags(ctrl_ptr + ((call % 2) * WORLD + w) * 2 + READY, flag_value(tl.load(grp + S_EPOCH), call),
                         need, tl.where(need, w, WORLD_P2), grp, status_ptr, OP, rank, WORLD, WORLD_P2, PUT=PUT)
    kk = tl.arange(0, TOPK_P2)
    DT: tl.constexpr = out_ptr.dtype.element_ty
    for t0 in range(blk * BT, num_tokens, NBLK * BT):
        t = t0 + tl.arange(0, BT)
        t_live = t < num_tokens
        owner = tl.load(routed_ptr + t[:, None] * TOPK + kk[None, :],
                        mask=t_live[:, None] & (kk < TOPK)[None, :], other=0) - 1     # [BT, TOPK_P2], -1 none
        acc = tl.zeros([BT, BH], dtype=tl.float32)
        for n in tl.static_range(NODES):   # nodes in ascending order
            part = tl.zeros([BT, BH], dtype=tl.float32)
            for j in tl.static_range(G):   # this node's ranks, ascending
                d = n * G + j
                ok = tl.sum(tl.where((w == d) & (put == 0), arrived.to(tl.int32), 0)) > 0
                use = tl.where(ok, tl.max((owner == d).to(tl.int32), axis=1) > 0, False)
                base = tl.load(data_ptrs_ptr + d, mask=ok, other=0) + X_OFFSET * 4
                if FP8:   # e4m3 bytes, then float32 scales
                    rows = row_pointers(base + (rank * M + t).to(tl.int64) * ROW_BYTES, tl.uint8, ALIGNED)
                    q = load_tile(rows, use, c0, HIDDEN, BH, ALIGNED).to(tl.float8e4nv, bitcast=True)
                    scale = load_tile((rows + HIDDEN).to(tl.pointer_type(tl.float32)), use, c0 // 128,
                                      HIDDEN // 128, BH // 128, ALIGNED)
                    v = dequantize_e4m3_groups(q, scale, BT, BH // 128)
                else:
                    rows = row_pointers(base + (rank * M + t).to(tl.int64) * ROW_BYTES, DT, ALIGNED)
                    v = load_tile(rows, use, c0, HIDDEN, BH, ALIGNED).to(tl.float32)
                part = tl.where(use[:, None], part + v, part)
            if PUT:   # another node: its rail's reduced row in the node inbox, if the token went there
                far = tl.sum(tl.where(mine & (w // G == n) & put & arrived, 1, 0)) > 0
                went = tl.max(((owner >= 0) & (owner // G == n)).to(tl.int32), axis=1) > 0
                use = tl.where(far, went, False)
                v = load_tile(inbox_ptr + (n * M + t).to(tl.int64) * HIDDEN, use, c0, HIDDEN, BH, ALIGNED)
                near = tl.sum(tl.where((w // G == n) & (put == 0) & (w < WORLD), 1, 0)) > 0
                acc = tl.where(near, acc + part, tl.where(use[:, None], acc + v.to(tl.float32), acc))
            else:
                acc = part
        store_tile(cast_rne(acc, DT), c0, HIDDEN, address(out_ptr + t.to(tl.int64) * HIDDEN)[:, None],
                   t_live[:, None], BH, 1, 1, ALIGNED)
    last, _ = arrive(done_ptr + WORLD + 1, tl.num_programs(0) * tl.num_programs(1), 0)
    if last:
        # No partial sum, and the error raised: a record that came after every flag this launch waited
        # for (a slow rank's receive: nothing to wait for) is adopted into this rank's word here.
        if check_failed(grp, status_ptr, WORLD, WORLD_P2):
            fill_nan(out_ptr, num_tokens, HIDDEN, BT, BH, ALIGNED)
        else:
            publish_released(ctrl_ptrs_ptr, call, grp, rank, WORLD, WORLD_P2, PUT, G, G_P2)
        tl.store(seq_ptr, call)
