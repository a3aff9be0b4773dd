"""The words the host and the kernels share: group state layout, status records and flag values.

Every kernel gets one int64 tensor, the **group state** ``grp`` (``CommGroup.state``, device memory of
this rank), and reads what it needs from it. Addresses and the timeout live there, not in kernel
arguments: a Python int argument is typed by its value (an address below 2**31 would become an i32), a
tensor entry is always int64.

Group state ``grp`` (int64 [STATE_WORDS + 3 * world]):

    [S_EPOCH]        epoch: bumped by every ``reset()`` / ``exclude()``; flags and status records carry it
    [S_ERR_ADDR]     address of this rank's error word (pinned host memory on CUDA, plain memory on CPU)
    [S_TIMEOUT_NS]   bound of every device wait, in nanoseconds
    [S_CLAIM]        0, or 1 once a kernel claimed the error word (first error wins; the host releases it)
    [S_BCAST_CLAIM]  0, or 1 once a kernel of this rank broadcast a group-wide error (one broadcast per epoch)
    [S_LIVE + j]     1 if rank j is live, 0 once excluded
    [S_STATUS + j]   address of rank j's status buffer, as mapped here (0: not load/store reachable)
    [S_TRANSPORT + j] how this rank's kernels reach rank j: TRANSPORT_STORE (stores through a peer
                     pointer) or TRANSPORT_PUT (NVSHMEM puts, the flag as the put's signal)

Status buffer (symmetric, int64 [world + world * REC_WORDS], one per rank): ``tags[j]`` then
``records[j]``. Row j is written only by rank j: when a kernel of rank j records a group-wide error it
stores the record into row j of every live rank, then the tag ``epoch + 1`` with a release. A rank whose
status holds a tag equal to its ``epoch + 1`` in any live row is *failed*: its kernels stop sending and
waiting until ``reset()`` (which clears the status and bumps the epoch, so old tags never match again).

Flags: ``flag(epoch, call) = epoch << EPOCH_SHIFT | call``; ``call`` counts a channel's calls since the
last reset (from 1). A rank that cannot take part in a call (an input error only it saw) publishes
``flag | ABORT_BIT`` instead: a peer that waits for that call records CommAbortedError.
"""

from __future__ import annotations

S_EPOCH = 0
S_ERR_ADDR = 1
S_TIMEOUT_NS = 2
S_CLAIM = 3
S_BCAST_CLAIM = 4
STATE_WORDS = 8          # fixed words; then live[world], then status addresses[world]
S_LIVE = STATE_WORDS


def s_status(world: int) -> int:
    """Index in the group state of the first status-buffer address."""
    return STATE_WORDS + world


def s_transport(world: int) -> int:
    """Index in the group state of the first per-peer transport word."""
    return STATE_WORDS + 2 * world


def state_words(world: int) -> int:
    return STATE_WORDS + 3 * world


VEC_BYTES = 16           # the widest global access (sm_90 ld/st.global.v4.b32): rows and bases aligned to
#                          it move as whole vectors (``triton_kernels/copy.py``, ``planner.vector_aligned``)

TRANSPORT_STORE = 0      # peer memory mapped here: plain stores, flag published with a release
TRANSPORT_PUT = 1        # NVSHMEM putmem(_signal)_nbi into the same landing layout, flag = the signal
TRANSPORTS = {"store": TRANSPORT_STORE, "put": TRANSPORT_PUT}


REC_WORDS = 8            # status record: [code, op, rank, peer, value, bound, 0, 0]


def status_words(world: int) -> int:
    return world + world * REC_WORDS


EPOCH_SHIFT = 40         # 2**40 calls per channel between resets (years at decode rates)
CALL_MASK = (1 << EPOCH_SHIFT) - 1
ABORT_BIT = 1 << 62


def flag(epoch: int, call: int) -> int:
    return (epoch << EPOCH_SHIFT) | call
