"""CommGroup (one rank's view of the communicator), ``init()`` and ``launch()``."""

from __future__ import annotations

import datetime
import math
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import socket
import sys
import threading
import time
import traceback
import weakref

import torch

from . import protocol
from .errors import (ERR_DROPPED, ERR_NONE, ERR_TIMEOUT, ERR_WORDS, GROUP_CODES, OPS, ClosedError,
                     CommTimeoutError, ExcludedError, GroupError, LaunchError, MoECommError, decode_error,
                     error_kind)
from .heap.base import Heap
from .trace.recorder import ENV_TRACE_DIR, trace_calls, write_dump
from .transport import choose_transports

BACKENDS = ("auto", "nvshmem", "shm", "loopback")
RAISED_GRACE_S = 1.0   # launch(): how long the other ranks may run on after one rank raised
_GROUPS: list[weakref.ref] = []   # every CommGroup of this process (``live_groups``); replaced, never mutated


def live_groups() -> list:
    """The CommGroups of this process that are not closed (what ``moe_comm.metrics`` exports)."""
    return [g for g in (r() for r in _GROUPS) if g is not None and not g.closed]


class CommGroup:
    """One rank of a moe-comm communicator: its heap, its device, its error word and its group state.

    ``error_word``: int64 [ERR_WORDS] that kernels write and the host reads without a device sync (pinned
    host memory on CUDA). ``state``: int64 device tensor every kernel reads (``moe_comm/protocol.py``:
    epoch, error-word address, timeout, live mask, status addresses). ``status``: symmetric buffer where
    ranks broadcast group-wide errors.

    Faults (docs/faults.md): ``check()`` raises what the kernels recorded; a group-wide
    error (``GroupError``) is sticky until ``reset()`` (collective over the live ranks) or
    ``exclude(ranks)`` (collective over the survivors). ``live_ranks``: ranks not excluded.
    """

    def __init__(self, heap: Heap, backend: str, timeout_s: float, owns_dist: bool = False,
                 error_word: torch.Tensor | None = None, trace=None):
        self.heap, self.backend, self.timeout_s = heap, backend, _check_timeout(timeout_s)
        self.trace_calls = trace_calls(trace)   # flight-recorder records per channel; 0 = off
        self._dumped_epoch = -1                 # MOE_COMM_TRACE_DIR: the epoch last dumped on a GroupError
        self.rank, self.world_size, self.device = heap.rank, heap.world_size, heap.device
        self._cuda = pin = self.device.type == "cuda"   # read at every op call: torch.device.type costs ~0.4 us
        self.error_word = (torch.zeros(ERR_WORDS, dtype=torch.int64, pin_memory=pin) if error_word is None
                           else error_word.zero_())
        self._error_host = self.error_word.numpy()   # the same host memory: ``check`` reads it at every call
        self._live = [True] * self.world_size
        self.epoch = 0
        self._members: list[weakref.ref] = []   # channels and ops: reset / closed with the group
        self._last_event = None                 # CUDA: completion of the last op (eager error checks)
        self._in_flight: list[OpCall] = []      # op calls whose kernels may still record a data error
        self._reads_lag = self.device.type == "cuda"  # the end of a call reads the word before its kernels end
        self._owns_dist, self._closed, self._excluded_self = owns_dist, False, False
        self.status = heap.alloc("group.status", (protocol.status_words(self.world_size),), torch.int64)
        self.state = torch.zeros(protocol.state_words(self.world_size), dtype=torch.int64, device=self.device)
        self.transports = choose_transports(heap)   # per peer: protocol.TRANSPORT_STORE / TRANSPORT_PUT
        self._put_launch = None                     # put_launch_args(), built on first use
        # Errors raised, for moe_comm.metrics: (kind, op, peer) -> count (a group-wide error once per epoch:
        # ``_count_error``); replaced on update, so another thread may read it at any time.
        self.error_counts: dict[tuple[str, str, str], int] = {}
        self._counted: set = set()   # group-wide errors of this epoch already counted
        self.on_check = None         # moe_comm.metrics on CUDA: the copy a scrape asked for, made at the next check
        self._write_state()
        global _GROUPS
        _GROUPS = [r for r in _GROUPS if r() is not None] + [weakref.ref(self)]

    @property
    def timeout_ns(self) -> int:
        return int(self.timeout_s * 1e9)

    @property
    def uses_put(self) -> bool:
        """True if any peer is reached by NVSHMEM puts (``moe_comm/transport.py``)."""
        return protocol.TRANSPORT_PUT in self.transports

    def put_launch_args(self) -> dict:
        """Launch arguments of a kernel whose put path is compiled in only when the group uses puts (its
        ``PUT: tl.constexpr``: the send kernels' put transport, the status broadcast of every kernel that
        may record a group-wide error): ``PUT``, and on CUDA with puts NVSHMEM's bitcode (those kernels'
        CUDA modules get ``nvshmemx_cumodule_init`` on load: ``channel.register_put_kernels``)."""
        if self._put_launch is None:
            args = {"PUT": self.uses_put}
            if self.uses_put and self.device.type == "cuda":  # once: the pairing check reads the disk
                from .channel import register_put_kernels  # noqa: PLC0415
                from .triton_kernels import nvshmem_bitcode  # noqa: PLC0415
                register_put_kernels()
                args.update(nvshmem_bitcode.launch_options())
            self._put_launch = args
        return dict(self._put_launch)

    @property
    def live_ranks(self) -> list[int]:
        """Ranks not excluded (``exclude``), in order."""
        return [r for r in range(self.world_size) if self._live[r]]

    def excluded_mask(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """int32 [world] on the group's device: 1 for each excluded rank, 0 for each live one (DeepEP's rank
        mask, ``compat.deep_ep``), read on the device from the live mask the kernels use: no host read,
        so a CUDA graph can capture it and it follows ``exclude()`` without a new capture. Into ``out``
        (int32 [world] on the device) when given."""
        live = self.state[protocol.S_LIVE:protocol.S_LIVE + self.world_size]
        if out is None:
            out = torch.empty(self.world_size, dtype=torch.int32, device=self.device)
        return out.copy_(live == 0)

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self):
        return (f"CommGroup(rank={self.rank}, world_size={self.world_size}, backend={self.backend!r}, "
                f"device={self.device}, live={self.live_ranks})")

    def _write_state(self) -> None:
        """Write the group state (host values) to the device tensor the kernels read."""
        w, st = self.world_size, torch.zeros_like(self.state, device="cpu")
        st[protocol.S_EPOCH] = self.epoch
        st[protocol.S_ERR_ADDR] = self.error_word.data_ptr()  # host address; valid on the device (UVA)
        st[protocol.S_TIMEOUT_NS] = self.timeout_ns
        st[protocol.S_LIVE:protocol.S_LIVE + w] = torch.tensor(self._live, dtype=torch.int64)
        st[protocol.s_status(w):protocol.s_status(w) + w] = self.status.peer_ptrs.cpu()
        st[protocol.s_transport(w):protocol.s_transport(w) + w] = torch.tensor(self.transports, dtype=torch.int64)
        self.state.copy_(st)

    # ---- members ---------------------------------------------------------------------------------
    def register(self, member) -> None:
        """Channels and ops register here: ``reset()`` calls their ``reset()``, ``close()`` their
        ``mark_closed()`` (if they have one)."""
        self._members.append(weakref.ref(member))

    def unregister(self, member) -> None:
        self._members = [m for m in self._members if m() is not None and m() is not member]

    def _each_member(self):
        self._members = [m for m in self._members if m() is not None]
        return [m() for m in self._members]

    def ensure_open(self) -> None:
        if self._closed:
            raise ClosedError(f"{self!r} is closed: create a new group")
        if self._excluded_self:
            raise ExcludedError(f"rank {self.rank} was excluded by the other ranks of its group")

    # ---- errors ----------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise the error the kernels recorded, if any. Never syncs the device.

        A data error (CapacityError, InvalidIndexError) is raised once and the word is released for the
        next one. A group-wide error (GroupError) stays: every later check and op raises it again until
        ``reset()`` / ``exclude()``. If an error found the word taken, the next check says so.
        """
        self.ensure_open()
        if self.on_check is not None:   # moe_comm.metrics: copies of device counters (no sync; see there)
            self.on_check()
        word = self._error_host   # a NumPy view: a read of one word costs ~0.1 us, a tensor index ~1.5 us
        code = int(word[0])  # the code first: kernels publish it after the fields
        if code != ERR_NONE:
            values = word.tolist()
            err = decode_error(values, self.timeout_s)
            if values[ERR_DROPPED]:
                err.args = (err.args[0] + " (further device errors were found while this one was pending)",)
            self._count_error(err)
            if code not in GROUP_CODES:
                self._release_error_word()
            else:
                self._dump_on_error(err)
            raise err
        if int(word[ERR_DROPPED]):
            self._release_error_word()
            err = MoECommError(f"rank {self.rank}: a device error was recorded while an earlier one was "
                               f"being reported; its details were lost (see the op's outputs)")
            self._count_error(err)
            raise err

    def _count_error(self, err: MoECommError) -> None:
        """Count ``err`` in ``error_counts`` by (kind, op, peer): a data error each time it is raised (each
        is a new record), a group-wide error once per epoch however often it is raised again."""
        peer = getattr(err, "peer", None)
        key = (error_kind(err), str(getattr(err, "op", "")), "" if peer is None else str(peer))
        if isinstance(err, GroupError):
            if key in self._counted:
                return
            self._counted.add(key)
        self.error_counts = {**self.error_counts, key: self.error_counts.get(key, 0) + 1}

    # ---- flight recorder --------------------------------------------------------------------------
    def traced_channels(self) -> list:
        """The channels of this group's ops that keep a flight recorder (every channel; see ``trace``)."""
        return [m for m in self._each_member() if hasattr(m, "trace")]

    def dump_trace(self, path, error: BaseException | None = None) -> str:
        """Write this rank's flight records (every channel's last calls, wait statistics, group facts) as
        JSON to ``path`` (a ``.json`` file, or a directory: ``path/trace-rank<rank>.json``); returns the
        file. Reads no device memory but the wait statistics (skipped while the stream is busy), so it
        works after a hang. Merge the ranks' files with ``python -m moe_comm trace DIR``."""
        return write_dump(self, path, error)

    def _dump_on_error(self, err: BaseException) -> None:
        """``MOE_COMM_TRACE_DIR`` set: dump once per epoch when a GroupError is raised."""
        where = os.environ.get(ENV_TRACE_DIR)
        if where and self._dumped_epoch != self.epoch:
            self._dumped_epoch = self.epoch
            self.dump_trace(where, err)

    def _release_error_word(self) -> None:
        """Clear the word, then let kernels claim it again (stream-ordered on CUDA: kernels already queued
        cannot write a half record over the cleared one)."""
        self.error_word.zero_()
        self.state[protocol.S_CLAIM].zero_()

    def begin_call(self, op: str) -> OpCall:
        """An op call's send phase is launched: its kernels may record a data error from now on."""
        call = OpCall(op)
        self._in_flight.append(call)
        return call

    def finish_op(self, result, call: OpCall | None = None):
        """End of an op call (its kernels are launched): raise what the kernels recorded. On CPU they have
        finished. On CUDA (eager) wait for the previous op's kernels first, so an error is raised at the
        latest at the end of the next call; under graph capture nothing is read (the engine checks once
        per step). A data error carries the result of the call that recorded it (``attribute_data_error``).
        """
        if call is not None:
            call.result, call.finished = result, True
        if self._cuda:
            if torch.cuda.is_current_stream_capturing():
                return result
            prev = self._last_event
            self._last_event = torch.cuda.Event()
            self._last_event.record(torch.cuda.current_stream(self.device))
            if prev is not None:
                prev.synchronize()
        if call is not None and call.error is not None:   # recorded by this call, read at an earlier one
            err, err.result, err.call_result = call.error, result, result
            self._in_flight.remove(call)
            raise err
        try:
            self.check()
        except MoECommError as e:
            if isinstance(e, GroupError) or not self.attribute_data_error(e, result):
                raise
            return result
        # Nothing recorded: every finished call's kernels have run (on CUDA, every one before this call).
        self._in_flight = [c for c in self._in_flight if not c.finished or (c is call and self._reads_lag)]
        return result

    def attribute_data_error(self, err: MoECommError, result) -> bool:
        """Give a data error ``err``, read at the end of an op call whose result is ``result``, the result of
        the call that recorded it: the one call of its op in flight (``err.result``; ``err.call_result`` is
        this call's). Returns False to raise it now; True if that call's receive phase has not run yet:
        the error is kept for the end of that call, raised there with its result. If several calls of
        the op are in flight, the error is raised now without a result, and says so."""
        err.call_result = result
        name = getattr(err, "op", None)
        calls = [c for c in self._in_flight if c.op == name]
        if len(calls) != 1:
            err.result = None
            err.args = (err.args[0] + f" (recorded by one of {len(calls)} {name} calls in flight: no result "
                        f"attached; err.call_result is the result of the call it is raised from)",)
            return False
        (rec,) = calls
        if not rec.finished:
            rec.error = err
            return True
        self._in_flight.remove(rec)
        err.result = rec.result
        if rec.result is not result:
            err.args = (err.args[0] + f" (recorded by an earlier {name} call, raised at the end of a later op "
                        f"call: err.result is the recording call's result, err.call_result this call's)",)
        return False

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        """Host barrier over the live ranks (a no-op on loopback, where program order already is one).
        On a failed group it raises the group's error instead of waiting (a peer that is recovering will
        not come to this barrier). Then ``check()``."""
        self.ensure_open()
        try:
            self.heap.barrier(self.live_ranks, poll=self._raise_if_failed)
        except CommTimeoutError as e:
            self._count_error(e)
            self._fail_group(e)
            raise
        self._raise_if_failed()

    def _fail_group(self, err: CommTimeoutError) -> None:
        """Make a timeout the host saw group-wide (this rank's error word and every live rank's status),
        as a kernel's failed wait does."""
        from .interpreter import kernel_for  # noqa: PLC0415
        from .triton_kernels.sync import fail_group_kernel  # noqa: PLC0415
        w = self.world_size
        kernel_for(fail_group_kernel, self.device)[(1,)](
            self.state, ERR_TIMEOUT, OPS.index("barrier"), self.rank, err.peer, self.timeout_ns,
            WORLD=w, WORLD_P2=1 << max(w - 1, 0).bit_length(), **self.put_launch_args())
        self.synchronize()
        # Ranks reached by puts got the record as a put; a rank that is not in a kernel reads it from the
        # control plane at its next barrier too.
        record = [ERR_TIMEOUT, OPS.index("barrier"), self.rank, err.peer, 0, self.timeout_ns]
        self.heap.post_failure(self.epoch, record + [0] * (protocol.REC_WORDS - len(record)))

    def _raise_if_failed(self) -> None:
        """Raise the group-wide error broadcast into this rank's status, if any (host read of the status
        tags; on CUDA a copy). The device keeps the record: the same named error as the kernels adopt."""
        self.check()
        w = self.world_size
        posted = self.heap.posted_failure(self.epoch)
        if posted is not None and self._live[posted[2]]:   # adopt it as a broadcast record of its rank
            j = posted[2]
            self.status.local[w + j * protocol.REC_WORDS: w + (j + 1) * protocol.REC_WORDS] = torch.tensor(
                posted, dtype=torch.int64)
            self.status.local[j] = self.epoch + 1
        tags = self.status.local[:w].tolist()
        for j in range(w):
            if self._live[j] and tags[j] == self.epoch + 1:
                rec = self.status.local[w + j * protocol.REC_WORDS: w + (j + 1) * protocol.REC_WORDS].tolist()
                err = decode_error(rec + [0, 0], self.timeout_s)
                self._count_error(err)
                self._dump_on_error(err)
                raise err

    def _agree(self, members, payload, op: str) -> tuple[dict[int, list[int]], list[int]]:
        """A decided recovery meeting of ``members`` (``heap.agree``): the payloads of the ranks the meeting's
        one decision took in, the same on every rank that reads it, and the members it left out. The heap
        bounds it by twice the timeout (ranks reach recovery up to one timeout apart: one saw the failure
        at once, another only when its own wait expired), twice that for a decision that leaves at most
        half of ``members``. A rank left out (it came after the decision) is excluded: ExcludedError, now
        and at every later call."""
        got, missing = self.heap.agree(members, payload)
        if self.rank not in got:
            self._excluded_self = True
            err = ExcludedError(f"{op}: rank {self.rank} came to the recovery meeting after the ranks "
                                f"{sorted(got)} had decided without it: it was excluded by the other ranks "
                                f"of its group")
            self._count_error(err)
            raise err
        return got, missing

    def _meet(self, kind: int, op: str, values=()) -> dict[int, list[int]]:
        """Recovery meeting of the live ranks (``_agree``): every one comes, for the same ``kind``; returns
        every live rank's ``values``. A live rank the decision left out is named by CommTimeoutError (its
        ``missing``: every one left out); it raises ExcludedError when it comes: ``exclude`` it."""
        t0 = time.monotonic()
        got, missing = self._agree(self.live_ranks, [kind, *values], op)
        if missing:
            err = CommTimeoutError(op, self.rank, missing[0], round(time.monotonic() - t0, 1))
            err.missing = list(missing)
            self._count_error(err)
            raise err
        odd = {j: v[0] for j, v in got.items() if v[0] != kind}
        if odd:
            raise GroupError(f"{op}: rank {self.rank} met ranks {sorted(odd)} in a different recovery call "
                             f"(every live rank must make the same recovery calls in the same order)")
        return {j: v[1:] for j, v in got.items()}

    def exchange(self, values: list[int]) -> dict[int, list[int]]:
        """Collective over the live ranks, outside the data path (recovery control plane, bounded): every
        live rank's int64 ``values`` (at most 7). For agreeing on where to resume after ``reset()``."""
        self.ensure_open()
        return self._meet(_EXCHANGE, "exchange", [int(v) for v in values])

    # ---- recovery --------------------------------------------------------------------------------
    def reset(self) -> None:
        """Collective over the live ranks: clear a group-wide error and start a new epoch.

        Waits for this rank's device work, meets every live rank (bounded: CommTimeoutError names a rank
        that does not come; ``exclude`` it), then zeroes this rank's flags, call counters, status and error
        word, drops every op's pending phase, bumps the epoch (flags and status records of older epochs
        are never accepted again), and meets the live ranks once more so that nobody sends in the new
        epoch before everyone has cleared. Handles of dispatches made before a reset are refused.
        """
        self.ensure_open()
        self.synchronize()
        self._meet(_RESET, "reset")
        for m in self._each_member():
            m.reset()
        self.status.local.zero_()
        self.error_word.zero_()
        self.epoch += 1
        self._counted = set()
        self._last_event = None
        self._in_flight = []
        self._write_state()
        self.heap.realign_barriers(self.epoch << 32)
        self.synchronize()
        self._meet(_RESET, "reset")

    def exclude(self, ranks) -> list[int]:
        """Collective over the survivors: ``ranks`` are absent from now on; returns the excluded set.

        The survivors agree on the set first, in one decided meeting (``_agree``): every rank reads the
        same decision of who took part, and the excluded set is a function of it alone: every rank it
        leaves out (a survivor that does not come is excluded too, and learns so when it comes) and every
        rank a survivor in it names, unless that rank came and named only ranks the decision left out (it
        was blocked on them: ``_excluded_by``). So a second failure during an exclude is handled the same
        way, and two survivors naming different ranks exclude both, everywhere. Then no kernel sends to or waits
        for an excluded rank: dispatch slots routed to its experts are not routed (counted in the buffer's statistics), AllToAllvDynamic rows
        addressed to it are dropped (counted), and the live mask is on the device, so captured CUDA graphs
        keep working. This rank's mappings of the excluded ranks' memory are released. Ends with
        ``reset()``. A rank that finds itself excluded raises ExcludedError and must stop.
        """
        self.ensure_open()
        gone = {int(r) for r in ranks}
        if any(r < 0 or r >= self.world_size for r in gone):
            raise ValueError(f"ranks must be in [0, {self.world_size}), got {sorted(gone)}")
        if self.rank in gone:
            raise ValueError(f"rank {self.rank} cannot exclude itself")
        gone |= {r for r in range(self.world_size) if not self._live[r]}
        self.synchronize()
        candidates = [r for r in range(self.world_size) if r not in gone]
        got, _ = self._agree(candidates, [_EXCLUDE] + _mask_words(gone, self.world_size), "exclude")
        odd = sorted(j for j, v in got.items() if v[0] != _EXCLUDE)
        if odd:
            raise GroupError(f"exclude: rank {self.rank} met ranks {odd} in a different recovery call "
                             f"(every live rank must call exclude() with the failed ranks)")
        before = {r for r in range(self.world_size) if not self._live[r]}
        gone = _excluded_by(got, before, self.world_size)   # from the decision alone
        if self.rank in gone:
            self._excluded_self = True
            err = ExcludedError(f"rank {self.rank} was excluded by the other ranks of its group")
            self._count_error(err)
            raise err
        for r in sorted(gone):
            if self._live[r]:
                self._live[r] = False
                self.heap.release_peer(r)
        self.reset()
        return sorted(gone)

    # ---- lifetime --------------------------------------------------------------------------------
    def close(self) -> None:
        """Release the heap. Every op built on this group is closed too: using one raises ClosedError."""
        if self._closed:
            return
        for m in self._each_member():
            mark = getattr(m, "mark_closed", None)
            if mark is not None:
                mark()
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


class OpCall:
    """One op call between its send phase and the host's first clean read of the error word after its
    kernels ran: ``op`` (an ``errors.OPS`` name), ``result`` once its receive phase is launched
    (``finished``), and a data error it recorded that was read before that (``error``)."""

    __slots__ = ("op", "result", "finished", "error")

    def __init__(self, op: str):
        self.op, self.result, self.finished, self.error = op, None, False, None


_RESET, _EXCLUDE, _EXCHANGE = 1, 2, 3   # kinds of recovery meeting (heap.agree payload word 0)


def _excluded_by(got: dict[int, list[int]], before: set[int], world: int) -> set[int]:
    """The ranks an exclusion meeting's decision ``got`` ({rank: [kind, mask words]}) excludes (``before``:
    the ranks excluded earlier, in every mask): every rank it left out, and every rank a rank it took in
    names, except a named rank that came and itself named only ranks the decision left out. That rank was
    blocked on them, not the fault: a survivor whose wait depended on it (the next prefill dispatch waits
    for every rank's ``released``; a decode combine for the rows of a rank still in its dispatch receive)
    ran out of time before that rank's own record, naming the dead rank, reached it."""
    absent = {r for r in range(world) if r not in got}
    fresh = {j: _mask_ranks(v[1:], world) - before for j, v in got.items()}   # whom each named now
    named = set().union(*fresh.values()) - absent
    blocked = {j for j in named & set(got) if fresh[j] and fresh[j] <= absent}
    return absent | (named - blocked)


def _mask_words(ranks, world: int) -> list[int]:
    """A set of ranks as int64 bit words (63 ranks per word: values stay positive)."""
    words = [0] * (world // 63 + 1)
    for r in ranks:
        words[r // 63] |= 1 << (r % 63)
    return words


def _mask_ranks(words, world: int) -> set[int]:
    return {r for r in range(world) if (words[r // 63] >> (r % 63)) & 1}


def _check_timeout(timeout_s) -> float:
    t = float(timeout_s)
    if not math.isfinite(t) or t <= 0:
        raise ValueError(f"timeout_s must be a finite number > 0, got {timeout_s!r}")
    return t


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


def init(backend: str = "auto", *, timeout_s: float = 30.0, world_size: int | None = None, device=None,
         trace=None):
    """Create this process's CommGroup (or, for ``backend="loopback"``, a list of ``world_size`` groups).

    Bootstraps from torch.distributed: an existing default group, else the torchrun env vars
    (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), else world 1.
    backend: "auto" (nvshmem on CUDA, shm on CPU) | "nvshmem" | "shm" | "loopback".
    timeout_s bounds every device wait and host barrier; expiry raises CommTimeoutError naming the peer.
    trace: the flight recorder (``moe_comm/trace``): None = ``MOE_COMM_TRACE``; True/False; or the number
    of calls to keep per channel.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    timeout_s = _check_timeout(timeout_s)
    if backend == "loopback":
        from .heap.loopback import LoopbackHeap  # noqa: PLC0415
        n = 1 if world_size is None else int(world_size)
        if n < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        dev = _as_device(device) if device is not None else _default_device("loopback", 0)
        return [CommGroup(h, "loopback", timeout_s, trace=trace) for h in LoopbackHeap.create_world(n, dev)]

    import torch.distributed as dist  # noqa: PLC0415
    owns = False
    if not dist.is_initialized() and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        pg_backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        init_process_group(pg_backend, timeout=datetime.timedelta(seconds=max(timeout_s, 10.0)))
        owns = True
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world_size is not None and world_size != world:
        raise ValueError(f"world_size={world_size} but torch.distributed has {world} ranks")
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if backend == "auto":
        backend = "nvshmem" if torch.cuda.is_available() else "shm"
    dev = _as_device(device) if device is not None else _default_device(backend, local_rank)
    from .heap.control import group_store  # noqa: PLC0415
    store = group_store(world)   # the control plane (heap/control.py): never a mapping of a peer
    if backend == "shm":
        from .heap.shm import ShmHeap, new_session  # noqa: PLC0415
        if dev.type != "cpu":
            raise ValueError("backend='shm' holds CPU tensors; use 'nvshmem' or 'loopback' on a GPU")
        session = os.environ.get("MOE_COMM_SESSION")
        if session is None:  # not under launch(): agree on a session name through torch.distributed
            box = [new_session()]
            if world > 1:
                dist.broadcast_object_list(box, src=0)
            session = box[0]
        heap = ShmHeap(rank, world, session, store, timeout_s)
    else:
        from .heap.nvshmem import NvshmemHeap  # noqa: PLC0415
        heap = NvshmemHeap(rank, world, dev, timeout_s, store)
    return CommGroup(heap, backend, timeout_s, owns_dist=owns, trace=trace)


def init_process_group(backend: str, **kwargs) -> None:
    """``torch.distributed.init_process_group(backend, **kwargs)``, made so that ``destroy_process_group``
    really ends the group: the process groups it made are destroyed there, their threads (gloo's workers and
    its transport loop) joined, none left running into interpreter finalization. Every process group
    moe-comm makes itself is made here; ``CommGroup.close`` destroys it (``init``'s group).

    Why: ``torch.distributed.nn.functional`` binds ``group=group.WORLD`` as the default argument of ten
    functions when it is first imported. Imported after the default group exists (torch._dynamo's import
    does it: a TorchFunctionMode, torch.compile), those defaults hold the default ProcessGroup, and
    ``destroy_process_group`` only drops torch's own references: the C++ group, its gloo worker threads
    included, lives until the interpreter finalizes. A worker that then releases the last reference to a
    finished work's tensor, whose Python object the tensor keeps, must take the GIL; a finalizing Python
    ends that thread (``pthread_exit``) inside a noexcept destructor and the process aborts ("terminate
    called without an active exception"; seen on a torchrun rank that exited right after its last
    collective). Imported before the group exists, those defaults are None (the default group). Two other
    torch modules bind it so (torch 2.13 and 2.15): ``distributed.optim.zero_redundancy_optimizer`` and
    ``distributed.fsdp.sharded_grad_scaler``, training code that nothing on moe-comm's paths imports (not
    transformers, torch._dynamo or moe-comm); not imported here (``torch.distributed.optim`` takes ~0.8 s), so
    a process that imports either after ``init`` keeps the group alive past ``close`` again."""
    import torch.distributed as dist  # noqa: PLC0415
    import torch.distributed.nn  # noqa: F401, PLC0415  (first: see above)
    dist.init_process_group(backend, **kwargs)


# ---- launch ------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent(launcher_pid: int) -> None:
    """A rank process must not outlive the process that launched it (SIGTERM or SIGKILL included). Its
    parent is the launcher (``spawn``) or the fork server (``forkserver``, which ends when the launcher
    does): ask Linux to SIGKILL it when that parent dies, and, where that is unavailable or the parent
    died before the request, watch both from a daemon thread."""
    try:
        import ctypes  # noqa: PLC0415
        import signal  # noqa: PLC0415
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    parent = os.getppid()

    def launcher_alive():
        try:
            os.kill(launcher_pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True

    def watch():
        while os.getppid() == parent and launcher_alive():
            time.sleep(0.5)
        os._exit(1)

    if parent == 1 or not launcher_alive():
        os._exit(1)
    threading.Thread(target=watch, name="moe_comm-parent-watch", daemon=True).start()


def _rank_main(work, rank, world_size, port, session, backend, timeout_s, conn, parent_pid, environ, fds):
    """One rank: the launcher's stdout/stderr and environment first, then ``work`` (the pickled
    ``(fn, args)``) is loaded, so that the modules it imports see that environment (a fork server's
    children start with the server's)."""
    _die_with_parent(parent_pid)
    for target, fd in zip((1, 2), fds):
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
                      MOE_COMM_SESSION=session, TORCHELASTIC_USE_AGENT_STORE="True")  # store: launch()'s
    start = init
    try:
        if _import_time_env(os.environ) != _IMPORTED_UNDER:   # moe_comm as this environment imports it
            start = _reimport_moe_comm().init
        fn, args = pickle.loads(work)
        with start(backend, timeout_s=timeout_s) as group:
            result = fn(group, *args)
        msg = ("ok", pickle.dumps(result))
    except BaseException as e:  # noqa: BLE001  (report everything, KeyboardInterrupt included)
        msg = ("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    conn.send(msg)
    conn.close()


# Rank processes are forked from a server that imported these once (``start_method="forkserver"``): torch's
# import alone costs about 3 s of CPU per process, moe_comm's and its interpreted kernels' 0.6 s
# (``_forkserver_preload``). Each rank is still a new process, forked before any group, heap or CUDA
# context exists, so nothing of one launch reaches the next; the environment is the launcher's at
# launch() (passed along).
FORKSERVER_PRELOAD = ("torch", "triton", "moe_comm._forkserver_preload")
# Preloaded as well when the launcher has imported the key module itself (its ranks will too): the
# transformers door with transformers' model and generation code, about 2.6 CPU-seconds per rank process.
PRELOAD_IF_IMPORTED = {"moe_comm.serving.hf": ("moe_comm.serving.hf", "transformers.modeling_utils",
                                               "transformers.generation.utils")}

# Variables read when modules are imported, by what the server preloads: Triton's ``@jit`` makes a kernel
# interpreted or compiled by TRITON_INTERPRET as its module is imported. moe_comm reads none at import.
IMPORT_TIME_ENV_PREFIXES = ("TRITON_",)


def _import_time_env(environ) -> dict:
    return {k: v for k, v in environ.items() if k.startswith(IMPORT_TIME_ENV_PREFIXES)}


_IMPORTED_UNDER = _import_time_env(os.environ)   # this process's environment when moe_comm was imported


def _reimport_moe_comm():
    """A rank whose import-time environment is not the fork server's: forget the server's moe_comm
    modules (and their interpreted twins) and import moe_comm again; returns the new ``moe_comm.group``."""
    import importlib  # noqa: PLC0415
    for name in [m for m in sys.modules if m == "moe_comm" or m.startswith("moe_comm.")]:
        del sys.modules[name]
    return importlib.import_module("moe_comm.group")


class _LauncherFd:
    """One of the launcher's file descriptors (stdout, stderr), handed to a rank as it starts: a fork
    server's child would otherwise write to the server's, not to where the launcher's output goes now."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):   # pickled while the process starts: multiprocessing passes the descriptor on
        from multiprocessing import reduction  # noqa: PLC0415
        return _detach_fd, (reduction.DupFd(self.fd),)


def _detach_fd(dup) -> int:
    return dup.detach()


def _process_context(start_method: str):
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        extra = [m for key, mods in PRELOAD_IF_IMPORTED.items() if key in sys.modules for m in mods]
        ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD) + extra)   # no effect once the server runs
    return ctx


def launch(fn, world_size: int, *args, backend: str = "auto", timeout_s: float = 30.0,
           start_method: str = "forkserver", grace_s: float | None = None):
    """Run ``fn(group, *args)`` in ``world_size`` new processes, each with a ready CommGroup.

    Returns the per-rank return values in rank order. When a rank raises, the other ranks are stopped
    after ``grace_s`` (default RAISED_GRACE_S: the launch ends within a second or two). When a rank dies
    without raising (killed, ``os._exit``), the others get ``grace_s`` (default 2*timeout_s + 15 s) to finish
    on their own, so they can report what they saw (e.g. a CommTimeoutError naming the dead rank). Then
    LaunchError is raised naming every failed rank, the first failure first. Shared-memory files of the
    run are removed whatever happens. ``fn`` and ``args`` must pickle.
    """
    if backend == "loopback":
        raise ValueError("launch() starts one process per rank; loopback keeps all ranks in one process: "
                         "use moe_comm.init(backend='loopback', world_size=N)")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    timeout_s = _check_timeout(timeout_s)
    died_grace_s = 2 * timeout_s + 15 if grace_s is None else grace_s
    raised_grace_s = RAISED_GRACE_S if grace_s is None else grace_s
    ctx = _process_context(start_method)
    from .heap.shm import new_session  # noqa: PLC0415
    port, session = _free_port(), new_session()
    from .heap.control import launcher_store  # noqa: PLC0415
    store = launcher_store(port, world_size)  # hosted here, so it outlives any rank (heap/control.py)
    procs, conns = [], []
    work = pickle.dumps((fn, args))
    for r in range(world_size):
        recv_end, send_end = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_rank_main, name=f"moe_comm-rank{r}", daemon=True,
                        args=(work, r, world_size, port, session, backend, timeout_s, send_end,
                              os.getpid(), dict(os.environ), (_LauncherFd(1), _LauncherFd(2))))
        p.start()
        send_end.close()
        procs.append(p)
        conns.append(recv_end)
    results, failures, pending = [None] * world_size, {}, set(range(world_size))
    deadline, raised, failed_at = None, False, None   # failures: in the order they were seen
    try:
        while pending:
            wait_for = [conns[r] for r in pending] + [procs[r].sentinel for r in pending]
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = multiprocessing.connection.wait(wait_for, timeout)
            if not ready:
                first = next(iter(failures))
                for r in sorted(pending):
                    procs[r].kill()
                    failures[r] = f"stopped: still running {time.monotonic() - failed_at:.1f} s after rank {first} failed"
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
                    failures[r], raised = payload, True
            if failures and (deadline is None or raised):
                if deadline is None:
                    failed_at = time.monotonic()
                grace = raised_grace_s if raised else died_grace_s
                deadline = min(deadline or math.inf, time.monotonic() + grace)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        from .heap.shm import remove_session_files  # noqa: PLC0415
        remove_session_files(session)
        del store
    if failures:
        raise LaunchError(failures, results)
    return results
