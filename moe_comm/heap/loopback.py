"""Loopback heap: one process holds every rank's buffers (on one GPU or the CPU).

Used for single-GPU benchmarks of multi-rank ops and for fast tests. Ranks are driven phase by phase
(all sends, then all receives), so nothing ever waits on something that has not run yet.
"""

from __future__ import annotations

import torch

from .base import Heap, SymmetricBuffer


class _Shared:
    """State common to the ``world_size`` LoopbackHeap objects of one loopback world."""

    def __init__(self, world_size: int, device: torch.device):
        self.world_size, self.device = world_size, device
        self.allocs: list[dict] = []  # k-th collective allocation: name, shape, dtype, tensors, peer_ptrs, freed


class LoopbackHeap(Heap):
    kind = "loopback"

    def __init__(self, shared: _Shared, rank: int):
        self.shared, self.rank = shared, rank
        self.world_size, self.device = shared.world_size, shared.device
        self._next = 0  # index of this rank's next collective allocation

    @staticmethod
    def create_world(world_size: int, device) -> list["LoopbackHeap"]:
        shared = _Shared(world_size, torch.device(device))
        return [LoopbackHeap(shared, r) for r in range(world_size)]

    def alloc(self, name, shape, dtype) -> SymmetricBuffer:
        shape, k = tuple(int(s) for s in shape), self._next
        self._next += 1
        allocs = self.shared.allocs
        if k == len(allocs):  # first rank to reach the k-th allocation makes every rank's copy
            tensors = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(self.world_size)]
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

    def barrier(self) -> None:
        pass  # one process: program order is the barrier

    def close(self) -> None:
        pass
