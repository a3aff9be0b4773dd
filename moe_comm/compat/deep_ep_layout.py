"""DeepEP's receive layouts from moe-comm results: the low-latency layout (on the device, from an EPBuffer
dispatch result) and the normal mode's packed receive (from a PrefillBuffer dispatch result). Used by
``moe_comm.compat.deep_ep`` and the SGLang dispatcher.

Pure tensor functions (no host reads: CUDA-graph capturable). R = num_ranks * num_max_dispatch_tokens_per_rank.

- ``src_info``      int32 [L, R]: for each valid row, the row's token index on its source rank (DeepEP's
                    ``handle[0]``); EPBuffer's ``d.src`` holds source_rank * M + token_index.
- ``layout_range``  int64 [L, num_ranks]: (first row << 32) | rows, per (local expert, source rank)
                    (DeepEP's ``handle[1]``). EPBuffer packs each expert's rows sorted by source rank, so
                    every source rank's rows are one contiguous run.
- ``column_major_scales``  [L, R, S] with strides (S * R, 1, R): DeepEP returns fp8 scales with the
                    last two dimensions column-major (the layout TMA loads in grouped GEMMs such as
                    DeepGEMM's masked layout take): float32 S = H/128, or int32 S = H/512 packed UE8M0
                    (``use_ue8m0``); EPBuffer's ``d.scales`` is row-major.
"""

from __future__ import annotations

import torch

RANGE_SHIFT = 32   # layout_range = (begin << RANGE_SHIFT) | count


def src_info(src: torch.Tensor, max_tokens_per_rank: int, out: torch.Tensor) -> torch.Tensor:
    """``out`` [L, R] int32 = token index at the source of each row (``src % M``); rows past a count hold
    unspecified values, as ``src`` does."""
    return torch.remainder(src, max_tokens_per_rank, out=out)


def layout_range(src: torch.Tensor, counts: torch.Tensor, max_tokens_per_rank: int, num_ranks: int,
                 out: torch.Tensor) -> torch.Tensor:
    """``out`` [L, num_ranks] int64 = (begin << 32) | count of each source rank's run of rows per local
    expert. Reads only rows below ``counts`` (the rest of ``src`` may hold anything)."""
    L, R = src.shape
    rows = torch.arange(R, device=src.device)
    valid = rows.unsqueeze(0) < counts.unsqueeze(1).to(torch.int64)
    # Source rank of each valid row; num_ranks past the count, so that every row stays sorted.
    rank_of = torch.where(valid, torch.div(src, max_tokens_per_rank, rounding_mode="floor").to(torch.int64),
                          num_ranks).contiguous()
    ranks = torch.arange(num_ranks, device=src.device, dtype=torch.int64).expand(L, num_ranks).contiguous()
    begin = torch.searchsorted(rank_of, ranks, right=False)
    end = torch.searchsorted(rank_of, ranks, right=True)
    return torch.bitwise_or(torch.bitwise_left_shift(begin, RANGE_SHIFT), end - begin, out=out)


def empty_column_major_scales(num_local_experts: int, rows: int, num_scales: int, device,
                              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``dtype`` [L, R, num_scales] whose last two dimensions are column-major (stride 1 along R)."""
    return torch.empty((num_local_experts, num_scales, rows), dtype=dtype, device=device).transpose(1, 2)


def column_major_scales(scales: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``scales`` ([L, R, S], float32 or packed int32) with DeepEP's strides (column-major over the R rows):
    copied into ``out`` (from ``empty_column_major_scales``) or into a new tensor."""
    if out is None:
        out = empty_column_major_scales(scales.shape[0], scales.shape[1], scales.shape[2], scales.device,
                                        scales.dtype)
    return out.copy_(scales)


def tokens_per_node(is_token_in_rank: torch.Tensor, ranks_per_node: int) -> torch.Tensor:
    """int32 [N]: tokens with an expert on a rank of each node of ``ranks_per_node`` consecutive ranks
    (DeepEP's ``num_tokens_per_rdma_rank``), from ``is_token_in_rank`` bool [T, W]."""
    T, W = is_token_in_rank.shape
    return is_token_in_rank.view(T, W // ranks_per_node, ranks_per_node).any(dim=2).sum(dim=0).to(torch.int32)


def split_range(layout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(begin, count) int64 tensors of a ``layout_range`` tensor."""
    return torch.bitwise_right_shift(layout, RANGE_SHIFT), torch.bitwise_and(layout, (1 << RANGE_SHIFT) - 1)


# ---- normal mode (PrefillBuffer) ----------------------------------------------------------------------

def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    """DeepEP's ``get_dispatch_layout`` on the device: topk_idx [T, K] (-1 = not routed; ids outside
    [0, num_experts) count nowhere) -> (num_tokens_per_rank int32 [W]: tokens with an expert on each rank,
    num_tokens_per_expert int32 [E], is_token_in_rank bool [T, W]); experts placed linearly."""
    idx = topk_idx.long()
    valid = (idx >= 0) & (idx < num_experts)
    ranks = torch.arange(num_ranks, device=idx.device)
    owner = torch.where(valid, idx // (num_experts // num_ranks), num_ranks)
    is_token_in_rank = (owner[:, :, None] == ranks).any(dim=1)
    return (is_token_in_rank.sum(0, dtype=torch.int32),
            torch.bincount(idx[valid], minlength=num_experts).to(torch.int32), is_token_in_rank)


class PackedReceive:
    """DeepEP's normal-mode receive from a ``PrefillDispatchResult`` ``d``: every row holding an expert of
    this rank, once, in (source rank, token index) order.

    x [N, hidden] (dtype, or float8_e4m3fn with fp8 dispatch), scales [N, S] (float32, or int32 packed
    UE8M0) or None, topk_idx int64 [N, K] local ids (-1 elsewhere), topk_weights float32 [N, K] (0 where
    -1), counts list of L ints: slots per local expert rounded up to ``expert_alignment``.
    ``combine(buf, y)``: y [N, hidden] (row i answers x[i]) -> buf.combine's [T, hidden] output.

    N is read on the host (as DeepEP's normal mode does), unless ``num_worst_tokens`` > 0 (DeepEP's
    fixed-size receive, for CUDA graphs): then N = num_worst_tokens and nothing is read on the host. The
    rows are gathered on the device; rows past the received count have topk_idx -1 and weights 0 (their
    x and scales are unspecified), counts is [] (DeepEP returns an empty list then), and ``received``
    (int64 [1] on the device) holds the count. A rank that received more rows than num_worst_tokens keeps
    the first num_worst_tokens (``received`` tells; compat.deep_ep records a CapacityError).
    """

    def __init__(self, d, expert_alignment: int = 1, num_worst_tokens: int = 0):
        self._zone, self.handle = d.recv_x, d.handle
        self.worst = int(num_worst_tokens)
        if not self.worst:
            ex = d.exact()
            self.rows, self.x, self.scales = ex["rows"], ex["x"], ex["scales"]
            self.topk_idx, self.topk_weights = ex["topk_idx"].to(torch.int64), ex["topk_weights"]
            self.counts = [-(-c // expert_alignment) * expert_alignment for c in d.expert_counts.tolist()]
            self.valid = self.received = None
            return
        mine = d.received_rows() & (d.recv_topk_idx >= 0).any(dim=1)        # [R]: rows this rank answers
        ends = torch.cumsum(mine, 0)                                         # rows answered up to each row
        self.received = ends[-1:]
        slot = torch.arange(1, self.worst + 1, device=ends.device)
        # Output row j holds the (j+1)-th answered row: the first row whose running count reaches j + 1.
        self.rows = torch.searchsorted(ends, slot).clamp(max=ends.shape[0] - 1)
        self.valid = slot <= self.received                                   # [worst]: rows j < N
        self.x = d.recv_x.index_select(0, self.rows)
        self.scales = None if d.recv_scales is None else d.recv_scales.index_select(0, self.rows)
        self.topk_idx = torch.where(self.valid[:, None], d.recv_topk_idx.index_select(0, self.rows).to(torch.int64),
                                    -1)
        self.topk_weights = torch.where(self.valid[:, None], d.recv_topk_weights.index_select(0, self.rows), 0.0)
        self.counts = []

    def combine(self, buf, y: torch.Tensor, out: torch.Tensor | None = None, phase: str = "both"):
        """Put y's rows back at their rank-major places and combine (send phase, or both). With a bf16
        dispatch the places are the landing zone's own rows, which the combine then reads in place
        (nothing else is copied); with fp8, or a fixed-size receive, they are a new [R, hidden] tensor
        (the fixed-size one scattered on the device: rows j >= N of y are not read)."""
        n = self.rows.shape[0]
        if y.shape != (n, buf.hidden) or y.dtype != buf.dtype:
            raise ValueError(f"the combine takes one {buf.dtype} row per received row: [{n}, {buf.hidden}], got "
                             f"{tuple(y.shape)} {y.dtype}")
        if self.worst:
            # -0.0 is the identity of float addition (x + -0.0 == x for every x, -0.0 included): every row
            # answered gets exactly its y row; rows j >= N add -0.0 wherever their index points.
            rows = torch.full((self._zone.shape[0], buf.hidden), -0.0, dtype=buf.dtype, device=y.device)
            rows.index_add_(0, self.rows, torch.where(self.valid[:, None], y, -0.0))
        else:
            rows = self._zone if not buf.fp8_dispatch else torch.empty(
                (self._zone.shape[0], buf.hidden), dtype=buf.dtype, device=y.device)
            rows[self.rows] = y
        return buf.combine(rows, self.handle, out=out, phase=phase)
