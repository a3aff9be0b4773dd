"""Shared-memory heap: CPU ranks in separate processes share POSIX shared memory (/dev/shm).

Each rank creates one file per buffer, every rank maps every peer's file, and once all have mapped them
the files are unlinked: the mappings stay valid and nothing can leak, even if a process is killed later.
``moe_comm.launch`` also removes any file of its session left by a rank that died mid-allocation.
A session is named after the process that starts it (``new_session``), so that a check for leaked files
can tell its own sessions from those of any other run on the same host (``pid_prefix``).

Emulated nodes (``MOE_COMM_RANKS_PER_NODE=k``): ranks ``[n*k, (n+1)*k)`` form node n. A rank maps only
the files of its own node; another node's ranks get ``peer_ptrs`` 0, are not load/store reachable (the
put transport is chosen for them), and are reached only through the wire (``wire.py``). The control
plane needs no mapping either way (``control.py``).
"""

from __future__ import annotations

import mmap
import os
import uuid

import torch

from .base import SymmetricBuffer, nbytes_of
from ..errors import CommTimeoutError
from .control import ControlBlock, ControlledHeap

SHM_DIR = "/dev/shm"
PREFIX = "moecomm_"
RANKS_PER_NODE_ENV = "MOE_COMM_RANKS_PER_NODE"
FINALIZE = "finalize"   # the control block (store keys) and op name of the finalize barrier (ShmHeap.close)


def ranks_per_node(world_size: int) -> int:
    """``MOE_COMM_RANKS_PER_NODE`` (default: every rank on one node)."""
    raw = os.environ.get(RANKS_PER_NODE_ENV, "").strip()
    if not raw:
        return world_size
    try:
        k = int(raw)
    except ValueError:
        k = 0
    if k < 1:
        raise ValueError(f"{RANKS_PER_NODE_ENV} must be a whole number >= 1 (ranks per emulated node), "
                         f"got {raw!r}")
    return min(k, world_size)


def new_session() -> str:
    """A fresh session name: this process's pid, then 12 random hex digits."""
    return f"{os.getpid()}-{uuid.uuid4().hex[:12]}"


def pid_prefix(pid: int) -> str:
    """The start of every file name of the sessions that process ``pid`` started."""
    return f"{PREFIX}{pid}-"


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
        k = ranks_per_node(world_size)
        self.node = [j // k for j in range(world_size)]   # emulated node of every rank
        self.wire = None
        if not all(self.reachable()):
            from .wire import Wire  # noqa: PLC0415
            self.wire = Wire(rank, store, timeout_s, self._base_of)
            self.barrier(op="init")   # every proxy listens before anyone sends

    def reachable(self) -> list[bool]:
        return [n == self.node[self.rank] for n in self.node]

    def _base_of(self, k: int):
        """Address of this rank's copy of allocation ``k`` (the wire's proxy delivers there), or None."""
        entry = self._live.get(k)
        return None if entry is None else entry[2].local.data_ptr()

    def _path(self, rank: int, k: int) -> str:
        return os.path.join(SHM_DIR, f"{session_prefix(self.session)}{rank}_{k}")

    def alloc(self, name, shape, dtype) -> SymmetricBuffer:
        k, nbytes = self._next, max(nbytes_of(shape, dtype), 64)
        self._next += 1
        maps = [None] * self.world_size
        sync = self._sync_live  # bounded, names a missing peer
        maps[self.rank] = _map_file(self._path(self.rank, k), nbytes, create=True)
        sync()  # every file exists
        near = self.reachable()
        for j in range(self.world_size):
            if j != self.rank and j not in self._excluded and near[j]:
                maps[j] = _map_file(self._path(j, k), nbytes, create=False)
        sync()  # every rank mapped every file of its node: the names are no longer needed
        os.unlink(self._path(self.rank, k))
        # An excluded rank has no copy: its entry points at ours, which is never addressed for it.
        # Another node's rank: no mapping, address 0 (reached through the wire).
        maps = [maps[self.rank] if m is None and near[j] else m for j, m in enumerate(maps)]
        views = [None if m is None else torch.frombuffer(m, dtype=torch.uint8, count=nbytes) for m in maps]
        local = views[self.rank][: nbytes_of(shape, dtype)].view(dtype).view(tuple(shape))
        ptrs = torch.tensor([0 if v is None else v.data_ptr() for v in views], dtype=torch.int64)
        buf = SymmetricBuffer(name, local, ptrs, handle=k, wire=self.wire)
        self._live[k] = [maps, views, buf]
        return buf

    def free(self, buf: SymmetricBuffer) -> None:
        # Mappings are released when the last tensor view of them is garbage collected.
        self._live.pop(buf.handle, None)
        self._quiet_live()

    def _quiet_live(self) -> None:
        """NVSHMEM's collective free and finalize quiet (``nvshmem_barrier_all``: quiet, then barrier) before
        the memory may be reused: one of the three places a quiet belongs (docs/multinode.md, "Staging reuse
        by causality"). Masked: no wait for an excluded rank, nor for one whose connection is gone (the
        nvshmem heap calls neither collective then: ``NvshmemHeap.free`` / ``close``)."""
        if self.wire is not None:
            self.wire.quiet(skip=self._excluded | self.wire.lost)

    def _sync_live(self) -> None:
        self.barrier([j for j in range(self.world_size) if j not in self._excluded], "alloc")

    def _finalize(self) -> None:
        """``nvshmem_finalize``'s barrier: NVSHMEM tears a PE's transport down only after every PE reached
        finalize (it is collective), so a peer's quiet never waits on a NIC that stopped answering. Here
        the live ranks (not excluded) meet once, in a block of their own (``FINALIZE``: any barrier or
        recovery sequence may have been cut short by a fault before), bounded by the heap's timeout; a
        rank that does not come (dead, hung, or closing without the others) is not waited for longer, and
        the wire closes anyway: a close never hangs and never raises. A dead rank's wire is gone whatever
        this does (nothing waits for it: its messages are masked out of every quiet once it is excluded or
        its connection lost); a live rank that never closes keeps acknowledging. Between two such
        meetings, each rank completes its own messages to the live ranks (``_quiet_live``;
        ``nvshmem_finalize`` quiets too), so no rank closes its wire while a live peer still waits for its
        acknowledgements; if the first meeting misses a rank, nothing is quieted (as the nvshmem heap
        skips ``finalize`` then)."""
        block = ControlBlock(self._control.store, FINALIZE, self.rank, self.world_size, self.timeout_s)
        live = [j for j in range(self.world_size) if j not in self._excluded]
        try:
            block.barrier(live, FINALIZE)
            self._quiet_live()
            block.barrier(live, FINALIZE)
        except CommTimeoutError:
            pass

    def _release_mappings(self, peer: int) -> None:
        for maps, views, buf in self._live.values():
            buf.peer_ptrs[peer] = buf.peer_ptrs[self.rank]
            maps[peer], views[peer] = None, None  # the mapping goes with its last view

    def close(self) -> None:
        """Release the heap. With a wire (emulated nodes), the live ranks first meet in the finalize
        barrier (``_finalize``), so that no rank's wire stops acknowledging while a live peer may still
        quiet messages to it."""
        if self.wire is not None:
            try:
                if self._control is not None:
                    self._finalize()
            finally:
                self.wire.close()
        self._control = self._recovery = None
        self._live.clear()
        for f in os.listdir(SHM_DIR):  # files of ours that a failed allocation left behind
            if f.startswith(f"{session_prefix(self.session)}{self.rank}_"):
                try:
                    os.unlink(os.path.join(SHM_DIR, f))
                except FileNotFoundError:
                    pass
