"""Routing layout on the device: which rank and expert each (token, k) slot goes to, and where it lands.

Given one rank's ``topk_idx`` [T, K] (expert ids, -1 = not routed) and E experts spread evenly over W
ranks (L = E / W per rank, rank r owns experts [r*L, (r+1)*L)), a slot (t, k) with a valid id goes to
rank ``idx // L``, local expert ``idx % L``. Its *position* is the number of earlier slots of this rank
(in (t, k) row-major order) routed to the same expert.

Each program takes a contiguous range of tokens. It histograms the ids of every token before its range
(``histogram_of_tokens``), then walks its range a chunk at a time: a slot's position is the histogram
count for its id plus the earlier slots of the chunk with the same id (``chunk_positions``), and the
chunk's ids are added to the histogram. Programs depend on nothing but ``topk_idx``: no program waits
for another, no atomics, and the layout, and everything built on it, is deterministic. The work is
linear in T*K per program (a histogram pass over the earlier tokens), so O(T*K * programs) in all.
Per-expert counts are a histogram of the valid ids.

Ids outside [-1, E) are not routed; ``load_topk_chunk`` reports them so the caller can record the error.

The helpers are fused into the dispatch send kernel (``dispatch.py``); ``routing_kernel`` /
``compute_routing`` expose the same computation on its own (one program, for tests and for callers that
want the layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..interpreter import kernel_for
from ..planner import next_pow2
from .sync import ERR_INDEX, S_LIVE, record_error


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
def scan_ids(idx_ptr, routed_ptr, excluded_ptr, grp, rank, num_tokens, num_experts, OP: tl.constexpr,
             TOPK: tl.constexpr, TOPK_P2: tl.constexpr, EXPERTS_PER_RANK: tl.constexpr, CHUNK_T: tl.constexpr,
             BINS: tl.constexpr, ONE_RANK: tl.constexpr = False):
    """One pass over all slots: returns the per-expert counts (int32 [BINS], a histogram of the valid
    ids), writes the combine's mask (``routed`` [T, TOPK] int32: 1 + the expert's rank where the id is
    valid and that rank is live, else 0), adds the slots whose expert's rank is excluded to ``excluded`` (int64 [1]),
    and records the first bad id (ERR_INDEX naming its flat slot and value).

    ``ONE_RANK`` (world 1): every expert is this rank's, and a rank is live to itself (it cannot exclude
    itself), so no rank's live word is read: that read waits for the ids, one more memory round trip."""
    counts = tl.zeros([BINS], dtype=tl.int32)
    excluded = tl.zeros([CHUNK_T * TOPK_P2], dtype=tl.int64)
    for t0 in range(0, num_tokens, CHUNK_T):
        t, k, idx, live, valid, bad = load_topk_chunk(idx_ptr, t0, num_tokens, num_experts, TOPK, TOPK_P2, CHUNK_T)
        counts += tl.histogram(idx, BINS, mask=valid)
        owner = tl.where(valid, idx // EXPERTS_PER_RANK, 0)
        if ONE_RANK:
            owner_live = valid
        else:
            owner_live = tl.load(grp + S_LIVE + owner, mask=valid, other=0) != 0
        tl.store(routed_ptr + t * TOPK + k, tl.where(valid & owner_live, owner + 1, 0).to(tl.int32), mask=live)
        excluded += (valid & ~owner_live).to(tl.int64)
        if tl.sum(bad.to(tl.int32)) > 0:  # chunks in order, first error wins: the first bad slot is recorded
            slot, value = first_bad_slot(t, k, idx_ptr, bad, TOPK)
            record_error(grp, ERR_INDEX, OP, rank, slot, value, num_experts)
    n_excluded = tl.sum(excluded)
    if n_excluded > 0:
        tl.atomic_add(excluded_ptr, n_excluded, sem="relaxed")
    return counts


@triton.jit
def histogram_of_tokens(idx_ptr, t_begin, t_end, num_experts,
                        TOPK: tl.constexpr, TOPK_P2: tl.constexpr, SCAN_T: tl.constexpr, BINS: tl.constexpr):
    """int32 [BINS]: how many valid slots of tokens [t_begin, t_end) name each expert id."""
    counts = tl.zeros([BINS], dtype=tl.int32)
    for c0 in range(t_begin, t_end, SCAN_T):
        t, k, idx, live, valid, bad = load_topk_chunk(idx_ptr, c0, t_end, num_experts, TOPK, TOPK_P2, SCAN_T)
        counts += tl.histogram(idx, BINS, mask=valid)
    return counts


@triton.jit
def chunk_positions(idx, slot, counts_before, BINS: tl.constexpr):
    """Positions of a chunk of slots (ids ``idx``, -1 where not valid; flat indices ``slot`` = t*TOPK + k;
    both [N]), given ``counts_before`` [BINS] = valid slots of every earlier token per id: that count
    for the slot's id plus the earlier slots of the chunk with the same id. Only the positions of valid
    slots mean anything. Returns (positions [N], counts_before plus this chunk's ids [BINS]).

    The running counts are a comparison sum over the [N, BINS] equality tile the lookup needs anyway,
    not ``tl.histogram``: a chunk is often one token (8 slots), smaller than the threads of a program,
    a shape whose histogram lowering some Triton versions have miscounted.
    """
    bins = tl.arange(0, BINS)
    hit = idx[:, None] == bins[None, :]  # -1 (not valid) hits no bin
    before = tl.sum(tl.where(hit, counts_before[None, :], 0), axis=1)
    same = (idx[:, None] == idx[None, :]) & (slot[None, :] < slot[:, None])
    return before + tl.sum(same.to(tl.int32), axis=1), counts_before + tl.sum(hit.to(tl.int32), axis=0)


@triton.jit
def token_reach(owner, BT: tl.constexpr, TOPK_P2: tl.constexpr, WORLD_P2: tl.constexpr):
    """int32 [BT, WORLD_P2]: 1 where token t of a chunk has a slot on rank w (``owner`` [BT * TOPK_P2]: the
    rank of each slot, -1 not routed)."""
    w = tl.arange(0, WORLD_P2)
    return tl.max((tl.reshape(owner, (BT, TOPK_P2))[:, :, None] == w[None, None, :]).to(tl.int32), axis=1)


@triton.jit
def reach_of_tokens(idx_ptr, t_begin, t_end, num_experts, TOPK: tl.constexpr, TOPK_P2: tl.constexpr,
                    EXPERTS_PER_RANK: tl.constexpr, WORLD_P2: tl.constexpr, SCAN_T: tl.constexpr):
    """int32 [WORLD_P2]: tokens of [t_begin, t_end) with a valid slot on each rank (a token counts once
    per rank): the rows a rank gets from tokens [t_begin, t_end) when only the routed rows travel."""
    rows = tl.zeros([WORLD_P2], dtype=tl.int32)
    for c0 in range(t_begin, t_end, SCAN_T):
        t, k, idx, live, valid, bad = load_topk_chunk(idx_ptr, c0, t_end, num_experts, TOPK, TOPK_P2, SCAN_T)
        rows += tl.sum(token_reach(tl.where(valid, idx // EXPERTS_PER_RANK, -1), SCAN_T, TOPK_P2, WORLD_P2), axis=0)
    return rows


@triton.jit
def packed_rows(owner, rows_before, BT: tl.constexpr, TOPK_P2: tl.constexpr, WORLD_P2: tl.constexpr):
    """Packed row of each token of a chunk on each rank, when a rank gets only the rows routed to it, in
    token order: ``owner`` [BT * TOPK_P2] as in ``token_reach``, ``rows_before`` [WORLD_P2] the rows of
    every earlier token (``reach_of_tokens``). Returns (row [BT, WORLD_P2], meaningful where reach;
    reach [BT, WORLD_P2]; rows_before plus this chunk's)."""
    reach = token_reach(owner, BT, TOPK_P2, WORLD_P2)
    return rows_before[None, :] + tl.cumsum(reach, axis=0) - reach, reach, rows_before + tl.sum(reach, axis=0)


@triton.jit
def token_destinations(owner, t_live, grp, failed, BT: tl.constexpr, TOPK_P2: tl.constexpr):
    """Where each token of a chunk goes, once per rank: ``owner`` [BT * TOPK_P2] is the rank of each slot
    (-1 not routed), ``t_live`` [BT] the tokens that exist. Returns (rank [BT, TOPK_P2] >= 0, write
    [BT, TOPK_P2]): slot k carries token t's row to its rank if that rank is live, no earlier slot of the
    token names it (so a rank gets the row once), and the group has not ``failed``."""
    kk = tl.arange(0, TOPK_P2)
    slot_owner = tl.reshape(owner, (BT, TOPK_P2))
    earlier = (slot_owner[:, :, None] == slot_owner[:, None, :]) & (kk[None, None, :] < kk[None, :, None])
    first = tl.max(earlier.to(tl.int32), axis=2) == 0
    to = tl.maximum(slot_owner, 0)
    owner_live = tl.load(grp + S_LIVE + to, mask=slot_owner >= 0, other=0) != 0
    return to, tl.where(failed, False, (slot_owner >= 0) & first & owner_live & t_live[:, None])


@triton.jit
def routing_kernel(
    idx_ptr,            # [T, TOPK] int32/int64 expert ids, -1 = not routed
    expert_counts_ptr,  # out int32 [WORLD * EXPERTS_PER_RANK]: slots routed to each expert
    rank_tokens_ptr,    # out int32 [WORLD]: tokens with at least one slot on each rank
    position_ptr,       # out int32 [T, TOPK]: position of the slot among this rank's slots for its expert; -1
    num_tokens, num_experts,
    WORLD: tl.constexpr, RANKS_P2: tl.constexpr, TOPK: tl.constexpr, TOPK_P2: tl.constexpr,
    EXPERTS_PER_RANK: tl.constexpr, BINS: tl.constexpr, CHUNK_T: tl.constexpr,
):
    # One program; BINS >= max(32, WORLD * EXPERTS_PER_RANK), a power of two (histogram bins).
    dest = tl.arange(0, RANKS_P2)
    counts = tl.zeros([BINS], dtype=tl.int32)
    tokens = tl.zeros([RANKS_P2], dtype=tl.int32)
    for t0 in range(0, num_tokens, CHUNK_T):
        t, k, idx, live, valid, bad = load_topk_chunk(idx_ptr, t0, num_tokens, num_experts,
                                                      TOPK, TOPK_P2, CHUNK_T)
        pos, counts = chunk_positions(idx, t * TOPK + k, counts, BINS)
        tl.store(position_ptr + t.to(tl.int64) * TOPK + k, tl.where(valid, pos, -1), mask=live)
        hit = (tl.where(valid, idx // EXPERTS_PER_RANK, -1)[None, :] == dest[:, None]).to(tl.int32)
        token_hit = tl.max(tl.reshape(hit, (RANKS_P2, CHUNK_T, TOPK_P2)), axis=2)
        tokens += tl.sum(token_hit, axis=1)
    g = tl.arange(0, BINS)
    tl.store(expert_counts_ptr + g, counts, mask=g < WORLD * EXPERTS_PER_RANK)
    tl.store(rank_tokens_ptr + dest, tokens, mask=dest < WORLD)


def histogram_bins(num_experts: int) -> int:
    """Bins of the per-expert histogram: a power of two, at least a warp (the GPU lowering's minimum)."""
    return max(32, next_pow2(num_experts))


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
    if chunk_tokens is None:  # one [chunk*K, chunk*K] comparison tile: 2**20 elements on CPU, 1024 on a GPU
        slots = 32 if dev.type == "cuda" else 1024  # 64 slots already take 255 registers on sm_90
        chunk_tokens = max(1, min(next_pow2(max(T, 1)), slots // next_pow2(K)))
    kernel_for(routing_kernel, dev)[(1,)](
        idx, layout.expert_counts, layout.rank_tokens, layout.position, T, num_experts,
        WORLD=world_size, RANKS_P2=next_pow2(world_size), TOPK=K, TOPK_P2=next_pow2(K),
        EXPERTS_PER_RANK=L, BINS=histogram_bins(num_experts), CHUNK_T=next_pow2(chunk_tokens))
    layout.position = layout.position[:T]
    return layout
