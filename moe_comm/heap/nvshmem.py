"""NVSHMEM heap: symmetric tensors from nvshmem4py; peers reached by load/store over NVLink, or by NVSHMEM
puts (``moe_comm/transport.py``) where they cannot be mapped.

nvshmem4py is imported lazily, so this module imports without a GPU. Facts relied on (nvshmem4py 0.4.1):
UID bootstrap (rank 0 makes the id, torch.distributed broadcasts it), ``nvshmem.core.tensor`` /
``free_tensor`` are collective and must be freed explicitly in the same order on every PE, and
``get_peer_tensor(t, pe)`` maps a peer's copy here (raises if it is not load/store reachable).

Reachability is found on the first allocation: a peer whose copy cannot be mapped (another node) gets
``peer_ptrs`` entry 0 and the put transport. The host control plane (barriers, allocation and recovery
meetings, ``control.py``) goes through the torch.distributed store and never maps a peer. NVSHMEM's own
collectives (``free_tensor``, ``finalize``) are called only after a bounded store barrier that every PE
passed: a dead or stuck peer turns them into "leave the heap to the process exit", never a hang.
"""

from __future__ import annotations

import torch

from .base import SymmetricBuffer
from ..errors import CommTimeoutError
from .control import ControlledHeap


def _import_nvshmem():
    try:
        import nvshmem.core as nvshmem  # noqa: PLC0415  (lazy: optional dependency)
        from cuda.core import Device  # noqa: PLC0415
    except ImportError as e:
        raise ImportError(
            "backend='nvshmem' needs nvshmem4py and cuda-core: pip install 'moe-comm[nvshmem]' "
            f"(import failed: {e})") from e
    return nvshmem, Device


class NvshmemHeap(ControlledHeap):
    kind = "nvshmem"

    def __init__(self, rank: int, world_size: int, device: torch.device, timeout_s: float, store):
        if not torch.cuda.is_available():
            raise RuntimeError("backend='nvshmem' needs CUDA; use backend='shm' (CPU) or 'loopback'")
        nvshmem, Device = _import_nvshmem()
        self.nv, self.rank, self.world_size, self.device = nvshmem, rank, world_size, device
        self.timeout_s = timeout_s
        torch.cuda.set_device(device)
        torch.zeros(1, device=device)  # make the CUDA context before cuda.core binds the device
        dev = Device(device.index)
        dev.set_current()
        uid = nvshmem.get_unique_id(empty=(rank != 0))
        if world_size > 1:
            import torch.distributed as dist  # noqa: PLC0415
            box = [uid]
            dist.broadcast_object_list(box, src=0)
            uid = box[0]
        nvshmem.init(device=dev, uid=uid, rank=rank, nranks=world_size, initializer_method="uid")
        self._start_heap(store)

    def _start_heap(self, store) -> None:
        """State before the first allocation; reachability is found by a probe allocation."""
        self._live: dict[int, list] = {}   # k -> [nvshmem tensor, SymmetricBuffer, peer tensors]
        self._next = 0
        self._excluded: set[int] = set()
        self._peer_lost = False  # a bounded barrier failed: NVSHMEM collectives may hang from now on
        self._reachable = None   # per PE, found by the first allocation
        self._start_control(store)
        self.free(self.alloc("reachability.probe", (1,), torch.int64))

    def alloc(self, name, shape, dtype) -> SymmetricBuffer:
        if self._excluded:
            raise RuntimeError("the nvshmem heap cannot allocate after a rank was excluded (NVSHMEM "
                               "allocation is collective over every PE): allocate buffers before serving")
        self._collective_barrier("alloc")  # nvshmem_malloc is collective: every PE is here first
        t = self.nv.tensor(tuple(int(s) for s in shape), dtype=dtype)
        t.zero_()
        peers = [t if pe == self.rank else self._peer_tensor(t, pe) for pe in range(self.world_size)]
        if self._reachable is None:
            self._reachable = [p is not None for p in peers]
        k, self._next = self._next, self._next + 1
        buf = SymmetricBuffer(name, t, torch.tensor([0 if p is None else p.data_ptr() for p in peers],
                                                    dtype=torch.int64, device=self.device), handle=k)
        self._live[k] = [t, buf, peers]
        self.barrier()  # every PE zeroed its copy before anyone writes into it
        return buf

    def _peer_tensor(self, t, pe):
        """Rank ``pe``'s copy of ``t`` mapped here, or None if NVSHMEM cannot map it (not on this node)."""
        if self._reachable is not None and not self._reachable[pe]:
            return None
        try:
            return self.nv.get_peer_tensor(t, pe)
        except Exception:  # noqa: BLE001  (nvshmem4py raises its own error types for an unmappable PE)
            return None

    def reachable(self) -> list[bool]:
        return list(self._reachable)

    def free(self, buf: SymmetricBuffer) -> None:
        entry = self._live.pop(buf.handle, None)
        if entry is not None and not (self._excluded or self._peer_lost):  # collective over every PE
            self._collective_barrier("free")
            self.nv.free_tensor(entry[0])

    def barrier(self, live=None, op: str = "barrier", poll=None) -> None:
        self._sync_device()
        super().barrier(live, op, poll)

    def _collective_barrier(self, op: str) -> None:
        """A bounded barrier of every PE before an NVSHMEM collective; a missing PE raises
        CommTimeoutError here and no NVSHMEM collective is called by this heap again."""
        try:
            self.barrier(op=op)
        except CommTimeoutError:
            self._peer_lost = True
            raise

    def _sync_device(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()

    def _release_mappings(self, peer: int) -> None:
        for entry in self._live.values():
            entry[1].peer_ptrs[peer] = entry[1].peer_ptrs[self.rank]
            entry[2][peer] = None

    def close(self) -> None:
        """Free every buffer and finalize NVSHMEM, both collective over every PE, only if every PE
        passes a bounded store barrier first; else (a PE excluded, dead or stuck) leave the symmetric
        heap to the process exit rather than hang."""
        if not (self._excluded or self._peer_lost):
            try:
                self._collective_barrier("close")
            except CommTimeoutError:
                pass
        if self._excluded or self._peer_lost:
            self._live.clear()
            return
        for k in sorted(self._live):  # same order on every PE: the frees are collective
            self.nv.free_tensor(self._live.pop(k)[0])
        self.nv.finalize()
