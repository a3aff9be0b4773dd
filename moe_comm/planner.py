"""Host-side planning: capacities, buffer layouts and launch shapes, from static sizes only.

Nothing here reads a device value: every size follows from the capacities the caller declared
(``max_rows_per_peer``, ``max_tokens_per_rank``, ...), so plans are fixed for the life of a buffer and
every launch is capturable in a CUDA graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# GPU launch shape: enough programs per peer to keep many SMs busy on large payloads.
GPU_TARGET_PROGRAMS = 132
GPU_BLOCK_BYTES = 4096


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def numel(shape) -> int:
    return math.prod(int(s) for s in shape)


def elem_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class CopyPlan:
    """How a phase kernel moves rows: payload rows are copied as raw words (the dtype does not matter)."""

    word_dtype: torch.dtype  # rows are viewed as words of this type; row bytes are a multiple of its size
    row_words: int           # words per row
    block_rows: int          # rows per program iteration
    block_words: int         # words per program iteration along a row
    blocks_per_peer: int     # programs per peer in each phase's grid (grid = world x blocks_per_peer)


def plan_copy(row_bytes: int, max_rows: int, world: int, device: torch.device) -> CopyPlan:
    word = torch.int32 if row_bytes % 4 == 0 else torch.int16 if row_bytes % 2 == 0 else torch.uint8
    row_words = row_bytes // elem_size(word)
    if device.type == "cuda":
        block_words = min(next_pow2(row_words), GPU_BLOCK_BYTES // elem_size(word))
        block_rows = 1 if row_words >= block_words else max(1, min(16, block_words // next_pow2(row_words)))
        blocks_needed = math.ceil(max_rows / block_rows)
        blocks_per_peer = max(1, min(blocks_needed, GPU_TARGET_PROGRAMS // max(1, world)))
    else:
        # The interpreter pays per program and per op, not per element: few, wide programs.
        block_words = min(next_pow2(row_words), 4096)
        block_rows = min(next_pow2(max_rows), max(1, 8192 // block_words))
        blocks_per_peer = 1
    return CopyPlan(word, row_words, block_rows, block_words, blocks_per_peer)


@dataclass(frozen=True)
class AllToAllvPlan:
    """Buffers of one AllToAllvDynamic (forward and reverse channel each have their own)."""

    world: int
    max_rows_per_peer: int
    row_shape: tuple
    dtype: torch.dtype
    copy: CopyPlan
    # Symmetric landing zone per channel: words [2 zones, world source ranks, max_rows_per_peer, row_words].
    # Zone = call sequence number % 2, so call i+1 never lands on rows call i is still reading.
    data_shape: tuple
    # Symmetric control words per channel: int64 [2 zones, world source ranks, 2] = (row count, flag).
    ctrl_shape: tuple

    @property
    def row_bytes(self) -> int:
        return numel(self.row_shape) * elem_size(self.dtype)

    @property
    def symmetric_bytes(self) -> int:
        per_channel = numel(self.data_shape) * elem_size(self.copy.word_dtype) + numel(self.ctrl_shape) * 8
        return 2 * per_channel

    @property
    def output_bytes(self) -> int:
        """Local output buffers: two alternating recv sets plus their metadata."""
        return 2 * (self.world * self.max_rows_per_peer * self.row_bytes + self.world * (4 + 4 + 8))


def plan_alltoallv(world: int, max_rows_per_peer: int, row_shape, dtype: torch.dtype,
                   device: torch.device) -> AllToAllvPlan:
    row_shape = tuple(int(s) for s in row_shape)
    row_bytes = numel(row_shape) * elem_size(dtype)
    copy = plan_copy(row_bytes, max_rows_per_peer, world, device)
    return AllToAllvPlan(world, max_rows_per_peer, row_shape, dtype, copy,
                         data_shape=(2, world, max_rows_per_peer, copy.row_words),
                         ctrl_shape=(2, world, 2))
