"""Shared-memory heap: CPU ranks in separate processes share POSIX shared memory (/dev/shm).

Each rank creates one file per buffer, every rank maps every peer's file, and once all have mapped them
the files are unlinked: the mappings stay valid and nothing can leak, even if a process is killed later.
``moe_comm.launch`` also removes any file of its session left by a rank that died mid-allocation.
"""

from __future__ import annotations

import mmap
import os

import torch

from .base import SymmetricBuffer, nbytes_of
from .control import ControlledHeap

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


class ShmHeap(ControlledHeap):
    """``session`` names this launch's files; ``store`` is the group's torch.distributed store (the
    control plane, ``control.py``)."""

    kind = "shm"

    def __init__(self, rank: int, world_size: int, session: str, store, timeout_s: float):
        self.rank, self.world_size, self.device = rank, world_size, torch.device("cpu")
        self.session, self.timeout_s = session, timeout_s
        self._next = 0
        self._live: dict[int, list] = {}  # k -> [mmaps, uint8 views, SymmetricBuffer] of every rank's copy
        self._excluded: set[int] = set()
        self._start_control(store)

    def _path(self, rank: int, k: int) -> str:
        return os.path.join(SHM_DIR, f"{session_prefix(self.session)}{rank}_{k}")

    def alloc(self, name, shape, dtype) -> SymmetricBuffer:
        k, nbytes = self._next, max(nbytes_of(shape, dtype), 64)
        self._next += 1
        maps = [None] * self.world_size
        sync = self._sync_live  # bounded, names a missing peer
        maps[self.rank] = _map_file(self._path(self.rank, k), nbytes, create=True)
        sync()  # every file exists
        for j in range(self.world_size):
            if j != self.rank and j not in self._excluded:
                maps[j] = _map_file(self._path(j, k), nbytes, create=False)
        sync()  # every rank mapped every file: the names are no longer needed
        os.unlink(self._path(self.rank, k))
        # An excluded rank has no copy: its entry points at ours, which is never addressed for it.
        maps = [maps[self.rank] if m is None else m for m in maps]
        views = [torch.frombuffer(m, dtype=torch.uint8, count=nbytes) for m in maps]
        local = views[self.rank][: nbytes_of(shape, dtype)].view(dtype).view(tuple(shape))
        ptrs = torch.tensor([v.data_ptr() for v in views], dtype=torch.int64)
        buf = SymmetricBuffer(name, local, ptrs, handle=k)
        self._live[k] = [maps, views, buf]
        return buf

    def free(self, buf: SymmetricBuffer) -> None:
        # Mappings are released when the last tensor view of them is garbage collected.
        self._live.pop(buf.handle, None)

    def _sync_live(self) -> None:
        self.barrier([j for j in range(self.world_size) if j not in self._excluded], "alloc")

    def _release_mappings(self, peer: int) -> None:
        for maps, views, buf in self._live.values():
            buf.peer_ptrs[peer] = buf.peer_ptrs[self.rank]
            maps[peer], views[peer] = None, None  # the mapping goes with its last view

    def close(self) -> None:
        self._control = self._recovery = None
        self._live.clear()
        for f in os.listdir(SHM_DIR):  # files of ours that a failed allocation left behind
            if f.startswith(f"{session_prefix(self.session)}{self.rank}_"):
                try:
                    os.unlink(os.path.join(SHM_DIR, f))
                except FileNotFoundError:
                    pass
