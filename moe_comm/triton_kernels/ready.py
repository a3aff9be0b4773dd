"""Per-expert "ready" words: the combine's send starts before every expert is done (``EPBuffer.ready_words``,
docs/moe-layer.md "Ready words").

A kernel of your own that writes expert_out (a GEMM) signals local expert e once its rows of expert_out are
all written: ``words[e]`` = the flag of the combine call that will send them (``ready_flag``), stored with a
release at system scope (``signal_expert``; or, from the host's stream, ``ReadyWords.signal``). The combine's
send, launched with ``ready=``, waits (``wait_ready``: bounded, block-uniform) for the experts whose rows a
block of its slots reads before it reads them, and its last program for every local expert before it
publishes, so the receive (ordered after the send) reads this rank's own rows in place only once they are
ready, and every signal of a call is consumed by that call. The flag is ``epoch << EPOCH_SHIFT | call``
with call = the combine channel's send count + 1: a signal of an earlier call or epoch never matches.
"""

import triton
import triton.language as tl

from .. import errors
from .sync import (CALL_MASK, ERR_TIMEOUT, S_EPOCH, flag_value, group_failed, publish, publish_many, read_once,
                   record_group_error, wait_flags)

OP_READY = tl.constexpr(errors.op_id("combine_ready"))


@triton.jit
def ready_flag(state_ptr, call_ptr):
    """The flag of the combine call whose send has not finished yet: ``ReadyWords.state`` (its epoch) and
    ``ReadyWords.call`` (the combine's send count, advanced at the end of each send). Read it in a kernel
    ordered after the previous combine call (e.g. after its receive, or after this call's dispatch)."""
    return flag_value(tl.load(state_ptr + S_EPOCH), tl.load(call_ptr) + 1)


@triton.jit
def signal_expert(words_ptr, e, flag):
    """Mark local expert ``e`` ready: ``words_ptr[e] = flag`` with a release at system scope, by one thread
    after a CTA barrier (``sync.publish``), so every store this program made before is ordered before it.
    Call it once per call per local expert (one with no rows too), in every thread of the program, after
    ALL of e's rows of expert_out are written: by this program, or by several that counted themselves in
    (an atomic counter, e.g. ``sync.arrive``) with the last one signalling."""
    publish(words_ptr + e, flag)


@triton.jit
def signal_kernel(words_ptr, experts_ptr, n, state_ptr, call_ptr, EXPERTS: tl.constexpr, BLOCK: tl.constexpr,
                  ALL: tl.constexpr):
    """``ReadyWords.signal``: mark local experts ready, in one program: ``experts_ptr[:n]`` (int64 ids; one
    outside [0, EXPERTS) is ignored: nothing is stored out of bounds, and the expert it meant is named by
    the combine's timeout), or with ALL every one (0 .. n - 1, nothing loaded), after the work queued
    before this launch on its stream. Grid (1,)."""
    flag = ready_flag(state_ptr, call_ptr)
    for i0 in range(0, n, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        if ALL:
            e = tl.where(i < n, i, -1).to(tl.int64)
        else:
            e = tl.load(experts_ptr + i, mask=i < n, other=-1)
        ok = (e >= 0) & (e < EXPERTS)
        publish_many(words_ptr + tl.where(ok, e, 0), flag, ok)


@triton.jit
def wait_ready(words_ptr, expert, use, flag, grp, status_ptr, rank, WORLD: tl.constexpr, WORLD_P2: tl.constexpr,
               EXPERTS_PER_RANK: tl.constexpr, EXPERTS_P2: tl.constexpr, PUT: tl.constexpr):
    """True (the same in every thread of the program) once every local expert among ``expert[use]`` (a
    vector of ids in [0, EXPERTS_PER_RANK)) has ``words[e] == flag``: all polled at once (``wait_flags``).
    False if the wait could not complete: a timeout is recorded as the group's error of op "combine_ready"
    naming the lowest local expert not signalled (the same whichever program times out first); any other
    failure was recorded by the wait (or by the rank that failed the group)."""
    e = tl.arange(0, EXPERTS_P2)
    need = tl.max(((expert[:, None] == e[None, :]) & use[:, None]).to(tl.int32), axis=0) != 0
    ok = tl.max(need.to(tl.int32)) == 0
    if ok == 0:   # decided on plain loads (the dispatch's metadata): block-uniform
        got = wait_flags(words_ptr + e, flag, need, e, grp, status_ptr, OP_READY, rank, WORLD, WORLD_P2, PUT=PUT,
                         RECORD_TIMEOUT=False, RANK_LANES=False)
        ok = tl.min(tl.where(need, got, True).to(tl.int32)) > 0
        if (ok == 0) & (group_failed(grp, status_ptr, WORLD, WORLD_P2) == 0):   # it timed out
            v = read_once(words_ptr + e, e < EXPERTS_PER_RANK)
            late = tl.min(tl.where((e < EXPERTS_PER_RANK) & (v != flag), e, EXPERTS_P2))
            late = tl.where(late < EXPERTS_P2, late, tl.min(tl.where(need & (got == 0), e, EXPERTS_P2)))  # came since
            seen = tl.max(tl.where(e == late, v & CALL_MASK, 0))
            record_group_error(grp, ERR_TIMEOUT, OP_READY, rank, late, seen, flag & CALL_MASK, WORLD, WORLD_P2, PUT)
    return ok
