"""Waiting for a dispatch's rows from inside a kernel of your own (``EPBuffer.arrival``, docs/moe-layer.md).

The dispatch receive publishes, per source rank s, the call's flag at ``words[s]`` (a release at system
scope) once it has written s's rows of every local expert into d.x, and s's rows per local expert at
``counts[s, :E_local]`` before that. A consumer kernel (a GEMM of your own, launched on another stream
while the receive runs) computes the flag once (``arrival_flag``), waits for the sources its tile needs
(``wait_source``: bounded, block-uniform, a failed wait records the group's error as the ops' do) and
reads d.x[e, base : base + counts[s, e]] with base = the counts of e from sources before s.
"""

import triton
import triton.language as tl

from .. import errors
from .sync import S_EPOCH, flag_value, wait_flags

OP_DISPATCH = tl.constexpr(errors.op_id("dispatch"))


@triton.jit
def arrival_flag(state_ptr, call_ptr):
    """The flag of the dispatch call whose send phase ran last: ``ArrivalWords.state`` (the group state,
    its epoch) and ``ArrivalWords.call`` (the channel's send count, written by the send kernel)."""
    return flag_value(tl.load(state_ptr + S_EPOCH), tl.load(call_ptr))


@triton.jit
def wait_source(words_ptr, source, flag, state_ptr, status_ptr, rank, WORLD: tl.constexpr, WORLD_P2: tl.constexpr):
    """True once source ``source``'s rows are in d.x (int1, the same in every thread of the program); False
    if the wait could not complete (timeout, abort, a failed group: recorded as the dispatch's error, raised
    by the host at its next check). Every thread of the program must call it."""
    w = tl.arange(0, WORLD_P2)
    got = wait_flags(words_ptr + w, flag, w == source, w, state_ptr, status_ptr, OP_DISPATCH, rank, WORLD, WORLD_P2)
    return tl.max(got.to(tl.int32)) > 0
