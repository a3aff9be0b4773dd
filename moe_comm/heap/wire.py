"""The network between emulated nodes (CPU, ``MOE_COMM_RANKS_PER_NODE``): puts travel as messages.

A rank maps nothing of another node's memory. Its interpreted NVSHMEM calls to a rank of another node
(``moe_comm/triton_kernels/nvshmem_device.py``) append messages to a per-destination stream instead:
``put`` (payload bytes for a symmetric buffer and offset) and ``signal`` (an int64 word set or added
with release). A proxy thread in the *receiving* process reads its incoming streams and applies each
message to its own heap, asynchronously, in order per (source, destination): a receiver that sees a
signal sees every payload sent before it. Each applied message is acknowledged; ``quiet`` waits until
every message this rank sent is delivered, bounded by the group timeout (a dead or stuck receiver never
blocks the sender longer: its messages are dropped, and the group's own waits name it). A put that is
never quieted (a group-wide error's status record, ``sync.record_group_error``) only sends: a dead
receiver refuses the connection or resets it at once, and a send to a stuck one is bounded by the same
timeout.

Symmetric addresses do not cross: a message names the buffer by its allocation index (the same on every
rank: allocation is collective) and the offset in it; the receiver resolves the index to its own copy.

The wire counts what it sends (``stats``: messages; bytes, headers included, also per destination; payload,
the bytes put plus 8 per signal value), so
the bytes a call puts on the network are a measured figure on the CPU. What it cannot show: a NIC's
reordering, partial completion or bandwidth (the streams are localhost TCP, ordered and reliable).
"""

from __future__ import annotations

import ctypes
import socket
import struct
import threading
import time
from collections import Counter

HEADER = struct.Struct("<BIQq")    # kind, buffer index, byte offset, payload bytes (put) / value (signal)
ACK = struct.Struct("<Q")          # messages applied so far on this stream
PUT, SIGNAL_SET, SIGNAL_ADD = 0, 1, 2
SIGNAL_BYTES = 8                   # a signal's payload: its int64 value (carried in the header's last field)
KEY = "wire/{}"                    # store key: the proxy's port of rank {}


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
        self.stats: Counter = Counter()   # "messages", "bytes", "payload", ("bytes", pe), ("messages", pe)
        self._out: dict[int, socket.socket] = {}
        self._sent: Counter = Counter()
        self._acked: Counter = Counter()
        self._lost: set[int] = set()
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
            threading.Thread(target=self._deliver, args=(conn,), daemon=True).start()

    def _deliver(self, conn: socket.socket) -> None:
        applied = 0
        with conn:
            while True:
                head = _recv_exact(conn, HEADER.size)
                if head is None:
                    return
                kind, index, offset, arg = HEADER.unpack(head)
                data = _recv_exact(conn, arg) if kind == PUT else b""
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
        s = self._stream(pe)
        if s is None:
            return
        try:
            s.sendall(msg)
            self._sent[pe] += 1
        except OSError:   # the receiver is dead or stuck past the timeout: its messages are dropped
            self._lost.add(pe)

    def put(self, pe: int, index: int, offset: int, src: int, nbytes: int) -> None:
        """Send ``nbytes`` bytes at local address ``src`` to rank ``pe``'s buffer ``index`` at ``offset``."""
        self._send(pe, PUT, index, offset, nbytes, ctypes.string_at(src, nbytes))

    def signal(self, pe: int, index: int, offset: int, value: int, add: bool) -> None:
        """Set (or add to) the int64 word at ``offset`` of rank ``pe``'s buffer ``index``, after every
        earlier message to ``pe``."""
        self._send(pe, SIGNAL_ADD if add else SIGNAL_SET, index, offset, int(value))

    def quiet(self) -> None:
        """Wait until every message sent so far is delivered (bounded: see the module docstring)."""
        deadline = time.monotonic() + self.timeout_s
        for pe, s in list(self._out.items()):
            while pe not in self._lost and self._acked[pe] < self._sent[pe]:
                s.settimeout(max(0.001, deadline - time.monotonic()))
                try:
                    ack = _recv_exact(s, ACK.size)
                except OSError:
                    ack = None
                if ack is None:
                    self._lost.add(pe)
                    break
                self._acked[pe] = ACK.unpack(ack)[0]

    def close(self) -> None:
        from . import peer_map  # noqa: PLC0415
        peer_map.wires.discard(self)
        self._closed = True
        for s in self._out.values():
            s.close()
        self._out.clear()
        self._server.close()
