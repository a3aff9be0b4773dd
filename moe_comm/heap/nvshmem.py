"""NVSHMEM heap: symmetric tensors from nvshmem4py; peers reached by load/store over NVLink, or by NVSHMEM
puts (``moe_comm/transport.py``) where they cannot be mapped.

nvshmem4py is imported lazily, so this module imports without a GPU. Facts relied on (nvshmem4py 0.4.1):
UID bootstrap (rank 0 makes the id, torch.distributed broadcasts it), ``nvshmem.core.tensor`` /
``free_tensor`` are collective and must be freed explicitly in the same order on every PE, and
``get_peer_tensor(t, pe)`` maps a peer's copy here (raises if it is not load/store reachable).

Reachability is found on the first allocation: a peer whose copy cannot be mapped gets ``peer_ptrs``
entry 0 and the put transport. The host control plane (barriers and the recovery meetings,
``control.py``) still reads and writes peers' memory through mappings, so a group with an unreachable
peer (a second node) is refused at init with a NotImplementedError: the device put path is built and
compiled, the multi-node control plane is not (docs/multinode.md).
"""

from __future__ import annotations

import torch

from .base import SymmetricBuffer
from .control import ControlledHeap, control_shape


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

    def __init__(self, rank: int, world_size: int, device: torch.device, timeout_s: float):
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
        self._live: dict[int, list] = {}   # k -> [nvshmem tensor, SymmetricBuffer, peer tensors]
        self._next = 0
        self._excluded: set[int] = set()
        self._control = None
        self._reachable = None   # per PE, found by the first allocation
        barrier_buf = self.alloc("control.barrier", control_shape(world_size), torch.int64)
        if not all(self._reachable):
            gone = [pe for pe, r in enumerate(self._reachable) if not r]
            raise NotImplementedError(
                f"rank {rank}: PEs {gone} are not load/store reachable (another node). The kernels can reach "
                f"them by NVSHMEM puts, but the host control plane (barrier, reset/exclude meetings) maps "
                f"every peer's memory and has no multi-node implementation yet (see docs/multinode.md)")
        recovery_buf = self.alloc("control.recovery", control_shape(world_size), torch.int64)
        self._start_control(self._live[barrier_buf.handle][2], self._live[recovery_buf.handle][2])

    def _stream(self):
        from nvshmem.core import NvshmemStream  # noqa: PLC0415
        return NvshmemStream(torch.cuda.current_stream(self.device))

    def alloc(self, name, shape, dtype) -> SymmetricBuffer:
        if self._excluded:
            raise RuntimeError("the nvshmem heap cannot allocate after a rank was excluded (NVSHMEM "
                               "allocation is collective over every PE): allocate buffers before serving")
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
        if entry is not None and not self._excluded:  # collective over every PE: impossible without one
            self.barrier()
            self.nv.free_tensor(entry[0])

    def barrier(self, live=None, op: str = "barrier", poll=None) -> None:
        torch.cuda.current_stream(self.device).synchronize()
        if self._control is None:  # bootstrap: the control blocks themselves are being allocated
            self.nv.barrier_all(self._stream())
            torch.cuda.current_stream(self.device).synchronize()
        else:
            super().barrier(live, op, poll)

    def _release_mappings(self, peer: int) -> None:
        for entry in self._live.values():
            entry[1].peer_ptrs[peer] = entry[1].peer_ptrs[self.rank]
            entry[2][peer] = None

    def close(self) -> None:
        if self._excluded:
            # NVSHMEM frees and finalize are collective over every PE, and a PE is gone: leave the
            # symmetric heap to the process exit rather than hang.
            self._live.clear()
            return
        for k in sorted(self._live):  # same order on every PE: the frees are collective
            self.nv.free_tensor(self._live.pop(k)[0])
        self.nv.finalize()
