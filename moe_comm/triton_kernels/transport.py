"""The put transport inside the send kernels: one code path, the transport chosen per peer.

Every send kernel computes, per peer, the base address its stores go to. For a peer reached by stores
(``TRANSPORT_STORE`` in the group state's transports section) that is the peer's landing zone, as
before. For a peer reached by puts (``TRANSPORT_PUT``) it is this rank's *staging* copy of exactly the
region the rank would have written on that peer (same row layout), so the row-building code is the same
for both. Where a store-path kernel publishes the flag, the put path instead calls ``flush`` (below):
the staged rows go to the peer's landing zone in one ``putmem_nbi``, then the staged control words in a
``putmem_signal_nbi`` whose signal *is* the flag (``SIGNAL_SET`` of the same value a store-path sender
publishes). The receive kernels wait for the same flag word, with the same bounded acquire wait.

No quiet and no fence on any steady-state path (docs/multinode.md, "Staging reuse by causality"):

- order: the program that puts a peer's rows issues that peer's signal, after them. NVSHMEM's IBGDA
  posts every call of one CTA to one PE on one RC queue pair (``ibgda_get_rc``: the pair is a function of
  the PE and the CTA, with one NIC per PE), which executes in order; NVSHMEM's own ``putmem_signal``
  relies on the same (its data writes, then the signal's atomic, on one pair, no fence). A ``fence``
  would be no cheaper than a quiet: IBGDA's polls the completions of every queue pair
  (``nvshmemi_ibgda_fence``), a dead peer's included, which is fatal (docs/faults.md);
- reuse: a staging buffer is rewritten only once a completed receive proves the NIC read it. Each
  channel's staging has two zones, ``call % 2`` as its landing zones: zone z is written again by send
  N + 2, which runs after this rank's receive N + 1, which saw every live put peer's flag N + 1; a peer
  publishes that only in its send N + 1, after its receive N, which saw our flag N, which its NIC
  carried after our puts from zone z (same queue pair, in order). ``STAGE_ZONE`` below names it.

``signal_op`` is issued by one thread per program (``nvshmem_device.py``).

Kernels take ``PUT: tl.constexpr``: False when no peer of the group uses puts, which compiles the put
path out (no NVSHMEM call in the module, no bitcode needed); True links NVSHMEM's bitcode.
Destinations of puts are *local* symmetric addresses (this rank's own copy; NVSHMEM finds the peer's).
"""

import triton
import triton.language as tl

from .. import protocol
from .nvshmem_device import SIGNAL_SET, fence_system, putmem_nbi_block, putmem_signal_nbi_block, signal_op
from .sync import publish

TRANSPORT_PUT = tl.constexpr(protocol.TRANSPORT_PUT)
STATE_WORDS = tl.constexpr(protocol.STATE_WORDS)


@triton.jit
def stage_zone(stage_ptr, zone, zone_elems):
    """``STAGE_ZONE``: the staging zone of call ``zone`` (= call % 2) of a channel whose staging is
    [2, zone_elems] elements. The one place each send kernel relies on staging reuse by causality (the
    module docstring): nothing but this zone's own send writes it, and its send N + 2 only after the
    receive N + 1 of the channel."""
    return stage_ptr + zone.to(tl.int64) * zone_elems


@triton.jit
def put_peers(grp, peers, mask, WORLD: tl.constexpr, PUT: tl.constexpr):
    """int1 shaped like ``peers`` (scalar or vector): True where that peer is reached by puts (lanes
    where ``mask``); all False when PUT is off."""
    if PUT:
        return tl.load(grp + STATE_WORDS + 2 * WORLD + peers, mask=mask, other=0) == TRANSPORT_PUT
    else:
        return peers != peers


@triton.jit
def dest(put, stage_addr, store_addr, PUT: tl.constexpr):
    """Where the stores for a peer go: ``stage_addr`` (this rank's staging) where ``put``, else
    ``store_addr`` (the peer's memory). Without PUT the staging is not even computed."""
    if PUT:
        return tl.where(put, stage_addr, store_addr)
    else:
        return store_addr


@triton.jit
def store_only(put, mask, PUT: tl.constexpr):
    """``mask`` without the peers reached by puts (the lanes a store-path publish serves)."""
    if PUT:
        return tl.where(put, False, mask)
    else:
        return mask


@triton.jit
def flush(dst_sym, src, nbytes, ctrl_sym, ctrl_src, ctrl_bytes, flag_sym, flag, pe):
    """Put path's publish to rank ``pe`` (scalar arguments, called by every thread of the program):
    ``nbytes`` staged bytes at ``src`` to ``dst_sym``, then ``ctrl_bytes`` staged control bytes to
    ``ctrl_sym`` with ``flag`` set at ``flag_sym`` as the put's signal. The staged bytes of every program
    of the launch must be visible: call after ``sync.arrive`` made this the last program. No fence: the
    rows and the signal go from this program to ``pe`` on one queue pair, in order; nothing waits (the
    staging is reused by causality, the module docstring)."""
    tl.debug_barrier()   # this program's own staging stores, before the put reads them
    if nbytes > 0:
        putmem_nbi_block(dst_sym, src, nbytes, pe)
    if ctrl_bytes > 0:
        putmem_signal_nbi_block(ctrl_sym, ctrl_src, ctrl_bytes, flag_sym, flag, SIGNAL_SET, pe)
    else:
        signal_op(flag_sym, flag, SIGNAL_SET, pe)


@triton.jit
def deliver(flag_ptr, flag, put, dst_sym, src, nbytes, ctrl_sym, ctrl_src, ctrl_bytes, flag_sym, pe,
            PUT: tl.constexpr):
    """Publish ``flag`` for rank ``pe`` (one peer, scalar arguments): store transport, a release at
    ``flag_ptr`` in the peer's memory (``sync.publish``); put transport (``put``), ``flush`` of the
    staged rows and control words with the flag as the signal."""
    if PUT:
        if put:
            flush(dst_sym, src, nbytes, ctrl_sym, ctrl_src, ctrl_bytes, flag_sym, flag, pe)
        else:
            publish(flag_ptr, flag)
    else:
        publish(flag_ptr, flag)


@triton.jit
def order_transports(grp, live, WORLD: tl.constexpr, WORLD_P2: tl.constexpr, PUT: tl.constexpr):
    """Before the flags of a launch: when it reaches some ``live`` peer ([WORLD_P2]) by stores and some
    by puts, a system-scope fence, so that the stores and the staging the puts read are ordered before
    every flag, whichever transport carries it (the multi-node hang DeepEP fixed in its PR #715).
    Nothing without PUT, or when every live peer uses one transport."""
    if PUT:
        put = put_peers(grp, tl.arange(0, WORLD_P2), live, WORLD, PUT)
        n_put = tl.sum(put.to(tl.int32))
        if (n_put > 0) & (n_put < tl.sum(live.to(tl.int32))):
            fence_system()
