"""The one interface every symmetric heap implements."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SymmetricBuffer:
    """One buffer allocated on every rank with the same name, shape and dtype."""

    name: str
    local: torch.Tensor      # this rank's copy, [*shape] dtype, on the heap's device; zeroed at allocation
    peer_ptrs: torch.Tensor  # int64 [world] on the heap's device: peer_ptrs[j] = address of rank j's copy, usable here
    handle: object = None    # heap-private bookkeeping


class Heap:
    """Symmetric memory shared by ``world_size`` ranks.

    ``alloc`` and ``free`` are collective: every rank calls them in the same order with the same arguments.
    """

    kind: str = "?"
    rank: int
    world_size: int
    device: torch.device

    def alloc(self, name: str, shape, dtype: torch.dtype) -> SymmetricBuffer:
        raise NotImplementedError

    def free(self, buf: SymmetricBuffer) -> None:
        raise NotImplementedError

    def barrier(self) -> None:
        """Host barrier over the ranks of this heap (bounded; raises CommTimeoutError naming a missing peer)."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


def nbytes_of(shape, dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.empty((), dtype=dtype).element_size()
