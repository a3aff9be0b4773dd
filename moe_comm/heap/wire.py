"""The network between emulated nodes (CPU, ``MOE_COMM_RANKS_PER_NODE``): puts travel as messages, posted
to an emulated NIC.

A rank maps nothing of another node's memory. Its interpreted NVSHMEM calls to a rank of another node
(``moe_comm/triton_kernels/nvshmem_device.py``) *post* messages to that rank's send queue and return at once:
``put`` (the source address and length of a symmetric buffer's bytes, for a destination buffer and offset)
and ``signal`` (an int64 word set or added with release). The emulated NIC, a thread per (source,
destination) pair, takes them in order, reads a put's source bytes only then (as a NIC reads them by DMA
when it processes the work request, not when it is posted: a sender that rewrote its staging before
anything proved the NIC had read it sends the new bytes), and sends them on a localhost TCP stream. A proxy
thread in the *receiving* process applies each message to its own heap, in order per (source, destination),
so a receiver that sees a signal sees every payload sent before it, and acknowledges it.

NIC model, ``MOE_COMM_WIRE_NIC`` (``NIC_MODELS``), after NVSHMEM 3.4.5's two InfiniBand transports
(docs/faults.md, "A dead peer across nodes", cites the source):

- ``ibgda`` (default; GPU-initiated, what survival across nodes needs): nothing polls a queue pair's
  completions but a ``quiet``, a ``fence`` (IBGDA's fence polls the completions of every queue pair, as its
  quiet does) and a post that finds the send queue full (``ibgda_reserve_wqe_slots`` waits for the oldest
  work requests to complete). So a message to a dead rank is harmless until one of those waits on it; the
  wait lasts until the NIC gives up on the message, then fails the process. Each message takes the work
  requests NVSHMEM posts for it (``WQES``); a destination's queue holds ``MOE_COMM_WIRE_QP_DEPTH``
  (default NVSHMEM's ``NVSHMEM_QP_DEPTH``, 1024), the depth of one of its queue pairs (NVSHMEM has two per
  peer, chosen by CTA: one queue per peer here is the conservative reading).
- ``proxy`` (IBRC: a CPU proxy thread posts the work and polls every completion): a message the NIC gives
  up on ends the process whether or not anything waits for it (a watchdog thread here, as the proxy's
  ``progress_send`` -> ``NVSHMEMI_NZ_EXIT``).

The NIC gives up on an unacknowledged message ``transport_timeout_s`` after it was posted (NVSHMEM's
queue-pair settings, ACK timeout 20 and 7 retries: about 34 s; ``MOE_COMM_WIRE_TRANSPORT_TIMEOUT_S``
shortens it for tests). A dead receiver's messages are never acknowledged (a closed connection is no
answer: a NIC learns nothing faster from a dead peer either); ``transport_failed`` then ends the process
as NVSHMEM does (IBGDA: the kernel asserts and the CUDA context is lost; IBRC: the proxy calls exit).

``quiet(skip)`` waits for every message to every rank but ``skip`` (the excluded ranks: the heap's free and
close, ``ShmHeap``, are the only callers; no kernel quiets or fences on a steady-state path, docs/multinode.md
"Staging reuse by causality"). A wire stops acknowledging when it closes; its heap closes it only after the
live ranks met in the finalize barrier (``ShmHeap._finalize``, as ``nvshmem_finalize``).

``MOE_COMM_WIRE_NIC_DELAY_S`` (tests): the emulated NIC takes this long before it reads and sends each
message ("0.05", or per rank "2:0.3,0:0.1"): a slow NIC, so that a staging buffer reused too early shows.

Symmetric addresses do not cross: a message names the buffer by its allocation index (the same on every
rank: allocation is collective) and the offset in it; the receiver resolves the index to its own copy.

The wire counts what it posts (``stats``: messages, puts, signals; bytes, headers included; payload, the
bytes put plus 8 per signal value; also per destination), so the bytes and puts a call puts on the network
are measured figures on the CPU. What it cannot show: a NIC's reordering, partial completion or bandwidth
(the streams are localhost TCP, ordered and reliable).
"""

from __future__ import annotations

import collections
import ctypes
import os
import socket
import struct
import sys
import threading
import time
from collections import Counter

HEADER = struct.Struct("<BIQq")    # kind, buffer index, byte offset, payload bytes (put) / value (signal)
ACK = struct.Struct("<Q")          # messages applied so far on this stream
PUT, SIGNAL_SET, SIGNAL_ADD = 0, 1, 2
SIGNAL_BYTES = 8                   # a signal's payload: its int64 value (carried in the header's last field)
KEY = "wire/{}"                    # store key: the proxy's port of rank {}
TRANSPORT_TIMEOUT_ENV = "MOE_COMM_WIRE_TRANSPORT_TIMEOUT_S"
NIC_ENV = "MOE_COMM_WIRE_NIC"
NIC_MODELS = ("ibgda", "proxy")    # NVSHMEM's GPU-initiated transport (default), its CPU proxy (IBRC)
QP_DEPTH_ENV = "MOE_COMM_WIRE_QP_DEPTH"
QP_DEPTH = 1024                    # NVSHMEM_QP_DEPTH's default (modules/transport/common/env_defs.h)
NIC_DELAY_ENV = "MOE_COMM_WIRE_NIC_DELAY_S"
# Work requests NVSHMEM's IBGDA posts per message on an RC queue pair (ibgda_device.cuh): a put of one
# memory chunk is one RDMA write; a 64-bit signal SET is an atomic of 2 WQEs plus a NOP
# (ibgda_get_num_wqes_in_atomic, need_additional_wqe), an ADD one; a putmem_signal is a put then a signal.
WQES = {PUT: 1, SIGNAL_SET: 3, SIGNAL_ADD: 1}
PROXY_POLL_S = 0.05                # how often the emulated IBRC proxy polls the completions
# NVSHMEM's RC queue pairs (ibrc.cpp, ibgda.cpp): local ACK timeout exponent 20 (4.096 us * 2**20 = 4.3 s
# per try) and 7 retries; the NIC reports a message to a silent peer as failed after 8 tries.
IB_ACK_TIMEOUT, IB_RETRY_CNT = 20, 7
NIC_GIVE_UP_S = (IB_RETRY_CNT + 1) * 4.096e-6 * 2 ** IB_ACK_TIMEOUT
TRANSPORT_FATAL_EXIT = 255         # exit(-1), as NVSHMEM's NVSHMEMI_NZ_EXIT


def _positive(name: str, raw: str, kind=float):
    try:
        value = kind(raw)
    except ValueError:
        value = -1
    if not value > 0:
        raise ValueError(f"{name} must be a positive {'number of seconds' if kind is float else 'whole number'}, "
                         f"got {raw!r}")
    return value


def transport_timeout_s() -> float:
    """How long the emulated NIC retries an unacknowledged message: ``MOE_COMM_WIRE_TRANSPORT_TIMEOUT_S``,
    else NIC_GIVE_UP_S (NVSHMEM's defaults)."""
    raw = os.environ.get(TRANSPORT_TIMEOUT_ENV, "").strip()
    return _positive(TRANSPORT_TIMEOUT_ENV, raw) if raw else NIC_GIVE_UP_S


def nic_model() -> str:
    """``MOE_COMM_WIRE_NIC``: "ibgda" (default) or "proxy"; ValueError naming the choices otherwise."""
    raw = os.environ.get(NIC_ENV, "").strip().lower() or NIC_MODELS[0]
    if raw not in NIC_MODELS:
        raise ValueError(f"{NIC_ENV}={os.environ[NIC_ENV]!r} is not a NIC model; set it to one of "
                         f"{', '.join(NIC_MODELS)} (ibgda: NVSHMEM's GPU-initiated transport, the default; "
                         f"proxy: its CPU proxy, IBRC)")
    return raw


def qp_depth() -> int:
    """Work requests one destination's send queue holds: ``MOE_COMM_WIRE_QP_DEPTH``, else NVSHMEM's 1024."""
    raw = os.environ.get(QP_DEPTH_ENV, "").strip()
    return _positive(QP_DEPTH_ENV, raw, int) if raw else QP_DEPTH


def nic_delay_s(rank: int) -> float:
    """``MOE_COMM_WIRE_NIC_DELAY_S`` for rank ``rank``: "seconds" (every rank) or "rank:seconds,..."."""
    raw = os.environ.get(NIC_DELAY_ENV, "").strip()
    if not raw:
        return 0.0
    try:
        if ":" not in raw:
            return max(0.0, float(raw))
        delays = dict(item.split(":") for item in raw.split(","))
        return max(0.0, float(delays.get(str(rank), 0.0)))
    except ValueError:
        raise ValueError(f"{NIC_DELAY_ENV}={raw!r}: give seconds (e.g. 0.05) or rank:seconds pairs "
                         f"(e.g. 2:0.3,0:0.1)") from None


def transport_failed(rank: int, pe: int, waited_s: float) -> None:
    """What NVSHMEM does when the NIC gives up on a message it then looks at: the process ends (never a
    Python error)."""
    print(f"moe_comm wire (emulated NVSHMEM transport, {nic_model()}): rank {rank}'s puts to rank {pe} were not "
          f"acknowledged after {waited_s:.1f} s (the NIC's retries ran out); NVSHMEM treats this as fatal (IBGDA: "
          f"the kernel asserts and the CUDA context is lost; IBRC: the proxy exits), so this rank exits "
          f"({TRANSPORT_FATAL_EXIT})", file=sys.stderr, flush=True)
    os._exit(TRANSPORT_FATAL_EXIT)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


class _Link:
    """This rank's send queue to rank ``pe`` and the emulated NIC serving it (``cv`` guards every field)."""

    def __init__(self, pe: int):
        self.pe = pe
        self.cv = threading.Condition()
        self.todo: collections.deque = collections.deque()      # (header, src, nbytes, keep): posted, unread
        self.unacked: collections.deque = collections.deque()   # (message number, WQEs, posted at)
        self.posted = self.acked = 0   # messages
        self.wqes_out = 0              # work requests posted and not acknowledged (the send queue's fill)
        self.lost = False              # the connection is gone: nothing more lands or is acknowledged
        self.sock = None

    def oldest(self) -> float:
        return self.unacked[0][2]


class Wire:
    """Rank ``rank``'s end of the emulated network: a proxy that applies incoming messages through
    ``resolve(index) -> local base address or None`` (a freed buffer's messages are dropped), and a send
    queue with its emulated NIC per destination, found through ``store``."""

    def __init__(self, rank: int, store, timeout_s: float, resolve):
        self.rank, self.store, self.timeout_s, self.resolve = rank, store, timeout_s, resolve
        self.transport_timeout_s = transport_timeout_s()
        self.model, self.depth, self.delay_s = nic_model(), qp_depth(), nic_delay_s(rank)
        self.stats: Counter = Counter()   # "messages", "puts", "signals", "bytes", "payload"; also per pe
        self._links: dict[int, _Link] = {}
        self._links_lock = threading.Lock()
        self._incoming: list[socket.socket] = []   # the proxy's connections (closed with the wire)
        self._closed = False
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.2)
        store.set(KEY.format(rank), str(self._server.getsockname()[1]))
        threading.Thread(target=self._accept, name=f"moe_comm-wire{rank}", daemon=True).start()
        if self.model == "proxy":
            threading.Thread(target=self._proxy_progress, name=f"moe_comm-proxy{rank}", daemon=True).start()

    # ---- the receiving proxy -------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            conn.settimeout(None)
            self._incoming.append(conn)
            threading.Thread(target=self._deliver, args=(conn,), daemon=True).start()

    def _deliver(self, conn: socket.socket) -> None:
        applied = 0
        with conn:
            while True:
                try:
                    head = _recv_exact(conn, HEADER.size)
                    if head is None:
                        return
                    kind, index, offset, arg = HEADER.unpack(head)
                    data = _recv_exact(conn, arg) if kind == PUT else b""
                except OSError:   # the wire was closed under this proxy
                    return
                if data is None:
                    return
                base = self.resolve(index)
                if base is not None:
                    if kind == PUT:
                        ctypes.memmove(base + offset, data, len(data))
                    else:
                        word = ctypes.c_int64.from_address(base + offset)
                        word.value = arg if kind == SIGNAL_SET else word.value + arg
                applied += 1
                try:
                    conn.sendall(ACK.pack(applied))
                except OSError:
                    return

    # ---- the sending side: posts (the kernels' threads), the emulated NIC (a thread per link) ----------
    def _link(self, pe: int) -> _Link:
        link = self._links.get(pe)
        if link is None:
            with self._links_lock:
                link = self._links.get(pe)
                if link is None:
                    link = self._links[pe] = _Link(pe)
                    threading.Thread(target=self._nic, args=(link,), name=f"moe_comm-nic{self.rank}-{pe}",
                                     daemon=True).start()
        return link

    def _post(self, pe: int, kind: int, index: int, offset: int, arg: int, src: int = 0, keep=None) -> None:
        """Post one message to rank ``pe``'s send queue (a put reads ``arg`` bytes at ``src`` when the NIC
        gets to it; ``keep`` holds that memory alive until then). Waits only while the queue is full, as
        NVSHMEM's post does: for the oldest work requests to be acknowledged, or the NIC to give up on
        them (then the process ends)."""
        wqes = WQES[kind]
        nbytes = HEADER.size + (arg if kind == PUT else 0)
        for key in ("messages", ("messages", pe), "puts" if kind == PUT else "signals",
                    ("puts" if kind == PUT else "signals", pe)):
            self.stats[key] += 1
        self.stats["bytes"] += nbytes
        self.stats[("bytes", pe)] += nbytes
        self.stats["payload"] += arg if kind == PUT else SIGNAL_BYTES
        link = self._link(pe)
        with link.cv:
            while link.wqes_out + wqes > self.depth and link.unacked:   # the send queue is full
                self._wait_acked(link, link.unacked[0][0])
            link.posted += 1
            link.wqes_out += wqes
            link.unacked.append((link.posted, wqes, time.monotonic()))
            link.todo.append((HEADER.pack(kind, index, offset, arg), src if kind == PUT else 0, arg, keep))
            link.cv.notify_all()

    def _wait_acked(self, link: _Link, number: int) -> None:
        """With ``link.cv`` held: wait until message ``number`` is acknowledged, or the NIC gives up on the
        oldest unacknowledged one (``transport_timeout_s`` after it was posted): the process ends."""
        while link.acked < number:
            waited = time.monotonic() - link.oldest()
            if waited >= self.transport_timeout_s:
                transport_failed(self.rank, link.pe, waited)
                return
            link.cv.wait(self.transport_timeout_s - waited)

    def _nic(self, link: _Link) -> None:
        """The emulated NIC of one link: reads each posted message's bytes when it gets to it (after the
        configured delay), sends it; a lost connection drops the rest (never acknowledged)."""
        while True:
            with link.cv:
                while not link.todo and not self._closed:
                    link.cv.wait()
                if self._closed:
                    return
                head, src, nbytes, keep = link.todo.popleft()
            if self.delay_s:
                time.sleep(self.delay_s)
            data = ctypes.string_at(src, nbytes) if src else b""
            del keep
            if link.lost:
                continue
            try:
                if link.sock is None:
                    port = int(self.store.get(KEY.format(link.pe)))
                    link.sock = socket.create_connection(("127.0.0.1", port), timeout=self.timeout_s)
                    link.sock.settimeout(None)
                    threading.Thread(target=self._acks, args=(link,), daemon=True).start()
                link.sock.sendall(head + data)
            except (OSError, RuntimeError):   # the receiver is dead (or its store entry gone)
                with link.cv:
                    link.lost = True
                    link.cv.notify_all()

    def _acks(self, link: _Link) -> None:
        """Reads the receiver's acknowledgement counts; a closed stream is no answer (lost)."""
        while True:
            try:
                ack = _recv_exact(link.sock, ACK.size)
            except OSError:
                ack = None
            with link.cv:
                if ack is None:
                    link.lost = True
                    link.cv.notify_all()
                    return
                link.acked = ACK.unpack(ack)[0]
                while link.unacked and link.unacked[0][0] <= link.acked:
                    link.wqes_out -= link.unacked.popleft()[1]
                link.cv.notify_all()

    def _proxy_progress(self) -> None:
        """The IBRC proxy thread: polls every link's completions; one the NIC gave up on ends the process,
        whether or not anything waits for it."""
        while not self._closed:
            time.sleep(PROXY_POLL_S)
            for link in list(self._links.values()):
                with link.cv:
                    if link.unacked and time.monotonic() - link.oldest() >= self.transport_timeout_s:
                        transport_failed(self.rank, link.pe, time.monotonic() - link.oldest())
                        return

    def put(self, pe: int, index: int, offset: int, src: int, nbytes: int, keep=None) -> None:
        """Post ``nbytes`` bytes at local address ``src`` for rank ``pe``'s buffer ``index`` at ``offset``
        (read by the NIC later: ``keep`` keeps that memory alive until then; without it, read now)."""
        if keep is None:   # memory the wire cannot hold alive: the bytes are taken now
            data = ctypes.create_string_buffer(ctypes.string_at(src, nbytes), nbytes)
            src, keep = ctypes.addressof(data), data
        self._post(pe, PUT, index, offset, nbytes, src, keep)

    def signal(self, pe: int, index: int, offset: int, value: int, add: bool) -> None:
        """Set (or add to) the int64 word at ``offset`` of rank ``pe``'s buffer ``index``, after every
        earlier message to ``pe``."""
        self._post(pe, SIGNAL_ADD if add else SIGNAL_SET, index, offset, int(value))

    def quiet(self, skip=()) -> None:
        """Wait until every message this rank posted, to any rank but those in ``skip``, is delivered; a
        message the emulated NIC gives up on (``transport_timeout_s`` after it was posted) ends the process,
        as NVSHMEM's quiet does (module docstring)."""
        for pe, link in sorted(self._links.items()):
            if pe not in skip:
                with link.cv:
                    self._wait_acked(link, link.posted)

    def fence(self) -> None:
        """NVSHMEM's fence: with IBGDA it waits for the completions of every queue pair, as a quiet does
        (``nvshmemi_ibgda_fence``), so a dead peer's messages make it fatal; the proxy orders without
        waiting (its messages to a peer are posted in order)."""
        if self.model == "ibgda":
            self.quiet()

    @property
    def lost(self) -> set[int]:
        """Ranks whose connection is gone (a dead process): their messages never land."""
        return {pe for pe, link in self._links.items() if link.lost}

    def close(self) -> None:
        """Stop applying and acknowledging; close every stream (ShmHeap.close calls it after the finalize
        barrier)."""
        from . import peer_map  # noqa: PLC0415
        peer_map.wires.discard(self)
        self._closed = True
        for link in list(self._links.values()):
            with link.cv:
                link.cv.notify_all()
        socks = [link.sock for link in self._links.values() if link.sock is not None] + self._incoming
        for s in socks:   # a closed end applies and acknowledges nothing more
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self._incoming.clear()
        self._server.close()
