"""The flight recorder's record layout: the words the kernels store and the host decodes.

A channel's recorder (``Channel.trace``) is an int64 ring [TRACE_N, record_words(world)]: record
``call % TRACE_N`` belongs to the call ``call`` (counted from 1 since the last reset, as the flags count).
Pinned host memory on CUDA (like the error word: the host reads it without a device sync, after a hang
too), a plain tensor on the CPU. The send and receive phases of a call may run on different streams or
not at all (a rank that died), so each phase tags the words it writes with its own flag value
(``protocol.flag(epoch, call)``): a phase's words are about ``call`` only if its tag says so.

Each half (send, receive) of a row is a seqlock, so that a reader (a dump, after a hang too) never pairs
one call's tag with another call's words (``triton_kernels/trace.py`` writes it):

- the program that opens the phase (the send's program 0; the receive's first program to enter, so
  that its start precedes every time another program of the receive records, in any program order)
  reads the tag, sets it to 0 (invalid) and fences before it writes the header words, then publishes
  the tag (a CTA barrier and a system-scope release): ``flag`` while the phase runs, with STALE_BIT
  when the per-peer words were not prepared for this call;
- the per-peer words (rows, SEEN, WAITED) start at 0: the phase of the call before, at its end, set the
  next row's tag to ``flag(epoch, call + 1) | PREP_BIT`` (no record: the old one there is given up,
  so a ring of N rows keeps the last N - 1 calls) and then cleared that row's per-peer words
  (``reset()`` clears the row of the new epoch's first call: ``recorder.prepare_first_row``). A call
  after one that did not trace (an aborted call) finds its row unprepared: STALE_BIT, and its per-peer
  words are not reported;
- the last program writes the end words (end time, outcome, error), then publishes the tag again with
  DONE_BIT: the end words are valid only under it.

The host reads the tag, the words, then the tag again, and keeps a half only if both reads agree and
name a record (``recorder.channel_records``).

Times are nanoseconds of the device clock (``sync.now_ns``: %globaltimer on a GPU, CLOCK_MONOTONIC under
Triton's interpreter). Durations on one rank are exact; times of different GPUs are not comparable.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import protocol
from ..errors import OPS

DEFAULT_CALLS = 64     # records per channel when tracing is on without a size

T_OP = 0               # op id (errors.OPS index) of the channel
T_SEND_TAG = 1         # flag(epoch, call) of the send phase that wrote words T_SEND_*; 0 never
T_SEND_START = 2       # ns: the send kernel began (its program 0)
T_SEND_END = 3         # ns: the send kernel's last program finished (after publishing); valid under DONE_BIT
T_RECV_TAG = 4         # flag(epoch, call) of the receive phase that wrote words T_RECV_*, SEEN, RECV_ROWS
T_RECV_START = 5       # ns: the receive kernel began (its first program to enter, whichever): <= every SEEN
#                        and the end time, in any program order (``triton_kernels/trace.py``)
T_RECV_END = 6         # ns: the receive kernel's last program finished; valid under DONE_BIT
T_OUTCOME = 7          # error code in this rank's error word when the receive ended (errors.ERR_*; 0 ok)
T_ERR_PEER = 8         # that error's peer word (the rank waited for, the expert, ...)
T_ERR_VALUE = 9        # that error's value word (desync: the call the peer's flag showed)
T_ERR_BOUND = 10       # that error's bound word (desync / timeout: the call this rank expected)
HEADER_WORDS = 12      # (word 11 unused) then four words per peer, [world] each (SENT_ROWS: the send's,
#                        the other three the receive's):


def sent_rows_word(world: int) -> int:
    """First of SENT_ROWS[world]: rows this rank's send phase addressed to each peer."""
    return HEADER_WORDS


def recv_rows_word(world: int) -> int:
    """First of RECV_ROWS[world]: rows this rank's receive phase took from each source."""
    return HEADER_WORDS + world


def seen_word(world: int) -> int:
    """First of SEEN[world]: ns when this rank's receive saw each source's flag of the call (0: never)."""
    return HEADER_WORDS + 2 * world


def waited_word(world: int) -> int:
    """First of WAITED[world]: ns the receive program that recorded source j waited for its flag (from
    that program's own start of waiting: exact even where programs run one after another, as under
    Triton's interpreter), or until it gave up; 0 for a source not waited for."""
    return HEADER_WORDS + 3 * world


def record_words(world: int) -> int:
    return HEADER_WORDS + 4 * world


# Bits of a row's tag besides the flag (epoch << EPOCH_SHIFT | call; epochs stay below 2**19).
DONE_BIT = 1 << 61     # the phase ended: its end words (end time; outcome and error) are valid
STALE_BIT = 1 << 60    # the row was not prepared for this call: its per-peer words are not this call's
PREP_BIT = 1 << 59     # no record: the row is cleared for the call in the low bits (per-peer words 0)
TAG_BITS = DONE_BIT | STALE_BIT | PREP_BIT


def is_record(tag: int) -> bool:
    """Whether a half's tag names a call's record (not 0, not a prepared row)."""
    return tag != 0 and not tag & PREP_BIT


OUTCOMES = {0: "ok", 1: "timeout", 2: "data error (capacity)", 3: "data error (index)", 4: "abort",
            5: "desync", 6: "data error (global scale)"}


def split_tag(tag: int) -> tuple[int, int]:
    """(epoch, call) of a phase tag."""
    return tag >> protocol.EPOCH_SHIFT, tag & protocol.CALL_MASK


@dataclass
class TraceRecord:
    """One call of one channel on one rank, decoded. Times in ns (device clock); None: that phase of the
    call was not recorded (never ran, or its record was overwritten by a later call)."""

    op: str
    epoch: int
    call: int
    send_start: int | None = None
    send_end: int | None = None      # None also while the send is still running
    recv_start: int | None = None
    recv_end: int | None = None      # None also while the receive is still running (a hang)
    outcome: str | None = None       # OUTCOMES value; None without a finished receive
    error: list[int] | None = None   # [peer, value, bound] of the error word when outcome is not "ok"
    row_bytes: int = 0                                   # bytes of one row (the channel's)
    # Per-peer words: empty where the phase's row was not prepared for the call (STALE_BIT); while a
    # phase runs, a peer's words not written yet read 0 (SEEN: None).
    sent_rows: list[int] = field(default_factory=list)   # per peer: rows this rank's send addressed to it
    recv_rows: list[int] = field(default_factory=list)   # per source: rows this rank's receive took from it
    seen: list[int | None] = field(default_factory=list)  # per source: ns its flag was seen, None never
    waited: list[int] = field(default_factory=list)       # per source: ns waited for its flag (WAITED)

    @property
    def sent_bytes(self) -> list[int]:
        return [r * self.row_bytes for r in self.sent_rows]

    @property
    def recv_bytes(self) -> list[int]:
        return [r * self.row_bytes for r in self.recv_rows]


def decode_row(words: list[int], world: int, row_bytes: int) -> list[TraceRecord]:
    """The calls one ring row (a list of int64, each half read consistently: ``recorder``) holds: one
    record when both phases of a call wrote it, two when the send phase of a later call has already
    overwritten the send words, none when unused or prepared for a call not made yet."""
    calls = sorted({t & ~TAG_BITS for t in (words[T_SEND_TAG], words[T_RECV_TAG]) if is_record(t)})
    return [_decode(words, world, call, row_bytes) for call in calls]


def _decode(words: list[int], world: int, flag: int, row_bytes: int) -> TraceRecord:
    send_tag, recv_tag = words[T_SEND_TAG], words[T_RECV_TAG]
    send = is_record(send_tag) and send_tag & ~TAG_BITS == flag
    recv = is_record(recv_tag) and recv_tag & ~TAG_BITS == flag
    op = words[T_OP]
    rec = TraceRecord(OPS[op] if 0 <= op < len(OPS) else f"op#{op}", *split_tag(flag), row_bytes=row_bytes)
    if send:
        rec.send_start = words[T_SEND_START]
        rec.send_end = words[T_SEND_END] if send_tag & DONE_BIT else None
        if not send_tag & STALE_BIT:
            s = sent_rows_word(world)
            rec.sent_rows = words[s:s + world]
    if recv:
        rec.recv_start = words[T_RECV_START]
        if recv_tag & DONE_BIT:
            rec.recv_end = words[T_RECV_END]
            rec.outcome = OUTCOMES.get(words[T_OUTCOME], f"error code {words[T_OUTCOME]}")
            if words[T_OUTCOME]:
                rec.error = words[T_ERR_PEER:T_ERR_BOUND + 1]
        if not recv_tag & STALE_BIT:
            r, v, w = recv_rows_word(world), seen_word(world), waited_word(world)
            rec.recv_rows = words[r:r + world]
            rec.seen = [t or None for t in words[v:v + world]]
            rec.waited = words[w:w + world]
    return rec
