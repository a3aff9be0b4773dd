"""Routing layout on the device: which rank and expert each (token, k) slot goes to, and where it lands.

Given one rank's ``topk_idx`` [T, K] (expert ids, -1 = not routed) and E experts spread evenly over W
ranks (L = E / W per rank, rank r owns experts [r*L, (r+1)*L)), a slot (t, k) with a valid id goes to
rank ``idx // L``, local expert ``idx % L``. Its *position* is the number of earlier slots of this rank
(in (t, k) row-major order) routed to the same expert. Positions come from prefix sums over a one-hot
[slots, L] matrix, chunk by chunk with running per-expert totals: no atomics, so the layout, and
everything built on it, is deterministic.

Ids outside [-1, E) are not routed; ``load_topk_chunk`` reports them so the caller can record the error.

The helpers are fused into the dispatch send kernel (``dispatch.py``), where each program computes
the layout for a block of destination ranks (one rank per program on a GPU, all of them on CPU);
``routing_kernel`` / ``compute_routing`` expose the same computation on its own (one program, for
tests and for callers that want the layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..planner import next_pow2


@triton.jit
def load_topk_chunk(idx_ptr, t0, num_tokens, num_experts,
                    TOPK: tl.constexpr, TOPK_P2: tl.constexpr, CHUNK_T: tl.constexpr):
    """Slots of tokens [t0, t0 + CHUNK_T), flattened in (t, k) order (k padded to TOPK_P2).

    Returns (t, k, idx, live, valid, bad), all [CHUNK_T * TOPK_P2]:
    live  = the slot exists (t < num_tokens, k < TOPK)
    idx   = int32 expert id where valid, else -1 (an out-of-range int64 id never wraps into range)
    valid = live and 0 <= id < num_experts;  bad = live and the id is neither valid nor -1
    """
    i = tl.arange(0, CHUNK_T * TOPK_P2)
    t = t0 + i // TOPK_P2
    k = i % TOPK_P2
    live = (t < num_tokens) & (k < TOPK)
    raw = tl.load(idx_ptr + t.to(tl.int64) * TOPK + k, mask=live, other=-1)
    valid = live & (raw >= 0) & (raw < num_experts)
    bad = live & ((raw < -1) | (raw >= num_experts))
    idx = tl.where(valid, raw, -1).to(tl.int32)
    return t, k, idx, live, valid, bad


@triton.jit
def first_bad_slot(t, k, raw_idx_ptr, bad, TOPK: tl.constexpr):
    """(slot t*TOPK + k, id) of the first bad slot in (t, k) order; call only when tl.sum(bad) > 0."""
    slot = t.to(tl.int64) * TOPK + k
    first = tl.min(tl.where(bad, slot, 1 << 62))
    value = tl.load(raw_idx_ptr + first).to(tl.int64)
    return first, value


@triton.jit
def positions_for_ranks(idx, valid, dest, running, EXPERTS_PER_RANK: tl.constexpr, EXPERTS_P2: tl.constexpr):
    """Slots of a chunk routed to each rank of ``dest`` [R] and their positions per local expert.

    ``running`` [R, EXPERTS_P2] int32: slots of earlier chunks routed to each local expert of each rank.
    Returns (hit, local_expert, position) [R, slots] and running + this chunk's counts; position is
    meaningful where hit.
    """
    local = tl.where(valid[None, :], idx[None, :] - dest[:, None] * EXPERTS_PER_RANK, -1)
    hit = (local >= 0) & (local < EXPERTS_PER_RANK)
    e = tl.arange(0, EXPERTS_P2)
    one_hot = (hit[:, :, None] & (local[:, :, None] == e[None, None, :])).to(tl.int32)  # [R, slots, L]
    inclusive = tl.cumsum(one_hot, 1)
    position = tl.sum(one_hot * (inclusive - 1 + running[:, None, :]), axis=2)
    return hit, local, position, running + tl.sum(one_hot, axis=1)


@triton.jit
def routing_kernel(
    idx_ptr,            # [T, TOPK] int32/int64 expert ids, -1 = not routed
    expert_counts_ptr,  # out int32 [WORLD * EXPERTS_PER_RANK]: slots routed to each expert
    rank_tokens_ptr,    # out int32 [WORLD]: tokens with at least one slot on each rank
    position_ptr,       # out int32 [T, TOPK]: position of the slot among this rank's slots for its expert; -1
    num_tokens, num_experts,
    WORLD: tl.constexpr, RANKS_P2: tl.constexpr, TOPK: tl.constexpr, TOPK_P2: tl.constexpr,
    EXPERTS_PER_RANK: tl.constexpr, EXPERTS_P2: tl.constexpr, CHUNK_T: tl.constexpr,
):
    # One program for all destination ranks (RANKS_P2 >= WORLD lanes, the extra ones masked off).
    dest = tl.arange(0, RANKS_P2)
    dest_live = dest < WORLD
    running = tl.zeros([RANKS_P2, EXPERTS_P2], dtype=tl.int32)
    tokens = tl.zeros([RANKS_P2], dtype=tl.int32)
    for t0 in range(0, num_tokens, CHUNK_T):
        t, k, idx, live, valid, bad = load_topk_chunk(idx_ptr, t0, num_tokens, num_experts,
                                                      TOPK, TOPK_P2, CHUNK_T)
        hit, local, pos, running = positions_for_ranks(idx, valid, dest, running, EXPERTS_PER_RANK, EXPERTS_P2)
        # A valid slot hits exactly one rank: collapse the rank axis.
        tl.store(position_ptr + t.to(tl.int64) * TOPK + k, tl.sum(tl.where(hit, pos, 0), axis=0), mask=valid)
        tl.store(position_ptr + t.to(tl.int64) * TOPK + k, -1, mask=live & ~valid)
        token_hit = tl.max(tl.reshape(hit.to(tl.int32), (RANKS_P2, CHUNK_T, TOPK_P2)), axis=2)
        tokens += tl.sum(token_hit, axis=1)
    e = tl.arange(0, EXPERTS_P2)
    tl.store(expert_counts_ptr + dest[:, None] * EXPERTS_PER_RANK + e[None, :], running,
             mask=dest_live[:, None] & (e < EXPERTS_PER_RANK)[None, :])
    tl.store(rank_tokens_ptr + dest, tokens, mask=dest_live)


@dataclass
class RoutingLayout:
    """Device routing layout of one rank's ``topk_idx`` (everything int32, on the input's device)."""

    expert_counts: torch.Tensor  # [E]: slots routed to each expert (invalid ids excluded)
    rank_tokens: torch.Tensor    # [W]: tokens sent to each rank; a token goes at most once to a rank
    position: torch.Tensor       # [T, K]: index of the slot among this rank's slots for the same expert,
    #                              counted in (t, k) order; -1 where the slot is not routed


def compute_routing(topk_idx: torch.Tensor, num_experts: int, world_size: int,
                    chunk_tokens: int | None = None) -> RoutingLayout:
    """Routing layout of ``topk_idx`` [T, K] (int32/int64 on any device Triton runs on); no host sync."""
    if topk_idx.dim() != 2:
        raise ValueError(f"topk_idx must be [T, K], got shape {tuple(topk_idx.shape)}")
    if num_experts % world_size:
        raise ValueError(f"num_experts={num_experts} is not a multiple of world_size={world_size}")
    T, K = topk_idx.shape
    L = num_experts // world_size
    dev = topk_idx.device
    idx = topk_idx.contiguous() if T > 0 else torch.full((1, K), -1, dtype=topk_idx.dtype, device=dev)
    layout = RoutingLayout(torch.empty(num_experts, dtype=torch.int32, device=dev),
                           torch.empty(world_size, dtype=torch.int32, device=dev),
                           torch.empty((max(T, 1), K), dtype=torch.int32, device=dev))
    if chunk_tokens is None:
        chunk_tokens = max(1, min(next_pow2(max(T, 1)), 16384 // (next_pow2(K) * next_pow2(num_experts))))
    routing_kernel[(1,)](
        idx, layout.expert_counts, layout.rank_tokens, layout.position, T, num_experts,
        WORLD=world_size, RANKS_P2=next_pow2(world_size), TOPK=K, TOPK_P2=next_pow2(K),
        EXPERTS_PER_RANK=L, EXPERTS_P2=next_pow2(L), CHUNK_T=next_pow2(chunk_tokens))
    layout.position = layout.position[:T]
    return layout


# What ``compile_report`` compiles for sm_90 without a GPU: DeepSeek-V3 routing (256 experts, top-8, EP8).
COMPILE_CONFIGS = [dict(
    kernel="routing_kernel", label="DSV3 EP8", types=dict(
        idx_ptr="*i64", expert_counts_ptr="*i32", rank_tokens_ptr="*i32", position_ptr="*i32",
        num_tokens="i32", num_experts="i32"),
    constexprs=dict(WORLD=8, RANKS_P2=8, TOPK=8, TOPK_P2=8, EXPERTS_PER_RANK=32, EXPERTS_P2=32, CHUNK_T=1))]
