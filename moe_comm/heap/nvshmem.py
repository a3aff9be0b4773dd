"""NVSHMEM heap: symmetric tensors from nvshmem4py; peers reached by load/store over NVLink.

nvshmem4py is imported lazily, so this module imports without a GPU. Facts relied on (nvshmem4py 0.4.1):
UID bootstrap (rank 0 makes the id, torch.distributed broadcasts it), ``nvshmem.core.tensor`` /
``free_tensor`` are collective and must be freed explicitly in the same order on every PE, and
``get_peer_tensor(t, pe)`` maps a peer's copy here (raises if it is not load/store reachable).
"""

from __future__ import annotations

import torch

from .base import Heap, SymmetricBuffer


def _import_nvshmem():
    try:
        import nvshmem.core as nvshmem  # noqa: PLC0415  (lazy: optional dependency)
        from cuda.core import Device  # noqa: PLC0415
    except ImportError as e:
        raise ImportError(
            "backend='nvshmem' needs nvshmem4py and cuda-core: pip install 'moe-comm[nvshmem]' "
            f"(import failed: {e})") from e
    return nvshmem, Device


class NvshmemHeap(Heap):
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
        self._live: dict[int, torch.Tensor] = {}
        self._next = 0

    def _stream(self):
        from nvshmem.core import NvshmemStream  # noqa: PLC0415
        return NvshmemStream(torch.cuda.current_stream(self.device))

    def alloc(self, name, shape, dtype) -> SymmetricBuffer:
        t = self.nv.tensor(tuple(int(s) for s in shape), dtype=dtype)
        t.zero_()
        ptrs = [t.data_ptr() if pe == self.rank else self.nv.get_peer_tensor(t, pe).data_ptr()
                for pe in range(self.world_size)]
        k, self._next = self._next, self._next + 1
        self._live[k] = t
        self.barrier()  # every PE zeroed its copy before anyone writes into it
        return SymmetricBuffer(name, t, torch.tensor(ptrs, dtype=torch.int64, device=self.device), handle=k)

    def free(self, buf: SymmetricBuffer) -> None:
        t = self._live.pop(buf.handle, None)
        if t is not None:
            self.barrier()
            self.nv.free_tensor(t)

    def barrier(self) -> None:
        self.nv.barrier_all(self._stream())
        torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        for k in sorted(self._live):  # same order on every PE: the frees are collective
            self.nv.free_tensor(self._live.pop(k))
        self.nv.finalize()
