"""Prefill dispatch device code: send phase (routing + payload straight into the output), receive phase, and
the pull of the rows that came from other nodes.

The landing zone of every rank is the output (one zone, symmetric int32 words; layout in
``planner.PrefillPlan``): row ``q = source * M + t`` of the planes recv_topk_idx [R, K], recv_topk_weights
[R, K], recv_x [R, X_WORDS] (and recv_scales [R, S_WORDS] with FP8). Control words
``ctrl[call % 2, source, :]`` (int64) = (tokens T of the source, per-expert slot counts from it, with
NVFP4 the bits of its global scale, flag).

Send (grid = NBLK token blocks x column blocks, ``EPPlan.send_grid``): first every program waits until
every live rank released the zones of the previous call (the ``released`` word of the combine channel
holds the combine count of that rank, ``prefill_combine.py``): nothing is written into a zone a rank may
still read. Then, for each token t of the program's range, the K local ids (-1 where the slot's expert
is on another rank) and K weights (0 there) go to row ``rank * M + t`` of every live rank of this node,
and the payload to the same row of each such rank holding one of its experts, once per rank however
many of its experts live there (``routing.token_destinations``), through ``copy.py``'s one copy loop
(FP8 and NVFP4: quantized in registers by ``quant.py`` first, one column block per program; PREQUANT: the
caller's fp8 codes and scales, already quantized, copied as they are in the same column blocks). One program writes
the control words; the last one to finish publishes every live rank's flag and advances the send count.

Across nodes (PUT, docs/prefill.md "Across nodes"; nodes of G consecutive ranks, the ranks of this
rank's node reached by stores, the others by puts): a token with an expert on a live rank of another node
is also stored once into this rank's payload staging (``stage``, parity call % 2: not its own zone row,
which is its output, written by its experts before anything proves a rail's NIC read it), and its routing
row (K global ids, K weights, the call's flag as a stamp) into its own row ``rank * M + t`` of the routing
plane; the last program puts those rows to this rank's *rail* on each such node (``rails_of``), at the
zone offsets of row ``rank * M + t``, then each rail's staged control words (tokens, the node's G*L
counts) with the flag as the signal, and a bare flag to every other live rank of another node: one
program, so each rail's rows and its flag travel in order on one queue pair. Nothing is quieted: the
staging is rewritten by the send of call + 2 at the earliest after ``wait_released`` saw every rail's
release of a combine that answered this call, so its NIC had read it (``transport.py``).

Receive (grid (1,)): wait (bounded) for the flag of every live source (first the sources of this node,
in this rank's control words, then the others, in their rail's control words on this node: a flag missing
there names the rail if the source's bare flag reached this rank, else the source), then write the
per-source token counts and the per-local-expert slot counts (clamped: no peer value can exceed M or
M * K). A failed call leaves counts of zero (no stale rows are valid). Pull (PUT, grid programs x
sources): the rows of every source of another node that its rail on this node received (stamp = this
call's flag) give this rank's ids and weights, and the rows with one of its experts are copied here.
"""

import triton
import triton.language as tl

from .copy import address, as_words, copy_rows, load_tile, row_pointers, store_nvfp4_tile, store_tile
from .nvshmem_device import SIGNAL_SET, putmem_nbi_block, signal_op
from .quant import check_scales, quantize_e4m3_groups
from .routing import load_topk_chunk, scan_ids, token_destinations
from .sync import (CALL_MASK, ERR_TIMEOUT, S_EPOCH, S_LIVE, arrive, as_ptr, check_failed, flag_value, group_failed,
                   is_live, live_ranks, named_while_blocked, publish_many, read_once, record_group_error,
                   wait_flags)
from .transport import flush, order_transports, put_peers, stage_zone, store_only


@triton.jit
def rails_of(grp, src, node, G: tl.constexpr, G_P2: tl.constexpr):
    """The rail of each source ``src`` on node ``node`` (int32 tensors of one 1-D shape): the rank of that
    node with the source's local index, or, if it is excluded, the next live one in cyclic local order;
    -1 if no rank of the node is live (``moe_comm.topology.NodeLayout.rail`` on the host)."""
    c = tl.arange(0, G_P2)
    local = (src[:, None] % G + c[None, :]) % G
    live = tl.load(grp + S_LIVE + node[:, None] * G + local, mask=(c < G)[None, :], other=0) != 0
    first = tl.min(tl.where(live, c[None, :], G_P2), axis=1)
    return tl.where(first < G_P2, node * G + (src % G + first) % G, -1)


@triton.jit
def rail_of(grp, src, node, G: tl.constexpr, G_P2: tl.constexpr):
    """``rails_of`` for one (scalar) source and node."""
    one = tl.zeros([1], dtype=tl.int32)
    return tl.max(rails_of(grp, one + src, one + node, G, G_P2))


@triton.jit
def node_rails(grp, rank, WORLD: tl.constexpr, G: tl.constexpr, G_P2: tl.constexpr, NODES: tl.constexpr,
               NODES_P2: tl.constexpr, PUT: tl.constexpr):
    """(rails [NODES_P2], far [NODES_P2]): this rank's rail on every node, and the nodes it reaches by
    puts through a live rail (every node but its own; its own too when it reaches itself by puts)."""
    n = tl.arange(0, NODES_P2)
    rails = rails_of(grp, tl.zeros([NODES_P2], dtype=tl.int32) + rank, n, G, G_P2)
    self_put = put_peers(grp, rank, True, WORLD, PUT)
    far = (n < NODES) & ((n != rank // G) | self_put) & (rails >= 0)
    return rails, far


@triton.jit
def write_counts(counts, ctrl_ptrs_ptr, stage_ctrl_ptr, ctrl_offset, grp, num_tokens, send, rails, far,
                 WORLD: tl.constexpr, WORLD_P2: tl.constexpr, EXPERTS_PER_RANK: tl.constexpr, BINS: tl.constexpr,
                 CTRL_WORDS: tl.constexpr, COUNT_SPAN: tl.constexpr, NODES_P2: tl.constexpr, PUT: tl.constexpr,
                 gscale_ptr, NVFP4: tl.constexpr):
    """The control words of one call, unless ``send`` is False: each live rank of this node (stores at
    ``ctrl_offset`` of its control words) gets the tokens and the counts of its experts, at 1 + e %
    COUNT_SPAN (COUNT_SPAN = L, or with puts G*L: a rank finds its counts at 1 + local index * L), and with
    NVFP4 (one node only: every rank is near) the bits of the global scale the rows are quantized with, at
    CTRL_WORDS - 2; with PUT, each rail of a ``far`` node gets the tokens and its node's G*L counts,
    staged in its row of ``stage_ctrl`` (put by the last program). ``counts`` [BINS]: valid slots per
    expert id."""
    w = tl.arange(0, WORLD_P2)
    near = tl.where(send, live_ranks(grp, WORLD, WORLD_P2), False)
    near = store_only(put_peers(grp, w, w < WORLD, WORLD, PUT), near, PUT)
    ctrl = as_ptr(tl.load(ctrl_ptrs_ptr + w, mask=near, other=0), tl.int64) + ctrl_offset
    tl.store(ctrl, num_tokens, mask=near)
    if NVFP4:
        scale_bits = tl.load(gscale_ptr).to(tl.int32, bitcast=True).to(tl.int64)
        tl.store(ctrl + CTRL_WORDS - 2, scale_bits + tl.zeros([WORLD_P2], tl.int64), mask=near)
    expert = tl.arange(0, BINS)
    owner = tl.minimum(expert // EXPERTS_PER_RANK, WORLD - 1)
    exists = expert < WORLD * EXPERTS_PER_RANK
    owner_near = tl.where(send & exists, tl.load(grp + S_LIVE + owner, mask=exists, other=0) != 0, False)
    owner_near = store_only(put_peers(grp, owner, exists, WORLD, PUT), owner_near, PUT)
    ctrl_e = as_ptr(tl.load(ctrl_ptrs_ptr + owner, mask=exists & owner_near, other=0), tl.int64) + ctrl_offset
    slot = 1 + expert % COUNT_SPAN
    tl.store(ctrl_e + slot, counts.to(tl.int64), mask=exists & owner_near)
    if PUT:
        n = tl.arange(0, NODES_P2)
        go = tl.where(send, far, False)   # a boolean mask (the interpreter broadcasts a scalar test as integers)
        tl.store(stage_ctrl_ptr + rails * CTRL_WORDS, num_tokens, mask=go)
        pick = n[None, :] == (expert // COUNT_SPAN)[:, None]                      # [BINS, NODES_P2]
        rail_e = tl.sum(tl.where(pick, rails[None, :], 0), axis=1)
        go_e = tl.sum(tl.where(pick, go[None, :].to(tl.int32), 0), axis=1) > 0
        tl.store(stage_ctrl_ptr + rail_e * CTRL_WORDS + slot, counts.to(tl.int64), mask=exists & go_e)


@triton.jit
def put_rows(idx_ptr, own_zone, stage, SX: tl.constexpr, rails, far, grp, rank, num_tokens, num_experts,
             TOPK: tl.constexpr, TOPK_P2: tl.constexpr, EXPERTS_PER_RANK: tl.constexpr, G: tl.constexpr,
             NODES: tl.constexpr, NODES_P2: tl.constexpr, M: tl.constexpr, R: tl.constexpr, X_OFFSET: tl.constexpr,
             X_WORDS: tl.constexpr, S_WORDS: tl.constexpr, ROUTE_OFFSET: tl.constexpr, RW: tl.constexpr):
    """Put this rank's tokens [0, num_tokens) (payload and fp8 scales from ``stage``, the scales at word SX;
    routing row from its own zone) to its rail on every ``far`` node holding a live owner of one of the
    token's experts, at the zone offsets of row ``rank * M + t``: one ``putmem_nbi`` per row and part, none
    to this rank itself (its rows are in place). Every argument is the same in every thread of the program
    (the ids are the caller's, plain loads)."""
    kk = tl.arange(0, TOPK_P2)
    n = tl.arange(0, NODES_P2)
    for t in range(0, num_tokens):
        raw = tl.load(idx_ptr + tl.cast(t, tl.int64) * TOPK + kk, mask=kk < TOPK, other=-1)
        valid = (kk < TOPK) & (raw >= 0) & (raw < num_experts)
        owner = tl.where(valid, raw // EXPERTS_PER_RANK, 0).to(tl.int32)
        ok = valid & (tl.load(grp + S_LIVE + owner, mask=valid, other=0) != 0)
        reach = tl.max((tl.where(ok, owner // G, -1)[None, :] == n[:, None]).to(tl.int32), axis=1) > 0
        go = reach & far & (rails != rank)
        q = tl.cast(rank * M + t, tl.int64)
        for node in range(NODES):
            if tl.max(tl.where(n == node, go, False).to(tl.int32)) > 0:
                pe = tl.sum(tl.where(n == node, rails, 0))
                putmem_nbi_block(own_zone + X_OFFSET + q * X_WORDS, stage + tl.cast(t, tl.int64) * X_WORDS, X_WORDS * 4,
                                 pe)
                if S_WORDS > 0:
                    putmem_nbi_block(own_zone + X_OFFSET + R * X_WORDS + q * S_WORDS,
                                     stage + SX + tl.cast(t, tl.int64) * S_WORDS, S_WORDS * 4, pe)
                row = own_zone + ROUTE_OFFSET + q * RW
                putmem_nbi_block(row, row, RW * 4, pe)


@triton.jit
def scale_rows(base, stage, staged, t, row, X_OFFSET: tl.constexpr, R: tl.constexpr, X_WORDS: tl.constexpr,
               S_WORDS: tl.constexpr, SX: tl.constexpr, PUT: tl.constexpr):
    """Byte addresses [BT, TOPK_P2] of the scale words of each destination row (``base``: its zone): the
    zone's scale plane, or with PUT where ``staged`` the staging's scale rows (from
    word SX)."""
    zone = base + (X_OFFSET + R * X_WORDS + row * S_WORDS) * 4
    if PUT:
        return tl.where(staged, address(stage) + ((SX + t.to(tl.int64) * S_WORDS) * 4)[:, None], zone)
    else:
        return zone


@triton.jit
def wait_released(released_ptr, combine_seq_ptr, grp, status_ptr, op, rank, WORLD: tl.constexpr,
                  WORLD_P2: tl.constexpr, PUT: tl.constexpr):
    """Wait until every live rank's ``released`` word (int64 [2, WORLD, 2] combine control words, word 0)
    shows this rank's combine count: each rank has finished reading every zone. Nothing to wait for before
    the first combine. Returns False if the wait failed (the group failed: send nothing). The count is
    another channel's: with overlapped zones the combine's receive may store it while this kernel runs
    (on another stream), so it is read once per program and broadcast (``read_once``), never per thread."""
    done = read_once(combine_seq_ptr, True)
    w = tl.arange(0, WORLD_P2)
    live = tl.where(done > 0, live_ranks(grp, WORLD, WORLD_P2), False)
    ok = wait_flags(released_ptr + ((done % 2) * WORLD + w) * 2, flag_value(tl.load(grp + S_EPOCH), done), live, w,
                    grp, status_ptr, op, rank, WORLD, WORLD_P2, PUT=PUT)
    return tl.min(tl.where(live, ok, True).to(tl.int32)) > 0


@triton.jit
def prefill_dispatch_send_kernel(
    x_ptr,            # [T, HIDDEN] dtype: the tokens (plain: copied as int32 words [T, X_WORDS]; PREQUANT:
    #                   the float8 codes as uint8 bytes)
    scales_ptr,       # int32 words [T, S_WORDS]: the codes' scales (PREQUANT only)
    idx_ptr,          # [T, TOPK] int32/int64 expert ids, -1 = not routed
    weights_ptr,      # [T, TOPK] float32 topk_weights
    routed_ptr,       # out int32 [M, TOPK]: 1 + the owner rank where slot (t, k) is routed (the combine's mask), else 0
    excluded_ptr,     # int64 [1]: slots whose expert's rank is excluded (accumulated)
    data_ptrs_ptr,    # int64 [WORLD]: every rank's zone (int32 words, PrefillPlan layout)
    ctrl_ptrs_ptr,    # int64 [WORLD]: every rank's control words, int64 [2, WORLD, CTRL_WORDS]
    released_ptr,     # int64 [2, WORLD, 2]: this rank's combine control words (word 0: released)
    combine_seq_ptr,  # int64 [1]: this rank's combine receive count
    seq_ptr,          # int64 [1]: the channel's send count (advanced here)
    done_ptr,         # int32 [WORLD + 3]: arrival counters ([WORLD]: this kernel's), zero between launches
    stamp_ptr,        # int64 [1] (PUT): this zone's stamp, the flag of the call (its pull and combine read it)
    stage_ptr,        # int32 [2, stage words] symmetric (PUT): payload rows, then scales (PrefillPlan.stage_words)
    stage_ctrl_ptr,   # int64 [2, WORLD, CTRL_WORDS] symmetric (PUT): control words staged for each rail
    grp, status_ptr, rank, num_tokens, num_experts,
    OP: tl.constexpr, WORLD: tl.constexpr, WORLD_P2: tl.constexpr, M: tl.constexpr, TOPK: tl.constexpr,
    TOPK_P2: tl.constexpr, EXPERTS_PER_RANK: tl.constexpr, HIDDEN: tl.constexpr, X_WORDS: tl.constexpr,
    S_WORDS: tl.constexpr, X_OFFSET: tl.constexpr, CTRL_WORDS: tl.constexpr, BT: tl.constexpr, BW: tl.constexpr,
    ROUTE_T: tl.constexpr, BINS: tl.constexpr, FP8: tl.constexpr, FP8_GROUPS: tl.constexpr, SCALE: tl.constexpr,
    S_BLOCK: tl.constexpr, PREQUANT: tl.constexpr, NBLK: tl.constexpr, ALIGNED: tl.constexpr, PUT: tl.constexpr,
    G: tl.constexpr, G_P2: tl.constexpr, NODES: tl.constexpr, NODES_P2: tl.constexpr, COUNT_SPAN: tl.constexpr,
    ROUTE_OFFSET: tl.constexpr, RW: tl.constexpr,
    gscale_ptr,       # float32 [1]: the NVFP4 global scale (read with NVFP4 only)
    NVFP4: tl.constexpr, NVFP4_GROUPS: tl.constexpr,  # NVFP4: quantized in column blocks of NVFP4_GROUPS * 16
):
    # SCALE: the scale format (quant.py); S_BLOCK: scale words of one FP8 column block (EPPlan.scale_block_words)
    blk = tl.program_id(0)
    col = tl.program_id(1)  # column block of the payload (FP8: of FP8_GROUPS * 128 columns; else the row)
    call = tl.load(seq_ptr) + 1
    zone = call % 2          # of the control words and the staging; the data has one zone
    R: tl.constexpr = WORLD * M
    SX: tl.constexpr = (M * X_WORDS + 3) // 4 * 4          # the staged scales' first word (PrefillPlan.stage_words)
    STAGE_WORDS: tl.constexpr = SX + (M * S_WORDS + 3) // 4 * 4   # one parity of the staging
    # The staging of this call's parity (STAGE_ZONE, transport.py), derived where used from the parameters
    # (not kept live across the copy, which spills the fp8 send's registers).
    released = wait_released(released_ptr, combine_seq_ptr, grp, status_ptr, OP, rank, WORLD, WORLD_P2, PUT)
    failed = group_failed(grp, status_ptr, WORLD, WORLD_P2) | (released == 0)  # a failed group sends nothing
    peer = tl.arange(0, WORLD_P2)
    peer_live = tl.where(failed, False, live_ranks(grp, WORLD, WORLD_P2))
    near_live = store_only(put_peers(grp, peer, peer < WORLD, WORLD, PUT), peer_live, PUT)   # this node's
    zone_all = as_ptr(tl.load(data_ptrs_ptr + peer, mask=near_live, other=0), tl.int32)   # [WORLD_P2]
    flag = flag_value(tl.load(grp + S_EPOCH), call)

    if (blk == NBLK - 1) & (col == 0):   # the combine's mask, excluded slots, bad ids, control words
        rails, far = node_rails(grp, rank, WORLD, G, G_P2, NODES, NODES_P2, PUT)
        counts = scan_ids(idx_ptr, routed_ptr, excluded_ptr, grp, rank, num_tokens, num_experts, OP, TOPK, TOPK_P2,
                          EXPERTS_PER_RANK, ROUTE_T, BINS)
        write_counts(counts, ctrl_ptrs_ptr, stage_zone(stage_ctrl_ptr, zone, WORLD * CTRL_WORDS),
                     (zone * WORLD + rank) * CTRL_WORDS, grp, num_tokens,
                     failed == 0, rails, far, WORLD, WORLD_P2, EXPERTS_PER_RANK, BINS, CTRL_WORDS, COUNT_SPAN,
                     NODES_P2, PUT, gscale_ptr, NVFP4)
        if PUT:
            tl.store(stamp_ptr, flag)

    per_program = tl.cdiv(num_tokens, NBLK)
    t_begin = tl.minimum(blk * per_program, num_tokens)
    t_end = tl.minimum(t_begin + per_program, num_tokens)
    for t0 in range(t_begin, t_end, BT):
        ts, ks, idx, live, valid, bad = load_topk_chunk(idx_ptr, t0, t_end, num_experts, TOPK, TOPK_P2, BT)
        owner = tl.where(valid, idx // EXPERTS_PER_RANK, -1)
        q = (rank * M + ts).to(tl.int64)                                        # the token's row everywhere
        if col == 0:   # ids and weights to every live rank of the node: local id / weight where the expert is
            here = owner[None, :] == peer[:, None]                              # [WORLD_P2, BT * TOPK_P2]
            w = tl.load(weights_ptr + ts.to(tl.int64) * TOPK + ks, mask=live, other=0.0)
            slot = zone_all[:, None] + (q * TOPK + ks)[None, :]
            put = near_live[:, None] & live[None, :]
            tl.store(slot, tl.where(here, (idx % EXPERTS_PER_RANK)[None, :], -1), mask=put)
            tl.store((slot + R * TOPK).to(tl.pointer_type(tl.float32)), tl.where(here, w[None, :], 0.0), mask=put)
            if PUT:   # the routing row (global ids of live owners, weights, stamp): what a rail's node reads
                owner_ok = valid & (tl.load(grp + S_LIVE + tl.maximum(owner, 0), mask=valid, other=0) != 0)
                route = as_ptr(tl.load(data_ptrs_ptr + rank), tl.int32) + ROUTE_OFFSET + q * RW   # this rank's zone
                tl.store(route + ks, tl.where(owner_ok, idx, -1), mask=live)
                tl.store((route + TOPK + ks).to(tl.pointer_type(tl.float32)), tl.where(owner_ok, w, 0.0), mask=live)
                tl.store((route + 2 * TOPK).to(tl.pointer_type(tl.int64)), flag + tl.zeros_like(q), mask=live & (ks == 0))

        t = t0 + tl.arange(0, BT)
        row = (rank * M + t).to(tl.int64)[:, None]
        if PUT:   # a slot on another node goes once into this rank's staging (the source of the puts to the
            #       rails), in the column of the token's first such slot; the others to their ranks' rows
            owner_ok = valid & (tl.load(grp + S_LIVE + tl.maximum(owner, 0), mask=valid, other=0) != 0)
            owner_far = tl.where(owner_ok & (owner != rank), put_peers(grp, tl.maximum(owner, 0), owner_ok, WORLD, PUT),
                                 False)
            to, write = token_destinations(tl.where(owner_far, -1, owner), t < t_end, grp, failed, BT, TOPK_P2)
            far_slot = tl.reshape(owner_far, (BT, TOPK_P2))
            kk = tl.arange(0, TOPK_P2)
            earlier = far_slot[:, None, :] & (kk[None, None, :] < kk[None, :, None])
            staged = far_slot & (tl.max(earlier.to(tl.int32), axis=2) == 0) & (t < t_end)[:, None]
            staged = tl.where(failed, False, staged)
            write = write | staged
            # the staging's rows as if it were a zone: the same offsets as a zone row then lead there
            stage = stage_zone(stage_ptr, zone, STAGE_WORDS)
            base = tl.where(staged, address(stage) - (X_OFFSET + row * X_WORDS) * 4
                            + (t.to(tl.int64) * X_WORDS * 4)[:, None],
                            tl.load(data_ptrs_ptr + to, mask=write & (staged == 0), other=0))
        else:
            to, write = token_destinations(owner, t < t_end, grp, failed, BT, TOPK_P2)
            staged = write != write
            stage = stage_ptr
            base = tl.load(data_ptrs_ptr + to, mask=write, other=0)             # [BT, TOPK_P2] zone addresses
        dst = base + (X_OFFSET + row * X_WORDS) * 4                             # bytes
        read = tl.max(write.to(tl.int32), axis=1) > 0
        if FP8:  # column block `col` of the row: quantized in registers (or given), stored to every destination
            COLS: tl.constexpr = FP8_GROUPS * 128
            if PREQUANT:
                qx = load_tile(x_ptr + t.to(tl.int64) * HIDDEN, read, col * COLS, HIDDEN, COLS, ALIGNED)
                scale = load_tile(scales_ptr + t.to(tl.int64) * S_WORDS, read, col * S_BLOCK, S_WORDS, S_BLOCK,
                                  ALIGNED & (S_WORDS % 4 == 0))
            else:
                xs = load_tile(x_ptr + t.to(tl.int64) * HIDDEN, read, col * COLS, HIDDEN, COLS, ALIGNED)
                qx, scale = quantize_e4m3_groups(xs.to(tl.float32), BT, FP8_GROUPS, SCALE)
            store_tile(qx, col * COLS, HIDDEN, dst, write, COLS, TOPK, TOPK_P2, ALIGNED)
            store_tile(scale, col * S_BLOCK, S_WORDS, scale_rows(base, stage, staged, t, row, X_OFFSET, R, X_WORDS,
                                                                S_WORDS, SX, PUT), write, S_BLOCK, TOPK, TOPK_P2,
                       ALIGNED & (S_WORDS % 4 == 0))
        elif NVFP4:  # the same for NVFP4 (value words into recv_x, scale words into recv_scales)
            NCOLS: tl.constexpr = NVFP4_GROUPS * 16
            xs = load_tile(x_ptr + t.to(tl.int64) * HIDDEN, read, col * NCOLS, HIDDEN, NCOLS, ALIGNED)
            store_nvfp4_tile(xs, col, tl.load(gscale_ptr), dst,
                             scale_rows(base, stage, staged, t, row, X_OFFSET, R, X_WORDS, S_WORDS, SX, PUT), write,
                             X_WORDS, S_WORDS, NVFP4_GROUPS, TOPK, TOPK_P2, ALIGNED)
        else:
            copy_rows(as_words(x_ptr) + t.to(tl.int64) * X_WORDS, read, dst, write, X_WORDS, BW, TOPK, TOPK_P2,
                      ALIGNED)

    # The last program publishes to every live rank, unless a program skipped its part, and advances the
    # send count.
    last, skipped = arrive(done_ptr + WORLD, NBLK * tl.num_programs(1), failed)
    if last:
        # The call and zone read again (the send count is written by this kernel's last program only, below):
        # kept live across the copy, they spill Triton 3.9's put build past its bound (PUT_SPILL_BYTES).
        call = tl.load(seq_ptr) + 1
        zone = call % 2
        if skipped == 0:
            ctrl = as_ptr(tl.load(ctrl_ptrs_ptr + peer, mask=near_live, other=0), tl.int64)
            order_transports(grp, peer_live, WORLD, WORLD_P2, PUT)
            publish_many(ctrl + (zone * WORLD + rank) * CTRL_WORDS + CTRL_WORDS - 1, flag, near_live)
            if PUT:   # the rows to the rails, then their flags: one program, one queue pair per rail
                rails, far = node_rails(grp, rank, WORLD, G, G_P2, NODES, NODES_P2, PUT)
                own_zone = as_ptr(tl.load(data_ptrs_ptr + rank), tl.int32)
                put_rows(idx_ptr, own_zone, stage_zone(stage_ptr, zone, STAGE_WORDS), SX, rails, far, grp, rank,
                         num_tokens, num_experts, TOPK, TOPK_P2, EXPERTS_PER_RANK, G, NODES, NODES_P2, M, R, X_OFFSET,
                         X_WORDS, S_WORDS, ROUTE_OFFSET, RW)
                publish_far(ctrl_ptrs_ptr, stage_zone(stage_ctrl_ptr, zone, WORLD * CTRL_WORDS),
                            (zone * WORLD + rank) * CTRL_WORDS, flag, rails, far, grp, rank, WORLD, CTRL_WORDS, G,
                            NODES, NODES_P2, PUT)
        tl.store(seq_ptr, call)


@triton.jit
def publish_far(ctrl_ptrs_ptr, stage_ctrl_ptr, ctrl_offset, flag, rails, far, grp, rank, WORLD: tl.constexpr,
                CTRL_WORDS: tl.constexpr, G: tl.constexpr, NODES: tl.constexpr, NODES_P2: tl.constexpr,
                PUT: tl.constexpr):
    """The flags of a dispatch to the other nodes (scalar control flow, every thread): each rail of a
    ``far`` node gets its staged control words in one ``putmem_signal_nbi`` whose signal is the flag;
    every other live rank reached by puts gets the bare flag (``signal_op``), so that every rank's
    control words show the call (aborts and drains read them). Nothing waits for them."""
    n = tl.arange(0, NODES_P2)
    own = as_ptr(tl.load(ctrl_ptrs_ptr + rank), tl.int64) + ctrl_offset
    for node in range(NODES):
        if tl.max(tl.where(n == node, far, False).to(tl.int32)) > 0:
            pe = tl.sum(tl.where(n == node, rails, 0))
            flush(own, own, 0, own, stage_ctrl_ptr + pe * CTRL_WORDS, (CTRL_WORDS - 2) * 8, own + CTRL_WORDS - 1,
                  flag, pe)
    for p in range(WORLD):
        rail = tl.sum(tl.where(n == p // G, rails, 0))
        if is_live(grp, p) & put_peers(grp, p, True, WORLD, PUT) & (rail != p):
            signal_op(own + CTRL_WORDS - 1, flag, SIGNAL_SET, p)


@triton.jit
def prefill_dispatch_recv_kernel(
    src_tokens_ptr,   # out int32 [WORLD]: tokens T_s of every source (rows [s*M, s*M + T_s) are its)
    counts_ptr,       # out int32 [EXPERTS_PER_RANK]: valid slots per local expert, all sources
    stats_ptr,        # int64 [EXPERTS_PER_RANK]: the same, accumulated over calls
    ctrl_ptr,         # int64 [2, WORLD, CTRL_WORDS]: this rank's control words
    ctrl_ptrs_ptr,    # int64 [WORLD]: every rank's control words (PUT: a rail's, on this node, for other sources)
    seq_ptr,          # int64 [1]: the channel's receive count (advanced here)
    grp, status_ptr, rank,
    OP: tl.constexpr, WORLD: tl.constexpr, WORLD_P2: tl.constexpr, M: tl.constexpr, TOPK: tl.constexpr,
    EXPERTS_PER_RANK: tl.constexpr, EXPERTS_P2: tl.constexpr, CTRL_WORDS: tl.constexpr, PUT: tl.constexpr,
    G: tl.constexpr, G_P2: tl.constexpr,
    NVFP4: tl.constexpr,  # every source's global scale (control word CTRL_WORDS - 2) is checked against this rank's
):
    call = tl.load(seq_ptr) + 1
    row0 = (call % 2) * WORLD
    w = tl.arange(0, WORLD_P2)
    live = live_ranks(grp, WORLD, WORLD_P2)
    target = flag_value(tl.load(grp + S_EPOCH), call)
    if PUT:
        # A source of this node: this rank's control words. Another source: its rail's on this node, whose
        # NIC wrote the flag after the rows. The sources of this node first (a dead rail is one of them,
        # unless it died after its own send; a lane whose peer id is WORLD_P2 or more is no candidate for
        # the name), then the others. A flag missing at a rail implicates the source or the rail: the
        # source sent it if its bare flag (every rank of the node but the rail gets one) reached this rank,
        # and then the rail is named, else the source.
        far = tl.where(live, put_peers(grp, w, w < WORLD, WORLD, PUT), False)
        near = tl.where(far, False, live)
        rail = rails_of(grp, w, tl.zeros([WORLD_P2], dtype=tl.int32) + rank // G, G, G_P2)
        via = tl.where(far, rail != rank, False)   # the source's rows and counts are in another rank's zone
        rail_ctrl = tl.load(ctrl_ptrs_ptr + tl.maximum(rail, 0), mask=via, other=0)
        own = ctrl_ptr + (row0 + w) * CTRL_WORDS
        base = as_ptr(tl.where(via, rail_ctrl + (row0 + w).to(tl.int64) * CTRL_WORDS * 8, address(own)), tl.int64)
        failed_before = group_failed(grp, status_ptr, WORLD, WORLD_P2)
        ok = wait_flags(own + CTRL_WORDS - 1, target, near, tl.where(near, w, WORLD_P2), grp, status_ptr, OP, rank,
                        WORLD, WORLD_P2, PUT=PUT)
        ok_far = wait_flags(base + CTRL_WORDS - 1, target, far, tl.where(far, w, WORLD_P2), grp, status_ptr, OP, rank,
                            WORLD, WORLD_P2, PUT=PUT, RECORD_TIMEOUT=False)
        missing = tl.where(far, ok_far == 0, False)
        # Timed out, or a peer gave up on this rank while it waited here (``sync.named_while_blocked``).
        blocked = (group_failed(grp, status_ptr, WORLD, WORLD_P2) == 0) | named_while_blocked(
            grp, status_ptr, rank, failed_before, missing, w, WORLD, WORLD_P2)
        if (tl.max(missing.to(tl.int32)) > 0) & blocked:
            at_rail = read_once(base + CTRL_WORDS - 1, missing)
            bare = read_once(own + CTRL_WORDS - 1, missing & via) == target   # the source's flag here: it sent
            blame = tl.where(missing, tl.where(via & bare, rail, w), WORLD_P2)
            late = tl.min(blame)
            seen = tl.max(tl.where(missing & (blame == late), at_rail & CALL_MASK, 0))   # the call its flag shows
            record_group_error(grp, ERR_TIMEOUT, OP, rank, late, seen, target & CALL_MASK, WORLD, WORLD_P2, PUT)
        arrived = tl.where(near, ok, ok_far)
        count_at = 1 + (rank % G) * EXPERTS_PER_RANK
    else:
        base = ctrl_ptr + (row0 + w) * CTRL_WORDS
        arrived = wait_flags(base + CTRL_WORDS - 1, target, live, w, grp, status_ptr, OP, rank, WORLD, WORLD_P2)
        count_at = 1
    # A failed group leaves zero counts, and its error raised: a record that came after every flag (a slow
    # rank's receive waits for nothing) is adopted into this rank's word here.
    arrived = tl.where(check_failed(grp, status_ptr, WORLD, WORLD_P2), False, arrived)
    e = tl.arange(0, EXPERTS_P2)
    e_live = e < EXPERTS_PER_RANK
    # Published before the flags this rank acquired: plain loads.
    counts = tl.load(base[:, None] + count_at + e[None, :], mask=arrived[:, None] & e_live[None, :], other=0)
    counts = tl.sum(tl.minimum(tl.maximum(counts, 0), M * TOPK), axis=0).to(tl.int32)
    tokens = tl.load(base, mask=arrived, other=0)
    tl.store(src_tokens_ptr + w, tl.minimum(tl.maximum(tokens, 0), M).to(tl.int32), mask=w < WORLD)
    tl.store(counts_ptr + e, counts, mask=e_live)
    tl.store(stats_ptr + e, tl.load(stats_ptr + e, mask=e_live) + counts.to(tl.int64), mask=e_live)
    if NVFP4:   # one node only: every source's control words are this rank's
        check_scales(base + CTRL_WORDS - 2, arrived, w, grp, OP, rank)
    tl.store(seq_ptr, call)


@triton.jit
def prefill_dispatch_pull_kernel(
    data_ptrs_ptr,    # int64 [WORLD]: every rank's zone (0 on other nodes)
    src_tokens_ptr,   # int32 [WORLD]: tokens of every source (the receive kernel's: 0 for one that did not arrive)
    stamp_ptr,        # int64 [1]: this zone's stamp (the flag of the call, written by the send kernel)
    ctrl_ptr,         # int64 [2, WORLD, CTRL_WORDS]: this rank's control words (word CTRL_WORDS - 2: pulled)
    ctrl_ptrs_ptr,    # int64 [WORLD]: every rank's control words
    seq_ptr,          # int64 [1]: the channel's receive count (the receive kernel advanced it to this call)
    done_ptr,         # int32 [WORLD + 3]: arrival counters ([WORLD + 1]: the receive phase's)
    grp, status_ptr, rank,
    OP: tl.constexpr, WORLD: tl.constexpr, WORLD_P2: tl.constexpr, M: tl.constexpr, TOPK: tl.constexpr,
    TOPK_P2: tl.constexpr, EXPERTS_PER_RANK: tl.constexpr, X_WORDS: tl.constexpr, S_WORDS: tl.constexpr,
    X_OFFSET: tl.constexpr, CTRL_WORDS: tl.constexpr, ROUTE_OFFSET: tl.constexpr, RW: tl.constexpr, G: tl.constexpr,
    G_P2: tl.constexpr, BT: tl.constexpr, BW: tl.constexpr, S_BW: tl.constexpr, ALIGNED: tl.constexpr,
    PUT: tl.constexpr,
):
    """Grid (programs, WORLD): program (b, s) takes source s if it is a live rank of another node (reached by
    puts), token blocks b, b + programs, ... of its T_s tokens. Each token's routing row at s's rail on this
    node (row s*M + t of the rail's routing plane, a peer load) tells whether it came to this node (its
    stamp is this call's flag; a row of an older call is not) and its global expert ids: this rank's row
    s*M + t gets its local ids (-1 elsewhere) and their weights (0 elsewhere), and, if it holds one of the
    experts and is not the rail itself, the payload row (and fp8 scales) copied from the rail's zone. Every
    row t < T_s is written: a token that did not come to this node reads as all -1.

    Then the node barrier of the pull: the last program publishes ``pulled`` to every live rank of this
    node and waits (bounded) for theirs. A rail's zone rows are its own output (its experts may write them
    in place, its combine writes its partial rows over them), so no rank's dispatch returns before every
    rank of its node has read what it needs from it."""
    blk = tl.program_id(0)
    s = tl.program_id(1)
    R: tl.constexpr = WORLD * M
    take = is_live(grp, s) & put_peers(grp, s, True, WORLD, PUT) & (group_failed(grp, status_ptr, WORLD, WORLD_P2) == 0)
    n_tokens = tl.where(take, tl.minimum(tl.maximum(tl.load(src_tokens_ptr + s), 0), M), 0)
    rail = tl.maximum(rail_of(grp, s, rank // G, G, G_P2), 0)
    rail_zone = as_ptr(tl.load(data_ptrs_ptr + rail), tl.int32)
    own_zone = as_ptr(tl.load(data_ptrs_ptr + rank), tl.int32)
    stamp = tl.load(stamp_ptr)
    kk = tl.arange(0, TOPK_P2)
    k_live = (kk < TOPK)[None, :]
    for t0 in range(blk * BT, n_tokens, tl.num_programs(0) * BT):
        t = t0 + tl.arange(0, BT)
        t_live = t < n_tokens
        q = (s * M + t).to(tl.int64)
        route = rail_zone + ROUTE_OFFSET + q * RW                                       # [BT] routing rows
        ids = tl.load(route[:, None] + kk[None, :], mask=t_live[:, None] & k_live, other=-1)
        wts = tl.load((route[:, None] + TOPK + kk[None, :]).to(tl.pointer_type(tl.float32)),
                      mask=t_live[:, None] & k_live, other=0.0)
        came = tl.load((route + 2 * TOPK).to(tl.pointer_type(tl.int64)), mask=t_live, other=0) == stamp
        here = came[:, None] & k_live & (ids >= 0) & (ids // EXPERTS_PER_RANK == rank)
        slot = own_zone + q[:, None] * TOPK + kk[None, :]
        tl.store(slot, tl.where(here, ids % EXPERTS_PER_RANK, -1), mask=t_live[:, None] & k_live)
        tl.store((slot + R * TOPK).to(tl.pointer_type(tl.float32)), tl.where(here, wts, 0.0),
                 mask=t_live[:, None] & k_live)
        mine = tl.where(rail != rank, tl.max(here.to(tl.int32), axis=1) > 0, False)   # boolean (see write_counts)
        # (the rail's rows by their address: a pointer loaded from memory is declared aligned by row_pointers)
        copy_rows(row_pointers(address(rail_zone + X_OFFSET + q * X_WORDS), tl.int32, ALIGNED), mine,
                  address(own_zone + X_OFFSET + q * X_WORDS)[:, None], mine[:, None], X_WORDS, BW, 1, 1, ALIGNED)
        if S_WORDS > 0:
            scales_aligned: tl.constexpr = ALIGNED & (S_WORDS % 4 == 0)
            copy_rows(row_pointers(address(rail_zone + X_OFFSET + R * X_WORDS + q * S_WORDS), tl.int32, scales_aligned),
                      mine, address(own_zone + X_OFFSET + R * X_WORDS + q * S_WORDS)[:, None], mine[:, None], S_WORDS,
                      S_BW, 1, 1, scales_aligned)
    last, _ = arrive(done_ptr + WORLD + 1, tl.num_programs(0) * tl.num_programs(1), 0)
    if last:
        call = tl.load(seq_ptr)
        w = tl.arange(0, WORLD_P2)
        near = store_only(put_peers(grp, w, w < WORLD, WORLD, PUT), live_ranks(grp, WORLD, WORLD_P2), PUT)
        flag = flag_value(tl.load(grp + S_EPOCH), call)
        ctrl = as_ptr(tl.load(ctrl_ptrs_ptr + w, mask=near, other=0), tl.int64)
        publish_many(ctrl + ((call % 2) * WORLD + rank) * CTRL_WORDS + CTRL_WORDS - 2, flag, near)
        # (the other nodes' ranks publish no ``pulled`` here: no candidate for the name, peer id WORLD_P2)
        wait_flags(ctrl_ptr + ((call % 2) * WORLD + w) * CTRL_WORDS + CTRL_WORDS - 2, flag, near,
                   tl.where(near, w, WORLD_P2), grp, status_ptr, OP, rank, WORLD, WORLD_P2, PUT=PUT)
        # A program that found the group failed pulled nothing: the error is raised (adopted into this
        # rank's word, if it came after the receive kernel and every pulled flag).
        check_failed(grp, status_ptr, WORLD, WORLD_P2)
