"""CommGroup (one rank's view of the communicator), ``init()`` and ``launch()``."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import socket
import time
import traceback
import uuid

import torch

from .errors import ERR_WORDS, LaunchError, decode_error
from .heap.base import Heap

BACKENDS = ("auto", "nvshmem", "shm", "loopback")


class CommGroup:
    """One rank of a moe-comm communicator: its heap, its device and its error word.

    ``error_word`` is int64 [ERR_WORDS] that kernels write and the host reads without a device sync
    (pinned host memory on CUDA: kernels reach it through ``error_addr``).
    """

    def __init__(self, heap: Heap, backend: str, timeout_s: float, owns_dist: bool = False):
        self.heap, self.backend, self.timeout_s = heap, backend, float(timeout_s)
        self.rank, self.world_size, self.device = heap.rank, heap.world_size, heap.device
        pin = self.device.type == "cuda"
        self.error_word = torch.zeros(ERR_WORDS, dtype=torch.int64, pin_memory=pin)
        self.error_addr = self.error_word.data_ptr()  # host address; valid on the device through UVA
        self._owns_dist, self._closed = owns_dist, False

    @property
    def timeout_ns(self) -> int:
        return int(self.timeout_s * 1e9)

    def __repr__(self):
        return f"CommGroup(rank={self.rank}, world_size={self.world_size}, backend={self.backend!r}, device={self.device})"

    def barrier(self) -> None:
        """Host barrier over all ranks (a no-op on loopback, where program order already is one)."""
        self.check()
        self.heap.barrier()

    def check(self) -> None:
        """Raise the first error a kernel recorded since the last check (then clear it). Never syncs the device."""
        err = decode_error(self.error_word.tolist(), self.timeout_s)
        if err is not None:
            self.error_word.zero_()
            raise err

    def check_after_launch(self) -> None:
        """Right after an op's kernels: on CPU they have finished and reading the error word is free, so
        raise at once; on a GPU the error surfaces at the next check instead (no sync here)."""
        if self.device.type == "cpu":
            self.check()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.heap.close()
        if self._owns_dist:
            import torch.distributed as dist  # noqa: PLC0415
            if dist.is_initialized():
                dist.destroy_process_group()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def _as_device(device) -> torch.device:
    """torch.device with an explicit index for CUDA ("cuda" -> "cuda:<current>"), so tensors compare equal."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _default_device(backend: str, local_rank: int) -> torch.device:
    if backend in ("nvshmem", "auto") and torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    if backend == "loopback" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init(backend: str = "auto", *, timeout_s: float = 30.0, world_size: int | None = None, device=None):
    """Create this process's CommGroup (or, for ``backend="loopback"``, a list of ``world_size`` groups).

    Bootstraps from torch.distributed: an existing default group, else the torchrun env vars
    (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), else world 1.
    backend: "auto" (nvshmem on CUDA, shm on CPU) | "nvshmem" | "shm" | "loopback".
    timeout_s bounds every device wait and host barrier; expiry raises CommTimeoutError naming the peer.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if backend == "loopback":
        from .heap.loopback import LoopbackHeap  # noqa: PLC0415
        n = 1 if world_size is None else int(world_size)
        if n < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        dev = _as_device(device) if device is not None else _default_device("loopback", 0)
        return [CommGroup(h, "loopback", timeout_s) for h in LoopbackHeap.create_world(n, dev)]

    import torch.distributed as dist  # noqa: PLC0415
    owns = False
    if not dist.is_initialized() and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        pg_backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(pg_backend, timeout=datetime.timedelta(seconds=max(timeout_s, 10.0)))
        owns = True
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world_size is not None and world_size != world:
        raise ValueError(f"world_size={world_size} but torch.distributed has {world} ranks")
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if backend == "auto":
        backend = "nvshmem" if torch.cuda.is_available() else "shm"
    dev = _as_device(device) if device is not None else _default_device(backend, local_rank)
    barrier = dist.barrier if world > 1 else (lambda: None)
    if backend == "shm":
        from .heap.shm import ShmHeap  # noqa: PLC0415
        if dev.type != "cpu":
            raise ValueError("backend='shm' holds CPU tensors; use 'nvshmem' or 'loopback' on a GPU")
        session = os.environ.get("MOE_COMM_SESSION")
        if session is None:  # not under launch(): agree on a session name through torch.distributed
            box = [uuid.uuid4().hex[:12]]
            if world > 1:
                dist.broadcast_object_list(box, src=0)
            session = box[0]
        heap = ShmHeap(rank, world, session, barrier, timeout_s)
    else:
        from .heap.nvshmem import NvshmemHeap  # noqa: PLC0415
        heap = NvshmemHeap(rank, world, dev, timeout_s)
    return CommGroup(heap, backend, timeout_s, owns_dist=owns)


# ---- launch ------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, rank, world_size, port, session, backend, timeout_s, args, conn):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
                      MOE_COMM_SESSION=session)
    try:
        with init(backend, timeout_s=timeout_s) as group:
            result = fn(group, *args)
        msg = ("ok", pickle.dumps(result))
    except BaseException as e:  # noqa: BLE001  (report everything, KeyboardInterrupt included)
        msg = ("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    conn.send(msg)
    conn.close()


def launch(fn, world_size: int, *args, backend: str = "auto", timeout_s: float = 30.0,
           start_method: str = "spawn", grace_s: float | None = None):
    """Run ``fn(group, *args)`` in ``world_size`` new processes, each with a ready CommGroup.

    Returns the per-rank return values in rank order. If any rank raises or dies, the others get
    ``grace_s`` (default 2*timeout_s + 15 s) to finish on their own (so they can report what they saw,
    e.g. a CommTimeoutError), are then killed, and LaunchError is raised naming every failed rank.
    Shared-memory files of the run are removed whatever happens. ``fn`` and ``args`` must pickle.
    """
    if backend == "loopback":
        raise ValueError("launch() starts one process per rank; loopback keeps all ranks in one process: "
                         "use moe_comm.init(backend='loopback', world_size=N)")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    grace_s = 2 * timeout_s + 15 if grace_s is None else grace_s
    ctx = mp.get_context(start_method)
    port, session = _free_port(), uuid.uuid4().hex[:12]
    procs, conns = [], []
    for r in range(world_size):
        recv_end, send_end = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_rank_main, name=f"moe_comm-rank{r}", daemon=True,
                        args=(fn, r, world_size, port, session, backend, timeout_s, args, send_end))
        p.start()
        send_end.close()
        procs.append(p)
        conns.append(recv_end)
    results, failures, pending = [None] * world_size, {}, set(range(world_size))
    deadline = None
    try:
        while pending:
            wait_for = [conns[r] for r in pending] + [procs[r].sentinel for r in pending]
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = multiprocessing.connection.wait(wait_for, timeout)
            if not ready:
                for r in sorted(pending):
                    failures[r] = f"still running {grace_s:g} s after another rank failed; killed"
                break
            for r in sorted(pending):
                if conns[r] not in ready and procs[r].sentinel not in ready:
                    continue
                pending.discard(r)
                try:
                    status, payload = conns[r].recv()
                except EOFError:  # the process ended without sending its result
                    procs[r].join()
                    failures[r] = f"died with exit code {procs[r].exitcode} before returning a result"
                    continue
                if status == "ok":
                    results[r] = pickle.loads(payload)
                else:
                    failures[r] = payload
            if failures and deadline is None:
                deadline = time.monotonic() + grace_s
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        from .heap.shm import remove_session_files  # noqa: PLC0415
        remove_session_files(session)
    if failures:
        raise LaunchError(failures, results)
    return results
