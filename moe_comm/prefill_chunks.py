"""A MoE layer's prefill for any number of tokens: ``PrefillBuffer`` calls over chunks of its capacity.

With ``zones=1`` the chunks run one after another (dispatch, experts, combine): the next dispatch would
write the zone the combine reads. With ``zones=2`` (twice the zone memory; or the same memory at half
the capacity per chunk, docs/prefill.md) the dispatch of chunk c+1 is issued before the experts of
chunk c and writes the other zone: on CUDA it runs on a side stream while the experts run on the
caller's stream, so its bytes cross the links under the experts' compute. The order of the calls is

    dispatch(0), dispatch(1), experts(0), combine(0), dispatch(2), experts(1), combine(1), ...

which keeps at most two dispatches in flight: dispatch(c+2) comes after combine(c), whose zone it reuses.

``local_experts(buf, expert_fn)`` turns a model's per-expert function into the ``experts`` argument:
a MoE layer's prefill is ``prefill_moe(buf, h, topk_idx, topk_weights, local_experts(buf, mlp), chunks)``.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import torch

from .prefill import PrefillBuffer, PrefillDispatchResult
from .reference import dequantize_fp8, dequantize_nvfp4

_SIDE_STREAMS: dict = {}   # device -> the CUDA stream the overlapped dispatches run on


def num_chunks(max_tokens_over_ranks: int, buf: PrefillBuffer) -> int:
    """Chunks a batch needs: ceil(the largest T of any rank / max_tokens_per_rank), at least 1."""
    return max(1, -(-int(max_tokens_over_ranks) // buf.max_tokens_per_rank))


def side_stream(device: torch.device):
    """The CUDA stream of overlapped dispatches on ``device`` (one per device, made once); None on a CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


def prefill_moe(buf: PrefillBuffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                experts: Callable[[PrefillDispatchResult], torch.Tensor], chunks: int,
                out: torch.Tensor | None = None, global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """y [T, hidden] for x [T, hidden] (any T), topk_idx / topk_weights [T, topk], in ``chunks`` calls.

    chunks    the same on every rank (collective): ``num_chunks(max T over ranks, buf)``, which the
              engine's scheduler knows; chunk c of this rank is tokens [c*M, (c+1)*M) (possibly none).
    experts   d -> expert_out [world * M, hidden]: this rank's partial rows for what it received
              (``PrefillBuffer.combine``); it may write them into d.recv_x and return it. It runs on the
              caller's stream; with ``buf.zones == 2`` the next chunk's dispatch is in flight meanwhile
              (on CUDA on ``side_stream(device)``), in the other zone: ``d`` stays valid.
    out       optional [T, hidden] contiguous tensor, written in place and returned.
    global_scale  the nvfp4 dispatch's (``PrefillBuffer.dispatch``), for every chunk; None otherwise.
    Every rank's y is what one ``dispatch`` + ``combine`` of all its tokens would give, bitwise, chunk by
    chunk, with one zone or two. Eager only (the chunk count and the streams are host decisions); the
    calls raise the buffer's errors as they come (a failed chunk raises on every rank: no partial y is
    returned).
    """
    T, m = x.shape[0], buf.max_tokens_per_rank
    if chunks * m < T:
        raise ValueError(f"{T} tokens need {num_chunks(T, buf)} chunks of {m}, got chunks={chunks}: pass "
                         f"num_chunks(max T over ranks, buf), the same on every rank")
    if out is None:
        out = torch.empty_like(x)
    side = side_stream(x.device) if buf.zones > 1 else None
    main = torch.cuda.current_stream(x.device) if side is not None else None
    if side is not None:
        side.wait_stream(main)   # the inputs were made on the caller's stream

    def rows(c: int) -> slice:
        return slice(min(c * m, T), min((c + 1) * m, T))

    def dispatch(c: int):
        s = rows(c)
        if side is None:
            return buf.dispatch(x[s], topk_idx[s], topk_weights[s], global_scale=global_scale), None
        with torch.cuda.stream(side):
            d = buf.dispatch(x[s], topk_idx[s], topk_weights[s], global_scale=global_scale)
            landed = torch.cuda.Event()
            landed.record(side)
        return d, landed

    in_flight, issued = deque(), 0
    for c in range(chunks):
        while issued < chunks and len(in_flight) < buf.zones:
            in_flight.append(dispatch(issued))
            issued += 1
        d, landed = in_flight.popleft()
        if landed is not None:
            main.wait_event(landed)
        buf.combine(experts(d), d.handle, out=out[rows(c)])
    return out


def local_experts(buf: PrefillBuffer, expert_fn: Callable[[int, torch.Tensor], torch.Tensor]
                  ) -> Callable[[PrefillDispatchResult], torch.Tensor]:
    """The ``experts`` argument of ``prefill_moe`` for a model whose local expert e (0 <= e < L) maps rows
    [n, hidden] buf.dtype -> [n, hidden] (e.g. ``serving.model.gated_mlp`` with expert e's weights).

    Partial row q (the combine's input) = sum over k with recv_topk_idx[q, k] >= 0, in k order, of
    recv_topk_weights[q, k] * expert_fn(recv_topk_idx[q, k], x[q]), in float32, rounded to buf.dtype;
    x = recv_x (fp8 or nvfp4 dispatch: dequantized with recv_scales (and the global scale) and rounded to
    buf.dtype first). Rows past a source's token count are not computed. With neither, and no fp8
    combine, the partial rows are written over recv_x (the combine then copies nothing). Eager: which rows each expert has is read on the host (a sync per
    call), as a plain reference of the grouped GEMM an engine passes instead. Bitwise reproducible when
    expert_fn computes each row independently of the others.
    """
    m, dtype = buf.max_tokens_per_rank, buf.dtype

    def experts(d: PrefillDispatchResult) -> torch.Tensor:
        rows_total = d.recv_x.shape[0]
        q = torch.arange(rows_total, device=d.recv_x.device)
        mine = q % m < d.src_tokens.repeat_interleave(m)
        ids = torch.where(mine[:, None], d.recv_topk_idx, -1)
        x = dequantized(d, dtype)
        acc = torch.zeros(rows_total, x.shape[1], dtype=torch.float32, device=x.device)
        outs = {}
        for e in range(buf.num_local_experts):   # each expert once, on every row that routes to it
            rows = (ids == e).any(dim=1).nonzero().flatten()
            if rows.numel():
                outs[e] = rows, expert_fn(e, x[rows]).float()
        for k in range(buf.topk):                # then the sum in k order (one expert per (row, k))
            for e, (rows, y) in outs.items():
                take = (ids[rows, k] == e)[:, None]
                acc[rows] += torch.where(take, d.recv_topk_weights[rows, k, None] * y, 0.0)
        in_place = d.recv_scales is None and buf.combine_format is None   # (PrefillBuffer.combine's in place)
        out = d.recv_x if in_place else torch.empty_like(acc, dtype=dtype)
        out.copy_(acc)
        return out

    return experts


def dequantized(d: PrefillDispatchResult, dtype: torch.dtype) -> torch.Tensor:
    """d.recv_x [R, hidden] in ``dtype``: as received, or dequantized (fp8: with recv_scales; nvfp4: with
    recv_scales and d.global_scale) and rounded to ``dtype``. The experts' input, on any device."""
    if d.recv_scales is None:
        return d.recv_x
    if d.global_scale is not None:
        return dequantize_nvfp4(d.recv_x, d.recv_scales, d.global_scale).to(dtype)
    return dequantize_fp8(d.recv_x, d.recv_scales).to(dtype)
