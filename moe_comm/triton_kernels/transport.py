"""The put transport inside the send kernels: one code path, the transport chosen per peer.

Every send kernel computes, per peer, the base address its stores go to. For a peer reached by stores
(``TRANSPORT_STORE`` in the group state's transports section) that is the peer's landing zone, as
before. For a peer reached by puts (``TRANSPORT_PUT``) it is this rank's *staging* copy of exactly the
region the rank would have written on that peer (same row layout), so the row-building code is the same
for both. Where a store-path kernel publishes the flag, the put path instead calls ``flush`` (below):
the staged rows go to the peer's landing zone in one ``putmem_nbi``, NVSHMEM ``fence`` orders them
before the staged control words, which travel in a ``putmem_signal_nbi`` whose signal *is* the flag
(``SIGNAL_SET`` of the same value a store-path sender publishes). The receive kernels wait for the same
flag word, with the same bounded acquire wait. One ``drain`` (``quiet``) per send launch, after the
flushes to every peer, by the launch's last program: the staging is rewritten by the channel's next
send, so its puts must have read it by then; nothing else waits for a put (docs/faults.md: a quiet
to a dead peer ends only when the NIC gives up, and NVSHMEM then aborts). The EP ops pack what they put (only the routed rows,
one run per peer: ``dispatch.py``, ``combine.py``), so their receives read a put peer's rows by the
put layout. ``signal_op``, ``fence`` and ``quiet`` are issued by one thread per program
(``nvshmem_device.py``).

Kernels take ``PUT: tl.constexpr``: False when no peer of the group uses puts, which compiles the put
path out (no NVSHMEM call in the module, no bitcode needed); True links NVSHMEM's bitcode.
Destinations of puts are *local* symmetric addresses (this rank's own copy; NVSHMEM finds the peer's).
"""

import triton
import triton.language as tl

from .. import protocol
from .nvshmem_device import SIGNAL_SET, fence, fence_system, putmem_nbi_block, putmem_signal_nbi_block, quiet, signal_op
from .sync import publish

TRANSPORT_PUT = tl.constexpr(protocol.TRANSPORT_PUT)
STATE_WORDS = tl.constexpr(protocol.STATE_WORDS)


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
    of the launch must be visible: call after ``sync.arrive`` made this the last program. Nothing waits
    here: flush every peer, then ``drain`` once (the staging may be reused after it), so the puts to
    all peers are in flight together."""
    tl.debug_barrier()   # this program's own staging stores, before the put reads them
    if nbytes > 0:
        putmem_nbi_block(dst_sym, src, nbytes, pe)
        fence()          # the rows reach pe before the control words and the signal
    if ctrl_bytes > 0:
        putmem_signal_nbi_block(ctrl_sym, ctrl_src, ctrl_bytes, flag_sym, flag, SIGNAL_SET, pe)
    else:
        signal_op(flag_sym, flag, SIGNAL_SET, pe)


@triton.jit
def deliver(flag_ptr, flag, put, dst_sym, src, nbytes, ctrl_sym, ctrl_src, ctrl_bytes, flag_sym, pe,
            PUT: tl.constexpr):
    """Publish ``flag`` for rank ``pe`` (one peer, scalar arguments): store transport, a release at
    ``flag_ptr`` in the peer's memory (``sync.publish``); put transport (``put``), ``flush`` of the
    staged rows and control words with the flag as the signal (the launch ``drain``s once, after every
    peer's)."""
    if PUT:
        if put:
            flush(dst_sym, src, nbytes, ctrl_sym, ctrl_src, ctrl_bytes, flag_sym, flag, pe)
        else:
            publish(flag_ptr, flag)
    else:
        publish(flag_ptr, flag)


@triton.jit
def drain():
    """Complete every put this rank issued (``quiet``: NVSHMEM waits on every queue pair, whichever
    program posted to it). Once per send launch, after its last flush: the staging may be rewritten
    after it."""
    quiet()


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
