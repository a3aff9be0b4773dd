"""The put transport inside the send kernels: one code path, the transport chosen per peer.

Every send kernel computes, per peer, the base address its stores go to. For a peer reached by stores
(``TRANSPORT_STORE`` in the group state's transports section) that is the peer's landing zone, as
before. For a peer reached by puts (``TRANSPORT_PUT``) it is this rank's *staging* copy of exactly the
region the rank would have written on that peer (same row layout), so the row-building code is the same
for both. Where a store-path kernel publishes the flag, the put path instead calls ``flush`` (below):
the staged rows go to the peer's landing zone in one ``putmem_nbi``, NVSHMEM ``fence`` orders them
before the staged control words, which travel in a ``putmem_signal_nbi`` whose signal *is* the flag
(``SIGNAL_SET`` of the same value a store-path sender publishes). The receive kernels do not change:
they wait for the same flag word, with the same bounded acquire wait, and read the same layout.

Kernels take ``PUT: tl.constexpr``: False when no peer of the group uses puts, which compiles the put
path out (no NVSHMEM call in the module, no bitcode needed); True links NVSHMEM's bitcode.
Destinations of puts are *local* symmetric addresses (this rank's own copy; NVSHMEM finds the peer's).
"""

import triton
import triton.language as tl

from .. import protocol
from .nvshmem_device import SIGNAL_SET, fence, putmem_nbi_block, putmem_signal_nbi_block, quiet, signal_op
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
    fence()              # the rows reach pe before the control words and the signal
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
            drain()
        else:
            publish(flag_ptr, flag)
    else:
        publish(flag_ptr, flag)


@triton.jit
def put_rows(dst_sym, src, nbytes, pe):
    """Put one run of staged rows now (scalar arguments, every thread of the program); ``drain`` before
    the program counts itself in, so the last program's signal follows every program's rows."""
    tl.debug_barrier()
    putmem_nbi_block(dst_sym, src, nbytes, pe)


@triton.jit
def drain():
    """Complete this program's puts (``quiet``)."""
    quiet()


@triton.jit
def signal_only(flag_sym, flag, pe):
    """Deliver ``flag`` to rank ``pe``'s ``flag_sym``. Call after a ``drain`` that completed the puts
    it must follow (then no fence is needed), for every peer, then ``drain`` once."""
    signal_op(flag_sym, flag, SIGNAL_SET, pe)
