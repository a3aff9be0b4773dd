"""Where a symmetric address of this rank lives on a peer, for heaps whose peers this process maps (CPU).

NVSHMEM's put calls take the *local* symmetric address of the destination and a PE, and NVSHMEM finds
the peer's copy. The interpreted twin of those calls (``moe_comm/triton_kernels/nvshmem_device.py``, CPU
tests) does the same with this table: every CPU symmetric buffer is registered here when it is made
(``SymmetricBuffer``), with its ``peer_ptrs``; ``peer_address(addr, pe)`` finds the buffer that holds
``addr`` and returns the same offset in rank ``pe``'s copy as mapped in this process. A peer that is not
mapped here (``peer_ptrs`` entry 0: another emulated node) is reached through the buffer's ``wire``
(``wire.py``) by allocation index and offset instead: ``remote(addr, pe)``.
"""

from __future__ import annotations

import bisect
import threading
import weakref

_lock = threading.Lock()
_starts: list[int] = []     # sorted start addresses
_entries: list[tuple] = []  # (start, end, peer_ptrs, allocation index, wire, weakref to local), by start
wires: set = set()          # every wire a registered buffer uses (``quiet`` completes them all)


def register(local, peer_ptrs, index=None, wire=None) -> None:
    """Register the local copy ``local`` (a CPU tensor), allocation ``index`` of its heap, whose unmapped
    peers are reached through ``wire``. The entry lives as long as ``local`` does: once the tensor is
    collected its memory may be reused by any allocation, which must not look symmetric (``_entry`` treats
    a collected buffer's entry as absent; registering drops it). An older entry that overlaps it belonged
    to freed memory and is dropped. No finalizer: one can run inside this function (a collection while it
    holds the lock) and would wait for the lock forever."""
    start = local.data_ptr()
    end = start + local.numel() * local.element_size()
    with _lock:
        keep = [e for e in _entries if (e[1] <= start or e[0] >= end) and e[5]() is not None]
        keep.append((start, end, peer_ptrs, index, wire, weakref.ref(local)))
        _store(keep)
        if wire is not None:
            wires.add(wire)


def _store(entries: list[tuple]) -> None:
    entries.sort(key=lambda x: x[0])
    _entries[:] = entries
    _starts[:] = [e[0] for e in entries]


def _entry(addr: int) -> tuple:
    i = bisect.bisect_right(_starts, addr) - 1
    if i < 0 or addr >= _entries[i][1] or _entries[i][5]() is None:
        raise ValueError(f"address {addr:#x} is not in a registered symmetric buffer of this process "
                         f"(a put's destination must be symmetric memory)")
    return _entries[i]


def peer_address(addr: int, pe: int) -> int:
    """The address, in this process, of rank ``pe``'s copy of the byte at local symmetric ``addr``; 0 if
    rank ``pe``'s copy is not mapped here (another node: NVSHMEM's ``nvshmem_ptr`` answer)."""
    with _lock:
        start, _, peer_ptrs = _entry(addr)[:3]
        base = int(peer_ptrs[pe])
        return base + (addr - start) if base else 0


def remote(addr: int, pe: int):
    """``(wire, allocation index, offset)`` if rank ``pe``'s copy of local symmetric ``addr`` is not
    mapped here, else None."""
    with _lock:
        start, _, peer_ptrs, index, wire = _entry(addr)[:5]
        if int(peer_ptrs[pe]) != 0:
            return None
        if wire is None:
            raise ValueError(f"rank {pe}'s copy of address {addr:#x} is neither mapped here nor on a wire")
        return wire, index, addr - start


def owner(addr: int):
    """The local tensor of the registered buffer holding ``addr``, or None (not symmetric memory, or
    collected): holding it keeps the memory a put will read later (the wire's NIC reads lazily) alive."""
    with _lock:
        i = bisect.bisect_right(_starts, addr) - 1
        if i < 0 or addr >= _entries[i][1]:
            return None
        return _entries[i][5]()
