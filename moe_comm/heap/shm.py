"""Shared-memory heap: CPU ranks in separate processes share POSIX shared memory (/dev/shm).

Each rank creates one file per buffer, every rank maps every peer's file, and once all have mapped them
the files are unlinked: the mappings stay valid and nothing can leak, even if a process is killed later.
``moe_comm.launch`` also removes any file of its session left by a rank that died mid-allocation.
"""

from __future__ import annotations

import mmap
import os
import time

import numpy as np
import torch

from ..errors import CommTimeoutError
from .base import Heap, SymmetricBuffer, nbytes_of

SHM_DIR = "/dev/shm"
PREFIX = "moecomm_"


def session_prefix(session: str) -> str:
    return f"{PREFIX}{session}_"


def remove_session_files(session: str) -> list[str]:
    """Unlink every shared-memory file of ``session``; returns their names."""
    pre = session_prefix(session)
    removed = []
    for f in os.listdir(SHM_DIR):
        if f.startswith(pre):
            try:
                os.unlink(os.path.join(SHM_DIR, f))
                removed.append(f)
            except FileNotFoundError:
                pass
    return removed


def _map_file(path: str, nbytes: int, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, nbytes)
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


class ShmHeap(Heap):
    """``session`` names this launch's files; ``barrier_fn`` is a bootstrap barrier (torch.distributed)."""

    kind = "shm"

    def __init__(self, rank: int, world_size: int, session: str, barrier_fn, timeout_s: float):
        self.rank, self.world_size, self.device = rank, world_size, torch.device("cpu")
        self.session, self.timeout_s, self._bootstrap_barrier = session, timeout_s, barrier_fn
        self._next = 0
        self._live: dict[int, list] = {}
        # Host barrier with bounded waits: slot [j] of rank i's array holds the last barrier epoch rank j reached.
        self._barrier_epoch = 0
        self._barrier_buf = self.alloc("barrier", (world_size,), torch.int64)
        self._barrier_views = [self._view_at(int(p), world_size) for p in self._barrier_buf.peer_ptrs]

    def _path(self, rank: int, k: int) -> str:
        return os.path.join(SHM_DIR, f"{session_prefix(self.session)}{rank}_{k}")

    def alloc(self, name, shape, dtype) -> SymmetricBuffer:
        k, nbytes = self._next, max(nbytes_of(shape, dtype), 64)
        self._next += 1
        maps = [None] * self.world_size
        # Once the heap's own barrier exists, use it: it is bounded and names a missing peer.
        sync = self.barrier if getattr(self, "_barrier_views", None) else self._bootstrap_barrier
        maps[self.rank] = _map_file(self._path(self.rank, k), nbytes, create=True)
        sync()  # every file exists
        for j in range(self.world_size):
            if j != self.rank:
                maps[j] = _map_file(self._path(j, k), nbytes, create=False)
        sync()  # every rank mapped every file: the names are no longer needed
        os.unlink(self._path(self.rank, k))
        views = [torch.frombuffer(m, dtype=torch.uint8, count=nbytes) for m in maps]
        local = views[self.rank][: nbytes_of(shape, dtype)].view(dtype).view(tuple(shape))
        ptrs = torch.tensor([v.data_ptr() for v in views], dtype=torch.int64)
        self._live[k] = [maps, views]
        return SymmetricBuffer(name, local, ptrs, handle=k)

    @staticmethod
    def _view_at(addr: int, n: int) -> np.ndarray:
        import ctypes
        return np.ctypeslib.as_array((ctypes.c_int64 * n).from_address(addr))

    def free(self, buf: SymmetricBuffer) -> None:
        # Mappings are released when the last tensor view of them is garbage collected.
        self._live.pop(buf.handle, None)

    def barrier(self) -> None:
        self._barrier_epoch += 1
        e = self._barrier_epoch
        for v in self._barrier_views:  # tell every rank we arrived (each writes only its own slot)
            v[self.rank] = e
        mine = self._barrier_views[self.rank]
        deadline = time.monotonic() + self.timeout_s
        for j in range(self.world_size):
            while mine[j] < e:
                if time.monotonic() > deadline:
                    raise CommTimeoutError("barrier", self.rank, j, self.timeout_s)
                time.sleep(0.0002)

    def close(self) -> None:
        self._barrier_views = []
        self._live.clear()
        for f in os.listdir(SHM_DIR):  # files of ours that a failed allocation left behind
            if f.startswith(f"{session_prefix(self.session)}{self.rank}_"):
                try:
                    os.unlink(os.path.join(SHM_DIR, f))
                except FileNotFoundError:
                    pass
