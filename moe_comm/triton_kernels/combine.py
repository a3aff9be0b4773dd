"""EP combine device code: send phase (expert outputs back to their tokens) and receive phase (reduce).

Landing zone on every rank (symmetric int32 words): ``data[zone, t, k, :]`` = the expert output row of
this rank's slot (t, k). Each slot has exactly one writer (the rank owning expert topk_idx[t, k]), so
there is nothing to order between senders. Control words ``ctrl[zone, source, 1]`` = flag. Zone = call % 2.

Send (grid = NBLK programs over the rows (s, t) of every token rank s): slot (s, t, k) routed here was
received into row ``row_of[s, t, k]`` of the dispatch output (kept by the dispatch); store
``expert_out`` of that row into s's landing zone at (t, k). A slot the dispatch dropped for capacity
(code -2) sends zeros. This rank's own slots (s = rank) are skipped: the receive reads them straight
from ``expert_out``, so at world 1 nothing is copied twice. The last program to finish publishes every
live rank's flag (unless the group failed) and advances the send count.

Receive (grid = NBLK token blocks x HIDDEN / BH column blocks): a program waits (bounded) only for the
ranks whose rows it reads, the owners of its tokens' remote slots (``routed`` holds 1 + the owner), all
polled at once (``sync.wait_flags``); program (0, 0) waits for every live rank. At world 1 there is no
flag: every slot is read in place, and no send kernel runs. If the call failed, the last program to
finish makes every row NaN (the error is raised); else
``y[t] = sum over k = 0..TOPK-1 with slot (t, k) routed of w[t, k] * row(t, k)`` in float32, k in
ascending order, cast to the output dtype; row(t, k) is ``expert_out[row_of[rank, t, k]]`` when this
rank holds the expert (zeros if dropped), else ``landing[t, k]``. The sum sees each slot's row bit for
bit as the expert wrote it and always in the same order, so y is bitwise reproducible across runs and
world sizes.

Put transport (``transport.py``; peers whose ``transports`` entry is TRANSPORT_PUT, only when compiled with
PUT): with puts a landing zone has a second half of M*K rows (``EPPlan.combine_zone_slots``), where
token rank s's slots sorted by (expert id, position), i.e. by (expert, token, k), are in order. The
slots of s on this rank's experts are one contiguous run there: it starts at s's run base (s's slots
on lower ranks' experts, a dispatch control word) and holds, per local expert e, the rows the dispatch
received from s for e, in d.x order. The send stages that run (``_stage_run``: every program a share,
rows read straight from expert_out, zeros for a row the dispatch dropped) and the last program puts it
in one ``putmem_signal_nbi`` whose signal is the flag, to every put rank (no quiet: the staging has two
zones, ``call % 2``, reused by causality, ``transport.py``). The
receive finds slot (t, k) from a put rank at M*K + id_base[id] + position (both kept by this rank's
dispatch: ``slot_key``, ``id_base``); its own slots by the owner word of ``routed``. Bytes: each routed
slot's row once, the floor, since the weights are applied here in a fixed k order.

FP8 (``combine_format="e4m3"``, ``formats.py``): a landing row is an fp8 row (``formats.fp8_row_words``: the
e4m3 bytes, then one float32 scale per 128 columns), quantized by the send as it copies (``copy_rows(...,
FP8=True)``, the one copy loop with ``quant.py``'s one quantizer); the receive dequantizes it in float32.
It quantizes this rank's own rows, which it reads in place, the same way in registers, so every slot's
row enters the sum as ``reference.fp8_round_trip`` of the expert's row whoever holds the expert: y is
still bitwise reproducible across runs and world sizes (``reference.combine(..., fp8=True)``).
"""

import triton
import triton.language as tl

from .copy import address, as_words, copy_rows, load_tile, store_tile
from .quant import cast_rne, dequantize_e4m3_groups, quantize_e4m3_groups
from .transport import flush, order_transports, put_peers, stage_zone, store_only
from . import trace
from .ready import wait_ready
from .sync import (S_EPOCH, arrive, as_ptr, check_failed, flag_value, group_failed, is_live, live_ranks,
                   publish_many, wait_flags)


@triton.jit
def fill_nan(out_ptr, num_tokens, HIDDEN: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, ALIGNED: tl.constexpr):
    """Every row of ``out`` [num_tokens, HIDDEN] NaN: what a failed combine leaves (no partial sum)."""
    nan = cast_rne(tl.full([BT, BH], float("nan"), tl.float32), out_ptr.dtype.element_ty)
    for t0 in range(0, num_tokens, BT):
        t = t0 + tl.arange(0, BT)
        for c in range(0, HIDDEN, BH):
            store_tile(nan, c, HIDDEN, address(out_ptr + t.to(tl.int64) * HIDDEN)[:, None],
                       (t < num_tokens)[:, None], BH, 1, 1, ALIGNED)


@triton.jit
def _slots(i, tokens, w, WORLD: tl.constexpr, M: tl.constexpr, TOPK: tl.constexpr, TOPK_P2: tl.constexpr):
    """Slots i = (row q, k), q = (token rank s, token t) = s * M + t, as the dispatch's row_of is laid
    out: (q, k, s, t, whether slot i is one of rank s's tokens' top-k slots). ``tokens``: int [WORLD_P2]
    tokens of every rank (0 for a rank that sends nothing)."""
    q = i // TOPK_P2
    k = i % TOPK_P2
    s = tl.minimum(q // M, WORLD - 1)
    t = q % M
    n_tokens = tl.sum(tl.where(s[:, None] == w[None, :], tokens[None, :], 0), axis=1)
    return q, k, s, t, (q < WORLD * M) & (k < TOPK) & (t < n_tokens)


@triton.jit
def _returned_rows(row_of_ptr, tokens, WORLD: tl.constexpr, WORLD_P2: tl.constexpr, M: tl.constexpr,
                   TOPK: tl.constexpr, TOPK_P2: tl.constexpr, BS: tl.constexpr):
    """Flight recorder, one program: int64 [WORLD_P2] rows this rank's experts return to each rank's
    tokens (dropped slots' zeros included; its own tokens' rows, read in place, under its own rank):
    what the dispatch received from each source."""
    w = tl.arange(0, WORLD_P2)
    rows = tl.zeros([WORLD_P2], dtype=tl.int64)
    for i0 in range(0, WORLD * M * TOPK_P2, BS):
        q, k, s, t, valid = _slots(i0 + tl.arange(0, BS), tokens, w, WORLD, M, TOPK, TOPK_P2)
        returned = tl.load(row_of_ptr + q * TOPK + k, mask=valid, other=-1) != -1
        rows += tl.sum(((s[:, None] == w[None, :]) & returned[:, None]).to(tl.int64), axis=0)
    return rows


@triton.jit
def _owners(routed_ptr, t, kk, num_tokens, TOPK: tl.constexpr):
    """[BT, TOPK_P2] the rank whose experts hold slot (t, k) of this rank's tokens; -1 not routed."""
    slot = t[:, None] * TOPK + kk[None, :]
    slot_live = (t < num_tokens)[:, None] & (kk < TOPK)[None, :]
    return slot, tl.load(routed_ptr + slot, mask=slot_live, other=0) - 1


@triton.jit
def _rows_by_owner(routed_ptr, num_tokens, TOPK: tl.constexpr, TOPK_P2: tl.constexpr, WORLD_P2: tl.constexpr,
                   BT: tl.constexpr):
    """Flight recorder, one program: int64 [WORLD_P2] rows of this rank's tokens each rank's experts
    return (own: read in place): what the dispatch sent to each rank."""
    w = tl.arange(0, WORLD_P2)
    kk = tl.arange(0, TOPK_P2)
    rows = tl.zeros([WORLD_P2], dtype=tl.int64)
    for t0 in range(0, num_tokens, BT):
        _, owner = _owners(routed_ptr, t0 + tl.arange(0, BT), kk, num_tokens, TOPK)
        rows += tl.sum(tl.sum((owner[:, :, None] == w[None, None, :]).to(tl.int64), axis=1), axis=0)
    return rows


@triton.jit
def _clamp_rows(n, M: tl.constexpr, TOPK: tl.constexpr):
    """A row count or run base of the dispatch's ``runs``, clamped to [0, M * TOPK]: no value steers a copy
    or put out of bounds."""
    return tl.minimum(tl.maximum(n, 0), M * TOPK)


@triton.jit
def _runs(runs_ptr, WORLD: tl.constexpr, WORLD_P2: tl.constexpr, M: tl.constexpr, TOPK: tl.constexpr,
          EXPERTS_PER_RANK: tl.constexpr, EXPERTS_P2: tl.constexpr):
    """(rows [WORLD_P2, EXPERTS_P2], run base [WORLD_P2]), int32: the dispatch's rows per (source, local
    expert) and the sources' run bases, clamped (``_clamp_rows``)."""
    w = tl.arange(0, WORLD_P2)
    e = tl.arange(0, EXPERTS_P2)
    rows = tl.load(runs_ptr + w[:, None] * (EXPERTS_PER_RANK + 1) + e[None, :],
                   mask=(w < WORLD)[:, None] & (e < EXPERTS_PER_RANK)[None, :], other=0)
    base = tl.load(runs_ptr + w * (EXPERTS_PER_RANK + 1) + EXPERTS_PER_RANK, mask=w < WORLD, other=0)
    return _clamp_rows(rows, M, TOPK), _clamp_rows(base, M, TOPK)


@triton.jit
def _run_of(runs_ptr, p, rank, M: tl.constexpr, TOPK: tl.constexpr, EXPERTS_PER_RANK: tl.constexpr,
            EXPERTS_P2: tl.constexpr):
    """(run base, rows) of rank p's run: its slots this rank's experts got, at [base, base + rows) of the
    sorted half of p's landing zone; no rows for this rank's own slots (read in place). Row p of ``_runs``,
    loaded alone: called per put peer around NVSHMEM calls, it keeps no [WORLD_P2, EXPERTS_P2] table live
    across them (what Triton 3.9's PTX otherwise spills)."""
    e = tl.arange(0, EXPERTS_P2)
    rows = tl.load(runs_ptr + p * (EXPERTS_PER_RANK + 1) + e, mask=e < EXPERTS_PER_RANK, other=0)
    b = _clamp_rows(tl.load(runs_ptr + p * (EXPERTS_PER_RANK + 1) + EXPERTS_PER_RANK), M, TOPK)
    n = tl.sum(_clamp_rows(rows, M, TOPK))
    return b, tl.where(p == rank, 0, tl.minimum(n, M * TOPK - b))


@triton.jit
def expert_rows(expert_out_ptr, row, X_WORDS: tl.constexpr, HIDDEN: tl.constexpr, FP8: tl.constexpr):
    """Pointers to rows ``row`` of expert_out: as words (copied as they are), or with FP8 as elements (the
    copy quantizes them)."""
    if FP8:
        return expert_out_ptr + row.to(tl.int64) * HIDDEN
    else:
        return as_words(expert_out_ptr) + row.to(tl.int64) * X_WORDS


@triton.jit
def _send_flag(grp, seq_ptr):
    """This send's flag, read where it is used (kept live across the copies it spills Triton 3.9's put build):
    the send count is advanced only by this kernel's last program, at its end."""
    return flag_value(tl.load(grp + S_EPOCH), tl.load(seq_ptr) + 1)


@triton.jit
def _stage_run(expert_out_ptr, stage, rows, p, blk, WORLD_P2: tl.constexpr, M: tl.constexpr, TOPK: tl.constexpr,
               EXPERTS_PER_RANK: tl.constexpr, EXPERTS_P2: tl.constexpr, CAP: tl.constexpr,
               X_WORDS: tl.constexpr, BS: tl.constexpr, BW: tl.constexpr, NBLK: tl.constexpr,
               ALIGNED: tl.constexpr, SLOT_WORDS: tl.constexpr, HIDDEN: tl.constexpr, FP8: tl.constexpr,
               ready_ptr, seq_ptr, grp, status_ptr, rank, WORLD: tl.constexpr, PUT: tl.constexpr):
    """This program's share of rank p's run, staged at ``stage`` (int32 words [M * TOPK, SLOT_WORDS]): row i
    is the i-th of p's slots here in (local expert, dispatch row) order, i.e. expert_out[e, base_e + j]
    with base_e = rows of expert e from ranks before p (the dispatch placed p's rows there), as an fp8 row
    with FP8; a row past the capacity (dropped by the dispatch) is staged as zeros. With ``ready_ptr``, each
    block first waits for its rows' experts (``ready.wait_ready``); returns False if a wait failed (then
    nothing more is read: the call is failed and its last program publishes nothing)."""
    ready = blk >= 0   # True
    w = tl.arange(0, WORLD_P2)
    rows_p = tl.sum(tl.where((w == p)[:, None], rows, 0), axis=0)             # [EXPERTS_P2]
    first = tl.sum(tl.where((w < p)[:, None], rows, 0), axis=0)               # row of p's first, per expert
    end = tl.cumsum(rows_p, axis=0)                                           # run index after expert e
    n = tl.minimum(tl.sum(rows_p), M * TOPK)
    for i0 in range(blk * BS, n, NBLK * BS):
        i = i0 + tl.arange(0, BS)
        ok = i < n
        e = tl.sum((end[None, :] <= i[:, None]).to(tl.int32), axis=1)          # the expert of run row i
        pick = e[:, None] == tl.arange(0, EXPERTS_P2)[None, :]
        row = tl.sum(tl.where(pick, first[None, :] + rows_p[None, :] - end[None, :], 0), axis=1) + i
        has_row = ok & (row < CAP)
        if ready_ptr is not None:   # read expert e's rows only once e is signalled ready
            ready = ready & wait_ready(ready_ptr, e, tl.where(ready, has_row, False), _send_flag(grp, seq_ptr), grp,
                                       status_ptr, rank,
                                       WORLD, WORLD_P2, EXPERTS_PER_RANK, EXPERTS_P2, PUT)
            has_row = tl.where(ready, has_row, False)
        src = expert_rows(expert_out_ptr, e.to(tl.int64) * CAP + tl.where(has_row, row, 0), X_WORDS, HIDDEN, FP8)
        copy_rows(src, has_row, address(stage + i.to(tl.int64) * SLOT_WORDS)[:, None], ok[:, None],
                  HIDDEN if FP8 else X_WORDS, BW, 1, 1, ALIGNED, FP8)
    return ready


@triton.jit
def _fp8_slot(expert_out_ptr, landing, code, at, use, here, has_row, c0, HIDDEN: tl.constexpr, BT: tl.constexpr,
              BH: tl.constexpr, SLOT_WORDS: tl.constexpr, ALIGNED: tl.constexpr):
    """float32 [BT, BH]: columns [c0, c0 + BH) of slot row(t, k) as the fp8 combine sums it, dequantized:
    an fp8 landing row at ``at`` (byte pointer ``landing``; e4m3 bytes, then float32 scales), or this rank's
    own expert_out row ``code`` (``here``) quantized in registers exactly as a peer's send would have; a
    dropped own slot reads nothing (zeros quantize to zeros)."""
    GROUPS: tl.constexpr = BH // 128
    own = load_tile(expert_out_ptr + tl.where(has_row, code, 0).to(tl.int64) * HIDDEN, use & here & has_row, c0,
                    HIDDEN, BH, ALIGNED)
    q_own, s_own = quantize_e4m3_groups(own.to(tl.float32), BT, GROUPS)
    row = landing + at.to(tl.int64) * (SLOT_WORDS * 4)
    remote = use & ~here
    q_in = load_tile(row, remote, c0, HIDDEN, BH, ALIGNED).to(tl.float8e4nv, bitcast=True)   # bytes (masked: 0)
    s_in = load_tile((row + HIDDEN).to(tl.pointer_type(tl.float32)), remote, c0 // 128, HIDDEN // 128, GROUPS, ALIGNED)
    q = tl.where(here[:, None], q_own.to(tl.float32), q_in.to(tl.float32))   # the e4m3 values, exact in float32
    return dequantize_e4m3_groups(q, tl.where(here[:, None], s_own, s_in), BT, GROUPS)


@triton.jit
def combine_send_kernel(
    expert_out_ptr,   # [ROWS, HIDDEN] dtype: expert outputs, rows as in d.x ([L, CAP] flattened), copied as words
    row_of_ptr,       # int32 [WORLD * M, TOPK]: dispatch's row of slot (s, t, k); -1 not here, -2 dropped
    src_tokens_ptr,   # int32 [WORLD]: rows of every rank in that dispatch's landing zone (its tokens T: store)
    runs_ptr,         # int32 [WORLD, EXPERTS_PER_RANK + 1] (PUT only): the dispatch's rows per (source, local
    #                   expert), then the source's run base
    data_ptrs_ptr,    # int64 [WORLD]: every rank's landing zone, int32 [2, ZONE_SLOTS, SLOT_WORDS]
    ctrl_ptrs_ptr,    # int64 [WORLD]: every rank's control words, int64 [2, WORLD, 2]
    stage_ptr,        # put transport: int32 [2, WORLD dest, M * TOPK, SLOT_WORDS], the run staged per dest, per zone
    stage_ctrl_ptr,   # put transport: int64 [2, WORLD, 2] (unused: the flag travels as the run's signal)
    seq_ptr,          # int64 [1]: the channel's send count (advanced here)
    done_ptr,         # int32 [WORLD + 3]: arrival counters ([WORLD]: this kernel's), zero between launches
    grp, status_ptr,  # group state and this rank's status buffer (moe_comm/protocol.py)
    rank,
    trace_ptr,        # int64 [TRACE_N, record words]: the channel's flight recorder (TRACE only)
    ready_ptr,        # None, or int64 [EXPERTS_PER_RANK]: the ready words (``ready.py``): the send reads expert
    #                   e's rows only once ready_ptr[e] is this call's flag, and finishes only once every one is
    WORLD: tl.constexpr, WORLD_P2: tl.constexpr, M: tl.constexpr, ROWS: tl.constexpr, TOPK: tl.constexpr,
    TOPK_P2: tl.constexpr, X_WORDS: tl.constexpr, BS: tl.constexpr, BW: tl.constexpr, NBLK: tl.constexpr,
    ALIGNED: tl.constexpr, PUT: tl.constexpr, TRACE: tl.constexpr, TRACE_N: tl.constexpr, OP: tl.constexpr,
    ZONE_SLOTS: tl.constexpr, EXPERTS_PER_RANK: tl.constexpr, EXPERTS_P2: tl.constexpr, CAP: tl.constexpr,
    SLOT_WORDS: tl.constexpr,  # words of a landing row: X_WORDS, or with FP8 an fp8 row (formats.fp8_row_words)
    HIDDEN: tl.constexpr, FP8: tl.constexpr,  # FP8: rows quantized on the way (BW then counts elements)
):
    blk = tl.program_id(0)
    call = tl.load(seq_ptr) + 1
    trace.send_begin(trace_ptr, grp, call, OP, blk == 0, WORLD, TRACE_N, TRACE)
    zone = call % 2
    stage_ptr = stage_zone(stage_ptr, zone, WORLD * M * TOPK * SLOT_WORDS)   # STAGE_ZONE (transport.py)
    failed = group_failed(grp, status_ptr, WORLD, WORLD_P2)  # a failed group sends nothing
    w = tl.arange(0, WORLD_P2)
    live = live_ranks(grp, WORLD, WORLD_P2)
    # (tl.where, not `&`: Triton's interpreter turns `bool vector & bool scalar` into int32, no mask)
    tokens = tl.minimum(tl.maximum(tl.load(src_tokens_ptr + w, mask=tl.where(failed, False, live), other=0), 0), M)
    if TRACE:
        if blk == 0:
            returned = _returned_rows(row_of_ptr, tokens, WORLD, WORLD_P2, M, TOPK, TOPK_P2, BS)
            if PUT:   # a put rank's rows: its run (row_of of the tokens its dispatch did not carry is stale)
                rows, _ = _runs(runs_ptr, WORLD, WORLD_P2, M, TOPK, EXPERTS_PER_RANK, EXPERTS_P2)
                returned = tl.where(put_peers(grp, w, w < WORLD, WORLD, PUT), tl.sum(rows, axis=1).to(tl.int64),
                                    returned)
            trace.store_peer_words(trace.sent_rows_ptr(trace_ptr, call, WORLD, TRACE_N), w, returned, w < WORLD,
                                   TRACE)
    ready = blk >= 0   # True; with ready_ptr: False once a wait for an expert failed (nothing more is read)
    # An excluded or failed token rank has no tokens here (tokens = 0), so nothing goes to it.
    for i0 in range(blk * BS, WORLD * M * TOPK_P2, NBLK * BS):
        q, k, s, t, valid = _slots(i0 + tl.arange(0, BS), tokens, w, WORLD, M, TOPK, TOPK_P2)
        live_slot = valid & (s != rank)  # own slots: read in place
        if PUT:  # a rank reached by puts gets its slots as one run (below), not slot by slot
            live_slot = tl.where(put_peers(grp, s, live_slot, WORLD, PUT), False, live_slot)
        code = tl.load(row_of_ptr + q * TOPK + k, mask=live_slot, other=-1)
        send = code != -1
        has_row = (code >= 0) & (code < ROWS)
        if ready_ptr is not None:   # read expert e's rows (codes e * CAP + i) only once e is signalled ready
            ready = ready & wait_ready(ready_ptr, code // CAP, tl.where(ready, has_row, False),
                                       _send_flag(grp, seq_ptr), grp,
                                       status_ptr, rank, WORLD, WORLD_P2, EXPERTS_PER_RANK, EXPERTS_P2, PUT)
            send = tl.where(ready, send, False)
            has_row = tl.where(ready, has_row, False)
        src = expert_rows(expert_out_ptr, tl.where(has_row, code, 0), X_WORDS, HIDDEN, FP8)
        # Slot (t, k) of rank s, in s's landing zone.
        zone_off = zone.to(tl.int64) * ZONE_SLOTS * SLOT_WORDS
        landing = as_ptr(tl.load(data_ptrs_ptr + s, mask=send, other=0), tl.int32) + zone_off
        dst = landing + (t * TOPK + k).to(tl.int64) * SLOT_WORDS
        copy_rows(src, has_row, address(dst)[:, None], send[:, None], HIDDEN if FP8 else X_WORDS, BW, 1, 1, ALIGNED,
                  FP8)
    if PUT:  # stage each put rank's run: the rows its tokens' slots got here, sorted by (expert, token, k)
        rows, _ = _runs(runs_ptr, WORLD, WORLD_P2, M, TOPK, EXPERTS_PER_RANK, EXPERTS_P2)
        for p in range(WORLD):
            if (p != rank) & is_live(grp, p) & put_peers(grp, p, True, WORLD, PUT) & (failed == 0):
                staged = _stage_run(expert_out_ptr, stage_ptr + tl.cast(p, tl.int64) * M * TOPK * SLOT_WORDS, rows,
                                    p, blk, WORLD_P2, M, TOPK, EXPERTS_PER_RANK, EXPERTS_P2, CAP, X_WORDS, BS, BW,
                                    NBLK, ALIGNED, SLOT_WORDS, HIDDEN, FP8, ready_ptr, seq_ptr, grp, status_ptr, rank,
                                    WORLD, PUT)
                if ready_ptr is not None:
                    ready = ready & staged
    # The last program publishes to every live rank, unless a program skipped its part because the group
    # failed (or, with ready_ptr, a wait for an expert failed), and advances the send count.
    if ready_ptr is not None:
        last, skipped = arrive(done_ptr + WORLD, NBLK, failed | (ready == 0))
    else:
        last, skipped = arrive(done_ptr + WORLD, NBLK, failed)
    if last:
        # The call, zone and live ranks read again (the send count is written by this kernel's last program
        # only, below; the group state holds still during a launch): kept live across the copies, they
        # spill Triton 3.9's put build past its bound (PUT_SPILL_BYTES).
        call = tl.load(seq_ptr) + 1
        zone = call % 2
        live = live_ranks(grp, WORLD, WORLD_P2)
        if ready_ptr is not None:   # every local expert, also those whose rows go nowhere or are read in place
            if skipped == 0:
                e = tl.arange(0, EXPERTS_P2)
                ready = wait_ready(ready_ptr, e, e < EXPERTS_PER_RANK, _send_flag(grp, seq_ptr), grp, status_ptr, rank,
                                   WORLD, WORLD_P2, EXPERTS_PER_RANK, EXPERTS_P2, PUT)
                skipped = ready == 0
        if skipped == 0:
            flag = flag_value(tl.load(grp + S_EPOCH), call)
            ctrl = as_ptr(tl.load(ctrl_ptrs_ptr + w, mask=live, other=0), tl.int64) + (zone * WORLD + rank) * 2
            put_all = put_peers(grp, w, w < WORLD, WORLD, PUT)
            order_transports(grp, live, WORLD, WORLD_P2, PUT)
            publish_many(ctrl + 1, flag, store_only(put_all, live, PUT))
            if PUT:  # each put rank's run in one put whose signal is the flag (own slots: read in place)
                own_flag = as_ptr(tl.load(ctrl_ptrs_ptr + rank), tl.int64) + (zone * WORLD + rank) * 2 + 1
                own_runs = as_ptr(tl.load(data_ptrs_ptr + rank), tl.int32) + zone.to(tl.int64) * ZONE_SLOTS * SLOT_WORDS
                for p in range(WORLD):
                    if is_live(grp, p) & put_peers(grp, p, True, WORLD, PUT):
                        base, n = _run_of(runs_ptr, p, rank, M, TOPK, EXPERTS_PER_RANK, EXPERTS_P2)
                        flush(own_runs, own_runs, 0, own_runs + (M * TOPK + base).to(tl.int64) * SLOT_WORDS,
                              stage_ptr + tl.cast(p, tl.int64) * M * TOPK * SLOT_WORDS,
                              n.to(tl.int64) * SLOT_WORDS * 4, own_flag, flag, p)
        tl.store(seq_ptr, call)
    trace.send_end(trace_ptr, call, last, WORLD, WORLD_P2, TRACE_N, TRACE)


@triton.jit
def combine_recv_kernel(
    out_ptr,          # out [T, HIDDEN] dtype
    weights_ptr,      # [T, TOPK] floating topk_weights
    routed_ptr,       # int32 [M, TOPK]: 1 + the owner rank of slot (t, k) where the dispatch routed it, else 0
    expert_out_ptr,   # [ROWS, HIDDEN] dtype: this rank's expert outputs (rows as in d.x)
    row_of_ptr,       # int32 [WORLD * M, TOPK]: the dispatch's row of slot (s, t, k) on this rank
    slot_key_ptr,     # int32 [M, TOPK] (PUT only): position * BINS + expert id of this rank's slot (t, k)
    id_base_ptr,      # int32 [BINS] (PUT only): this rank's slots with a lower expert id
    data_ptr,         # int32 words [2, ZONE_SLOTS, SLOT_WORDS]: this rank's landing zone
    ctrl_ptr,         # int64 [2, WORLD, 2]: this rank's control words
    seq_ptr,          # int64 [1]: the channel's receive count (advanced here; unused at world 1)
    done_ptr,         # int32 [WORLD + 3]: arrival counters ([WORLD + 1]: this kernel's; [WORLD + 2]: its entry)
    grp, status_ptr, rank, num_tokens,
    trace_ptr,        # int64 [TRACE_N, record words]: the channel's flight recorder (TRACE only)
    wait_ptr,         # int64 [2, WORLD]: wait statistics per source (TRACE only, triton_kernels/trace.py)
    OP: tl.constexpr, WORLD: tl.constexpr, WORLD_P2: tl.constexpr, M: tl.constexpr, ROWS: tl.constexpr,
    TOPK: tl.constexpr, TOPK_P2: tl.constexpr, HIDDEN: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr,
    NBLK: tl.constexpr, ALIGNED: tl.constexpr, TRACE: tl.constexpr, TRACE_N: tl.constexpr,
    PUT: tl.constexpr, ZONE_SLOTS: tl.constexpr, BINS: tl.constexpr,
    SLOT_WORDS: tl.constexpr,  # words of a landing row (HIDDEN * elem / 4, or an fp8 row)
    FP8: tl.constexpr,         # landing rows are fp8 rows; own rows are quantized here the same way (BH % 128 == 0)
):
    blk = tl.program_id(0)
    c0 = tl.program_id(1) * BH  # this program's columns: [c0, c0 + BH)
    # A program waits only for the ranks whose rows it reads: the owners of its tokens' slots routed to
    # another rank (``routed`` holds 1 + the owner). Program (0, 0) waits for every live peer, even when
    # T = 0: a rank must not finish a combine before every peer's send of that call, or it could run two
    # calls ahead and overwrite a landing zone a peer is still reading. At world 1 every slot is read in
    # place and there is no flag and no call count.
    arrived = blk >= 0  # True
    kk = tl.arange(0, TOPK_P2)
    if WORLD > 1:
        call = tl.load(seq_ptr) + 1
        zone = call % 2
        w = tl.arange(0, WORLD_P2)
        trace.recv_begin(trace_ptr, grp, call, OP, done_ptr, WORLD, TRACE_N, TRACE)
        first = (blk == 0) & (tl.program_id(1) == 0)   # also the one that records rows and SEEN (flight recorder)
        if TRACE:
            if first:
                trace.store_peer_words(trace.recv_rows_ptr(trace_ptr, call, WORLD, TRACE_N), w,
                                       _rows_by_owner(routed_ptr, num_tokens, TOPK, TOPK_P2, WORLD_P2, BT),
                                       w < WORLD, TRACE)
        need = w < 0   # [WORLD_P2] False
        for t0 in range(blk * BT, num_tokens, NBLK * BT):
            slot, owner = _owners(routed_ptr, t0 + tl.arange(0, BT), kk, num_tokens, TOPK)
            if PUT:   # (row_of of a token the own put dispatch did not carry is stale)
                remote = owner != rank
            else:
                remote = tl.load(row_of_ptr + rank * M * TOPK + slot, mask=owner >= 0, other=0) == -1
            hit = tl.where(remote, owner, -1)
            need = need | tl.max(tl.max((hit[:, :, None] == w[None, None, :]).to(tl.int32), axis=1), axis=0) != 0
        need = tl.where(first, True, need)
        if tl.max(need.to(tl.int32)) > 0:
            live = tl.where(need, live_ranks(grp, WORLD, WORLD_P2), False)
            flags, target = ctrl_ptr + (zone * WORLD + w) * 2 + 1, flag_value(tl.load(grp + S_EPOCH), call)
            seen = trace.seen_ptr(trace_ptr, call, WORLD, TRACE_N)
            t_wait = trace.wait_begin(TRACE)
            if TRACE:
                ok = wait_flags(flags, target, live, w, grp, status_ptr, OP, rank, WORLD, WORLD_P2,
                                seen_ptr=seen, seen_mask=tl.where(first, w < WORLD, False), PUT=PUT)
            else:
                ok = wait_flags(flags, target, live, w, grp, status_ptr, OP, rank, WORLD, WORLD_P2, PUT=PUT)
            trace.add_waits(wait_ptr, seen, w, tl.where(first, w < WORLD, False), live, t_wait, WORLD, TRACE)
            arrived = tl.min(tl.where(live, ok, True).to(tl.int32)) > 0
    else:
        zone = tl.program_id(0) * 0
    if FP8:   # byte rows (fp8 rows, loaded as bytes)
        landing = data_ptr.to(tl.pointer_type(tl.uint8)) + zone.to(tl.int64) * ZONE_SLOTS * SLOT_WORDS * 4
    else:
        landing = data_ptr.to(tl.pointer_type(out_ptr.dtype.element_ty)) + zone.to(tl.int64) * ZONE_SLOTS * HIDDEN
    for t0 in range(blk * BT, num_tokens, NBLK * BT):
        t = t0 + tl.arange(0, BT)
        live = t < num_tokens
        # Per-slot words: routed, weight and this rank's row of the slot (-1: another rank's expert,
        # in the landing zone).
        slot = t[:, None] * TOPK + kk[None, :]
        slot_live = live[:, None] & (kk < TOPK)[None, :]
        routed_all = tl.load(routed_ptr + slot, mask=slot_live, other=0)
        use_all = routed_all != 0
        w_all = tl.load(weights_ptr + slot, mask=slot_live, other=0).to(tl.float32)
        if PUT:
            # Own slots by the owner (row_of of a token the own put dispatch did not carry is stale); a
            # slot from a put rank is in that rank's run: row M*TOPK + (slots of lower ids) + position.
            code_all = tl.load(row_of_ptr + rank * M * TOPK + slot, mask=routed_all == rank + 1, other=-1)
            key = tl.load(slot_key_ptr + slot, mask=use_all, other=0)
            sorted_slot = tl.load(id_base_ptr + key % BINS, mask=use_all, other=0) + key // BINS
            at_all = tl.where(put_peers(grp, routed_all - 1, use_all, WORLD, PUT), M * TOPK + sorted_slot, slot)
        else:
            code_all = tl.load(row_of_ptr + rank * M * TOPK + slot, mask=use_all, other=-1)
        acc = tl.zeros([BT, BH], dtype=tl.float32)
        for k in tl.static_range(TOPK):
            pick = kk[None, :] == k
            use = tl.sum(tl.where(pick, use_all.to(tl.int32), 0), axis=1) != 0
            wk = tl.sum(tl.where(pick, w_all, 0.0), axis=1)
            code = tl.sum(tl.where(pick, code_all, 0), axis=1)
            if PUT:
                at = tl.sum(tl.where(pick, at_all, 0), axis=1)      # landing row of slot (t, k)
            else:
                at = t * TOPK + k
            here = code != -1
            has_row = (code >= 0) & (code < ROWS)
            if FP8:
                v = _fp8_slot(expert_out_ptr, landing, code, at, tl.where(arrived, use, False), here, has_row, c0,
                              HIDDEN, BT, BH, SLOT_WORDS, ALIGNED)
            else:
                # One load per slot: from expert_out in place, or from the landing zone; a dropped slot (-2)
                # reads nothing and adds w * 0, as the zeros a peer sends for one.
                row = tl.where(here, expert_out_ptr + tl.where(has_row, code, 0).to(tl.int64) * HIDDEN,
                               landing + at.to(tl.int64) * HIDDEN)
                v = load_tile(row, tl.where(arrived, use & (has_row | ~here), False), c0, HIDDEN, BH,
                              ALIGNED).to(tl.float32)
            acc = tl.where(use[:, None], acc + wk[:, None] * v, acc)
        store_tile(cast_rne(acc, out_ptr.dtype.element_ty), c0, HIDDEN, address(out_ptr + t.to(tl.int64) * HIDDEN)[:, None],
                   live[:, None], BH, 1, 1, ALIGNED)
    if WORLD > 1:
        last, _ = arrive(done_ptr + WORLD + 1, tl.num_programs(0) * tl.num_programs(1), 0)
        if last:
            tl.store(seq_ptr, call)
            # A failed call leaves no partial sum: every row is NaN, written by the last program because a
            # program that reads no peer's rows does not wait, and cannot know (the error is raised).
            if check_failed(grp, status_ptr, WORLD, WORLD_P2):  # adopted into this rank's word: raised
                fill_nan(out_ptr, num_tokens, HIDDEN, BT, BH, ALIGNED)
        trace.recv_end(trace_ptr, grp, call, last, done_ptr, WORLD, WORLD_P2, TRACE_N, TRACE)
