"""The network between emulated nodes (CPU, ``MOE_COMM_RANKS_PER_NODE``): puts travel as messages.

A rank maps nothing of another node's memory. Its interpreted NVSHMEM calls to a rank of another node
(``moe_comm/triton_kernels/nvshmem_device.py``) append messages to a per-destination stream instead:
``put`` (payload bytes for a symmetric buffer and offset) and ``signal`` (an int64 word set or added
with release). A proxy thread in the *receiving* process reads its incoming streams and applies each
message to its own heap, asynchronously, in order per (source, destination): a receiver that sees a
signal sees every payload sent before it. Each applied message is acknowledged.

``quiet`` models NVSHMEM's, not the group's timeout: it waits until every message this rank has sent to
every rank is acknowledged (NVSHMEM's device quiet waits on every queue pair, whoever posted to it),
for as long as a NIC retries an unacknowledged message (``transport_timeout_s``: by default NVSHMEM's
queue-pair settings, ACK timeout 20 and 7 retries, about 34 s from the oldest unacknowledged message;
``MOE_COMM_WIRE_TRANSPORT_TIMEOUT_S`` shortens it for tests). A dead receiver's messages are never
acknowledged (a closed connection is no answer: a NIC learns nothing faster from a dead peer either),
so the quiet then does what NVSHMEM does when the NIC gives up: ``transport_failed`` ends the process
(NVSHMEM's IBGDA quiet asserts on the device, which loses the CUDA context; its IBRC proxy thread calls
exit). A message nothing quiets (a group-wide error's status record, ``sync.record_group_error``; an
abort's flag) only sends; the next quiet of the process covers it too. What this does not model:
IBRC's proxy fails the process when the NIC gives up whether or not anything quiets. See docs/faults.md.
A wire stops acknowledging when it closes; its heap closes it only after the live ranks met in the
finalize barrier (``ShmHeap._finalize``, as ``nvshmem_finalize``), so a rank that merely finished never
looks dead to a peer's quiet.

Symmetric addresses do not cross: a message names the buffer by its allocation index (the same on every
rank: allocation is collective) and the offset in it; the receiver resolves the index to its own copy.

The wire counts what it sends (``stats``: messages; bytes, headers included, also per destination; payload,
the bytes put plus 8 per signal value), so
the bytes a call puts on the network are a measured figure on the CPU. What it cannot show: a NIC's
reordering, partial completion or bandwidth (the streams are localhost TCP, ordered and reliable).
"""

from __future__ import annotations

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
# NVSHMEM's RC queue pairs (ibrc.cpp, ibgda.cpp): local ACK timeout exponent 20 (4.096 us * 2**20 = 4.3 s
# per try) and 7 retries; the NIC reports a message to a silent peer as failed after 8 tries.
IB_ACK_TIMEOUT, IB_RETRY_CNT = 20, 7
NIC_GIVE_UP_S = (IB_RETRY_CNT + 1) * 4.096e-6 * 2 ** IB_ACK_TIMEOUT
TRANSPORT_FATAL_EXIT = 255         # exit(-1), as NVSHMEM's NVSHMEMI_NZ_EXIT


def transport_timeout_s() -> float:
    """How long the emulated NIC retries an unacknowledged message: ``MOE_COMM_WIRE_TRANSPORT_TIMEOUT_S``,
    else NIC_GIVE_UP_S (NVSHMEM's defaults)."""
    raw = os.environ.get(TRANSPORT_TIMEOUT_ENV, "").strip()
    if not raw:
        return NIC_GIVE_UP_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{TRANSPORT_TIMEOUT_ENV} must be a positive number of seconds, got {raw!r}")
    return value


def transport_failed(rank: int, pe: int, waited_s: float) -> None:
    """What NVSHMEM does when the NIC gives up on a message: the process ends (never a Python error)."""
    print(f"moe_comm wire (emulated NVSHMEM transport): rank {rank}'s puts to rank {pe} were not acknowledged "
          f"after {waited_s:.1f} s (the NIC's retries ran out); NVSHMEM treats this as fatal (IBGDA: the "
          f"kernel asserts and the CUDA context is lost; IBRC: the proxy exits), so this rank exits "
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


class Wire:
    """Rank ``rank``'s end of the emulated network: a proxy that applies incoming messages through
    ``resolve(index) -> local base address or None`` (a freed buffer's messages are dropped), and
    outgoing streams to the other ranks, found through ``store``."""

    def __init__(self, rank: int, store, timeout_s: float, resolve):
        self.rank, self.store, self.timeout_s, self.resolve = rank, store, timeout_s, resolve
        self.transport_timeout_s = transport_timeout_s()
        self.stats: Counter = Counter()   # "messages", "bytes", "payload", ("bytes", pe), ("messages", pe)
        self._out: dict[int, socket.socket] = {}
        self._sent: Counter = Counter()    # messages posted to each rank (sent, or lost with its connection)
        self._acked: Counter = Counter()   # of those, acknowledged (read by quiet)
        self._since: dict[int, float] = {}  # rank -> when its oldest unacknowledged message was posted
        self._lost: set[int] = set()       # ranks whose connection is gone: their messages never land
        self._incoming: list[socket.socket] = []   # the proxy's connections (closed with the wire)
        self._closed = False
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.2)
        store.set(KEY.format(rank), str(self._server.getsockname()[1]))
        threading.Thread(target=self._accept, name=f"moe_comm-wire{rank}", daemon=True).start()

    # ---- the receiving proxy -------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
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

    # ---- the sending side --------------------------------------------------------------------------
    def _stream(self, pe: int) -> socket.socket | None:
        if pe in self._lost:
            return None
        s = self._out.get(pe)
        if s is None:
            try:
                port = int(self.store.get(KEY.format(pe)))
                s = socket.create_connection(("127.0.0.1", port), timeout=self.timeout_s)
            except (OSError, RuntimeError):
                self._lost.add(pe)
                return None
            s.settimeout(self.timeout_s)
            self._out[pe] = s
        return s

    def _send(self, pe: int, kind: int, index: int, offset: int, arg: int, data: bytes = b"") -> None:
        msg = HEADER.pack(kind, index, offset, arg) + data
        self.stats["messages"] += 1
        self.stats["bytes"] += len(msg)
        self.stats["payload"] += len(data) if kind == PUT else SIGNAL_BYTES
        self.stats[("messages", pe)] += 1
        self.stats[("bytes", pe)] += len(msg)
        self._sent[pe] += 1   # posted: the NIC owns it until it is acknowledged or the NIC gives up
        self._since.setdefault(pe, time.monotonic())
        s = self._stream(pe)
        if s is None:
            return
        try:
            s.sendall(msg)
        except OSError:   # the receiver is dead or stuck past the timeout: this message never lands
            self._lost.add(pe)

    def put(self, pe: int, index: int, offset: int, src: int, nbytes: int) -> None:
        """Send ``nbytes`` bytes at local address ``src`` to rank ``pe``'s buffer ``index`` at ``offset``."""
        self._send(pe, PUT, index, offset, nbytes, ctypes.string_at(src, nbytes))

    def signal(self, pe: int, index: int, offset: int, value: int, add: bool) -> None:
        """Set (or add to) the int64 word at ``offset`` of rank ``pe``'s buffer ``index``, after every
        earlier message to ``pe``."""
        self._send(pe, SIGNAL_ADD if add else SIGNAL_SET, index, offset, int(value))

    def quiet(self) -> None:
        """Wait until every message this rank sent, to any rank, is delivered; a message the emulated NIC
        gives up on (``transport_timeout_s`` after the oldest unacknowledged one to that rank) ends the
        process, as in NVSHMEM (module docstring)."""
        for pe in list(self._sent):
            while self._acked[pe] < self._sent[pe]:
                deadline = self._since[pe] + self.transport_timeout_s
                ack = self._next_ack(pe, deadline - time.monotonic())
                if ack is not None:
                    self._acked[pe] = ack
                elif time.monotonic() >= deadline:
                    transport_failed(self.rank, pe, time.monotonic() - self._since[pe])
                    return
            self._since.pop(pe, None)

    def _next_ack(self, pe: int, wait_s: float) -> int | None:
        """The next acknowledgement count from rank ``pe``, waiting at most ``wait_s`` (those already here
        are read first); None if none came (a lost connection: after ``wait_s``, as a NIC would)."""
        s = None if pe in self._lost else self._out.get(pe)
        if s is None:
            time.sleep(max(0.0, wait_s))
            return None
        s.settimeout(max(0.001, wait_s))
        try:
            ack = _recv_exact(s, ACK.size)
        except (TimeoutError, socket.timeout):
            return None
        except OSError:
            ack = None
        if ack is None:   # closed by a dead receiver: nothing more will come
            self._lost.add(pe)
            return None
        return ACK.unpack(ack)[0]

    def close(self) -> None:
        """Stop applying and acknowledging; close every stream (ShmHeap.close calls it after the finalize
        barrier)."""
        from . import peer_map  # noqa: PLC0415
        peer_map.wires.discard(self)
        self._closed = True
        for s in list(self._out.values()) + self._incoming:   # a closed end applies and acknowledges nothing more
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self._out.clear()
        self._incoming.clear()
        self._server.close()
