"""EP combine device code: send phase (expert outputs back to their tokens) and receive phase (reduce).

Landing zone on every rank (symmetric int32 words): ``data[zone, t, k, :]`` = the expert output row of
this rank's slot (t, k). Each slot has exactly one writer (the rank owning expert topk_idx[t, k]), so
there is nothing to order between senders. Control words ``ctrl[zone, source, 1]`` = flag. Zone = call % 2.

Send (grid = NBLK programs over the rows (s, t) of every token rank s): slot (s, t, k) routed here was
received into row ``row_of[s, t, k]`` of the dispatch output (kept by the dispatch); store
``expert_out`` of that row into s's landing zone at (t, k). A slot the dispatch dropped for capacity
(code -2) sends zeros. This rank's own slots (s = rank) are skipped: the receive reads them straight
from ``expert_out``, so at world 1 nothing is copied twice. The last program to finish publishes every
rank's flag and advances the call counter.

Receive (grid = NBLK token blocks x HIDDEN / BH column blocks): a program with tokens waits (bounded) for
every rank's flag (at world 1 there is none: every slot is read in place, and no send kernel runs), then
``y[t] = sum over k = 0..TOPK-1 with slot (t, k) routed of w[t, k] * row(t, k)`` in float32, k in
ascending order, cast to the output dtype; row(t, k) is ``expert_out[row_of[rank, t, k]]`` when this
rank holds the expert (zeros if dropped), else ``landing[t, k]``. The sum sees each slot's row bit for
bit as the expert wrote it and always in the same order, so y is bitwise reproducible across runs and
world sizes.
"""

import triton
import triton.language as tl

from .quant import cast_rne
from .sync import arrive, as_ptr, signal, wait_flag


@triton.jit
def combine_send_kernel(
    expert_out_ptr,   # int32 words [ROWS, X_WORDS]: expert outputs, rows as in d.x ([L, CAP] flattened)
    row_of_ptr,       # int32 [WORLD * M, TOPK]: dispatch's row of slot (s, t, k); -1 not here, -2 dropped
    src_tokens_ptr,   # int32 [WORLD]: tokens T of every rank in that dispatch
    data_ptrs_ptr,    # int64 [WORLD]: every rank's landing zone, int32 [2, M, TOPK, X_WORDS]
    ctrl_ptrs_ptr,    # int64 [WORLD]: every rank's control words, int64 [2, WORLD, 2]
    seq_ptr,          # int64 [1]: combine calls whose send phase ran (advanced here)
    done_ptr,         # int32 [1+]: arrival counter, zero between launches
    rank,
    WORLD: tl.constexpr, WORLD_P2: tl.constexpr, M: tl.constexpr, ROWS: tl.constexpr, TOPK: tl.constexpr,
    TOPK_P2: tl.constexpr, X_WORDS: tl.constexpr, BS: tl.constexpr, BW: tl.constexpr, NBLK: tl.constexpr,
):
    blk = tl.program_id(0)
    call = tl.load(seq_ptr) + 1
    zone = call % 2
    w = tl.arange(0, WORLD_P2)
    tokens = tl.minimum(tl.maximum(tl.load(src_tokens_ptr + w, mask=w < WORLD, other=0), 0), M)
    ww = tl.arange(0, BW)
    # Slots i = (row q, k), q = (token rank s, token t) = s * M + t, as the dispatch's row_of is laid out.
    for i0 in range(blk * BS, WORLD * M * TOPK_P2, NBLK * BS):
        i = i0 + tl.arange(0, BS)
        q = i // TOPK_P2
        k = i % TOPK_P2
        s = tl.minimum(q // M, WORLD - 1)
        t = q % M
        n_tokens = tl.sum(tl.where(s[:, None] == w[None, :], tokens[None, :], 0), axis=1)
        live = (q < WORLD * M) & (k < TOPK) & (t < n_tokens) & (s != rank)  # own slots: read in place
        code = tl.load(row_of_ptr + q * TOPK + k, mask=live, other=-1)
        send = code != -1
        has_row = (code >= 0) & (code < ROWS)
        src = expert_out_ptr + tl.where(has_row, code, 0).to(tl.int64) * X_WORDS
        landing = as_ptr(tl.load(data_ptrs_ptr + s), tl.int32) + zone.to(tl.int64) * M * TOPK * X_WORDS
        dst = landing + (t * TOPK + k).to(tl.int64) * X_WORDS
        v_next = tl.load(src[:, None] + ww[None, :], mask=has_row[:, None] & (ww < X_WORDS)[None, :], other=0)
        for w0 in range(0, X_WORDS, BW):  # the next block's load is issued before this one's store
            w_live = (w0 + ww < X_WORDS)[None, :]
            v = v_next
            v_next = tl.load(src[:, None] + w0 + BW + ww[None, :],
                             mask=has_row[:, None] & (w0 + BW + ww < X_WORDS)[None, :], other=0)
            tl.store(dst[:, None] + w0 + ww[None, :], v, mask=send[:, None] & w_live)
    # The last program publishes to every rank (lanes past WORLD repeat the last rank's flag with the
    # same value) and advances the call counter.
    if arrive(done_ptr, NBLK):
        ctrl = as_ptr(tl.load(ctrl_ptrs_ptr + tl.minimum(w, WORLD - 1)), tl.int64) + (zone * WORLD + rank) * 2
        signal(ctrl + 1, call)
        tl.store(seq_ptr, call)


@triton.jit
def combine_recv_kernel(
    out_ptr,          # out [T, HIDDEN] dtype
    weights_ptr,      # [T, TOPK] floating topk_weights
    routed_ptr,       # int32 [M, TOPK]: 1 where slot (t, k) was routed by the dispatch
    expert_out_ptr,   # [ROWS, HIDDEN] dtype: this rank's expert outputs (rows as in d.x)
    row_of_ptr,       # int32 [WORLD * M, TOPK]: the dispatch's row of slot (s, t, k) on this rank
    data_ptr,         # int32 words [2, M, TOPK, HIDDEN * elem / 4]: this rank's landing zone
    ctrl_ptr,         # int64 [2, WORLD, 2]: this rank's control words
    seq_ptr,          # int64 [1]: already advanced by this call's send phase
    err_addr, timeout_ns, rank, num_tokens,
    OP: tl.constexpr, WORLD: tl.constexpr, M: tl.constexpr, ROWS: tl.constexpr, TOPK: tl.constexpr,
    TOPK_P2: tl.constexpr, HIDDEN: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, NBLK: tl.constexpr,
):
    blk = tl.program_id(0)
    c0 = tl.program_id(1) * BH  # this program's columns: [c0, c0 + BH)
    call = tl.load(seq_ptr)
    zone = call % 2
    # A program with tokens waits, and so does program (0, 0) even when T = 0: a rank must not finish
    # a combine before every peer's send of that call, or it could run two calls ahead and overwrite a
    # landing zone a peer is still reading. At world 1 every slot is read in place and there is no flag.
    if WORLD > 1:
        if (blk * BT < num_tokens) | ((blk == 0) & (tl.program_id(1) == 0)):
            for p in range(WORLD):
                wait_flag(ctrl_ptr + (zone * WORLD + p) * 2 + 1, call, timeout_ns, err_addr, OP, rank, p)
    landing = data_ptr.to(tl.pointer_type(out_ptr.dtype.element_ty)) + zone.to(tl.int64) * M * TOPK * HIDDEN
    c = tl.arange(0, BH)
    c_live = (c0 + c < HIDDEN)[None, :]
    kk = tl.arange(0, TOPK_P2)
    for t0 in range(blk * BT, num_tokens, NBLK * BT):
        t = t0 + tl.arange(0, BT)
        live = t < num_tokens
        # Per-slot words: routed, weight and this rank's row of the slot (-1: another rank's expert,
        # in the landing zone).
        slot = t[:, None] * TOPK + kk[None, :]
        slot_live = live[:, None] & (kk < TOPK)[None, :]
        use_all = tl.load(routed_ptr + slot, mask=slot_live, other=0) != 0
        w_all = tl.load(weights_ptr + slot, mask=slot_live, other=0).to(tl.float32)
        code_all = tl.load(row_of_ptr + rank * M * TOPK + slot, mask=use_all, other=-1)
        acc = tl.zeros([BT, BH], dtype=tl.float32)
        for k in tl.static_range(TOPK):
            pick = kk[None, :] == k
            use = tl.sum(tl.where(pick, use_all.to(tl.int32), 0), axis=1) != 0
            wk = tl.sum(tl.where(pick, w_all, 0.0), axis=1)
            code = tl.sum(tl.where(pick, code_all, 0), axis=1)
            here = code != -1
            has_row = (code >= 0) & (code < ROWS)
            # One load per slot: from expert_out in place, or from the landing zone; a dropped slot (-2)
            # reads nothing and adds w * 0, as the zeros a peer sends for one.
            row = tl.where(here, expert_out_ptr + tl.where(has_row, code, 0).to(tl.int64) * HIDDEN,
                           landing + (t * TOPK + k).to(tl.int64) * HIDDEN)
            v = tl.load(row[:, None] + c0 + c[None, :], mask=(use & (has_row | ~here))[:, None] & c_live,
                        other=0).to(tl.float32)
            acc = tl.where(use[:, None], acc + wk[:, None] * v, acc)
        tl.store(out_ptr + t[:, None].to(tl.int64) * HIDDEN + c0 + c[None, :], cast_rne(acc, out_ptr.dtype.element_ty),
                 mask=live[:, None] & c_live)


def _compile_configs() -> list[dict]:
    """DeepSeek-V3 decode on EP8 (hidden 7168 bf16, top-8, 128 tokens per rank), GPU launch shapes of the
    planner: what ``compile_report`` compiles for sm_90 without a GPU."""
    import torch  # noqa: PLC0415

    from ..planner import plan_ep  # noqa: PLC0415

    p = plan_ep(8, 256, 7168, 128, 8, torch.bfloat16, False, "cuda")
    label = "DSV3 EP8 bf16"
    return [
        dict(kernel="combine_send_kernel", label=label, types=dict(
            expert_out_ptr="*i32", row_of_ptr="*i32", src_tokens_ptr="*i32", data_ptrs_ptr="*i64",
            ctrl_ptrs_ptr="*i64", seq_ptr="*i64", done_ptr="*i32", rank="i32"), constexprs=dict(
            WORLD=8, WORLD_P2=8, M=128, ROWS=p.experts_per_rank * p.capacity, TOPK=8, TOPK_P2=8,
            X_WORDS=p.out_words, BS=p.block_slots, BW=p.out_block_words, NBLK=p.recv_programs)),
        dict(kernel="combine_recv_kernel", label=label, types=dict(
            out_ptr="*bf16", weights_ptr="*fp32", routed_ptr="*i32", expert_out_ptr="*bf16", row_of_ptr="*i32",
            data_ptr="*i32", ctrl_ptr="*i64", seq_ptr="*i64", err_addr="i64", timeout_ns="i64", rank="i32",
            num_tokens="i32"), constexprs=dict(
            OP=3, WORLD=8, M=128, ROWS=p.experts_per_rank * p.capacity, TOPK=8, TOPK_P2=8, HIDDEN=7168,
            BT=p.block_tokens, BH=p.block_hidden,
            NBLK=p.reduce_programs)),
    ]


COMPILE_CONFIGS = _compile_configs()
