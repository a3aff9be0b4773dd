"""EP dispatch device code: send phase (routing + payload, fp8 quantization fused) and receive phase.

Landing zone on every rank (symmetric int32 words): ``data[zone, source, t, :]`` = one row per
(source rank, token): the token's payload (dtype bytes, or fp8 bytes then float32 scales), then TOPK
routing words ``local_expert + L * position`` for each k routed to this rank (else -1), padded to whole
16-byte vectors (``EPPlan.row_words``). A source writes its token t at row t, so the send side needs no
compaction, and a token crosses to a rank at most once however many of its top-k experts live there.
Control words ``ctrl[zone, source, :]`` (int64) = (tokens T of the source, L per-local-expert slot counts
from it, flag); with puts (``EPPlan.with_put``) = (rows, L counts, run base, flag), rows = T from a store
source, the tokens routed here from a put source (below); with NVFP4 the bits of the source's global
scale before the flag (the receive checks them against its own: ``quant.check_scales``). Zone = call % 2.

Send (grid = NBLK token blocks x column blocks, ``EPPlan.send_grid``): each program takes a contiguous
range of tokens, computes the positions of their slots from a histogram of the earlier tokens' ids
(``routing.py``; no program waits for another), and stores (column block 0) each token's routing words
into every live rank's row t (-1 where the rank holds none of the token's experts) and its payload into
row t of each rank holding one: one destination per slot k, the slot's rank unless an earlier slot of
the token has it. The payload moves by ``copy.py``: one register tile stored to each destination in
turn, 16-byte vectors. With FP8 each program quantizes one column block of FP8_GROUPS * 128 columns
(a row is spread over several programs; none walks it). One program also histograms the expert ids into
every rank's counts, writes the combine's mask and records bad ids. The last program to finish
publishes every rank's flag (release) and advances the call counter.

Receive (grid = NBLK programs per source x WORLD sources, ``EPPlan.recv_grid``): expert e's rows from
source s start at ``base[s, e] = sum over s' < s of count[s', e]``; slot (s, t, k) with routing word
(e, pos) is copied to ``x[e, base[s, e] + pos]``. Rows are thereby packed and sorted by (source, token,
k) without atomics. A program unpacks one source s, so it waits (bounded) only for the flags of sources
0..s, all polled at once (``sync.wait_flags``: one vector of acquire loads per poll): source 0's rows are
copied while later sources are still in flight, and the programs of the last source wait for all.
Counts read from peers are clamped so that no value can steer a store out of bounds; a row past the
capacity is dropped and recorded (CapacityError).

NVFP4 (``formats.py``): the same with ``quant.quantize_nvfp4_groups`` (``copy.store_nvfp4_tile``): a landing
row's payload is H / 8 words of packed e2m1 codes, then H / 64 words of e4m3 scales (four per word), each
program quantizing one column block of NVFP4_GROUPS * 16 columns with the caller's global scale.

Put transport (``transport.py``; peers whose ``transports`` entry is TRANSPORT_PUT, only when compiled with
PUT): a put peer gets only the rows of the tokens routed to it (each once), packed in token order into
this rank's staging copy of its region: row j is the j-th such token (``routing.packed_rows``: the
tokens of earlier programs are counted like the histogram), and carries the token index in the word
after the routing words (``EPPlan.with_put``). The control words say rows, not T, and add the run base
of the combine (this rank's slots on lower ranks' experts). The last program puts the rows in one
``putmem_nbi`` (rows x row bytes: the floor), then the control words in a ``putmem_signal_nbi`` whose
signal is the flag. The receive of a put source reads each row's token from that word; it writes
row_of only for the rows it received (the combine answers a put source by its run, not by row_of), and
keeps the source's rows per local expert and its run base for the combine (``runs``). A launch that
reaches peers by both transports fences at system scope before any flag (``order_transports``). The
staging has two zones (``call % 2``), reused by causality, never quieted (``transport.py``).
"""

import triton
import triton.language as tl

from . import trace
from .copy import address, as_words, copy_rows, load_tile, store_nvfp4_tile, store_tile
from .quant import check_scales, quantize_e4m3_groups
from .routing import (chunk_positions, histogram_of_tokens, load_topk_chunk, packed_rows, reach_of_tokens, scan_ids,
                      token_destinations)
from .transport import dest, flush, order_transports, put_peers, stage_zone, store_only
from .sync import (ERR_CAPACITY, S_EPOCH, S_LIVE, arrive, as_ptr, check_failed, flag_value, group_failed, is_live,
                   live_ranks, publish, publish_many, read_once, record_error, wait_flags)


@triton.jit
def _by_slot(a, BT: tl.constexpr, TOPK_P2: tl.constexpr, WORLD_P2: tl.constexpr):
    """[BT, WORLD_P2] per (token, rank) -> [WORLD_P2, BT * TOPK_P2] per (rank, slot) of the chunk."""
    return tl.reshape(tl.broadcast_to(tl.trans(a)[:, :, None], (WORLD_P2, BT, TOPK_P2)), (WORLD_P2, BT * TOPK_P2))


@triton.jit
def count_and_check(idx_ptr, routed_ptr, excluded_ptr, id_base_ptr, ctrl_ptrs_ptr, stage_ctrl_ptr, ctrl_offset, grp,
                    rank, num_tokens, num_experts, send, OP: tl.constexpr, WORLD: tl.constexpr,
                    WORLD_P2: tl.constexpr, TOPK: tl.constexpr, TOPK_P2: tl.constexpr,
                    EXPERTS_PER_RANK: tl.constexpr, CHUNK_T: tl.constexpr, BINS: tl.constexpr,
                    CTRL_WORDS: tl.constexpr, PUT: tl.constexpr, gscale_ptr, NVFP4: tl.constexpr):
    """The combine's mask (routed), the excluded-slot count and the first bad id, in one pass over the
    slots; then, unless the group failed, every live rank's control words (rows: T, or for a rank reached
    by puts the tokens routed to it; per-local-expert counts: a histogram of the valid ids with BINS >= E
    bins; for a put rank its run base, the slots routed to lower ranks' experts; with NVFP4 the bits of
    the global scale the rows are quantized with, word CTRL_WORDS - 2): in the rank's memory, or staged
    here for a rank reached by puts. With PUT, ``id_base`` [BINS] gets the slots of lower expert ids (the
    combine's receive finds the put runs' rows by it)."""
    counts = scan_ids(idx_ptr, routed_ptr, excluded_ptr, grp, rank, num_tokens, num_experts, OP, TOPK, TOPK_P2,
                      EXPERTS_PER_RANK, CHUNK_T, BINS)
    # (tl.where, not `&`: Triton's interpreter turns `bool vector & bool scalar` into int32, no mask)
    live = tl.where(send, live_ranks(grp, WORLD, WORLD_P2), False)
    peer = tl.arange(0, WORLD_P2)
    expert = tl.arange(0, BINS)
    put = put_peers(grp, peer, peer < WORLD, WORLD, PUT)
    ctrl = dest(put, stage_ctrl_ptr + peer * CTRL_WORDS,
                as_ptr(tl.load(ctrl_ptrs_ptr + peer, mask=live, other=0), tl.int64) + ctrl_offset, PUT)
    if PUT:
        rows = reach_of_tokens(idx_ptr, 0, num_tokens, num_experts, TOPK, TOPK_P2, EXPERTS_PER_RANK, WORLD_P2,
                               CHUNK_T)
        tl.store(ctrl, tl.where(put, rows, num_tokens).to(tl.int64), mask=live)
        below = tl.cumsum(counts, axis=0) - counts   # slots of lower expert ids
        run_base = tl.sum(tl.where(expert[None, :] == peer[:, None] * EXPERTS_PER_RANK, below[None, :], 0), axis=1)
        tl.store(ctrl + 1 + EXPERTS_PER_RANK, run_base.to(tl.int64), mask=tl.where(put, live, False))
        tl.store(id_base_ptr + expert, below)
    else:
        tl.store(ctrl, num_tokens, mask=live)
    if NVFP4:
        scale_bits = tl.load(gscale_ptr).to(tl.int32, bitcast=True).to(tl.int64)
        tl.store(ctrl + CTRL_WORDS - 2, scale_bits + tl.zeros([WORLD_P2], tl.int64), mask=live)
    owner = tl.minimum(expert // EXPERTS_PER_RANK, WORLD - 1)
    owner_live = tl.where(send, tl.load(grp + S_LIVE + owner) != 0, False)
    ctrl_of_expert = dest(put_peers(grp, owner, owner_live, WORLD, PUT), stage_ctrl_ptr + owner * CTRL_WORDS,
                          as_ptr(tl.load(ctrl_ptrs_ptr + owner, mask=owner_live, other=0), tl.int64) + ctrl_offset,
                          PUT)
    tl.store(ctrl_of_expert + 1 + expert % EXPERTS_PER_RANK, counts.to(tl.int64),
             mask=(expert < WORLD * EXPERTS_PER_RANK) & owner_live)
    return counts


@triton.jit
def dispatch_send_kernel(
    x_ptr,            # [T, HIDDEN] dtype: the tokens (plain: copied as int32 words [T, X_WORDS])
    idx_ptr,          # [T, TOPK] int32/int64 expert ids, -1 = not routed
    routed_ptr,       # out int32 [M, TOPK]: 1 + the owner rank where slot (t, k) is routed (the combine's mask), else 0
    excluded_ptr,     # int64 [1]: slots whose expert's rank is excluded (accumulated)
    slot_key_ptr,     # out int32 [M, TOPK] (PUT only): position * BINS + expert id of each valid slot
    id_base_ptr,      # out int32 [BINS] (PUT only): valid slots with a lower expert id
    data_ptrs_ptr,    # int64 [WORLD]: every rank's landing zone, int32 [2, WORLD, M, ROW_WORDS]
    ctrl_ptrs_ptr,    # int64 [WORLD]: every rank's control words, int64 [2, WORLD, CTRL_WORDS]
    stage_ptr,        # put transport: int32 [2, WORLD dest, M, ROW_WORDS], this rank's rows for each dest, per zone
    stage_ctrl_ptr,   # put transport: int64 [2, WORLD dest, CTRL_WORDS] staged control words, per zone (symmetric)
    seq_ptr,          # int64 [1]: the channel's send count (advanced here)
    done_ptr,         # int32 [WORLD + 3]: arrival counters ([WORLD]: this kernel's), zero between launches
    grp, status_ptr,  # group state and this rank's status buffer (moe_comm/protocol.py)
    rank, num_tokens, num_experts,
    trace_ptr,        # int64 [TRACE_N, record words]: the channel's flight recorder (TRACE only)
    OP: tl.constexpr, WORLD: tl.constexpr, WORLD_P2: tl.constexpr, M: tl.constexpr, TOPK: tl.constexpr,
    TOPK_P2: tl.constexpr, EXPERTS_PER_RANK: tl.constexpr, HIDDEN: tl.constexpr,
    X_WORDS: tl.constexpr, S_WORDS: tl.constexpr, ROW_WORDS: tl.constexpr, CTRL_WORDS: tl.constexpr,
    BT: tl.constexpr, BW: tl.constexpr, ROUTE_T: tl.constexpr, BINS: tl.constexpr,
    FP8: tl.constexpr, FP8_GROUPS: tl.constexpr, SCALE: tl.constexpr, S_BLOCK: tl.constexpr, NBLK: tl.constexpr,
    ALIGNED: tl.constexpr, PUT: tl.constexpr, TRACE: tl.constexpr, TRACE_N: tl.constexpr,
    gscale_ptr,       # float32 [1]: the NVFP4 global scale (read with NVFP4 only)
    NVFP4: tl.constexpr, NVFP4_GROUPS: tl.constexpr,  # NVFP4: quantized in column blocks of NVFP4_GROUPS * 16
):
    # SCALE: the scale format (quant.py); S_BLOCK: scale words of one FP8 column block (EPPlan.scale_block_words)
    blk = tl.program_id(0)
    col = tl.program_id(1)  # column block of the payload (FP8: of FP8_GROUPS * 128 columns; else the row)
    call = tl.load(seq_ptr) + 1
    trace.send_begin(trace_ptr, grp, call, OP, (blk == 0) & (col == 0), WORLD, TRACE_N, TRACE)
    zone = call % 2
    first_row = (zone * WORLD + rank).to(tl.int64) * M  # this source's rows in every rank's landing zone
    stage_ptr = stage_zone(stage_ptr, zone, WORLD * M * ROW_WORDS)            # STAGE_ZONE (transport.py)
    stage_ctrl_ptr = stage_zone(stage_ctrl_ptr, zone, WORLD * CTRL_WORDS)
    META: tl.constexpr = X_WORDS + S_WORDS              # routing words follow payload and scales
    TOKEN_WORD: tl.constexpr = META + TOPK              # put rows: the token index, after the routing words
    ROW_BYTES: tl.constexpr = ROW_WORDS * 4
    failed = group_failed(grp, status_ptr, WORLD, WORLD_P2)  # a failed group sends nothing
    peer = tl.arange(0, WORLD_P2)
    peer_live = tl.where(failed, False, live_ranks(grp, WORLD, WORLD_P2))
    # Where this program's rows for each rank go: that rank's landing zone (store transport), or this
    # rank's staging for it (put transport: the last program puts rows [0, T) of it, transport.py).
    landing_all = dest(put_peers(grp, peer, peer < WORLD, WORLD, PUT), stage_ptr + peer.to(tl.int64) * M * ROW_WORDS,
                       as_ptr(tl.load(data_ptrs_ptr + peer, mask=peer_live, other=0), tl.int32) + first_row * ROW_WORDS,
                       PUT)

    # 1. Bookkeeping, by one program: the combine's mask, the excluded-slot count, the first bad id, and
    #    per-expert counts (a histogram of the valid ids; BINS >= E) into each live rank's control words.
    if (blk == NBLK - 1) & (col == 0):
        counts = count_and_check(idx_ptr, routed_ptr, excluded_ptr, id_base_ptr, ctrl_ptrs_ptr, stage_ctrl_ptr,
                                 (zone * WORLD + rank) * CTRL_WORDS, grp, rank, num_tokens, num_experts, failed == 0,
                                 OP, WORLD, WORLD_P2, TOPK, TOPK_P2, EXPERTS_PER_RANK, ROUTE_T, BINS, CTRL_WORDS, PUT,
                                 gscale_ptr, NVFP4)
        trace.store_slots_per_rank(trace.sent_rows_ptr(trace_ptr, call, WORLD, TRACE_N), counts, peer_live,
                                   EXPERTS_PER_RANK, WORLD, WORLD_P2, BINS, TRACE)

    # 2. This program's tokens, a contiguous range: routing words to every live rank (column block 0),
    #    payload (column block `col`) once to row t of every live rank holding one of the token's experts.
    #    Positions continue a histogram of the ids of every earlier token (linear in T, see routing.py).
    per_program = tl.cdiv(num_tokens, NBLK)
    t_begin = tl.minimum(blk * per_program, num_tokens)
    t_end = tl.minimum(t_begin + per_program, num_tokens)
    before = histogram_of_tokens(idx_ptr, 0, t_begin, num_experts, TOPK, TOPK_P2, ROUTE_T, BINS)
    if PUT:  # a put rank gets only its tokens' rows, packed in token order: rows of the earlier tokens
        put_all = put_peers(grp, peer, peer < WORLD, WORLD, PUT)
        rows_before = reach_of_tokens(idx_ptr, 0, t_begin, num_experts, TOPK, TOPK_P2, EXPERTS_PER_RANK, WORLD_P2,
                                      ROUTE_T)
    for t0 in range(t_begin, t_end, BT):
        ts, ks, idx, live, valid, bad = load_topk_chunk(idx_ptr, t0, t_end, num_experts, TOPK, TOPK_P2, BT)
        pos, before = chunk_positions(idx, ts * TOPK + ks, before, BINS)
        owner = tl.where(valid, idx // EXPERTS_PER_RANK, -1)
        t = t0 + tl.arange(0, BT)
        if PUT:
            packed, reach, rows_before = packed_rows(owner, rows_before, BT, TOPK_P2, WORLD_P2)  # [BT, WORLD_P2]
        if col == 0:
            word = tl.where(owner[None, :] == peer[:, None], idx % EXPERTS_PER_RANK + pos * EXPERTS_PER_RANK, -1)
            if PUT:  # a put rank: the token's packed row, only tokens routed there, and the token index word
                at = tl.where(put_all[:, None], _by_slot(packed, BT, TOPK_P2, WORLD_P2), ts[None, :])
                sent = tl.where(put_all[:, None], _by_slot(reach, BT, TOPK_P2, WORLD_P2) != 0, True)
                tl.store(landing_all[:, None] + at.to(tl.int64) * ROW_WORDS + META + ks[None, :], word,
                         mask=peer_live[:, None] & live[None, :] & sent)
                tl.store(landing_all[None, :] + packed.to(tl.int64) * ROW_WORDS + TOKEN_WORD, t[:, None],
                         mask=(reach != 0) & (put_all & peer_live)[None, :] & (t < t_end)[:, None])
                tl.store(slot_key_ptr + ts * TOPK + ks, pos * BINS + idx, mask=valid)
            else:
                tl.store(landing_all[:, None] + ts[None, :].to(tl.int64) * ROW_WORDS + META + ks[None, :], word,
                         mask=peer_live[:, None] & live[None, :])

        # Destinations of token t: one per slot k, the slot's rank if it is live and no earlier slot of
        # the token has it (so a rank gets the row once); its address is that rank's row t (a put rank:
        # the token's packed row in the staging for it).
        to, write = token_destinations(owner, t < t_end, grp, failed, BT, TOPK_P2)
        put_to = put_peers(grp, to, write, WORLD, PUT)
        zone_base = dest(put_to, address(stage_ptr) + to.to(tl.int64) * M * ROW_BYTES,
                         tl.load(data_ptrs_ptr + to, mask=write, other=0) + first_row * ROW_BYTES, PUT)
        if PUT:
            row = tl.where(put_to, tl.sum(tl.where(to[:, :, None] == peer[None, None, :], packed[:, None, :], 0), axis=2),
                           t[:, None])
        else:
            row = t[:, None]
        dst = zone_base + row.to(tl.int64) * ROW_BYTES                                  # [BT, TOPK_P2] bytes
        read = tl.max(write.to(tl.int32), axis=1) > 0
        if FP8:  # column block `col` of the row: quantized in registers, stored to every destination
            COLS: tl.constexpr = FP8_GROUPS * 128
            xs = load_tile(x_ptr + t.to(tl.int64) * HIDDEN, read, col * COLS, HIDDEN, COLS, ALIGNED)
            q, scale = quantize_e4m3_groups(xs.to(tl.float32), BT, FP8_GROUPS, SCALE)
            store_tile(q, col * COLS, HIDDEN, dst, write, COLS, TOPK, TOPK_P2, ALIGNED)
            store_tile(scale, col * S_BLOCK, S_WORDS, dst + X_WORDS * 4, write, S_BLOCK, TOPK, TOPK_P2, ALIGNED)
        elif NVFP4:  # the same for NVFP4: value words, then scale words, of column block `col`
            NCOLS: tl.constexpr = NVFP4_GROUPS * 16
            xs = load_tile(x_ptr + t.to(tl.int64) * HIDDEN, read, col * NCOLS, HIDDEN, NCOLS, ALIGNED)
            store_nvfp4_tile(xs, col, tl.load(gscale_ptr), dst, dst + X_WORDS * 4, write, X_WORDS, S_WORDS,
                             NVFP4_GROUPS, TOPK, TOPK_P2, ALIGNED)
        else:
            copy_rows(as_words(x_ptr) + t.to(tl.int64) * X_WORDS, read, dst, write, X_WORDS, BW, TOPK, TOPK_P2,
                      ALIGNED)

    # 3. The last program publishes to every live rank, unless a program skipped its part because the
    #    group failed, and advances the send count.
    last, skipped = arrive(done_ptr + WORLD, NBLK * tl.num_programs(1), failed)
    if last:
        if skipped == 0:
            ctrl_off = (zone * WORLD + rank) * CTRL_WORDS
            flag = flag_value(tl.load(grp + S_EPOCH), call)
            ctrl_last = as_ptr(tl.load(ctrl_ptrs_ptr + peer, mask=peer_live, other=0), tl.int64)
            order_transports(grp, peer_live, WORLD, WORLD_P2, PUT)
            publish_many(ctrl_last + ctrl_off + CTRL_WORDS - 1, flag,
                         store_only(put_peers(grp, peer, peer < WORLD, WORLD, PUT), peer_live, PUT))
            if PUT:
                own_rows = as_ptr(tl.load(data_ptrs_ptr + rank), tl.int32) + first_row * ROW_WORDS
                own_ctrl = as_ptr(tl.load(ctrl_ptrs_ptr + rank), tl.int64) + ctrl_off
                for p in range(WORLD):
                    if is_live(grp, p) & put_peers(grp, p, True, WORLD, PUT):
                        rows = read_once(stage_ctrl_ptr + p * CTRL_WORDS, p < WORLD)   # staged for p by another program
                        flush(own_rows, stage_ptr + tl.cast(p, tl.int64) * M * ROW_WORDS, rows * ROW_BYTES,
                              own_ctrl, stage_ctrl_ptr + p * CTRL_WORDS, (CTRL_WORDS - 1) * 8,
                              own_ctrl + CTRL_WORDS - 1, flag, p)
        tl.store(seq_ptr, call)
    trace.send_end(trace_ptr, call, last, WORLD, WORLD_P2, TRACE_N, TRACE)


@triton.jit
def dispatch_recv_kernel(
    out_x_ptr,        # out int32 words [EXPERTS_PER_RANK * CAP, X_WORDS]: d.x
    out_scales_ptr,   # out int32 words [EXPERTS_PER_RANK * CAP, S_WORDS]: d.scales (FP8 only)
    out_src_ptr,      # out int32 [EXPERTS_PER_RANK * CAP]: source_rank * M + token per row
    out_counts_ptr,   # out int32 [EXPERTS_PER_RANK]: valid rows per local expert
    row_of_ptr,       # out int32 [WORLD * M, TOPK]: e * CAP + row of slot (s, t, k); -1 not here, -2 dropped
    src_tokens_ptr,   # out int32 [WORLD]: rows of every source in the landing zone: its tokens T (store), or
    #                   its tokens routed here (put source; the combine answers those by runs, not by row)
    runs_ptr,         # out int32 [WORLD, EXPERTS_PER_RANK + 1]: per source, its rows per local expert, then (PUT
    #                   only) its run base (control word), for the combine's runs
    stats_ptr,        # int64 [EXPERTS_PER_RANK]: rows received per local expert, accumulated over calls
    arrival_ptr,      # out int64 [WORLD]: arrival[s] = this call's flag once source s's rows are in d.x (below)
    data_ptr,         # int32 [2, WORLD * M, ROW_WORDS]: this rank's landing zone
    ctrl_ptr,         # int64 [2, WORLD, CTRL_WORDS]: this rank's control words
    seq_ptr,          # int64 [1]: the channel's receive count (advanced here)
    done_ptr,         # int32 [WORLD + 3]: arrival counters ([WORLD + 1]: this kernel's; [WORLD + 2]: its entry)
    grp, status_ptr, rank,
    trace_ptr,        # int64 [TRACE_N, record words]: the channel's flight recorder (TRACE only)
    wait_ptr,         # int64 [2, WORLD]: wait statistics per source (TRACE only, triton_kernels/trace.py)
    OP: tl.constexpr, WORLD: tl.constexpr, WORLD_P2: tl.constexpr, M: tl.constexpr, CAP: tl.constexpr,
    TOPK: tl.constexpr, TOPK_P2: tl.constexpr, EXPERTS_PER_RANK: tl.constexpr, EXPERTS_P2: tl.constexpr,
    X_WORDS: tl.constexpr, S_WORDS: tl.constexpr, S_WORDS_P2: tl.constexpr, ROW_WORDS: tl.constexpr,
    CTRL_WORDS: tl.constexpr, BS: tl.constexpr, BW: tl.constexpr, ALIGNED: tl.constexpr, PUT: tl.constexpr,
    TRACE: tl.constexpr, TRACE_N: tl.constexpr,
    NVFP4: tl.constexpr,  # every source's global scale (control word CTRL_WORDS - 2) is checked against this rank's
    COPY: tl.constexpr = True,   # False: the metadata only, no payload to d.x (moe_comm.MoELayer reads it in place)
):
    blk = tl.program_id(0)
    src = tl.program_id(1)   # the source this program unpacks
    call = tl.load(seq_ptr) + 1
    zone = call % 2
    ctrl = ctrl_ptr + zone * WORLD * CTRL_WORDS
    META: tl.constexpr = X_WORDS + S_WORDS
    target = flag_value(tl.load(grp + S_EPOCH), call)
    trace.recv_begin(trace_ptr, grp, call, OP, done_ptr, WORLD, TRACE_N, TRACE)

    # Source src's rows go after those of sources 0..src-1: their counts and src's rows are all this
    # program needs. An excluded or failed source counts as sending nothing (a failed wait fails the
    # group: the last program then zeroes the counts). Recorder: program (0, src) records source src.
    w = tl.arange(0, WORLD_P2)
    need = tl.where(w <= src, live_ranks(grp, WORLD, WORLD_P2), False)
    seen = trace.seen_ptr(trace_ptr, call, WORLD, TRACE_N)
    t_wait = trace.wait_begin(TRACE)
    if TRACE:
        arrived = wait_flags(ctrl + w * CTRL_WORDS + CTRL_WORDS - 1, target, need, w, grp, status_ptr, OP, rank,
                             WORLD, WORLD_P2, seen_ptr=seen, seen_mask=tl.where(blk == 0, w == src, False), PUT=PUT)
    else:
        arrived = wait_flags(ctrl + w * CTRL_WORDS + CTRL_WORDS - 1, target, need, w, grp, status_ptr, OP, rank,
                             WORLD, WORLD_P2, PUT=PUT)
    trace.add_waits(wait_ptr, seen, w, tl.where(blk == 0, w == src, False), need, t_wait, WORLD, TRACE)
    e = tl.arange(0, EXPERTS_P2)
    e_live = e < EXPERTS_PER_RANK
    # Control words of arrived sources were published before their flags: plain loads (block-uniform).
    counts = tl.load(ctrl + w[:, None] * CTRL_WORDS + 1 + e[None, :], mask=arrived[:, None] & e_live[None, :],
                     other=0)
    counts = tl.minimum(tl.maximum(counts, 0), M * TOPK).to(tl.int32)   # [WORLD_P2, EXPERTS_P2]
    tokens = tl.load(ctrl + w * CTRL_WORDS, mask=arrived, other=0)
    tokens = tl.minimum(tl.maximum(tokens, 0), M).to(tl.int32)          # [WORLD_P2]

    if (blk == 0) & (src == WORLD - 1):   # the program that waited for every source
        total = tl.sum(counts, axis=0)
        kept = tl.minimum(total, CAP)
        tl.store(out_counts_ptr + e, kept, mask=e_live)
        tl.store(stats_ptr + e, tl.load(stats_ptr + e, mask=e_live) + kept.to(tl.int64), mask=e_live)
        tl.store(src_tokens_ptr + w, tokens, mask=w < WORLD)
        trace.store_peer_words(trace.recv_rows_ptr(trace_ptr, call, WORLD, TRACE_N), w, tl.sum(counts, axis=1),
                               w < WORLD, TRACE)
        if tl.max(total) > CAP:
            record_error(grp, ERR_CAPACITY, OP, rank, tl.argmax(total, axis=0), tl.max(total), CAP)
        if NVFP4:
            check_scales(ctrl + w * CTRL_WORDS + CTRL_WORDS - 2, arrived, w, grp, OP, rank)

    # This source's base and count per local expert: rows of expert e from sources before src.
    base = tl.sum(tl.where((w < src)[:, None], counts, 0), axis=0)      # [EXPERTS_P2]
    count = tl.sum(tl.where((w == src)[:, None], counts, 0), axis=0)
    n_tokens = tl.sum(tl.where(w == src, tokens, 0))   # rows of this source in the landing zone
    packed = put_peers(grp, src, True, WORLD, PUT)      # a put source: row j holds the token in its token word
    if blk == 0:   # this source's rows per local expert (the arrival words' row counts; the combine's runs)
        tl.store(runs_ptr + src * (EXPERTS_PER_RANK + 1) + e, count, mask=e_live)
        if PUT:
            run_base = tl.load(ctrl + src * CTRL_WORDS + 1 + EXPERTS_PER_RANK)
            tl.store(runs_ptr + src * (EXPERTS_PER_RANK + 1) + EXPERTS_PER_RANK,
                     tl.minimum(tl.maximum(run_base, 0), M * TOPK).to(tl.int32))
    # Slots j = (token t, k) of this source, k padded to TOPK_P2: one flat axis, so that every tile below
    # is 2-D. Every slot's row_of is written (-1 past the source's tokens), the payload only where routed.
    landing = data_ptr + (zone * WORLD + src).to(tl.int64) * M * ROW_WORDS
    for j0 in range(blk * BS, M * TOPK_P2, tl.num_programs(0) * BS):
        j = j0 + tl.arange(0, BS)
        t = j // TOPK_P2
        k = j % TOPK_P2
        slot_live = (t < M) & (k < TOPK)
        src_row = landing + t.to(tl.int64) * ROW_WORDS
        q = src * M + t
        if PUT:   # a put source's row t holds token tok (clamped: no value steers a store out of bounds);
            #       only its received rows' slots are written (the combine answers a put source by runs)
            # (tl.where, not ``& packed``: Triton's interpreter broadcasts a scalar comparison as integers,
            # and from 3.9 on refuses a mask that is not boolean)
            tok = tl.load(src_row + META + TOPK, mask=tl.where(packed, slot_live & (t < n_tokens), False), other=0)
            q = tl.where(packed, src * M + tl.minimum(tl.maximum(tok, 0), M - 1), q)
            slot_live = tl.where(packed, slot_live & (t < n_tokens), slot_live)
        word = tl.load(src_row + META + k, mask=slot_live & (t < n_tokens), other=-1)
        here = word >= 0
        expert = tl.where(here, word % EXPERTS_PER_RANK, 0)
        pos = tl.where(here, word // EXPERTS_PER_RANK, 0)
        pick = expert[:, None] == e[None, :]                                        # [BS, EXPERTS_P2]
        row = tl.sum(tl.where(pick, base[None, :], 0), axis=1) + pos
        ok = here & (pos < tl.sum(tl.where(pick, count[None, :], 0), axis=1)) & (row < CAP)
        dst = expert.to(tl.int64) * CAP + row                                      # row of d.x as [L*CAP]
        code = tl.where(ok, dst, tl.where(here, -2, -1)).to(tl.int32)
        tl.store(row_of_ptr + q * TOPK + k, code, mask=slot_live)
        tl.store(out_src_ptr + dst, q, mask=ok)                                    # q = src * M + t
        # A row routed to several local experts is read once per slot; the reads of one tile hit the
        # same lines, so the copy costs one read of the row.
        if COPY:
            to = address(out_x_ptr + dst * X_WORDS)[:, None]
            copy_rows(src_row, ok, to, ok[:, None], X_WORDS, BW, 1, 1, ALIGNED)
        if COPY & (S_WORDS > 0):
            copy_rows(src_row + X_WORDS, ok, address(out_scales_ptr + dst * S_WORDS)[:, None], ok[:, None],
                      S_WORDS, S_WORDS_P2, 1, 1, ALIGNED & (S_WORDS % 4 == 0))

    # Arrival words (a consumer's own GEMM waits on them, docs/moe-layer.md): the last program of source
    # src publishes the call's flag once every program of src has copied its share of src's rows, for
    # every local expert at once; nothing for a source whose wait failed. Counters: the channel's
    # per-destination words (done[src]), which the dispatch send does not use.
    # (Every program of src counts itself in, a failed one as skipped, so the counter is 0 again after.)
    src_done = tl.max(tl.where(w == src, arrived | (live_ranks(grp, WORLD, WORLD_P2) == 0), False).to(tl.int32))
    last_of_src, src_skipped = arrive(done_ptr + src, tl.num_programs(0), src_done == 0)
    if last_of_src & (src_skipped == 0):
        publish(arrival_ptr + src, target)
    # The last program advances the receive count; if the group failed, no result is partial.
    last, _ = arrive(done_ptr + WORLD + 1, tl.num_programs(0) * tl.num_programs(1), 0)
    if last:
        tl.store(seq_ptr, call)
        if check_failed(grp, status_ptr, WORLD, WORLD_P2):  # the error is in this rank's word: raised
            tl.store(out_counts_ptr + e, 0, mask=e_live)
    trace.recv_end(trace_ptr, grp, call, last, done_ptr, WORLD, WORLD_P2, TRACE_N, TRACE)
