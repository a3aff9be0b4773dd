"""Loopback heap: one process holds every rank's buffers (on one GPU or the CPU).

Used for single-GPU benchmarks of multi-rank ops and for fast tests. Ranks are driven phase by phase
(all sends, then all receives), so nothing ever waits on something that has not run yet.
"""

from __future__ import annotations

import torch

from .base import Heap, SymmetricBuffer, all_ranks, nbytes_of


class _Shared:
    """State common to the ``world_size`` LoopbackHeap objects of one loopback world."""

    def __init__(self, world_size: int, device: torch.device, allocator=None):
        self.world_size, self.device, self.allocator = world_size, device, allocator
        self.allocs: list[dict] = []  # k-th collective allocation: name, shape, dtype, tensors, peer_ptrs, freed

    def zeros(self, shape, dtype) -> torch.Tensor:
        if self.allocator is None:
            return torch.zeros(shape, dtype=dtype, device=self.device)
        t = self.allocator(nbytes_of(shape, dtype)).view(dtype).view(shape)
        return t.zero_()


class LoopbackHeap(Heap):
    kind = "loopback"

    def __init__(self, shared: _Shared, rank: int):
        self.shared, self.rank = shared, rank
        self.world_size, self.device = shared.world_size, shared.device
        self._next = 0  # index of this rank's next collective allocation

    @staticmethod
    def create_world(world_size: int, device, allocator=None) -> list["LoopbackHeap"]:
        """``allocator(nbytes) -> uint8 tensor`` on ``device``, if given, provides every buffer's memory
        (tests use it to place buffers at chosen addresses)."""
        shared = _Shared(world_size, torch.device(device), allocator)
        return [LoopbackHeap(shared, r) for r in range(world_size)]

    def alloc(self, name, shape, dtype) -> SymmetricBuffer:
        shape, k = tuple(int(s) for s in shape), self._next
        self._next += 1
        allocs = self.shared.allocs
        if k == len(allocs):  # first rank to reach the k-th allocation makes every rank's copy
            tensors = [self.shared.zeros(shape, dtype) for _ in range(self.world_size)]
            ptrs = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=self.device)
            allocs.append(dict(name=name, shape=shape, dtype=dtype, tensors=tensors, ptrs=ptrs, freed=set()))
        a = allocs[k]
        if (a["name"], a["shape"], a["dtype"]) != (name, shape, dtype):
            raise RuntimeError(f"loopback alloc #{k} mismatch: rank {self.rank} asked for {name} {shape} {dtype}, "
                               f"another rank for {a['name']} {a['shape']} {a['dtype']} (collective order differs)")
        return SymmetricBuffer(name, a["tensors"][self.rank], a["ptrs"], handle=k)

    def free(self, buf: SymmetricBuffer) -> None:
        a = self.shared.allocs[buf.handle]
        a["freed"].add(self.rank)
        if len(a["freed"]) == self.world_size:  # last rank out releases the memory
            a["tensors"], a["ptrs"] = None, None

    def barrier(self, live=None, op: str = "barrier", poll=None) -> None:
        pass  # one process: program order is the barrier

    def agree(self, live, payload):
        """One thread drives every rank, so the others have not posted yet: each rank answers with its own
        payload for all (callers of collective control operations pass the same value on every rank)."""
        return {j: list(payload) for j in all_ranks(self, live)}, []

    def realign_barriers(self, base: int) -> None:
        pass

    def release_peer(self, peer: int) -> None:
        pass  # one process: every rank's memory stays allocated until the last rank frees it

    def close(self) -> None:
        pass
