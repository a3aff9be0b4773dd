"""AllToAllvDynamic device code: send phase and receive phase, forward and reverse.

Send (grid = world destinations x blocks_per_peer): rows for destination j are stored straight into j's
symmetric landing zone ``data[zone, rank]``; the last program for j writes the row count into
``ctrl[zone, rank, 0]`` on j and publishes ``ctrl[zone, rank, 1] = call`` with a release. The last
program of the grid advances the call counter ``seq``.

Receive (grid = world sources x blocks_per_peer): wait for ``ctrl[zone, i, 1] >= call`` (bounded), then
copy the rows of source i out of the landing zone into the output.

World 1 (``a2a_local_kernel``): one kernel copies the rows straight from the input to the output.

Forward rows come from ``send`` at prefix-sum offsets of the device counts (computed here, clamped to
the capacity and to N, the clamped values kept for the reverse); reverse rows come from
``rows[i, :recv_counts[i]]`` and land at the offsets the forward kept. No count ever leaves the device.
"""

import triton
import triton.language as tl

from .sync import ERR_CAPACITY, arrive, as_ptr, record_error, signal, wait_flag


@triton.jit
def _copy_rows(src, dst, n_rows, first_block, ROW_WORDS: tl.constexpr, BLOCK_R: tl.constexpr,
               BLOCK_C: tl.constexpr, NBLK: tl.constexpr):
    """dst[r, :] = src[r, :] for r < n_rows, rows first_block*BLOCK_R + k*NBLK*BLOCK_R + [0, BLOCK_R)."""
    r = tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_C)
    for r0 in range(first_block * BLOCK_R, n_rows, NBLK * BLOCK_R):
        rows = r0 + r
        row_ok = rows < n_rows
        for c0 in range(0, ROW_WORDS, BLOCK_C):
            cols = c0 + c
            m = row_ok[:, None] & (cols < ROW_WORDS)[None, :]
            offs = rows.to(tl.int64)[:, None] * ROW_WORDS + cols[None, :]
            tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)


@triton.jit
def forward_split(counts_ptr, kept_counts_ptr, kept_offsets_ptr, peer, keep, n_rows, err_addr, rank, max_rows,
                  OP: tl.constexpr, WORLD: tl.constexpr, WORLD_P2: tl.constexpr):
    """(count, first row) of ``peer``'s rows in ``send``: the device counts clamped to the capacity and
    to N, at their prefix-sum offsets. With ``keep`` (one program per peer) stores them for the reverse
    and records a count that had to be clamped (CapacityError)."""
    w = tl.arange(0, WORLD_P2)
    raw = tl.load(counts_ptr + w, mask=w < WORLD, other=0).to(tl.int64)
    cap = tl.minimum(tl.maximum(raw, 0), max_rows)
    offs = tl.cumsum(cap, 0) - cap
    cnt = tl.minimum(cap, tl.maximum(n_rows - offs, 0))  # rows past N do not exist: never read them
    my_raw = tl.sum(tl.where(w == peer, raw, 0))
    my_cnt = tl.sum(tl.where(w == peer, cnt, 0))
    my_off = tl.sum(tl.where(w == peer, offs, 0))
    if keep:
        tl.store(kept_counts_ptr + peer, my_cnt.to(tl.int32))
        tl.store(kept_offsets_ptr + peer, my_off)
        if (my_raw < 0) | (my_raw > max_rows):
            record_error(err_addr, ERR_CAPACITY, OP, rank, peer, my_raw, max_rows)
        elif my_cnt < my_raw:
            record_error(err_addr, ERR_CAPACITY, OP, rank, peer, my_off + my_raw, n_rows)
    return my_cnt, my_off


@triton.jit
def a2a_send_kernel(
    src_ptr,           # words: forward [N, ROW_WORDS]; reverse [WORLD, max_rows, ROW_WORDS]
    counts_ptr,        # forward: send_counts [WORLD] int32/int64 as given; reverse: rows per peer [WORLD] int32
    kept_counts_ptr,   # forward out: int32 [WORLD], counts after clamping (the reverse's expectations)
    kept_offsets_ptr,  # forward out: int64 [WORLD], row in src where peer j's rows start
    n_rows,            # forward: N (rows in src); reverse: unused
    data_ptrs_ptr,     # int64 [WORLD]: base of every rank's landing zone [2, WORLD, max_rows, ROW_WORDS]
    ctrl_ptrs_ptr,     # int64 [WORLD]: base of every rank's control words [2, WORLD, 2]
    seq_ptr,           # int64 [1]: calls completed so far on this channel (advanced here)
    done_ptr,          # int32 [WORLD + 1]: arrival counters, zero between launches
    err_addr, rank, max_rows,
    OP: tl.constexpr, FORWARD: tl.constexpr, WORLD: tl.constexpr, WORLD_P2: tl.constexpr,
    ROW_WORDS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, NBLK: tl.constexpr,
):
    peer = tl.program_id(0)
    blk = tl.program_id(1)
    call = tl.load(seq_ptr) + 1
    zone = call % 2
    if FORWARD:
        my_cnt, my_off = forward_split(counts_ptr, kept_counts_ptr, kept_offsets_ptr, peer, blk == 0, n_rows,
                                       err_addr, rank, max_rows, OP, WORLD, WORLD_P2)
    else:
        my_cnt = tl.minimum(tl.maximum(tl.load(counts_ptr + peer).to(tl.int64), 0), max_rows)
        my_off = peer.to(tl.int64) * max_rows
    elem = src_ptr.dtype.element_ty
    dst = as_ptr(tl.load(data_ptrs_ptr + peer), elem) + (zone * WORLD + rank).to(tl.int64) * max_rows * ROW_WORDS
    _copy_rows(src_ptr + my_off * ROW_WORDS, dst, my_cnt, blk, ROW_WORDS, BLOCK_R, BLOCK_C, NBLK)
    if arrive(done_ptr + peer, NBLK):
        ctrl = as_ptr(tl.load(ctrl_ptrs_ptr + peer), tl.int64) + (zone * WORLD + rank) * 2
        tl.store(ctrl, my_cnt)
        signal(ctrl + 1, call)
    if arrive(done_ptr + WORLD, WORLD * NBLK):
        tl.store(seq_ptr, call)


@triton.jit
def a2a_recv_kernel(
    dst_ptr,           # words: forward [WORLD, max_rows, ROW_WORDS]; reverse [N, ROW_WORDS]
    recv_counts_ptr,   # forward out: int32 [WORLD]
    kept_counts_ptr,   # reverse: int32 [WORLD] rows expected back from each peer (the forward's clamped counts)
    kept_offsets_ptr,  # reverse: int64 [WORLD] row of dst where they go
    data_ptr,          # words [2, WORLD, max_rows, ROW_WORDS]: this rank's landing zone
    ctrl_ptr,          # int64 [2, WORLD, 2]: this rank's control words
    seq_ptr,           # int64 [1]: already advanced by this call's send phase
    err_addr, timeout_ns, rank, max_rows,
    OP: tl.constexpr, FORWARD: tl.constexpr, WORLD: tl.constexpr,
    ROW_WORDS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, NBLK: tl.constexpr,
):
    src = tl.program_id(0)
    blk = tl.program_id(1)
    call = tl.load(seq_ptr)
    zone = call % 2
    ctrl = ctrl_ptr + (zone * WORLD + src) * 2
    arrived = wait_flag(ctrl + 1, call, timeout_ns, err_addr, OP, rank, src)
    if FORWARD:
        # Clamp again: the count came from another process and must not steer a store out of bounds.
        cnt = tl.minimum(tl.maximum(tl.load(ctrl, volatile=True), 0), max_rows)
        off = src.to(tl.int64) * max_rows
    else:
        cnt = tl.minimum(tl.maximum(tl.load(kept_counts_ptr + src).to(tl.int64), 0), max_rows)
        off = tl.load(kept_offsets_ptr + src)
    cnt = tl.where(arrived, cnt, 0)
    if FORWARD:
        if blk == 0:
            tl.store(recv_counts_ptr + src, cnt.to(tl.int32))
    landing = data_ptr + (zone * WORLD + src).to(tl.int64) * max_rows * ROW_WORDS
    _copy_rows(landing, dst_ptr + off * ROW_WORDS, cnt, blk, ROW_WORDS, BLOCK_R, BLOCK_C, NBLK)


@triton.jit
def a2a_local_kernel(
    src_ptr,           # words: forward [N, ROW_WORDS]; reverse [1, max_rows, ROW_WORDS]
    counts_ptr,        # forward: send_counts [1] as given; reverse: the forward's kept count [1] int32
    kept_counts_ptr,   # forward out: int32 [1], the count after clamping
    kept_offsets_ptr,  # forward out / reverse in: int64 [1], row of ``send`` where the rows start (0)
    recv_counts_ptr,   # forward out: int32 [1]
    dst_ptr,           # words: forward [1, max_rows, ROW_WORDS] (recv); reverse [N, ROW_WORDS]
    n_rows,            # N: rows of the forward's send (both directions)
    err_addr, rank, max_rows,
    OP: tl.constexpr, FORWARD: tl.constexpr,
    ROW_WORDS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, NBLK: tl.constexpr,
):
    """World 1 in one kernel: the rows go straight from the input to the output (no landing zone, no
    flag), with the counts clamped and kept exactly as the two-phase kernels do. Grid = (NBLK,)."""
    blk = tl.program_id(0)
    if FORWARD:
        cnt, off = forward_split(counts_ptr, kept_counts_ptr, kept_offsets_ptr, 0, blk == 0, n_rows, err_addr,
                                 rank, max_rows, OP, 1, 1)
        if blk == 0:
            tl.store(recv_counts_ptr, cnt.to(tl.int32))
        _copy_rows(src_ptr + off * ROW_WORDS, dst_ptr, cnt, blk, ROW_WORDS, BLOCK_R, BLOCK_C, NBLK)
    else:
        off = tl.minimum(tl.maximum(tl.load(kept_offsets_ptr), 0), n_rows)
        cnt = tl.minimum(tl.minimum(tl.maximum(tl.load(counts_ptr).to(tl.int64), 0), max_rows), n_rows - off)
        _copy_rows(src_ptr, dst_ptr + off * ROW_WORDS, cnt, blk, ROW_WORDS, BLOCK_R, BLOCK_C, NBLK)
