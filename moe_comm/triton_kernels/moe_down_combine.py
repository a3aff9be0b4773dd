"""The fused MoE layer's second kernel: down GEMM + combine send, each output tile stored where it goes.

Row i of local expert e (i < counts[e], the dispatch's d.x order) answers slot (s, t, k): s and t from the
dispatch's src word (s * M + t), k the one with ``row_of[s, t, k] == e * CAP + i``. Its output row is
``h[e, i] @ w2[e].T`` in float32 (``serving.experts.expert_tile``), rounded once to the dtype, not
weighted: the combine's receive applies the weights in its fixed k order, as for ``EPBuffer.combine``. A
program (n, e) computes columns [n0, n0 + BN) of expert e's rows, BM at a time, and stores each tile row
straight into its slot's place (the combine landing zone layout, ``combine.py``):

- s = this rank: ``expert_out[t * TOPK + k]`` (local, [M * TOPK, HIDDEN]); the combine receive reads
  this rank's own slots there through ``own_codes``, this rank's row of a row_of-shaped table (one
  program rewrites row_of's codes ``e * CAP + i`` of kept own slots as ``t * TOPK + k``);
- s reached by stores: s's landing zone, slot (t, k) of this call's zone;
- s reached by puts: this rank's staging for s, at the slot's index in s's run (per local expert e the
  rows the dispatch received from s, in d.x order: ``combine.py``), put by the last program.

A slot the dispatch dropped for capacity (code -2) gets zeros, as the combine send sends: in a store
peer's landing zone (programs of expert 0, each its columns), in a put peer's run (the run rows past the
capacity, by expert e's programs); this rank's own dropped slots keep -2 (the receive adds nothing).

The last program to finish (``sync.arrive``) publishes the combine flag to every live rank, this one
included (stores; a put peer's flag is the signal of its run's put), unless the group failed or a
program skipped its part, and advances the combine channel's send count: the combine receive
(``combine_recv_kernel``, unchanged) then sums as for ``EPBuffer.combine``, same order, same bits.
Nothing here quiets: the staging for a put peer p is rewritten only by this rank's next call, after its
dispatch receive got p's flag of that call, which p publishes after its combine receive got this
call's put, whose signal NVSHMEM delivers after the payload (design.md, "Staging reuse by causality").

At world 1 every slot is this rank's: the tiles go to expert_out, and there is no flag and no count.
"""

import triton
import triton.language as tl

from ..serving.experts import W_BLOCK, expert_tile
from .moe_gate_up import FP8_WEIGHTS_LABEL
from . import trace
from .combine import _returned_rows, _run_of, _runs, _slots
from .copy import address, store_tile
from .quant import cast_rne
from .sync import (S_EPOCH, arrive, as_ptr, flag_value, group_failed, is_live, live_ranks, publish_many)
from .transport import flush, order_transports, put_peers, store_only


@triton.jit
def _own_codes(row_of_ptr, own_codes_ptr, rank, M: tl.constexpr, TOPK: tl.constexpr, BS: tl.constexpr):
    """Row ``rank`` of own_codes: slot j = t * TOPK + k of this rank's tokens is j where row_of holds a
    kept row here (the tile stored it at expert_out[j]), else row_of's code (-1 not here, -2 dropped)."""
    base = rank.to(tl.int64) * M * TOPK
    for j0 in range(0, M * TOPK, BS):
        j = j0 + tl.arange(0, BS)
        code = tl.load(row_of_ptr + base + j, mask=j < M * TOPK, other=-1)
        tl.store(own_codes_ptr + base + j, tl.where(code >= 0, j, code), mask=j < M * TOPK)


@triton.jit
def _zero_dropped(row_of_ptr, tokens, data_ptrs_ptr, zone_off, grp, rank, n0, WORLD: tl.constexpr,
                  WORLD_P2: tl.constexpr, M: tl.constexpr, TOPK: tl.constexpr, TOPK_P2: tl.constexpr,
                  HIDDEN: tl.constexpr, SLOT_WORDS: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr,
                  ALIGNED: tl.constexpr, DTYPE: tl.constexpr, PUT: tl.constexpr):
    """Columns [n0, n0 + BN) of zeros into every store peer's landing slot that this rank's dispatch
    dropped (row_of code -2): what the combine receive adds for it (``tokens``: rows of each source)."""
    w = tl.arange(0, WORLD_P2)
    zeros = tl.zeros([BS, BN], dtype=DTYPE)
    for i0 in range(0, WORLD * M * TOPK_P2, BS):
        q, k, s, t, valid = _slots(i0 + tl.arange(0, BS), tokens, w, WORLD, M, TOPK, TOPK_P2)
        peer = valid & (s != rank)
        if PUT:   # a put peer's dropped slots are zero rows of its run
            peer = tl.where(put_peers(grp, s, peer, WORLD, PUT), False, peer)
        dropped = tl.load(row_of_ptr + q * TOPK + k, mask=peer, other=-1) == -2
        landing = tl.load(data_ptrs_ptr + s, mask=dropped, other=0) + zone_off
        store_tile(zeros, n0, HIDDEN, (landing + (t * TOPK + k).to(tl.int64) * (SLOT_WORDS * 4))[:, None],
                   dropped[:, None], BN, 1, 1, ALIGNED)


@triton.jit
def moe_down_combine_kernel(
    h_ptr,            # [L, CAP, INTER] dtype: the gate/up kernel's activations (rows < counts[e])
    w2_ptr,           # [L, HIDDEN, INTER] dtype (W_FP8: float8_e4m3fn): down projections
    w2_scale_ptr,     # W_FP8: float32 [L, ceil(HIDDEN / 128), ceil(INTER / 128)], w2's block scales; else None
    counts_ptr,       # int32 [L]: rows per local expert (the dispatch's d.counts)
    src_ptr,          # int32 [L * CAP]: source_rank * M + token of each row (the dispatch's d.src)
    row_of_ptr,       # int32 [WORLD * M, TOPK]: the dispatch's row e * CAP + i of slot (s, t, k); -1 not
    #                   here, -2 dropped (a put source's: only its received tokens' slots)
    src_tokens_ptr,   # int32 [WORLD]: rows of every source in that dispatch's landing zone (its tokens: store)
    runs_ptr,         # int32 [WORLD, L + 1] (PUT only): the dispatch's rows per (source, local expert), then
    #                   the source's run base
    expert_out_ptr,   # out [M * TOPK, HIDDEN] dtype: output rows of this rank's own slots, slot (t, k) at row
    #                   t * TOPK + k (kept slots only)
    own_codes_ptr,    # out int32 [WORLD * M * TOPK]: row `rank` written (see _own_codes), for the combine receive
    data_ptrs_ptr,    # int64 [WORLD]: every rank's combine landing zone, int32 [2, ZONE_SLOTS, SLOT_WORDS]
    ctrl_ptrs_ptr,    # int64 [WORLD]: every rank's combine control words, int64 [2, WORLD, 2]
    stage_ptr,        # put transport: int32 [WORLD dest, M * TOPK, SLOT_WORDS], each put peer's run (symmetric)
    stage_ctrl_ptr,   # put transport: int64 [WORLD, 2] (unused: the flag travels as the run's signal)
    seq_ptr,          # int64 [1]: the combine channel's send count (advanced here)
    done_ptr,         # int32 [WORLD + 3]: the combine channel's arrival counters ([WORLD]: this kernel's)
    grp, status_ptr, rank,
    trace_ptr,        # int64 [TRACE_N, record words]: the combine channel's flight recorder (TRACE only)
    OP: tl.constexpr, WORLD: tl.constexpr, WORLD_P2: tl.constexpr, M: tl.constexpr, CAP: tl.constexpr,
    TOPK: tl.constexpr, TOPK_P2: tl.constexpr, EXPERTS_PER_RANK: tl.constexpr, EXPERTS_P2: tl.constexpr,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, SLOT_WORDS: tl.constexpr, ZONE_SLOTS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BS: tl.constexpr, PRECISION: tl.constexpr,
    ALIGNED: tl.constexpr, PUT: tl.constexpr, TRACE: tl.constexpr, TRACE_N: tl.constexpr,
    W_FP8: tl.constexpr = False,   # fp8 weights with block scales, dequantized per tile (``expert_tile``)
):
    # SLOT_WORDS: words of a combine landing row (HIDDEN * element size / 4); BS: slots per step of the
    # bookkeeping loops
    n0 = tl.program_id(0) * BN
    e = tl.program_id(1)
    first = (tl.program_id(0) == 0) & (e == 0)
    DTYPE: tl.constexpr = h_ptr.dtype.element_ty
    ROW_BYTES: tl.constexpr = SLOT_WORDS * 4
    w = tl.arange(0, WORLD_P2)
    if WORLD > 1:
        call = tl.load(seq_ptr) + 1
        zone_off = (call % 2).to(tl.int64) * ZONE_SLOTS * ROW_BYTES
        trace.send_begin(trace_ptr, grp, call, OP, first, WORLD, TRACE_N, TRACE)
        failed = group_failed(grp, status_ptr, WORLD, WORLD_P2)   # a failed group sends nothing
        live = tl.where(failed, False, live_ranks(grp, WORLD, WORLD_P2))
        # An excluded or failed token rank has no tokens here (tokens = 0), so nothing goes to it.
        tokens = tl.minimum(tl.maximum(tl.load(src_tokens_ptr + w, mask=live, other=0), 0), M)
    else:
        zone_off = tl.zeros([], dtype=tl.int64)
        failed = e < 0    # False
        live = w == 0
    if failed == 0:
        if first:
            _own_codes(row_of_ptr, own_codes_ptr, rank, M, TOPK, BS)
        if TRACE & (WORLD > 1):
            if first:   # rows returned to each rank (own: kept in expert_out), as the combine send records them
                returned = _returned_rows(row_of_ptr, tokens, WORLD, WORLD_P2, M, TOPK, TOPK_P2, BS)
                if PUT:
                    rows_tab, _ = _runs(runs_ptr, WORLD, WORLD_P2, M, TOPK, EXPERTS_PER_RANK, EXPERTS_P2)
                    returned = tl.where(put_peers(grp, w, w < WORLD, WORLD, PUT),
                                        tl.sum(rows_tab, axis=1).to(tl.int64), returned)
                trace.store_peer_words(trace.sent_rows_ptr(trace_ptr, call, WORLD, TRACE_N), w, returned, w < WORLD,
                                       TRACE)
        if WORLD > 1:
            if e == 0:
                _zero_dropped(row_of_ptr, tokens, data_ptrs_ptr, zone_off, grp, rank, n0, WORLD, WORLD_P2, M, TOPK,
                              TOPK_P2, HIDDEN, SLOT_WORDS, BN, BS, ALIGNED, DTYPE, PUT)
        if PUT:   # where expert e's rows from each put peer p sit in p's run
            rows_tab, _ = _runs(runs_ptr, WORLD, WORLD_P2, M, TOPK, EXPERTS_PER_RANK, EXPERTS_P2)
            ee = tl.arange(0, EXPERTS_P2)
            rows_e = tl.sum(tl.where(ee[None, :] == e, rows_tab, 0), axis=1)                     # [WORLD_P2]
            run_before = tl.sum(tl.where(ee[None, :] < e, rows_tab, 0), axis=1)                 # run index of e's first
            row_first = tl.sum(tl.where(w[:, None] < w[None, :], rows_e[:, None], 0), axis=0)  # d.x row of p's first
        rows = tl.minimum(tl.maximum(tl.load(counts_ptr + e), 0), CAP)
        h_base = h_ptr + e.to(tl.int64) * CAP * INTER
        b_base = w2_ptr + e.to(tl.int64) * HIDDEN * INTER
        s_base = w2_scale_ptr
        if W_FP8:
            s_base = w2_scale_ptr + e.to(tl.int64) * (tl.cdiv(HIDDEN, W_BLOCK) * tl.cdiv(INTER, W_BLOCK))
        kk = tl.arange(0, TOPK_P2)
        for m0 in range(0, rows, BM):
            i = m0 + tl.arange(0, BM)
            row_live = i < rows
            acc = expert_tile(h_base, i.to(tl.int64) * INTER, row_live, b_base, b_base, n0, INTER, HIDDEN, 1, 1, INTER,
                              False, BM, BN, BK, PRECISION, W_FP8, s_base, 0, 0)
            # The slot (s, t, k) of each row: s * M + t from src, k where row_of names the row.
            q = tl.minimum(tl.maximum(tl.load(src_ptr + e * CAP + i, mask=row_live, other=0), 0), WORLD * M - 1)
            s = q // M
            t = q % M
            codes = tl.load(row_of_ptr + q[:, None] * TOPK + kk[None, :], mask=row_live[:, None] & (kk < TOPK)[None, :],
                            other=-1)
            hit = codes == (e * CAP + i)[:, None]
            k = tl.sum(tl.where(hit, kk[None, :], 0), axis=1)
            write = row_live & (tl.max(hit.to(tl.int32), axis=1) > 0)
            slot = (t * TOPK + k).to(tl.int64)
            dst = address(expert_out_ptr) + slot * ROW_BYTES   # a row of expert_out is a landing row's bytes
            if WORLD > 1:
                peer = write & (s != rank)
                landing = tl.load(data_ptrs_ptr + s, mask=peer, other=0) + zone_off
                dst = tl.where(peer, landing + slot * ROW_BYTES, dst)
                if PUT:
                    put = put_peers(grp, s, peer, WORLD, PUT)
                    pick = s[:, None] == w[None, :]
                    run = tl.sum(tl.where(pick, run_before[None, :] - row_first[None, :], 0), axis=1) + i
                    staged = address(stage_ptr) + s.to(tl.int64) * (M * TOPK * ROW_BYTES) + run.to(tl.int64) * ROW_BYTES
                    dst = tl.where(put, staged, dst)
                    write = write & tl.where(put, run < M * TOPK, True)
            store_tile(cast_rne(acc, DTYPE), n0, HIDDEN, dst[:, None], write[:, None], BN, 1, 1, ALIGNED)
        if PUT:   # rows of put peers past the capacity, dropped by the dispatch: zeros in their runs
            for p in range(WORLD):
                if (p != rank) & is_live(grp, p) & put_peers(grp, p, True, WORLD, PUT):
                    first_p = tl.sum(tl.where(w == p, row_first, 0))
                    end_p = tl.minimum(first_p + tl.sum(tl.where(w == p, rows_e, 0)), WORLD * M * TOPK)
                    before_p = tl.sum(tl.where(w == p, run_before, 0))
                    stage_p = address(stage_ptr) + p * (M * TOPK * ROW_BYTES)
                    for r0 in range(tl.maximum(first_p, CAP), end_p, BM):
                        r = r0 + tl.arange(0, BM)
                        run = before_p + r - first_p
                        store_tile(tl.zeros([BM, BN], dtype=DTYPE), n0, HIDDEN,
                                   (stage_p + run.to(tl.int64) * ROW_BYTES)[:, None],
                                   ((r < end_p) & (run < M * TOPK))[:, None], BN, 1, 1, ALIGNED)
    if WORLD > 1:
        # The last program publishes to every live rank, unless a program skipped its part because the
        # group failed, and advances the send count.
        last, skipped = arrive(done_ptr + WORLD, tl.num_programs(0) * tl.num_programs(1), failed)
        if last:
            if skipped == 0:
                flag = flag_value(tl.load(grp + S_EPOCH), call)
                ctrl = as_ptr(tl.load(ctrl_ptrs_ptr + w, mask=live, other=0), tl.int64) + (call % 2 * WORLD + rank) * 2
                order_transports(grp, live, WORLD, WORLD_P2, PUT)
                publish_many(ctrl + 1, flag, store_only(put_peers(grp, w, w < WORLD, WORLD, PUT), live, PUT))
                if PUT:  # each put rank's run in one put whose signal is the flag (own slots: read in place)
                    own_flag = as_ptr(tl.load(ctrl_ptrs_ptr + rank), tl.int64) + (call % 2 * WORLD + rank) * 2 + 1
                    own_runs = as_ptr(tl.load(data_ptrs_ptr + rank), tl.int32) + zone_off // 4
                    for p in range(WORLD):
                        if is_live(grp, p) & put_peers(grp, p, True, WORLD, PUT):
                            base, n = _run_of(runs_ptr, p, rank, M, TOPK, EXPERTS_PER_RANK, EXPERTS_P2)
                            flush(own_runs, own_runs, 0, own_runs + (M * TOPK + base).to(tl.int64) * SLOT_WORDS,
                                  stage_ptr + tl.cast(p, tl.int64) * M * TOPK * SLOT_WORDS,
                                  n.to(tl.int64) * ROW_BYTES, own_flag, flag, p)
            tl.store(seq_ptr, call)
        trace.send_end(trace_ptr, call, last, WORLD, WORLD_P2, TRACE_N, TRACE)


def _compile_configs() -> list[dict]:
    """DeepSeek-V3 decode (256 experts, hidden 7168, intermediate 2048, top-8, 128 tokens per rank) with the
    planner's GPU shapes: EP8 over stores, with the flight recorder, over puts (NVSHMEM linked), and EP1."""
    import torch  # noqa: PLC0415

    from ..planner import next_pow2, plan_ep, plan_moe_layer  # noqa: PLC0415
    types = dict(h_ptr="*bf16", w2_ptr="*bf16", counts_ptr="*i32", src_ptr="*i32", row_of_ptr="*i32",
                 src_tokens_ptr="*i32", runs_ptr="*i32", expert_out_ptr="*bf16", own_codes_ptr="*i32",
                 data_ptrs_ptr="*i64", ctrl_ptrs_ptr="*i64", stage_ptr="*i32", stage_ctrl_ptr="*i64", seq_ptr="*i64",
                 done_ptr="*i32", grp="*i64", status_ptr="*i64", rank="i32")
    out = []
    for world, put, traced, fp8 in ((8, False, False, False), (8, False, True, False), (8, True, False, False),
                                    (1, False, False, False), (8, False, False, True), (8, True, False, True),
                                    (1, False, False, True)):
        p = plan_ep(world, 256, 7168, 128, 8, torch.bfloat16, False, "cuda")
        p = p.with_put() if put else p
        lp = plan_moe_layer(p, 2048, "cuda")
        label = f"DSV3 EP{world} bf16" + (" put" if put else "") + (" trace" if traced else "") + \
            (" " + FP8_WEIGHTS_LABEL if fp8 else "")
        out.append(dict(kernel="moe_down_combine_kernel", label=label, nvshmem=put,
                        types=dict(types, w2_ptr="*fp8e4nv", w2_scale_ptr="*fp32") if fp8 else types, constexprs=dict(
            OP=3, WORLD=world, WORLD_P2=next_pow2(world), M=128, CAP=p.capacity, TOPK=8, TOPK_P2=8,
            EXPERTS_PER_RANK=p.experts_per_rank, EXPERTS_P2=next_pow2(p.experts_per_rank), HIDDEN=7168, INTER=2048,
            SLOT_WORDS=p.combine_words, ZONE_SLOTS=max(1, p.combine_zone_slots), BM=lp.block_rows, BN=lp.down_cols,
            BK=lp.block_k, BS=lp.bookkeeping_slots, PRECISION="tf32", ALIGNED=True, PUT=put, TRACE=traced,
            TRACE_N=64, W_FP8=fp8, **({} if fp8 else dict(w2_scale_ptr=None)))))
    return out


COMPILE_CONFIGS = _compile_configs()
