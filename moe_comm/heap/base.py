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
    handle: object = None    # heap-private bookkeeping (the shm heap: the allocation index)
    wire: object = None      # CPU emulated nodes: how unmapped peers (peer_ptrs 0) are reached (wire.py)

    def __post_init__(self):
        if self.local.device.type == "cpu":  # interpreted puts find peers' copies here (peer_map.py)
            from . import peer_map  # noqa: PLC0415
            peer_map.register(self.local, self.peer_ptrs, self.handle, self.wire)


class Heap:
    """Symmetric memory shared by ``world_size`` ranks.

    ``alloc`` and ``free`` are collective: every rank calls them in the same order with the same arguments.
    ``barrier`` and ``allgather`` are the control plane (host-driven, bounded), over the live ranks given.
    """

    kind: str = "?"
    rank: int
    world_size: int
    device: torch.device

    def alloc(self, name: str, shape, dtype: torch.dtype) -> SymmetricBuffer:
        raise NotImplementedError

    def free(self, buf: SymmetricBuffer) -> None:
        raise NotImplementedError

    def barrier(self, live=None, op: str = "barrier", poll=None) -> None:
        """Host barrier over ``live`` ranks (default all): bounded; raises CommTimeoutError naming a missing
        peer. ``poll()`` is called while waiting and may raise to end the wait."""
        raise NotImplementedError

    def agree(self, live, payload: list[int]) -> tuple[dict[int, list[int]], list[int]]:
        """Decided recovery meeting (``reset``/``exclude``/``exchange``; its own sequence, apart from
        barriers), bounded: the int64 ``payload`` of every rank the meeting's one decision took in (the
        same on every rank that reads it; without this rank when it came after the decision), and the
        ranks of ``live`` it left out."""
        raise NotImplementedError

    def realign_barriers(self, base: int) -> None:
        """Restart the barrier sequence at ``base`` (every live rank passes the same value, in a reset)."""
        raise NotImplementedError

    def reachable(self) -> list[bool]:
        """For every rank: is its memory mapped here (load/store)? The CPU heaps map every peer."""
        return [True] * self.world_size

    def post_failure(self, epoch: int, record: list[int]) -> None:
        """Leave a group-wide error the host found (``record``: the status record words) where ranks that
        do not map this one's memory can read it (``posted_failure``). Heaps that map every peer need not:
        the kernels' status broadcast reaches them."""

    def posted_failure(self, epoch: int) -> list[int] | None:
        """The first record ``post_failure`` left in ``epoch``, or None."""
        return None

    def release_peer(self, peer: int) -> None:
        """``peer`` is excluded and will never be addressed again: point every live buffer's
        ``peer_ptrs[peer]`` at this rank's own copy (an address that stays valid) and drop this process's
        mappings of the peer's memory. Called with the device idle."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


def nbytes_of(shape, dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.empty((), dtype=dtype).element_size()


def all_ranks(heap: Heap, live) -> list[int]:
    return list(range(heap.world_size)) if live is None else sorted(live)
