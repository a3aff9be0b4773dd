"""NVSHMEM device calls for Triton kernels, from stock Triton (no fork, no C++ extension).

Each function below is ``@triton.jit``-callable from a kernel. Compiled, it is a call into NVSHMEM's
device bitcode (``libnvshmem_device*.bc``, linked by launching with ``extern_libs``; see
``nvshmem_bitcode.py`` for finding it, the version check and the module-init hook). Every address is
passed as an int64 (Triton 3.6's extern signatures cannot name pointer types): pass a pointer or an
int64, the functions convert. Destinations are *local* symmetric addresses; NVSHMEM finds rank ``pe``'s
copy.

The ``*_block`` calls are collective over the calling program (CTA): every thread must make the same
call with the same arguments, so call them with scalar arguments only, from code every thread of the
program runs (uniform branches). ``signal_op``, ``fence`` and ``quiet`` are too (same rule), but one
thread of the program issues them, after a CTA barrier (on IBGDA each is a network operation; issued by
every thread it would be sent once per thread); ``quiet`` ends with a CTA barrier, so no thread of the
program goes on before the program's puts are complete.

Interpreted twin (CPU tests, ``moe_comm/interpreter.py``): the same functions run as plain memory
operations in this process: a put is a byte copy into the peer's copy (found through
``moe_comm/heap/peer_map.py``, as NVSHMEM would find it), a signal is a release store / atomic add on
the peer's word, ``fence`` and ``quiet`` have nothing to wait for there. A peer on another emulated node
(``MOE_COMM_RANKS_PER_NODE``) is not mapped: its puts and signals are posted to the wire
(``moe_comm/heap/wire.py``), whose emulated NIC reads a put's source later and sends it to a proxy in the
receiving process; ``quiet`` (and, with the IBGDA model, ``fence``) waits until they are delivered, or
ends the process when the emulated NIC gives up on one (a dead receiver), as NVSHMEM does. The kernels
call neither on a steady-state path (``transport.py``). So CPU tests run the put transport's protocol (the
order of payload, counts and signal, and which program issues each: ``_order``) through the very calls
the compiled kernels make; they cannot show RDMA timing.
"""

import ctypes
import time

import triton
import triton.language as tl
from triton.language import core

from moe_comm.heap import peer_map  # absolute: the interpreted twin must share the real module's table

SIGNAL_SET = tl.constexpr(9)    # NVSHMEM_SIGNAL_SET (nvshmem_common_transport.h)
SIGNAL_ADD = tl.constexpr(10)   # NVSHMEM_SIGNAL_ADD
CMP_EQ = tl.constexpr(0)        # NVSHMEM_CMP_EQ (nvshmem_constants.h)
CMP_GE = tl.constexpr(5)        # NVSHMEM_CMP_GE

# The C functions called, in the order of the public functions below (the compile check reads this).
C_FUNCTIONS = ("nvshmemx_putmem_nbi_block", "nvshmemx_putmem_signal_nbi_block", "nvshmemx_signal_op",
               "nvshmem_signal_wait_until", "nvshmem_quiet", "nvshmem_fence", "nvshmem_ptr",
               "nvshmem_uint64_atomic_add", "nvshmem_int64_p")

INTERPRET = bool(triton.knobs.runtime.interpret)   # see sync.py: decided when the module is imported

_I64, _U64, _I32 = core.dtype("int64"), core.dtype("uint64"), core.dtype("int32")


def _extern(name, args, types, ret, _semantic):
    return core.extern_elementwise("", "", args, {tuple(types): (name, ret)}, is_pure=False, _semantic=_semantic)


# ---- compiled: calls into the NVSHMEM device library (void functions are declared as returning i32) ----
@core.extern
def _putmem_nbi_block(dest, src, nbytes, pe, _semantic=None):
    return _extern("nvshmemx_putmem_nbi_block", [dest, src, nbytes, pe], [_I64, _I64, _I64, _I32], _I32, _semantic)


@core.extern
def _putmem_signal_nbi_block(dest, src, nbytes, sig, value, op, pe, _semantic=None):
    return _extern("nvshmemx_putmem_signal_nbi_block", [dest, src, nbytes, sig, value, op, pe],
                   [_I64, _I64, _I64, _I64, _U64, _I32, _I32], _I32, _semantic)


@core.extern
def _signal_op(sig, value, op, pe, _semantic=None):
    return _extern("nvshmemx_signal_op", [sig, value, op, pe], [_I64, _U64, _I32, _I32], _I32, _semantic)


@core.extern
def _signal_wait_until(sig, cmp, value, _semantic=None):
    return _extern("nvshmem_signal_wait_until", [sig, cmp, value], [_I64, _I32, _U64], _U64, _semantic)


@core.extern
def _quiet(_semantic=None):
    return _extern("nvshmem_quiet", [], [], _I32, _semantic)


@core.extern
def _fence(_semantic=None):
    return _extern("nvshmem_fence", [], [], _I32, _semantic)


@core.extern
def _ptr(dest, pe, _semantic=None):
    return _extern("nvshmem_ptr", [dest, pe], [_I64, _I32], _I64, _semantic)


@core.extern
def _uint64_atomic_add(dest, value, pe, _semantic=None):
    return _extern("nvshmem_uint64_atomic_add", [dest, value, pe], [_I64, _U64, _I32], _I32, _semantic)


@core.extern
def _int64_p(dest, value, pe, _semantic=None):
    return _extern("nvshmem_int64_p", [dest, value, pe], [_I64, _I64, _I32], _I32, _semantic)


@triton.jit
def _i64(x):
    """int64 of a pointer, an integer tensor or a Python int (extern arguments)."""
    return tl.cast(x, tl.int64)


@triton.jit
def _u64(x):
    return tl.cast(x, tl.uint64)


@triton.jit
def _i32(x):
    return tl.cast(x, tl.int32)


# ---- interpreted twin: plain memory operations in this process -------------------------------------
def _int(x) -> int:
    """A Python int from an interpreted scalar (tl.tensor over a NumPy array), a pointer or an int."""
    h = getattr(x, "handle", None)
    if h is not None:
        return int(h.data.reshape(-1)[0])
    return int(getattr(x, "value", x))   # a constexpr, or a plain int


def _order(event: str, pe, program=None) -> None:
    """Interpreted calls report here, in program order: "put", "put_signal" (then its "signal"),
    "signal", "fence", "quiet", "fence_system" with the target rank (-1 for the last three) and the
    program ((x, y, z) grid index) that issued it. Nothing by default; a test records them to check the
    put path's order (the interpreter cannot reorder, so the order of the calls, and which program made
    each, is what can be checked on the CPU)."""


def _report(event: str, pe) -> None:
    from triton.runtime.interpreter import interpreter_builder  # noqa: PLC0415
    _order(event, pe, interpreter_builder.grid_idx)


def _copy_to_peer(dest, src, nbytes, pe):
    n = _int(nbytes)
    if n > 0:
        far = peer_map.remote(_int(dest), _int(pe))
        if far is None:
            ctypes.memmove(peer_map.peer_address(_int(dest), _int(pe)), _int(src), n)
        else:   # another emulated node: a message on the wire (moe_comm/heap/wire.py), read by its NIC later
            wire, index, offset = far
            wire.put(_int(pe), index, offset, _int(src), n, keep=peer_map.owner(_int(src)))


def _signal_far(sig, value, add, pe) -> bool:
    """Deliver a signal (set, or add) to rank ``pe`` on another emulated node; False if ``pe`` is mapped
    here (the caller stores)."""
    far = peer_map.remote(_int(sig), _int(pe))
    if far is None:
        return False
    wire, index, offset = far
    wire.signal(_int(pe), index, offset, _int(value), add)
    return True


def _quiet_wires() -> None:
    for wire in list(peer_map.wires):
        wire.quiet()


def _fence_wires() -> None:
    for wire in list(peer_map.wires):
        wire.fence()


if INTERPRET:
    @triton.jit
    def _peer_word(sig, pe):
        return tl.full([], peer_map.peer_address(_int(sig), _int(pe)), tl.int64).to(tl.pointer_type(tl.int64))

    @triton.jit
    def putmem_nbi_block(dest, src, nbytes, pe):
        """Put ``nbytes`` bytes from local ``src`` to rank ``pe``'s copy of symmetric ``dest``; returns
        at once (the source must not change until ``quiet``)."""
        _report("put", _int(pe))
        _copy_to_peer(dest, src, nbytes, pe)

    @triton.jit
    def signal_op(sig, value, op, pe):
        """Set (SIGNAL_SET) or add to (SIGNAL_ADD) the uint64 word ``sig`` of rank ``pe`` (release)."""
        _report("signal", _int(pe))
        if not _signal_far(sig, value, _int(op) != SIGNAL_SET.value, pe):
            word = _peer_word(sig, pe)
            if op == SIGNAL_SET:
                tl.atomic_xchg(word, tl.cast(value, tl.int64), sem="release", scope="sys")
            else:
                tl.atomic_add(word, tl.cast(value, tl.int64), sem="release", scope="sys")

    @triton.jit
    def putmem_signal_nbi_block(dest, src, nbytes, sig, value, op, pe):
        """``putmem_nbi_block``, then ``signal_op`` on rank ``pe``'s ``sig``, which is delivered after
        the data (a receiver that sees the signal sees the bytes)."""
        _report("put_signal", _int(pe))
        _copy_to_peer(dest, src, nbytes, pe)
        signal_op(sig, value, op, pe)

    @triton.jit
    def signal_wait_until(sig, cmp, value):
        """Wait (unbounded, as NVSHMEM's) until local word ``sig`` compares to ``value`` (CMP_EQ or
        CMP_GE); returns the word. The kernels wait with the bounded ``sync.wait_flag`` instead."""
        word = tl.cast(sig, tl.int64).to(tl.pointer_type(tl.int64))
        v = tl.atomic_add(word, 0, sem="acquire", scope="sys")
        while (v != value) & ((cmp != CMP_GE) | (v < value)):
            time.sleep(0.0002)
            v = tl.atomic_add(word, 0, sem="acquire", scope="sys")
        return v

    @triton.jit
    def quiet():
        """Complete every put this rank issued (interpreted puts to mapped peers are complete already;
        puts on the wire to another emulated node are delivered by then, or the emulated NIC gave up on
        one and the process ended, as NVSHMEM's quiet does: ``heap/wire.py``)."""
        _report("quiet", -1)
        _quiet_wires()

    @triton.jit
    def fence():
        """Order this thread's earlier puts to each rank before its later ones (interpreted: in order; on
        another emulated node the wire's fence, which with IBGDA waits as a quiet does: ``heap/wire.py``)."""
        _report("fence", -1)
        _fence_wires()

    @triton.jit
    def fence_system():
        """Order every store and put of this program before its later ones, at system scope (not an
        NVSHMEM call; interpreted: in order, reported as "fence_system")."""
        _report("fence_system", -1)

    @triton.jit
    def ptr(dest, pe):
        """Address, usable by loads and stores here, of rank ``pe``'s copy of symmetric ``dest``; 0 if
        that rank is not load/store reachable (interpreted: another emulated node)."""
        return tl.full([], peer_map.peer_address(_int(dest), _int(pe)), tl.int64)

    @triton.jit
    def uint64_atomic_add(dest, value, pe):
        """Atomically add ``value`` to rank ``pe``'s copy of the symmetric uint64 word ``dest``."""
        if not _signal_far(dest, value, True, pe):
            tl.atomic_add(_peer_word(dest, pe), tl.cast(value, tl.int64), sem="relaxed", scope="sys")

    @triton.jit
    def int64_p(dest, value, pe):
        """Store one int64 ``value`` into rank ``pe``'s copy of symmetric ``dest`` (ordered by ``fence``)."""
        if not _signal_far(dest, value, False, pe):
            tl.store(_peer_word(dest, pe), tl.cast(value, tl.int64))
else:
    @triton.jit
    def putmem_nbi_block(dest, src, nbytes, pe):
        _putmem_nbi_block(_i64(dest), _i64(src), _i64(nbytes), _i32(pe))

    @triton.jit
    def _first_thread():
        # %tid.x: launches are 1-D blocks of num_warps * 32 threads.
        return tl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r", [], dtype=tl.int32, is_pure=True,
                                         pack=1) == 0

    @triton.jit
    def signal_op(sig, value, op, pe):
        tl.debug_barrier()
        if _first_thread():
            _signal_op(_i64(sig), _u64(value), _i32(op), _i32(pe))

    @triton.jit
    def putmem_signal_nbi_block(dest, src, nbytes, sig, value, op, pe):
        _putmem_signal_nbi_block(_i64(dest), _i64(src), _i64(nbytes), _i64(sig), _u64(value), _i32(op), _i32(pe))

    @triton.jit
    def signal_wait_until(sig, cmp, value):
        return _signal_wait_until(_i64(sig), _i32(cmp), _u64(value)).to(tl.int64)

    @triton.jit
    def quiet():
        tl.debug_barrier()
        if _first_thread():
            _quiet()
        tl.debug_barrier()   # no thread goes on (counts itself in, reuses the staging) before it returned

    @triton.jit
    def fence():
        tl.debug_barrier()
        if _first_thread():
            _fence()

    @triton.jit
    def fence_system():
        # fence.sc.sys after a CTA barrier: cumulative, it orders every thread's earlier stores (to mapped
        # peers and to the staging the puts read) before this program's later stores, puts and signals.
        tl.debug_barrier()
        tl.inline_asm_elementwise("fence.sc.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def ptr(dest, pe):
        return _ptr(_i64(dest), _i32(pe))

    @triton.jit
    def uint64_atomic_add(dest, value, pe):
        _uint64_atomic_add(_i64(dest), _u64(value), _i32(pe))

    @triton.jit
    def int64_p(dest, value, pe):
        _int64_p(_i64(dest), _i64(value), _i32(pe))
