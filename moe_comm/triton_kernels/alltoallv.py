"""AllToAllvDynamic device code: send phase and receive phase, forward and reverse.

Send (grid = world destinations x blocks_per_peer): rows for destination j are stored straight into j's
symmetric landing zone ``data[zone, rank]``; the last program for j writes the row count into
``ctrl[zone, rank, 0]`` on j and publishes the flag of the call into ``ctrl[zone, rank, 1]`` (CTA barrier,
then release; ``sync.py``). The last program of the grid advances the channel's send count. An
excluded destination gets nothing; a failed group sends nothing.

Receive (grid = world sources x blocks_per_peer): wait (bounded) for the flag of the call from source i,
then copy its rows out of the landing zone into the output; the receive counts its own calls. If a
wait failed, no result is partial: the last program zeroes every receive count.

Put transport (``transport.py``; peers whose ``transports`` entry is TRANSPORT_PUT, only when compiled with
PUT): the rows for j go to this rank's staging for j; the last program for j puts them in one
``putmem_nbi``, then the row count in a ``putmem_signal_nbi`` whose signal is the flag; nothing waits for
them (the staging has two zones, ``call % 2``, reused by causality: ``transport.py``). When the live
ranks are reached by both transports, the last program for j fences at system scope before its flag,
whichever transport carries it (``transport.order_transports``, as the EP send kernels do).

World 1 (``a2a_local_kernel``): one kernel copies the rows straight from the input to the output.

Forward rows come from ``send`` at prefix-sum offsets of the device counts as given (what is sent is
clamped to the capacity and to N, the clamped values kept for the reverse); reverse rows come from
``rows[i, :recv_counts[i]]`` and land at the offsets the forward kept. No count ever leaves the device.
"""

import triton
import triton.language as tl

from . import trace
from .copy import address, copy_rows
from .sync import (ERR_CAPACITY, S_EPOCH, arrive, as_ptr, check_failed, flag_value, group_failed, is_live,
                   live_ranks, record_error, wait_flags)
from .transport import deliver, dest, order_transports, put_peers, stage_zone


@triton.jit
def copy_row_range(src, dst, n_rows, first_block, ROW_WORDS: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_C: tl.constexpr, NBLK: tl.constexpr, ALIGNED: tl.constexpr):
    """dst[r, :] = src[r, :] for r < n_rows, rows first_block*BLOCK_R + k*NBLK*BLOCK_R + [0, BLOCK_R)."""
    r = tl.arange(0, BLOCK_R)
    for r0 in range(first_block * BLOCK_R, n_rows, NBLK * BLOCK_R):
        rows = (r0 + r).to(tl.int64)
        row_ok = rows < n_rows
        copy_rows(src + rows * ROW_WORDS, row_ok, address(dst + rows * ROW_WORDS)[:, None], row_ok[:, None],
                  ROW_WORDS, BLOCK_C, 1, 1, ALIGNED)


@triton.jit
def forward_split(counts_ptr, kept_counts_ptr, kept_offsets_ptr, dropped_ptr, peer, keep, n_rows, grp, rank,
                  max_rows, OP: tl.constexpr, WORLD: tl.constexpr, WORLD_P2: tl.constexpr):
    """(count, first row) of ``peer``'s rows in ``send``.

    Rows are grouped by destination at the prefix-sum offsets of the counts *as given* (negative ones
    taken as 0), so one destination's excess never shifts another's rows. What is sent is clamped to
    the capacity, to the rows that exist (N), and to 0 for an excluded peer. With ``keep`` (one
    program per peer) stores the count and offset for the reverse, adds rows addressed to an excluded
    peer to ``dropped``, and records a count that had to be clamped (CapacityError; of several, the
    lowest destination's)."""
    w = tl.arange(0, WORLD_P2)
    raw = tl.load(counts_ptr + w, mask=w < WORLD, other=0).to(tl.int64)
    given = tl.maximum(raw, 0)
    offs = tl.cumsum(given, 0) - given
    cnt = tl.minimum(tl.minimum(given, max_rows), tl.maximum(n_rows - offs, 0))  # rows past N do not exist
    my_raw = tl.sum(tl.where(w == peer, raw, 0))
    my_cnt = tl.sum(tl.where(w == peer, cnt, 0))
    my_off = tl.sum(tl.where(w == peer, offs, 0))
    live = is_live(grp, peer)
    if keep:
        tl.store(kept_counts_ptr + peer, tl.where(live, my_cnt, 0).to(tl.int32))
        tl.store(kept_offsets_ptr + peer, my_off)
        if live == 0:
            tl.atomic_add(dropped_ptr, my_cnt, sem="relaxed")
        # Only the lowest destination with a bad count is recorded, by its own program: the error a
        # call reports does not depend on which program runs first.
        over = (raw < 0) | (raw > max_rows)
        past = (offs + raw > n_rows) & (w < WORLD)
        if peer == tl.min(tl.where(over | past, w, WORLD_P2)):
            if (my_raw < 0) | (my_raw > max_rows):
                record_error(grp, ERR_CAPACITY, OP, rank, peer, my_raw, max_rows)
            else:
                record_error(grp, ERR_CAPACITY, OP, rank, peer, my_raw, tl.maximum(n_rows - my_off, 0))
    return tl.where(live, my_cnt, 0), my_off


@triton.jit
def a2a_send_kernel(
    src_ptr,           # words: forward [N, ROW_WORDS]; reverse [WORLD, max_rows, ROW_WORDS]
    counts_ptr,        # forward: send_counts [WORLD] int32/int64 as given; reverse: rows per peer [WORLD] int32
    kept_counts_ptr,   # forward out: int32 [WORLD], counts after clamping (the reverse's expectations)
    kept_offsets_ptr,  # forward out: int64 [WORLD], row in src where peer j's rows start
    dropped_ptr,       # forward: int64 [1], rows addressed to excluded ranks (accumulated)
    n_rows,            # forward: N (rows in src); reverse: unused
    data_ptrs_ptr,     # int64 [WORLD]: base of every rank's landing zone [2, WORLD, max_rows, ROW_WORDS]
    ctrl_ptrs_ptr,     # int64 [WORLD]: base of every rank's control words [2, WORLD, 2] = (rows, flag)
    stage_ptr,         # put transport: this rank's staging, words [2, WORLD dest, max_rows, ROW_WORDS] (symmetric)
    stage_ctrl_ptr,    # put transport: int64 [2, WORLD dest, 2] staged control words, per zone (symmetric)
    seq_ptr,           # int64 [1]: the channel's send count (advanced here)
    done_ptr,          # int32 [WORLD + 3]: arrival counters, zero between launches
    grp, status_ptr,   # group state and this rank's status buffer (moe_comm/protocol.py)
    rank, max_rows,
    trace_ptr,         # int64 [TRACE_N, record words]: the channel's flight recorder (TRACE only)
    OP: tl.constexpr, FORWARD: tl.constexpr, WORLD: tl.constexpr, WORLD_P2: tl.constexpr,
    ROW_WORDS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, NBLK: tl.constexpr,
    ALIGNED: tl.constexpr, PUT: tl.constexpr, TRACE: tl.constexpr, TRACE_N: tl.constexpr,
):
    peer = tl.program_id(0)
    blk = tl.program_id(1)
    call = tl.load(seq_ptr) + 1
    trace.send_begin(trace_ptr, grp, call, OP, (peer == 0) & (blk == 0), WORLD, TRACE_N, TRACE)
    zone = call % 2
    failed = group_failed(grp, status_ptr, WORLD, WORLD_P2)  # a failed group sends nothing
    if FORWARD:
        my_cnt, my_off = forward_split(counts_ptr, kept_counts_ptr, kept_offsets_ptr, dropped_ptr, peer, blk == 0,
                                       n_rows, grp, rank, max_rows, OP, WORLD, WORLD_P2)
    else:
        my_cnt = tl.minimum(tl.maximum(tl.load(counts_ptr + peer).to(tl.int64), 0), max_rows)
        my_off = peer.to(tl.int64) * max_rows
    live = is_live(grp, peer)
    trace.store_peer_words(trace.sent_rows_ptr(trace_ptr, call, WORLD, TRACE_N), peer, my_cnt, blk == 0, TRACE)
    # Store transport: straight into the peer's landing zone; put transport: into this rank's staging for
    # the peer, the same rows, put by the last program (transport.py).
    put = put_peers(grp, peer, True, WORLD, PUT)
    elem = src_ptr.dtype.element_ty
    region = (zone * WORLD + rank).to(tl.int64) * max_rows * ROW_WORDS  # this source's rows on the peer
    stage = (stage_zone(stage_ptr, zone, tl.cast(max_rows, tl.int64) * WORLD * ROW_WORDS)
             + peer.to(tl.int64) * max_rows * ROW_WORDS)
    stage_ctrl_ptr = stage_zone(stage_ctrl_ptr, zone, WORLD * 2)   # STAGE_ZONE (transport.py)
    if live & (failed == 0):
        dst = dest(put, stage, as_ptr(tl.load(data_ptrs_ptr + peer), elem) + region, PUT)
        copy_row_range(src_ptr + my_off * ROW_WORDS, dst, my_cnt, blk, ROW_WORDS, BLOCK_R, BLOCK_C, NBLK, ALIGNED)
    last, skipped = arrive(done_ptr + peer, NBLK, failed)
    if last & live & (skipped == 0):
        ctrl_off = (zone * WORLD + rank) * 2
        ctrl = dest(put, stage_ctrl_ptr + peer * 2, as_ptr(tl.load(ctrl_ptrs_ptr + peer), tl.int64) + ctrl_off, PUT)
        tl.store(ctrl, my_cnt)
        own_ctrl = as_ptr(tl.load(ctrl_ptrs_ptr + rank), tl.int64) + ctrl_off  # local symmetric addresses
        row_bytes = ROW_WORDS * (elem.primitive_bitwidth // 8)
        if PUT:  # a launch reaching live peers by both transports: a system-scope fence before the flag
            order_transports(grp, live_ranks(grp, WORLD, WORLD_P2), WORLD, WORLD_P2, PUT)
        deliver(ctrl + 1, flag_value(tl.load(grp + S_EPOCH), call), put,
                as_ptr(tl.load(data_ptrs_ptr + rank), elem) + region, stage, my_cnt * row_bytes,
                own_ctrl, ctrl, 8, own_ctrl + 1, peer, PUT)
    # The last program of the grid advances the send count (nothing waits for the puts: the staging has
    # two zones, reused by causality, transport.py).
    last_all, _ = arrive(done_ptr + WORLD, WORLD * NBLK, 0)
    if last_all:
        tl.store(seq_ptr, call)
    trace.send_end(trace_ptr, call, last_all, WORLD, WORLD_P2, TRACE_N, TRACE)


@triton.jit
def a2a_recv_kernel(
    dst_ptr,           # words: forward [WORLD, max_rows, ROW_WORDS]; reverse [N, ROW_WORDS]
    recv_counts_ptr,   # forward out: int32 [WORLD]
    kept_counts_ptr,   # reverse: int32 [WORLD] rows expected back from each peer (the forward's clamped counts)
    kept_offsets_ptr,  # reverse: int64 [WORLD] row of dst where they go
    data_ptr,          # words [2, WORLD, max_rows, ROW_WORDS]: this rank's landing zone
    ctrl_ptr,          # int64 [2, WORLD, 2]: this rank's control words
    seq_ptr,           # int64 [1]: the channel's receive count (advanced here)
    done_ptr,          # int32 [WORLD + 3]: arrival counters ([WORLD + 1]: this kernel's; [WORLD + 2]: its entry)
    grp, status_ptr, rank, max_rows,
    trace_ptr,         # int64 [TRACE_N, record words]: the channel's flight recorder (TRACE only)
    wait_ptr,          # int64 [2, WORLD]: wait statistics per source (TRACE only, triton_kernels/trace.py)
    OP: tl.constexpr, FORWARD: tl.constexpr, WORLD: tl.constexpr, WORLD_P2: tl.constexpr,
    ROW_WORDS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, NBLK: tl.constexpr,
    ALIGNED: tl.constexpr, TRACE: tl.constexpr, TRACE_N: tl.constexpr, PUT: tl.constexpr = False,
):
    src = tl.program_id(0)
    blk = tl.program_id(1)
    call = tl.load(seq_ptr) + 1
    zone = call % 2
    ctrl = ctrl_ptr + (zone * WORLD + src) * 2
    trace.recv_begin(trace_ptr, grp, call, OP, done_ptr, WORLD, TRACE_N, TRACE)
    seen = trace.seen_ptr(trace_ptr, call, WORLD, TRACE_N)
    t_wait = trace.wait_begin(TRACE)
    live = is_live(grp, src)
    arrived = live
    if arrived:  # an excluded source sends nothing and is not waited for
        # Every source's flag is a lane (a timeout names the lowest missing source, whichever program
        # times out first: sync.lowest_missing); this program waits for src's only.
        w = tl.arange(0, WORLD_P2)
        flags, target = ctrl_ptr + (zone * WORLD + w) * 2 + 1, flag_value(tl.load(grp + S_EPOCH), call)
        if TRACE:
            ok = wait_flags(flags, target, w == src, w, grp, status_ptr, OP, rank, WORLD, WORLD_P2,
                            seen_ptr=seen, seen_mask=tl.where(blk == 0, w == src, False), PUT=PUT)
        else:
            ok = wait_flags(flags, target, w == src, w, grp, status_ptr, OP, rank, WORLD, WORLD_P2, PUT=PUT)
        arrived = tl.max(tl.where(w == src, ok, False).to(tl.int32)) > 0
    trace.add_waits(wait_ptr, seen, src, blk == 0, live, t_wait, WORLD, TRACE)   # (SEEN of an excluded source: 0)
    if FORWARD:
        # Clamp again: the count came from another process and must not steer a store out of bounds.
        cnt = tl.minimum(tl.maximum(tl.load(ctrl), 0), max_rows)   # published before the flag: a plain load
        off = src.to(tl.int64) * max_rows
    else:
        cnt = tl.minimum(tl.maximum(tl.load(kept_counts_ptr + src).to(tl.int64), 0), max_rows)
        off = tl.load(kept_offsets_ptr + src)
    cnt = tl.where(arrived, cnt, 0)
    trace.store_peer_words(trace.recv_rows_ptr(trace_ptr, call, WORLD, TRACE_N), src, cnt, blk == 0, TRACE)
    if FORWARD:
        if blk == 0:
            tl.store(recv_counts_ptr + src, cnt.to(tl.int32))
    landing = data_ptr + (zone * WORLD + src).to(tl.int64) * max_rows * ROW_WORDS
    copy_row_range(landing, dst_ptr + off * ROW_WORDS, cnt, blk, ROW_WORDS, BLOCK_R, BLOCK_C, NBLK, ALIGNED)
    last, _ = arrive(done_ptr + WORLD + 1, WORLD * NBLK, 0)
    if last:
        tl.store(seq_ptr, call)
        if FORWARD:
            # No partial result: every count is 0, and the error is adopted into this rank's word (raised).
            if check_failed(grp, status_ptr, WORLD, WORLD_P2):
                w = tl.arange(0, WORLD_P2)
                tl.store(recv_counts_ptr + w, 0, mask=w < WORLD)
    trace.recv_end(trace_ptr, grp, call, last, done_ptr, WORLD, WORLD_P2, TRACE_N, TRACE)


@triton.jit
def a2a_local_kernel(
    src_ptr,           # words: forward [N, ROW_WORDS]; reverse [1, max_rows, ROW_WORDS]
    counts_ptr,        # forward: send_counts [1] as given; reverse: the forward's kept count [1] int32
    kept_counts_ptr,   # forward out: int32 [1], the count after clamping
    kept_offsets_ptr,  # forward out / reverse in: int64 [1], row of ``send`` where the rows start (0)
    recv_counts_ptr,   # forward out: int32 [1]
    dst_ptr,           # words: forward [1, max_rows, ROW_WORDS] (recv); reverse [N, ROW_WORDS]
    dropped_ptr,       # int64 [1]: unused at world 1 (no rank can be excluded)
    n_rows,            # N: rows of the forward's send (both directions)
    grp, rank, max_rows,
    OP: tl.constexpr, FORWARD: tl.constexpr,
    ROW_WORDS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, NBLK: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    """World 1 in one kernel: the rows go straight from the input to the output (no landing zone, no
    flag), with the counts clamped and kept exactly as the two-phase kernels do. Grid = (NBLK,)."""
    blk = tl.program_id(0)
    if FORWARD:
        cnt, off = forward_split(counts_ptr, kept_counts_ptr, kept_offsets_ptr, dropped_ptr, 0, blk == 0, n_rows,
                                 grp, rank, max_rows, OP, 1, 1)
        if blk == 0:
            tl.store(recv_counts_ptr, cnt.to(tl.int32))
        copy_row_range(src_ptr + off * ROW_WORDS, dst_ptr, cnt, blk, ROW_WORDS, BLOCK_R, BLOCK_C, NBLK, ALIGNED)
    else:
        off = tl.minimum(tl.maximum(tl.load(kept_offsets_ptr), 0), n_rows)
        cnt = tl.minimum(tl.minimum(tl.maximum(tl.load(counts_ptr).to(tl.int64), 0), max_rows), n_rows - off)
        copy_row_range(src_ptr, dst_ptr + off * ROW_WORDS, cnt, blk, ROW_WORDS, BLOCK_R, BLOCK_C, NBLK, ALIGNED)
