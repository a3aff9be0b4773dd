"""A MoE layer's prefill for any number of tokens: ``PrefillBuffer`` calls over chunks of its capacity.

The chunks run one after another (dispatch, experts, combine): with one landing zone per buffer the
dispatch of chunk i+1 cannot start before the combine of chunk i has released every zone, so this
function does not overlap them (docs/prefill.md, "Not done").
"""

from __future__ import annotations

from typing import Callable

import torch

from .prefill import PrefillBuffer, PrefillDispatchResult


def num_chunks(max_tokens_over_ranks: int, buf: PrefillBuffer) -> int:
    """Chunks a batch needs: ceil(the largest T of any rank / max_tokens_per_rank), at least 1."""
    return max(1, -(-int(max_tokens_over_ranks) // buf.max_tokens_per_rank))


def prefill_moe(buf: PrefillBuffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                experts: Callable[[PrefillDispatchResult], torch.Tensor], chunks: int,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """y [T, hidden] for x [T, hidden] (any T), topk_idx / topk_weights [T, topk], in ``chunks`` calls.

    chunks    the same on every rank (collective): ``num_chunks(max T over ranks, buf)``, which the
              engine's scheduler knows; chunk c of this rank is tokens [c*M, (c+1)*M) (possibly none).
    experts   d -> expert_out [world * M, hidden]: this rank's partial rows for what it received
              (``PrefillBuffer.combine``); it may write them into d.recv_x and return it.
    out       optional [T, hidden] contiguous tensor, written in place and returned.
    Every rank's y is what one ``dispatch`` + ``combine`` of all its tokens would give, chunk by chunk.
    """
    T, m = x.shape[0], buf.max_tokens_per_rank
    if chunks * m < T:
        raise ValueError(f"{T} tokens need {num_chunks(T, buf)} chunks of {m}, got chunks={chunks}: pass "
                         f"num_chunks(max T over ranks, buf), the same on every rank")
    if out is None:
        out = torch.empty_like(x)
    for c in range(chunks):
        lo, hi = min(c * m, T), min((c + 1) * m, T)
        d = buf.dispatch(x[lo:hi], topk_idx[lo:hi], topk_weights[lo:hi])
        buf.combine(experts(d), d.handle, out=out[lo:hi])
    return out
