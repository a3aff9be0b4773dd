"""Device-side signalling shared by every op: group state, publishing, bounded waits, error records.

The words and their layout are in ``moe_comm/protocol.py``; the rules, in short:

- Each (sender -> receiver) pair owns its flag word in the receiver's symmetric memory: no two ranks
  write one word. A flag is ``epoch << EPOCH_SHIFT | call``; a sender publishes it with a release at
  system scope **after a CTA barrier** (so every warp's payload stores are ordered before it), and a
  receiver waits for exactly that value with an acquire, then a CTA barrier before it reads the payload.
- Every wait is bounded by the group's timeout. It ends early when the peer published ABORT for the call
  (CommAbortedError), when a flag of a later call shows the ranks out of step (CommDesyncError), or when
  the group is already failed. A wait that does not get its flag records a group-wide error: into this
  rank's error word (for the host) and into row ``rank`` of every live rank's status buffer (by stores
  where the status is mapped; by an NVSHMEM put with the tag as its signal to a peer reached by puts,
  in kernels compiled with ``PUT``), so every rank's kernels stop sending and waiting until ``reset()``.
- "Last program publishes": programs count themselves in with an acq_rel atomic (``arrive``); the last
  one publishes, and only if no program skipped its part.

Block-uniform decisions. The interpreter runs one thread per program; a GPU runs num_warps * 32, and
Triton computes a "scalar" in every thread separately. A branch that holds a CTA barrier (``debug_barrier``,
a publish, an atomic's result broadcast, ``claim``) or a block-wide call (NVSHMEM ``*_block``) must be
taken by every thread of the program alike, or warps meet different barriers: a hang, or warps reading
shared-memory slots meant for another broadcast (the CUDA context lost at the first realistic timeout,
issue 33). So every such branch decides on one of these, and nothing else:

- values every thread computes alike: kernel arguments, constexprs, program ids, and plain loads of words
  that do not change while the kernel runs (the group state; control words published before a flag this
  program acquired, read after the wait's barrier). Not a word another channel's kernels write (they may
  run meanwhile on another stream: the prefill dispatch's read of the combine's count), which is read
  once (``read_once``; ``ptx_rules.OTHER_CHANNEL_PARAMS``);
- an atomic's result (``read_once``, ``claim``, ``arrive``, the waits' polls): Triton issues it once per
  element and hands the value to every thread through shared memory after a barrier, so every thread sees
  the one value read. Words that change under a running kernel (flags, status tags) are read this way;
- ``block_any(p)``: a CTA-wide OR of a per-thread predicate in one barrier (``bar.red.or.pred``). The
  timer is per thread (``%globaltimer`` is read by each thread at its own moment), so a timeout is the
  verdict of ``block_any``, and so is the error word (pinned host memory, no atomics there).

``ptx_rules.divergent_barriers`` checks this on the PTX of every kernel config: no barrier or block-wide
call is reachable under a branch whose predicate depends, per thread, on a timer read or a volatile,
relaxed or acquire load.
"""

import time

import triton
import triton.language as tl

from .. import errors, protocol
from . import nvshmem_device

# Codes and layout as constexpr: compiled @jit code may only read module globals that are constexpr.
ERR_TIMEOUT = tl.constexpr(errors.ERR_TIMEOUT)
ERR_CAPACITY = tl.constexpr(errors.ERR_CAPACITY)
ERR_INDEX = tl.constexpr(errors.ERR_INDEX)
ERR_ABORTED = tl.constexpr(errors.ERR_ABORTED)
ERR_DESYNC = tl.constexpr(errors.ERR_DESYNC)
ERR_SCALE = tl.constexpr(errors.ERR_SCALE)
ERR_DROPPED = tl.constexpr(errors.ERR_DROPPED)
S_EPOCH = tl.constexpr(protocol.S_EPOCH)
S_ERR_ADDR = tl.constexpr(protocol.S_ERR_ADDR)
S_TIMEOUT_NS = tl.constexpr(protocol.S_TIMEOUT_NS)
S_CLAIM = tl.constexpr(protocol.S_CLAIM)
S_BCAST_CLAIM = tl.constexpr(protocol.S_BCAST_CLAIM)
S_LIVE = tl.constexpr(protocol.S_LIVE)
STATE_WORDS = tl.constexpr(protocol.STATE_WORDS)
REC_WORDS = tl.constexpr(protocol.REC_WORDS)
EPOCH_SHIFT = tl.constexpr(protocol.EPOCH_SHIFT)
CALL_MASK = tl.constexpr(protocol.CALL_MASK)
ABORT_BIT = tl.constexpr(protocol.ABORT_BIT)
TRANSPORT_PUT = tl.constexpr(protocol.TRANSPORT_PUT)
NOT_FAILED, FAILED_ADOPTED, FAILED_NAMING_ME = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)   # failure_seen
SKIP_UNIT = tl.constexpr(1 << 16)  # arrive(): skipped programs are counted in the counter's high half

# True in the interpreted twin of this module (moe_comm/interpreter.py): decided when the module is
# imported, by the knob the twin's import turns on; never by reading the environment.
INTERPRET = bool(triton.knobs.runtime.interpret)

if INTERPRET:
    import threading

    POLL_SLEEP_MIN_S = 0.0002   # the first polls of a wait: the flag is usually about to arrive
    POLL_SLEEP_MAX_S = 0.004    # a long wait (a slow peer, a timeout): at most this late, and mostly asleep
    POLL_RUN_GAP_NS = 20_000_000   # pauses closer than this are one wait's; a longer gap starts anew

    class _PollPacer(threading.local):
        """The host sleep between an interpreted wait's polls. One interpreted poll costs about a
        millisecond of CPU (a dozen interpreted ops) and interpreted ranks outnumber cores: a waiting rank
        that spun would take the CPU from the peer it waits for. Consecutive pauses double the sleep up to
        POLL_SLEEP_MAX_S; a gap between pauses (the next wait) starts again at POLL_SLEEP_MIN_S. Per
        thread: loopback ranks in threads pace apart."""

        last_ns = 0
        sleep_s = POLL_SLEEP_MIN_S

        def __call__(self) -> None:
            if time.monotonic_ns() - self.last_ns < POLL_RUN_GAP_NS:
                self.sleep_s = min(2 * self.sleep_s, POLL_SLEEP_MAX_S)
            else:
                self.sleep_s = POLL_SLEEP_MIN_S
            time.sleep(self.sleep_s)
            self.last_ns = time.monotonic_ns()

    _pace_poll = _PollPacer()

    @triton.jit
    def now_ns():
        # The interpreter runs this body as Python, so it can read the host clock.
        return time.monotonic_ns()

    @triton.jit
    def poll_pause():
        """Between two polls of a wait: the interpreter hands the CPU to the ranks being waited for."""
        _pace_poll()
else:
    @triton.jit
    def now_ns():
        # %globaltimer: a nanosecond clock readable by every SM.
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                         is_pure=False, pack=1)

    @triton.jit
    def poll_pause():
        """Between two polls of a wait: nothing on a GPU (the poll itself is the wait)."""
        pass


if INTERPRET:
    @triton.jit
    def release_store(ptrs, value, mask):
        """Store int64 ``value`` at ``ptrs`` (lanes where ``mask``; all three the same shape) with a
        release at system scope, ordered after this thread's earlier stores (``publish``: after a CTA
        barrier, every thread's)."""
        # The interpreter has no inline PTX; its atomics are as ordered as any store on the CPU.
        # Interpreted, a module constexpr plus a tensor (``code + tl.zeros(...)`` with ``code`` =
        # ERR_TIMEOUT) is a constexpr holding a tensor (``constexpr.__add__``); Triton 3.6's ops unwrapped
        # it, Triton 3.9's refuse it ("cannot convert [1] ... to tensor"), so it is unwrapped here.
        if isinstance(value, tl.constexpr):
            value = value.value
        tl.atomic_xchg(ptrs, value, mask=mask, sem="release", scope="sys")
else:
    @triton.jit
    def release_store(ptrs, value, mask):
        # st.release.sys: a plain store with release semantics, which every target supports. An atomic
        # (atom.exch) needs atomics the target may lack: pinned host memory (the error word) when the
        # host has no native atomics with the device (hostNativeAtomicSupported = 0 on many x86 hosts),
        # and peers reached over PCIe. Every thread holding a lane stores it (the same value).
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.s32 p, $3, 0; @p st.release.sys.global.b64 [$1], $2; mov.u32 $0, 0; }",
            "=r,l,l,r", [ptrs, value, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


if INTERPRET:
    @triton.jit
    def block_any(pred):
        """True for every thread of the program if ``pred`` (a per-thread scalar) is True in any of them.
        The interpreter runs one thread per program: the predicate itself."""
        return pred != 0
else:
    @triton.jit
    def block_any(pred):
        # bar.red.or.pred: a CTA barrier that ORs one predicate per thread and gives every thread the result.
        # Every thread of the program must reach it (call it where control flow is already block-uniform).
        return tl.inline_asm_elementwise(
            "{ .reg .pred %bany_in, %bany_out; setp.ne.s32 %bany_in, $1, 0; "
            "bar.red.or.pred %bany_out, 0, %bany_in; selp.s32 $0, 1, 0, %bany_out; }",
            "=r,r", [(pred != 0).to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1) != 0


@triton.jit
def read_once(ptrs, mask):
    """int64 words at ``ptrs`` (lanes where ``mask``, else 0) that may change while the kernel runs, as
    one value per lane for every thread of the program: an atomic add of 0 (relaxed, system scope) is
    issued once per lane and its result broadcast (module docstring). Device memory only (not the error
    word, which may be pinned host memory)."""
    m = (tl.zeros(ptrs.shape, tl.int32) + mask) != 0   # a mask tensor shaped like ptrs (mask may be a bool)
    return tl.where(m, tl.atomic_add(ptrs, 0, mask=m, sem="relaxed", scope="sys"), 0)


@triton.jit
def as_ptr(addr, DTYPE: tl.constexpr):
    """Turn an int64 address (a ``peer_ptrs`` or group-state entry) into a pointer to DTYPE."""
    return addr.to(tl.pointer_type(DTYPE))


@triton.jit
def flag_value(epoch, call):
    """The flag a sender publishes for ``call`` of ``epoch`` (both int64)."""
    return (epoch << EPOCH_SHIFT) | call


@triton.jit
def live_ranks(grp, WORLD: tl.constexpr, WORLD_P2: tl.constexpr):
    """int1 [WORLD_P2]: rank j is live (not excluded); False past WORLD."""
    w = tl.arange(0, WORLD_P2)
    return tl.load(grp + S_LIVE + w, mask=w < WORLD, other=0) != 0


@triton.jit
def is_live(grp, r):
    return tl.load(grp + S_LIVE + r) != 0


@triton.jit
def failed_source(grp, status_ptr, WORLD: tl.constexpr, WORLD_P2: tl.constexpr):
    """The lowest live rank whose group-wide error of this epoch is in this rank's status, or WORLD_P2."""
    w = tl.arange(0, WORLD_P2)
    tags = read_once(status_ptr + w, w < WORLD)   # block-uniform: a tag may land while the kernel runs
    hit = (tags == tl.load(grp + S_EPOCH) + 1) & live_ranks(grp, WORLD, WORLD_P2)
    return tl.min(tl.where(hit, w, WORLD_P2))


@triton.jit
def group_failed(grp, status_ptr, WORLD: tl.constexpr, WORLD_P2: tl.constexpr):
    """True once any live rank (this one included) broadcast a group-wide error in this epoch: then
    kernels neither send nor wait. One vector load of the status tags (local memory)."""
    return failed_source(grp, status_ptr, WORLD, WORLD_P2) < WORLD


@triton.jit
def claim(word_ptr):
    """True for the one caller that turns the int64 device word at ``word_ptr`` from 0 to 1."""
    zero = tl.zeros([], dtype=tl.int64)
    return tl.atomic_cas(word_ptr, zero, zero + 1, sem="relaxed", scope="gpu") == 0


@triton.jit
def record_error(grp, code, op, rank, peer, value, bound):
    """Record an error in this rank's error word, if no error holds it (the first one since the host
    last released the word wins; a later one only marks the word 'dropped').

    The word may live in pinned host memory: it is claimed with an atomic on a device word of the group
    state, its fields are plain stores, and the code is published last with a system-scope release, so
    the host (which reads the code first) never sees a torn record.
    """
    err = as_ptr(tl.load(grp + S_ERR_ADDR), tl.int64)
    if claim(grp + S_CLAIM):
        tl.store(err + 1, op)
        tl.store(err + 2, rank)
        tl.store(err + 3, peer)
        tl.store(err + 4, value)
        tl.store(err + 5, bound)
        tl.debug_barrier()
        one = tl.arange(0, 1)
        release_store(err + one, code + tl.zeros([1], tl.int64), one == 0)
    else:
        tl.store(err + ERR_DROPPED, 1)


@triton.jit
def record_group_error(grp, code, op, rank, peer, value, bound, WORLD: tl.constexpr, WORLD_P2: tl.constexpr,
                       PUT: tl.constexpr = False):
    """Record a group-wide error here and broadcast it: row ``rank`` of every live rank's status buffer
    gets the record (int64 [REC_WORDS]: code, op, rank, peer, value, bound, 0, 0), then the tag
    ``epoch + 1`` at word ``rank`` (release): payload before tag, as ``adopt_group_error`` reads them.
    Once per epoch per rank (the first wins).

    Store transport (the status mapped here, ``status_addr != 0``): plain stores, then a release store of
    the tag. With ``PUT`` (constexpr; the kernel was launched with the put transport), a live peer whose
    ``transports`` entry is TRANSPORT_PUT (e.g. on another node: not mapped at all) gets instead one
    ``putmem_signal_nbi`` of this rank's own row (its symmetric copy, written by the stores above) into
    the same row of the peer's status, the tag as the signal (SIGNAL_SET; NVSHMEM delivers the payload
    before the signal). Nothing waits for those puts (no ``quiet``): a dead or unreachable peer must not
    hold up the rank that records the error. Without ``PUT`` this compiles to the store path only."""
    record_error(grp, code, op, rank, peer, value, bound)
    if claim(grp + S_BCAST_CLAIM):
        w = tl.arange(0, WORLD_P2)
        live = live_ranks(grp, WORLD, WORLD_P2)
        status_addr = tl.load(grp + STATE_WORDS + WORLD + w, mask=live, other=0)
        stored = status_addr != 0  # live and mapped here
        if PUT:  # a put peer gets the record as a put (below); this rank's own row is always stored
            put = tl.load(grp + STATE_WORDS + 2 * WORLD + w, mask=live, other=0) == TRANSPORT_PUT
            stored = stored & ((put == 0) | (w == rank))
        status = as_ptr(status_addr, tl.int64)
        f = tl.arange(0, REC_WORDS)
        rec = tl.where(f == 0, code, tl.where(f == 1, op, tl.where(f == 2, rank, tl.where(
            f == 3, peer, tl.where(f == 4, value, tl.where(f == 5, bound, 0)))))).to(tl.int64)
        tl.store(status[:, None] + WORLD + rank * REC_WORDS + f[None, :], rec[None, :], mask=stored[:, None])
        tl.debug_barrier()
        tag = tl.load(grp + S_EPOCH) + 1
        release_store(status + rank, tag + tl.zeros([WORLD_P2], tl.int64), stored)
        if PUT:
            broadcast_by_puts(grp, rank, tag, WORLD)


@triton.jit
def broadcast_by_puts(grp, rank, tag, WORLD: tl.constexpr):
    """The put half of ``record_group_error`` (scalar arguments, called by every thread of the program):
    this rank's status row ``rank`` (int64 [REC_WORDS], already stored here) to the same row of every
    live peer reached by puts, with ``tag`` (int64) SIGNAL_SET at that peer's status word ``rank``.
    Non-blocking: issued, never waited for."""
    own = tl.load(grp + STATE_WORDS + WORLD + rank)   # this rank's status: a local symmetric address
    row = own + (WORLD + rank * REC_WORDS) * 8
    nvshmem_device.fence_system()   # the row's stores, before the network reads them
    for p in range(WORLD):
        if (p != rank) & is_live(grp, p) & (tl.load(grp + STATE_WORDS + 2 * WORLD + p) == TRANSPORT_PUT):
            nvshmem_device.putmem_signal_nbi_block(row, row, REC_WORDS * 8, own + rank * 8, tag,
                                                   nvshmem_device.SIGNAL_SET, p)


@triton.jit
def adopt_group_error(grp, status_ptr, source, WORLD: tl.constexpr):
    """Copy rank ``source``'s broadcast record into this rank's error word (if free), so that the host
    raises the same named error on every rank."""
    tl.atomic_add(status_ptr + source, 0, sem="acquire", scope="sys")  # the record was stored before its tag
    tl.debug_barrier()
    rec = status_ptr + WORLD + source * REC_WORDS   # written once per epoch, before its tag: plain loads
    # The error word may be written meanwhile (by this kernel's other programs, or cleared by the host
    # between kernels): every thread's view, ORed, decides.
    taken = block_any(tl.load(as_ptr(tl.load(grp + S_ERR_ADDR), tl.int64), volatile=True) != 0)
    if taken == 0:
        record_error(grp, tl.load(rec), tl.load(rec + 1), tl.load(rec + 2), tl.load(rec + 3), tl.load(rec + 4),
                     tl.load(rec + 5))


@triton.jit
def blocked_elsewhere(status_ptr, source, rank, failed_before, pending, peers, WORLD: tl.constexpr):
    """True (block-uniform) when rank ``source``'s broadcast record (its tag set) is a timeout naming ``rank``
    that came while this rank waited (the group was not failed when the wait began: ``failed_before``)
    for flags of other ranks than ``source`` only (``pending`` lanes, rank ``peers[i]``: every lane the
    launch waits for, not only this program's, as ``missing_lanes``; a program that does not wait for
    ``source`` while another program of the launch does is in the mutual wait too): a peer whose wait
    depended on this rank gave up on it while it was blocked on a third rank. Such a rank names whom it
    waits for, not itself (docs/faults.md, "Which rank is named"). A rank that was late when its wait
    began, or that waits for ``source`` itself, adopts the record: every rank raises the same error."""
    tl.atomic_add(status_ptr + source, 0, sem="acquire", scope="sys")  # the record was stored before its tag
    tl.debug_barrier()
    f = tl.arange(0, 4)
    rec = read_once(status_ptr + WORLD + source * REC_WORDS + f, (f == 0) | (f == 3))   # code, peer
    names = (tl.max(tl.where(f == 0, rec, 0)) == ERR_TIMEOUT) & (tl.max(tl.where(f == 3, rec, 0)) == rank)
    waits_for_source = tl.max(tl.where(pending & (peers == source), 1, 0)) > 0
    return names & (failed_before == 0) & (waits_for_source == 0)


@triton.jit
def named_while_blocked(grp, status_ptr, rank, failed_before, pending, peers, WORLD: tl.constexpr,
                        WORLD_P2: tl.constexpr):
    """``blocked_elsewhere`` of the group's failure (False if the group is not failed)."""
    source = failed_source(grp, status_ptr, WORLD, WORLD_P2)
    return (source < WORLD) & blocked_elsewhere(status_ptr, tl.minimum(source, WORLD - 1), rank, failed_before,
                                                pending, peers, WORLD)


@triton.jit
def failure_seen(grp, status_ptr, rank, failed_before, flag_ptrs, target, peers, WORLD: tl.constexpr,
                 WORLD_P2: tl.constexpr, ABORT_ARRIVES: tl.constexpr):
    """A pending wait's view of the group (block-uniform): NOT_FAILED; FAILED_NAMING_ME (``blocked_elsewhere``
    on the launch's missing lanes, ``missing_lanes``: nothing adopted, the wait records its own timeout); or
    FAILED_ADOPTED (any other group-wide error, now in this rank's error word too, as ``check_failed``)."""
    source = failed_source(grp, status_ptr, WORLD, WORLD_P2)
    out = NOT_FAILED
    if source < WORLD:
        missing, _ = missing_lanes(flag_ptrs, target, peers, grp, WORLD, ABORT_ARRIVES)
        if blocked_elsewhere(status_ptr, source, rank, failed_before, missing, peers, WORLD):
            out = FAILED_NAMING_ME
        else:
            adopt_group_error(grp, status_ptr, source, WORLD)
            out = FAILED_ADOPTED
    return out


@triton.jit
def check_failed(grp, status_ptr, WORLD: tl.constexpr, WORLD_P2: tl.constexpr):
    """``group_failed``, and if so make sure the error is in this rank's error word too."""
    source = failed_source(grp, status_ptr, WORLD, WORLD_P2)
    failed = source < WORLD
    if failed:
        adopt_group_error(grp, status_ptr, source, WORLD)
    return failed


@triton.jit
def wait_flags(flag_ptrs, target, mask, peers, grp, status_ptr, op, rank, WORLD: tl.constexpr,
               WORLD_P2: tl.constexpr, ABORT_ARRIVES: tl.constexpr = False, seen_ptr=None, seen_mask=None,
               PUT: tl.constexpr = False, RECORD_TIMEOUT: tl.constexpr = True, RANK_LANES: tl.constexpr = True):
    """Wait until every flag at ``flag_ptrs`` (a vector, this rank's memory; lanes where ``mask``; lane i
    is rank ``peers[i]``'s flag) equals ``target``: every pending flag is polled at once, one vector of
    acquire loads (system scope) per poll, so N flags cost one round trip, not N.

    Returns int1 like ``mask``: True on the lanes that arrived. The CTA barrier after the wait lets the
    whole program read the payload those flags cover. A wait that cannot complete returns with the
    missing lanes False, having recorded why as a group-wide error: a peer published ABORT for this call,
    or a flag of a later call of this epoch (out of step), or the group failed meanwhile (another rank's
    error, adopted here; but a peer's timeout naming this rank, come while this wait was pending on other
    ranks, is answered by this rank's own timeout record naming ``lowest_missing``: ``blocked_elsewhere``),
    or the timeout passed (naming ``lowest_missing``: the same peer whichever
    program of the launch times out first, so callers pass every live peer's flag as a lane, and
    ``mask`` only the ones this program waits for). With ``ABORT_ARRIVES`` a peer's ABORT for the call
    counts as arrived (``drain_kernel``: any sign that the peer is done with the call before it).

    Flight recorder (``seen_ptr`` given, ``triton_kernels/trace.py``): on the lanes where ``seen_mask``,
    ``seen_ptr[peers[i]]`` gets the time lane i's flag was seen (``now_ns``), 0 if it never was.

    ``PUT`` (constexpr): the error a failed wait records also reaches the peers reached by puts
    (``record_group_error``); launch with the put transport's arguments when the group uses puts.
    ``RANK_LANES`` False: the lanes are not ranks (``ready.wait_ready``'s are local experts): a group failure
    is always adopted, and ``peers`` only orders the lanes.
    ``RECORD_TIMEOUT`` False: a timeout, or a peer's timeout naming this rank come while it waited,
    returns with the missing lanes False and records nothing (the caller names whom to blame and records
    it: ``prefill_dispatch``'s wait at a rail, which reads ``group_failed`` before it and asks
    ``named_while_blocked`` after).
    """
    v = tl.atomic_add(flag_ptrs, 0, mask=mask, sem="acquire", scope="sys")
    pending = tl.where(mask, v != target, False)
    if seen_ptr is not None:
        seen_at = tl.where(pending, 0, now_ns())
    if tl.max(pending.to(tl.int32)) > 0:
        timeout_ns = tl.load(grp + S_TIMEOUT_NS)
        t0 = now_ns()
        if RANK_LANES:
            failed_before = group_failed(grp, status_ptr, WORLD, WORLD_P2)   # before this wait began
        else:   # lanes are not ranks: a record naming this rank is adopted (``blocked_elsewhere`` is False)
            failed_before = True
        state = 0  # 0 waiting, 1 arrived, 2 failed
        while state == 0:
            done = v == target
            if ABORT_ARRIVES:
                done = done | (v == (target | ABORT_BIT))
            pending = tl.where(mask, done == 0, False)
            aborted = tl.where(pending, v == (target | ABORT_BIT), False)
            ahead = tl.where(pending, ((v >> EPOCH_SHIFT) == (target >> EPOCH_SHIFT))
                             & ((v & CALL_MASK) > (target & CALL_MASK)), False)
            bad = tl.where(aborted | ahead, 1, 0)
            # The lowest peer among the lanes that decide the outcome, and its flag's call.
            first = tl.min(tl.where(bad != 0, peers, WORLD_P2 + tl.where(pending, peers, WORLD_P2)))
            first_peer = first % WORLD_P2
            seen = tl.max(tl.where(peers == first_peer, v & CALL_MASK, 0))
            if tl.max(pending.to(tl.int32)) == 0:
                state = 1
            elif tl.max(aborted.to(tl.int32)) > 0:
                record_group_error(grp, ERR_ABORTED, op, rank, first_peer, 0, 0, WORLD, WORLD_P2, PUT)
                state = 2
            elif tl.max(ahead.to(tl.int32)) > 0:
                record_group_error(grp, ERR_DESYNC, op, rank, first_peer, seen, target & CALL_MASK, WORLD, WORLD_P2,
                                   PUT)
                state = 2
            else:
                failed = failure_seen(grp, status_ptr, rank, failed_before, flag_ptrs, target, peers, WORLD, WORLD_P2,
                                      ABORT_ARRIVES)
                if failed == FAILED_ADOPTED:
                    state = 2
                elif (failed == FAILED_NAMING_ME) | block_any(now_ns() - t0 > timeout_ns):   # each thread: own clock
                    if RECORD_TIMEOUT:   # also when blocked here on a third rank: name whom this wait misses
                        late, late_seen = lowest_missing(flag_ptrs, target, peers, first_peer, seen, grp, WORLD,
                                                         WORLD_P2, ABORT_ARRIVES)
                        record_group_error(grp, ERR_TIMEOUT, op, rank, late, late_seen, target & CALL_MASK, WORLD,
                                           WORLD_P2, PUT)
                    state = 2
                else:
                    poll_pause()
                    v = tl.where(pending, tl.atomic_add(flag_ptrs, 0, mask=pending, sem="acquire", scope="sys"), v)
                    if seen_ptr is not None:
                        seen_at = tl.where(pending & (v == target), now_ns(), seen_at)
    if seen_ptr is not None:
        tl.store(seen_ptr + peers, tl.where(mask & (v == target), seen_at, 0), mask=seen_mask)
    tl.debug_barrier()  # the whole program sees the payload the flags cover
    return tl.where(mask, v == target, False)


@triton.jit
def missing_lanes(flag_ptrs, target, peers, grp, WORLD: tl.constexpr, ABORT_ARRIVES: tl.constexpr = False):
    """(missing, v): int1 per lane, a live peer's lane (``peers`` below WORLD) whose flag is not ``target`` now
    (nor its ABORT, with ``ABORT_ARRIVES``), every lane, waited for by this program or not; and the flags
    read (acquire: one atomic per lane, its value broadcast, so block-uniform)."""
    known = (peers < WORLD) & (tl.load(grp + S_LIVE + peers, mask=peers < WORLD, other=0) != 0)
    v = tl.atomic_add(flag_ptrs, 0, mask=known, sem="acquire", scope="sys")
    done = v == target
    if ABORT_ARRIVES:
        done = done | (v == (target | ABORT_BIT))
    return known & (done == 0), v


@triton.jit
def lowest_missing(flag_ptrs, target, peers, first_peer, seen, grp, WORLD: tl.constexpr, WORLD_P2: tl.constexpr,
                   ABORT_ARRIVES: tl.constexpr = False):
    """Whom a timed-out wait names, and that peer's flag's call: the lowest live rank among ``peers``
    (every lane, waited for or not; a lane whose peer id is WORLD_P2 or more is no candidate) whose flag
    is not ``target`` now (nor its ABORT, with ``ABORT_ARRIVES``). Programs of one launch wait for
    different peers and the first to time out records the group's error: naming the lowest missing
    peer of all makes it the same whichever program that is (with two peers dead, always the lower).
    ``first_peer``/``seen``: the waited lanes' answer, kept if every flag arrived meanwhile."""
    missing, v = missing_lanes(flag_ptrs, target, peers, grp, WORLD, ABORT_ARRIVES)
    late = tl.min(tl.where(missing, peers, WORLD_P2))
    late_seen = tl.max(tl.where(missing & (peers == late), v & CALL_MASK, 0))
    if late >= WORLD_P2:
        late = first_peer
        late_seen = seen
    return late, late_seen


@triton.jit
def wait_flag(flag_ptr, target, grp, status_ptr, op, rank, peer, WORLD: tl.constexpr, WORLD_P2: tl.constexpr,
              seen_ptr=None, seen_mask=None, PUT: tl.constexpr = False):
    """``wait_flags`` for one flag (rank ``peer``'s, at ``flag_ptr``): True when it arrived."""
    one = tl.arange(0, 1)
    ok = wait_flags(flag_ptr + one, target, one == 0, peer + one, grp, status_ptr, op, rank, WORLD, WORLD_P2,
                    seen_ptr=seen_ptr, seen_mask=seen_mask, PUT=PUT)
    return tl.max(ok.to(tl.int32)) > 0


@triton.jit
def publish(flag_ptr, value):
    """Publish ``value`` at ``flag_ptr`` (int64, usually in a peer's memory) after every prior store of
    this program: a CTA barrier orders the other warps' stores before the one-thread release."""
    tl.debug_barrier()
    one = tl.arange(0, 1)
    release_store(flag_ptr + one, value + tl.zeros([1], tl.int64), one == 0)


@triton.jit
def publish_many(flag_ptrs, value, mask):
    """``publish`` to a vector of flags (one per peer, lanes where ``mask``)."""
    tl.debug_barrier()
    release_store(flag_ptrs, value + tl.zeros(mask.shape, tl.int64), mask)


@triton.jit
def arrive(counter_ptr, num_programs, skipped):
    """Count this program in; returns (last, any_skipped): True for the last of ``num_programs`` to
    arrive (which resets the counter), and whether any of them (this one included) skipped its part
    (``skipped`` != 0), in which case the last one must not publish.

    A CTA barrier first, then acq_rel at system scope: every store of the earlier programs (to peers
    too) is visible to the last one, and so to whatever it publishes next. Nobody waits here, so it is
    safe within a launch.
    """
    tl.debug_barrier()
    add = 1 + ((tl.zeros([], dtype=tl.int32) + skipped) != 0).to(tl.int32) * SKIP_UNIT  # skipped: int or bool
    total = tl.atomic_add(counter_ptr, add, sem="acq_rel", scope="sys") + add
    last = (total % SKIP_UNIT) == num_programs
    if last:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
    return last, total >= SKIP_UNIT


@triton.jit
def abort_kernel(
    ctrl_ptrs_ptr,    # int64 [WORLD]: every rank's control words of the channel, [2 zones, WORLD, CTRL_WORDS]
    send_seq_ptr,     # int64 [1]: the channel's send count (advanced here)
    grp, rank,
    CTRL_WORDS: tl.constexpr, FLAG_WORD: tl.constexpr, WORLD: tl.constexpr, WORLD_P2: tl.constexpr,
    PUT: tl.constexpr,
):
    """A rank's part of a call it cannot make (an input error it raised, which its peers may not have
    seen): publish ABORT for the call to every live peer and advance the send count, without sending or
    waiting. Its receive side is ``drain_kernel``, run before the channel's next launch. If every rank
    aborted the call, nobody fails and the group stays usable; a peer that did make the call records
    CommAbortedError when it waits for this rank. Grid (1,).

    Peers reached by puts get the flag as an NVSHMEM signal, and nothing waits for it (no ``quiet``): a
    signal is delivered without one (NVSHMEM posts it to the NIC at once; a quiet only waits for the
    completion), it carries its value itself (no staging a later launch could rewrite), and nothing
    here depends on its arrival (the peers' own waits do). A quiet would only add a wait that, for a
    dead peer, ends when the NIC gives up, fatally (docs/faults.md)."""
    call = tl.load(send_seq_ptr) + 1
    w = tl.arange(0, WORLD_P2)
    peers = live_ranks(grp, WORLD, WORLD_P2) & (w != rank)
    ctrl = as_ptr(tl.load(ctrl_ptrs_ptr + w, mask=peers, other=0), tl.int64)
    slot = ((call % 2) * WORLD + rank) * CTRL_WORDS + FLAG_WORD
    flag = flag_value(tl.load(grp + S_EPOCH), call) | ABORT_BIT
    if PUT:  # peers reached by puts get the flag as an NVSHMEM signal (moe_comm/triton_kernels/transport.py)
        put = tl.load(grp + STATE_WORDS + 2 * WORLD + w, mask=peers, other=0) == TRANSPORT_PUT
        publish_many(ctrl + slot, flag, tl.where(put, False, peers))
        own = as_ptr(tl.load(ctrl_ptrs_ptr + rank), tl.int64) + slot
        for p in range(WORLD):
            if (p != rank) & is_live(grp, p) & (tl.load(grp + STATE_WORDS + 2 * WORLD + p) == TRANSPORT_PUT):
                nvshmem_device.signal_op(own, flag, nvshmem_device.SIGNAL_SET, p)
    else:
        publish_many(ctrl + slot, flag, peers)
    tl.store(send_seq_ptr, call)


@triton.jit
def drain_kernel(
    ctrl_ptr,         # int64 [2 zones, WORLD, CTRL_WORDS]: this rank's control words of the channel
    recv_seq_ptr,     # int64 [1]: the channel's receive count (advanced here)
    grp, status_ptr, op, rank,
    CTRL_WORDS: tl.constexpr, FLAG_WORD: tl.constexpr, WORLD: tl.constexpr, WORLD_P2: tl.constexpr,
    PUT: tl.constexpr = False,
):
    """The receive side of an aborted call, run before the channel's next launch on this rank: wait
    (bounded) until every live peer published its flag of the call, data or ABORT, then advance the
    receive count. A peer publishes it only after its own receive of the call before, so this rank's
    next send cannot overwrite a zone that a slow peer still reads (what the receive phase guarantees
    for a call that was made). A wait that fails records its group-wide error (``wait_flags``), so
    every rank's next call raises it (put peers too, with ``PUT``). Grid (1,)."""
    call = tl.load(recv_seq_ptr) + 1
    w = tl.arange(0, WORLD_P2)
    peers = live_ranks(grp, WORLD, WORLD_P2) & (w != rank)
    flags = ctrl_ptr + ((call % 2) * WORLD + w) * CTRL_WORDS + FLAG_WORD
    # This rank's own lane is no candidate for the rank a timeout names (lane id past the world).
    wait_flags(flags, flag_value(tl.load(grp + S_EPOCH), call), peers, tl.where(w != rank, w, WORLD_P2), grp,
               status_ptr, op, rank, WORLD, WORLD_P2, ABORT_ARRIVES=True, PUT=PUT)
    tl.store(recv_seq_ptr, call)


@triton.jit
def fail_group_kernel(grp, code, op, rank, peer, bound, WORLD: tl.constexpr, WORLD_P2: tl.constexpr,
                      PUT: tl.constexpr = False):
    """A group-wide error the host found (a host barrier that timed out): record it here and broadcast it
    to every live rank's status, exactly as a kernel's failed wait does (with ``PUT``, by puts to the
    peers reached by puts), so that a slow peer which still passes that barrier, or is busy in an op,
    raises the same error at its next check instead of sending into a group that is recovering.
    Grid (1,)."""
    record_group_error(grp, code, op, rank, peer, 0, bound, WORLD, WORLD_P2, PUT)
