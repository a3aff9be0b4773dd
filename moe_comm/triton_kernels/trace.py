"""Flight recorder, device side: the few stores each phase of a call makes into its channel's ring.

Layout and meaning of every word: ``moe_comm/trace/layout.py``. Every function here does nothing unless
the kernel was compiled with ``TRACE`` (off: no extra store, no clock read). Each writes the ring from
one program of a launch (``first``/``last`` below), except the per-peer row counts, stored by the
program that owns that peer; every program of a receive calls ``recv_begin``, which finds the one that
opens the record.

Each half of a record is a seqlock (``layout``): ``open_half`` (``send_begin``: the send's program
``first``; ``recv_begin``: the receive's first program to enter) reads the tag, invalidates it and
fences before the header words change, then publishes the tag (``sync.publish``: a CTA barrier, then a
system-scope release, which pinned host memory takes without atomics); ``send_end`` / ``recv_end``
write the end words, then publish the tag with DONE_BIT, then prepare the next call's row (its tag
PREP, a fence, its per-peer words 0). Their branches are on program ids, on an atomic's result (the
receive's entry counter, broadcast to every thread) and on words no program of the launch writes
meanwhile (the tag is read before a CTA barrier, written after it; the end reads the tag the opening
program published before its ``arrive``), so they are block-uniform (``sync.py``'s docstring).

The receive's start is that of the receive as a whole, whatever order its programs run in (a GPU runs
them in any order; so does the interpreter under ``MOE_COMM_INTERPRET_ORDER``): every program reads the
clock, then (after a CTA barrier) adds 1 to the receive's entry counter (``Channel.done`` word
WORLD + 2, device memory; the last program of the launch sets it back to 0); the program that found 0
opens the record with the time it read. Every time another program records (SEEN, the end time) is
read after its own entry, which the counter orders after the opener's (its result reaches every thread
through a CTA barrier), so the start is no later than any of them. (An atomic minimum of every
program's start into the start word would need the word initialised before the launch, which a row
nobody prepared is not, and an atomic on the ring, pinned host memory, which many hosts do not
support.)

Wait statistics (``wait_ptr``, int64 [2, WORLD]: [0, j] cumulative ns this rank's receive waited for
source j's flag, [1, j] how many waits that got it) are accumulated by the program that recorded the
source's SEEN word, so each call counts once per source.
"""

import triton
import triton.language as tl

from ..trace import layout
from .sync import S_EPOCH, S_ERR_ADDR, as_ptr, flag_value, now_ns, publish

T_OP = tl.constexpr(layout.T_OP)
T_SEND_TAG = tl.constexpr(layout.T_SEND_TAG)
T_SEND_START = tl.constexpr(layout.T_SEND_START)
T_SEND_END = tl.constexpr(layout.T_SEND_END)
T_RECV_TAG = tl.constexpr(layout.T_RECV_TAG)
T_RECV_START = tl.constexpr(layout.T_RECV_START)
T_RECV_END = tl.constexpr(layout.T_RECV_END)
T_OUTCOME = tl.constexpr(layout.T_OUTCOME)
T_ERR_PEER = tl.constexpr(layout.T_ERR_PEER)
HEADER_WORDS = tl.constexpr(layout.HEADER_WORDS)
DONE_BIT = tl.constexpr(layout.DONE_BIT)
STALE_BIT = tl.constexpr(layout.STALE_BIT)
PREP_BIT = tl.constexpr(layout.PREP_BIT)
TAG_BITS = tl.constexpr(layout.TAG_BITS)
ERR_PEER_WORD = tl.constexpr(3)   # errors.py error word: [3] peer, [4] value, [5] bound
# One vector store each: the op and the send's start time (words 0-3), the receive's end words.
assert layout.T_OP < 4 and layout.T_SEND_START < 4
assert (layout.T_OUTCOME, layout.T_ERR_PEER, layout.T_ERR_BOUND) == tuple(layout.T_RECV_END + k for k in (1, 2, 4))

INTERPRET = bool(triton.knobs.runtime.interpret)   # see sync.py: decided when the module is imported

if INTERPRET:
    @triton.jit
    def fence_sys():
        """Order this thread's earlier stores before its later ones for every observer (the host reading
        the ring); the interpreter stores in program order."""
        pass
else:
    @triton.jit
    def fence_sys():
        tl.inline_asm_elementwise("fence.acq_rel.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                                  pack=1)


@triton.jit
def record_of(trace_ptr, call, WORLD: tl.constexpr, TRACE_N: tl.constexpr):
    """The ring row of ``call``: int64 [HEADER_WORDS + 4 * WORLD]."""
    return trace_ptr + (call % TRACE_N).to(tl.int64) * (HEADER_WORDS + 4 * WORLD)


@triton.jit
def sent_rows_ptr(trace_ptr, call, WORLD: tl.constexpr, TRACE_N: tl.constexpr):
    return record_of(trace_ptr, call, WORLD, TRACE_N) + HEADER_WORDS


@triton.jit
def recv_rows_ptr(trace_ptr, call, WORLD: tl.constexpr, TRACE_N: tl.constexpr):
    return record_of(trace_ptr, call, WORLD, TRACE_N) + HEADER_WORDS + WORLD


@triton.jit
def seen_ptr(trace_ptr, call, WORLD: tl.constexpr, TRACE_N: tl.constexpr):
    """Where ``sync.wait_flags`` stores when each source's flag was seen (its ``seen_ptr``)."""
    return record_of(trace_ptr, call, WORLD, TRACE_N) + HEADER_WORDS + 2 * WORLD


@triton.jit
def open_half(trace_ptr, grp, call, op, start, RECV: tl.constexpr, WORLD: tl.constexpr, TRACE_N: tl.constexpr):
    """Open the call's send (RECV False) or receive half of its row: its start time ``start`` (and the
    op), under its tag; STALE_BIT if the row was not prepared for this call (its per-peer words may be an
    older call's). By one program per launch."""
    rec = record_of(trace_ptr, call, WORLD, TRACE_N)
    if RECV:
        tag_at = rec + T_RECV_TAG
    else:
        tag_at = rec + T_SEND_TAG
    tag = flag_value(tl.load(grp + S_EPOCH), call)
    was = tl.load(tag_at)   # written by earlier launches only
    stale = (was != 0) & (was != (tag | PREP_BIT))
    tl.debug_barrier()      # every thread has read the tag before any writes it
    tl.store(tag_at, 0)     # invalid first ...
    fence_sys()             # ... before the header words change
    if RECV:
        tl.store(rec + T_RECV_START, start)
    else:   # T_OP and T_SEND_START, around the tag word: one store
        f = tl.arange(0, 4)
        tl.store(rec + f, tl.where(f == T_OP, op, start).to(tl.int64), mask=(f == T_OP) | (f == T_SEND_START))
    publish(tag_at, tag | tl.where(stale, STALE_BIT, 0))


@triton.jit
def send_begin(trace_ptr, grp, call, op, first, WORLD: tl.constexpr, TRACE_N: tl.constexpr, TRACE: tl.constexpr):
    """Program ``first`` of a send: the call's send half opened, started now."""
    if TRACE:
        if first:
            open_half(trace_ptr, grp, call, op, now_ns(), False, WORLD, TRACE_N)


@triton.jit
def recv_entry(done_ptr, WORLD: tl.constexpr):
    """The receive's entry counter: word WORLD + 2 of the channel's arrival counters (``Channel.done``),
    0 between launches."""
    return done_ptr + WORLD + 2


@triton.jit
def recv_begin(trace_ptr, grp, call, op, done_ptr, WORLD: tl.constexpr, TRACE_N: tl.constexpr,
               TRACE: tl.constexpr):
    """Every program of a receive, before it records anything: the first program to enter opens the
    call's receive half, with the time it read before entering (module docstring)."""
    if TRACE:
        start = now_ns()
        tl.debug_barrier()   # every thread has read the clock before the program enters
        if tl.atomic_add(recv_entry(done_ptr, WORLD), 1, sem="relaxed", scope="gpu") == 0:
            open_half(trace_ptr, grp, call, op, start, True, WORLD, TRACE_N)


@triton.jit
def prepare_next(trace_ptr, call, tag, RECV: tl.constexpr, WORLD: tl.constexpr, WORLD_P2: tl.constexpr,
                 TRACE_N: tl.constexpr):
    """The end of ``call``'s phase (its tag ``tag``): the next call's row of the half stops being a
    record (tag PREP of call + 1), then its per-peer words are 0, so that call's words never mix with
    an older call's. With one row there is no other row to give up: nothing (every record STALE)."""
    if TRACE_N > 1:
        nxt = record_of(trace_ptr, call + 1, WORLD, TRACE_N)
        f = tl.arange(0, 4 * WORLD_P2)
        if RECV:
            tl.store(nxt + T_RECV_TAG, ((tag & ~TAG_BITS) + 1) | PREP_BIT)
            fence_sys()
            tl.store(nxt + HEADER_WORDS + WORLD + f, tl.zeros([4 * WORLD_P2], tl.int64), mask=f < 3 * WORLD)
        else:
            tl.store(nxt + T_SEND_TAG, ((tag & ~TAG_BITS) + 1) | PREP_BIT)
            fence_sys()
            tl.store(nxt + HEADER_WORDS + f, tl.zeros([4 * WORLD_P2], tl.int64), mask=f < WORLD)


@triton.jit
def send_end(trace_ptr, call, last, WORLD: tl.constexpr, WORLD_P2: tl.constexpr, TRACE_N: tl.constexpr,
             TRACE: tl.constexpr):
    """The last program of a send phase (after publishing): end time, the tag with DONE_BIT, then the
    next call's row prepared."""
    if TRACE:
        if last:
            rec = record_of(trace_ptr, call, WORLD, TRACE_N)
            tag = tl.load(rec + T_SEND_TAG)   # published by the opening program before its arrive
            tl.store(rec + T_SEND_END, now_ns())
            publish(rec + T_SEND_TAG, tag | DONE_BIT)
            prepare_next(trace_ptr, call, tag, False, WORLD, WORLD_P2, TRACE_N)


@triton.jit
def recv_end(trace_ptr, grp, call, last, done_ptr, WORLD: tl.constexpr, WORLD_P2: tl.constexpr,
             TRACE_N: tl.constexpr, TRACE: tl.constexpr):
    """The last program of a receive phase: the end time and the outcome (this rank's error word: code,
    peer, value, bound), the tag with DONE_BIT, then the next call's row prepared and the entry counter
    set back to 0 (every program entered before it arrived)."""
    if TRACE:
        if last:
            tl.atomic_xchg(recv_entry(done_ptr, WORLD), 0, sem="relaxed", scope="gpu")
            rec = record_of(trace_ptr, call, WORLD, TRACE_N)
            tag = tl.load(rec + T_RECV_TAG)   # published by the opening program before its arrive
            err = as_ptr(tl.load(grp + S_ERR_ADDR), tl.int64)
            f = tl.arange(0, 8)   # T_RECV_END, T_OUTCOME, T_ERR_PEER, T_ERR_VALUE, T_ERR_BOUND
            fields = tl.load(err + ERR_PEER_WORD + f - 2, mask=(f >= 2) & (f < 5), other=0, volatile=True)
            code = tl.load(err, volatile=True)
            end = tl.where(f == 0, now_ns(), tl.where(f == 1, code, fields))
            tl.store(rec + T_RECV_END + f, end, mask=f < 5)
            publish(rec + T_RECV_TAG, tag | DONE_BIT)
            prepare_next(trace_ptr, call, tag, True, WORLD, WORLD_P2, TRACE_N)


@triton.jit
def store_peer_words(words_ptr, peers, values, mask, TRACE: tl.constexpr):
    """``words_ptr[peers] = values`` where ``mask`` (scalars or vectors): per-peer words of the call (row
    counts; SEEN = 0 of a source that is not waited for)."""
    if TRACE:
        tl.store(words_ptr + peers, (tl.zeros([], dtype=tl.int64) + values), mask=mask)


@triton.jit
def wait_begin(TRACE: tl.constexpr):
    """The time a wait starts (for the wait statistics); 0 untraced."""
    if TRACE:
        t = now_ns()
    else:
        t = 0
    return t


@triton.jit
def add_waits(wait_ptr, seen_at, peers, mask, waited_for, t_wait, WORLD: tl.constexpr, TRACE: tl.constexpr):
    """After this program's wait (begun at ``t_wait``), for the sources it records (``mask``), of which
    it waited for ``waited_for``: the WAITED words (until the flag was seen, or until now when it never
    was; 0 where not waited for), and the wait statistics of the sources whose flag was seen. SEEN
    (at ``seen_at``, ``seen_ptr``) was written by ``sync.wait_flags`` in this program."""
    if TRACE:
        seen = tl.load(seen_at + peers, mask=mask, other=0)
        waited = tl.where(seen > 0, tl.maximum(seen - t_wait, 0), now_ns() - t_wait)
        tl.store(seen_at + WORLD + peers, tl.where(waited_for, waited, 0), mask=mask)
        counted = tl.where(mask, tl.where(waited_for, seen > 0, False), False)
        tl.atomic_add(wait_ptr + peers, waited, mask=counted, sem="relaxed")
        tl.atomic_add(wait_ptr + WORLD + peers, tl.zeros_like(waited) + 1, mask=counted, sem="relaxed")


@triton.jit
def store_slots_per_rank(rows_ptr, counts, live, EXPERTS_PER_RANK: tl.constexpr, WORLD: tl.constexpr,
                         WORLD_P2: tl.constexpr, BINS: tl.constexpr, TRACE: tl.constexpr):
    """Dispatch send: ``rows_ptr[j]`` = the slots routed to rank j's experts (its rows of d.x from this
    rank), from ``counts`` (int [BINS]: slots per expert); 0 where not ``live`` (int1 [WORLD_P2])."""
    if TRACE:
        peer = tl.arange(0, WORLD_P2)
        expert = tl.arange(0, BINS)
        mine = (expert[None, :] // EXPERTS_PER_RANK == peer[:, None]) & (expert < WORLD * EXPERTS_PER_RANK)[None, :]
        per_rank = tl.sum(tl.where(mine, counts[None, :], 0), axis=1)
        tl.store(rows_ptr + peer, tl.where(live, per_rank, 0).to(tl.int64), mask=peer < WORLD)
