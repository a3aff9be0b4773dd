"""Host-driven control plane of a heap: bounded barrier and all-gather over the live ranks.

One symmetric int64 buffer per rank, ``[2 parities, world rows, 1 + PAYLOAD_WORDS]``: row j of every rank
is written only by rank j, ``[seq, payload...]``. Every control operation (barrier or all-gather) of a
rank takes the next ``seq``; the rank writes its payload then its ``seq`` into row ``rank`` of parity
``seq % 2`` on every live rank, then waits (bounded) until every live rank's row there holds a
``seq >= `` its own. A rank can be at most one operation ahead of a slower one (it waits for everybody
at each), so two parities keep a payload from being overwritten before it is read.

Waits are bounded by the heap's timeout; a rank that does not arrive is named in CommTimeoutError (for
a barrier) or returned as missing (for an all-gather, which the exclusion agreement uses). A ``poll``
callback, called while waiting, may raise to end the wait (a barrier on a failed group raises the
group's error instead of waiting for ranks that will not come). A heap keeps two blocks with their own
sequences: one for barriers and allocations, one for recovery (``reset``/``exclude``), so that a rank
in recovery never meets a peer's ordinary barrier; ``realign(base)`` restarts a block's sequence at a
value every live rank agrees on (after a reset, whatever barriers were cut short before it). Views are
host-writable tensors (CPU memory for the shm heap; peer-mapped device memory for nvshmem, where each
access is a synchronous copy: this is the control plane, not the data path).
"""

from __future__ import annotations

import time

import torch

from ..errors import CommTimeoutError
from .base import Heap, all_ranks

PAYLOAD_WORDS = 8   # all-gather payload: up to 8 int64 words per rank (a kind + an exclusion mask of <= 441 ranks)
POLL_S = 0.0002


def control_shape(world: int) -> tuple:
    return (2, world, 1 + PAYLOAD_WORDS)


class ControlBlock:
    """``views[j]``: rank j's control buffer (int64 ``control_shape(world)``) as reachable from here."""

    def __init__(self, views: list[torch.Tensor], rank: int, timeout_s: float):
        self.views, self.rank, self.world, self.timeout_s = views, rank, len(views), timeout_s
        self.seq = 0

    def _post(self, live, payload: list[int]) -> int:
        self.seq += 1
        p, row = self.seq % 2, torch.zeros(1 + PAYLOAD_WORDS, dtype=torch.int64)
        row[1:1 + len(payload)] = torch.tensor(payload, dtype=torch.int64)
        for j in live:
            dst = self.views[j][p, self.rank]
            dst[1:].copy_(row[1:])
        for j in live:  # seq after every payload word (x86 stores and synchronous copies are ordered)
            self.views[j][p, self.rank, 0] = self.seq
        return p

    def _arrived(self, p: int, j: int) -> bool:
        return int(self.views[self.rank][p, j, 0]) >= self.seq

    def _wait(self, p: int, ranks, poll=None) -> list[int]:
        """Wait for ``ranks``; returns those still missing at the deadline."""
        pending, deadline = [j for j in ranks if not self._arrived(p, j)], time.monotonic() + self.timeout_s
        while pending and time.monotonic() < deadline:
            if poll is not None:
                poll()
            time.sleep(POLL_S)
            pending = [j for j in pending if not self._arrived(p, j)]
        return pending

    def realign(self, base: int) -> None:
        """Restart this rank's sequence at ``base`` (larger than any sequence posted before)."""
        self.seq = base

    def barrier(self, live, op: str = "barrier", poll=None) -> None:
        """Every live rank arrives, or CommTimeoutError names the first missing one."""
        p = self._post(live, [])
        missing = self._wait(p, live, poll)
        if missing:
            raise CommTimeoutError(op, self.rank, missing[0], self.timeout_s)

    def allgather(self, live, payload: list[int]) -> tuple[dict[int, list[int]], list[int]]:
        """Every live rank's payload (``len(payload)`` words), and the live ranks that did not answer."""
        if len(payload) > PAYLOAD_WORDS:
            raise ValueError(f"all-gather payload of {len(payload)} words, at most {PAYLOAD_WORDS}")
        p = self._post(live, payload)
        missing = self._wait(p, live)
        got = {j: [int(v) for v in self.views[self.rank][p, j, 1:1 + len(payload)].tolist()]
               for j in live if j not in missing}
        return got, missing


class ControlledHeap(Heap):
    """A heap whose barriers and recovery meetings run over two ControlBlocks (shm and nvshmem): a barrier
    block (barriers, allocations) and a recovery block (``agree``, bounded by twice the timeout: ranks
    reach recovery up to one timeout apart, see ``CommGroup._meet``). Subclasses call ``_start_control``
    once both buffers exist and implement ``_release_mappings``; ``_excluded`` holds released peers."""

    _control: ControlBlock | None = None
    _recovery: ControlBlock | None = None

    def _start_control(self, barrier_views: list[torch.Tensor], recovery_views: list[torch.Tensor]) -> None:
        self._control = ControlBlock(barrier_views, self.rank, self.timeout_s)
        self._recovery = ControlBlock(recovery_views, self.rank, 2 * self.timeout_s)

    def barrier(self, live=None, op: str = "barrier", poll=None) -> None:
        self._control.barrier(all_ranks(self, live), op, poll)

    def agree(self, live, payload):
        return self._recovery.allgather(all_ranks(self, live), payload)

    def realign_barriers(self, base: int) -> None:
        self._control.realign(base)

    def release_peer(self, peer: int) -> None:
        self._excluded.add(peer)
        for block in (self._control, self._recovery):
            block.views[peer] = block.views[self.rank]  # never written to again
        self._release_mappings(peer)

    def _release_mappings(self, peer: int) -> None:
        """Repoint every buffer's ``peer_ptrs[peer]`` at this rank's copy and drop the peer's mappings."""
        raise NotImplementedError
