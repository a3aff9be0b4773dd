"""Device-side signalling shared by every op.

Protocol: each (sender -> receiver) pair owns its own flag word in the receiver's symmetric memory, so
no two ranks ever write the same word. A flag holds the sequence number of the last call whose payload
is complete; sequence numbers only grow, so flags are never reset. The sender publishes with a release
at system scope after its payload stores; the receiver polls with an acquire at system scope.

Every wait is bounded by ``timeout_ns``. On expiry the waiter records (code, op, rank, peer, value,
bound) in its rank's error word and gives up; later waits in the same launch see the recorded timeout
(after a 50 us grace period) and do not wait again, so a dead peer costs one timeout, not one per program.
"""

import os
import time

import triton
import triton.language as tl

from .. import errors

# Error codes as constexpr: compiled @jit code may only read module globals that are constexpr.
ERR_TIMEOUT = tl.constexpr(errors.ERR_TIMEOUT)
ERR_CAPACITY = tl.constexpr(errors.ERR_CAPACITY)
ERR_INDEX = tl.constexpr(errors.ERR_INDEX)

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Spin this long on a late flag before looking at the error word (see wait_flag).
WAIT_GRACE_NS = tl.constexpr(50_000)

if INTERPRET:
    @triton.jit
    def now_ns():
        # The interpreter runs this body as Python, so it can read the host clock. It is called once
        # per poll of a wait: a short sleep hands the CPU to the peer processes being waited for
        # (interpreted ranks often outnumber cores).
        time.sleep(0.0002)
        return time.monotonic_ns()
else:
    @triton.jit
    def now_ns():
        # %globaltimer: a nanosecond clock readable by every SM.
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                         is_pure=False, pack=1)


@triton.jit
def as_ptr(addr, DTYPE: tl.constexpr):
    """Turn an int64 address (a ``peer_ptrs`` entry) into a pointer to DTYPE."""
    return addr.to(tl.pointer_type(DTYPE))


@triton.jit
def record_error(err_addr, code, op, rank, peer, value, bound):
    """Record an error in this rank's error word unless one is already there (the first one wins).

    Plain stores, code last: the word may live in pinned host memory, where device atomics are not
    guaranteed to be atomic with respect to the host.
    """
    err = as_ptr(err_addr, tl.int64)
    if tl.load(err, volatile=True) == 0:
        tl.store(err + 1, op)
        tl.store(err + 2, rank)
        tl.store(err + 3, peer)
        tl.store(err + 4, value)
        tl.store(err + 5, bound)
        tl.debug_barrier()
        tl.store(err, code)


@triton.jit
def signal(flag_ptr, value):
    """Publish ``value`` at ``flag_ptr`` (int64, usually in a peer's memory) after every prior store of
    this program."""
    tl.atomic_xchg(flag_ptr, value, sem="release", scope="sys")


@triton.jit
def wait_flag(flag_ptr, target, timeout_ns, err_addr, op, rank, peer):
    """Wait until ``*flag_ptr >= target`` (acquire, system scope), at most ``timeout_ns``.

    Returns True when the flag arrived. On expiry records ERR_TIMEOUT naming ``peer`` and returns False.
    If a timeout is already recorded on this rank, returns at once (after one look at the flag).
    """
    v = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    if v < target:
        # The error word lives in pinned host memory, and reads of it from many programs serialize
        # (~4 us each on an H100, bench/NOTES.md). A flag that is merely a little late (a peer still
        # sending) arrives within the grace period and never costs one; only a flag later than that
        # reads the word, to skip the wait when a timeout is already recorded.
        t0 = now_ns()
        while (v < target) & (now_ns() - t0 < tl.minimum(timeout_ns, WAIT_GRACE_NS)):
            v = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
        if v < target:
            already_failed = tl.load(as_ptr(err_addr, tl.int64), volatile=True) == ERR_TIMEOUT
            if already_failed == 0:
                while (v < target) & (now_ns() - t0 < timeout_ns):
                    v = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
                if v < target:
                    record_error(err_addr, ERR_TIMEOUT, op, rank, peer, v, target)
    tl.debug_barrier()  # the whole program sees the payload the flag covers
    return v >= target


@triton.jit
def arrive(counter_ptr, num_programs):
    """Count this program in; True for the last of ``num_programs`` to arrive, which resets the counter.

    acq_rel at system scope: every store the earlier programs made (to peers too) is visible to the
    last one, and so to whatever it publishes next. Nobody waits here, so it is safe within a launch.
    """
    old = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="sys")
    last = old == num_programs - 1
    if last:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
    return last
