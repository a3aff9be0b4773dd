"""Where a symmetric address of this rank lives on a peer, for heaps whose peers this process maps (CPU).

NVSHMEM's put calls take the *local* symmetric address of the destination and a PE, and NVSHMEM finds
the peer's copy. The interpreted twin of those calls (``moe_comm/triton_kernels/nvshmem_device.py``, CPU
tests) does the same with this table: every CPU symmetric buffer is registered here when it is made
(``SymmetricBuffer``), with its ``peer_ptrs``; ``peer_address(addr, pe)`` finds the buffer that holds
``addr`` and returns the same offset in rank ``pe``'s copy as mapped in this process.
"""

from __future__ import annotations

import bisect
import threading

_lock = threading.Lock()
_starts: list[int] = []     # sorted start addresses
_entries: list[tuple] = []  # (start, end, peer_ptrs tensor), in the order of _starts


def register(start: int, nbytes: int, peer_ptrs) -> None:
    """Register a buffer of ``nbytes`` at ``start`` (a local copy). An older entry that overlaps it
    belonged to freed memory and is dropped."""
    end = start + nbytes
    with _lock:
        keep = [(s, e, p) for (s, e, p) in _entries if e <= start or s >= end]
        keep.append((start, end, peer_ptrs))
        keep.sort(key=lambda x: x[0])
        _entries[:] = keep
        _starts[:] = [s for s, _, _ in keep]


def peer_address(addr: int, pe: int) -> int:
    """The address, in this process, of rank ``pe``'s copy of the byte at local symmetric ``addr``."""
    with _lock:
        i = bisect.bisect_right(_starts, addr) - 1
        if i < 0 or addr >= _entries[i][1]:
            raise ValueError(f"address {addr:#x} is not in a registered symmetric buffer of this process "
                             f"(a put's destination must be symmetric memory)")
        start, _, peer_ptrs = _entries[i]
        return int(peer_ptrs[pe]) + (addr - start)
