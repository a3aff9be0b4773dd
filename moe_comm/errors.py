"""Exceptions raised by moe-comm, and the device error word they are decoded from.

Kernels never raise: they record the first problem they see in a per-rank error word that the host
reads without a device sync (pinned host memory on CUDA, plain memory on CPU). The host turns it into
one of these exceptions at the next ``group.check()`` or at the end of the next op call.

Two families (the fault model, docs/faults.md):

- ``GroupError`` (CommTimeoutError, CommAbortedError, CommDesyncError, ExcludedError): the group is out
  of step or a peer is gone. Sticky: every later op on every rank raises it until ``group.reset()`` (or
  ``group.exclude()``).
- Data errors (CapacityError, InvalidIndexError, GlobalScaleError): a device value was out of range (or
  an nvfp4 global scale differed between ranks); the op completed on every rank without the offending
  slots/rows (GlobalScaleError: with them, as sent), and the error is raised once, on the rank that found
  it, carrying the result of the call that recorded it (``err.result``).
"""

from __future__ import annotations

import struct


class MoECommError(RuntimeError):
    """Base class of every moe-comm error. For a data error raised at the end of an op call:
    ``result``, the result of the call that recorded it (that op completed; keep using it, e.g. its
    dispatch handle), None if that call cannot be told (the message says so); ``call_result``, the
    result of the call it is raised from (on CUDA usually the next op call: it completed too). Else
    both None."""

    result = None
    call_result = None


class GroupError(MoECommError):
    """A group-wide error: sticky until ``group.reset()`` (or ``group.exclude()``) on every live rank."""


class CommTimeoutError(GroupError):
    """A bounded device wait expired: ``rank`` waited for ``peer`` in ``op`` and gave up."""

    missing: list[int] | None = None   # a recovery meeting (reset, exchange): every rank its decision left out
    expert: int | None = None          # op "combine_ready": the local expert of ``rank`` never signalled ready

    def __init__(self, op: str, rank: int, peer: int, timeout_s: float, expert: int | None = None):
        self.op, self.rank, self.peer, self.timeout_s, self.expert = op, rank, peer, timeout_s, expert
        if expert is not None:
            super().__init__(
                f"{op}: rank {rank} timed out after {timeout_s:g} s waiting for its local expert {expert} to be "
                f"signalled ready (EPBuffer.combine(..., ready=words)): signal every local expert once per "
                f"combine call after its rows of expert_out are written (ReadyWords.signal, or "
                f"ready.signal_expert in your kernel); the group is failed until group.reset()")
            return
        super().__init__(
            f"{op}: rank {rank} timed out after {timeout_s:g} s waiting for peer rank {peer} "
            f"(peer dead, stuck, or not calling the same op); the group is failed until group.reset() "
            f"or group.exclude([{peer}])")


class CommAbortedError(GroupError):
    """``peer`` could not take part in a call of ``op`` (an input error only it saw) and told ``rank``."""

    def __init__(self, op: str, rank: int, peer: int):
        self.op, self.rank, self.peer = op, rank, peer
        super().__init__(
            f"{op}: rank {rank} got an abort from peer rank {peer} for this call (that rank raised an "
            f"input error the others did not); the group is failed until group.reset()")


class CommDesyncError(GroupError):
    """``rank`` saw a flag of a later call from ``peer``: the two are out of step (a skipped call)."""

    def __init__(self, op: str, rank: int, peer: int, got: int, expected: int):
        self.op, self.rank, self.peer, self.got, self.expected = op, rank, peer, got, expected
        super().__init__(
            f"{op}: rank {rank} expected call {expected} from peer rank {peer} but got call {got} (the "
            f"ranks are out of step: one skipped a call); the group is failed until group.reset()")


class ExcludedError(GroupError):
    """This rank was excluded by the other ranks of its group (``group.exclude``): it may not take part."""


class ClosedError(MoECommError):
    """An op or group was used after ``close()``."""


class CapacityError(MoECommError, ValueError):
    """A device count exceeded the capacity the buffers were planned for; the excess was dropped."""

    def __init__(self, op: str, rank: int, peer: int, value: int, capacity: int):
        self.op, self.rank, self.peer, self.value, self.capacity = op, rank, peer, value, capacity
        if op == "deep_ep.dispatch":
            text = (f"DeepEP normal-mode dispatch: rank {rank} received {value} rows, num_worst_tokens is {capacity}; "
                    f"only the first {capacity} were returned (the combine treats the rest as zero rows). Fix: "
                    f"num_worst_tokens >= the most rows a rank can receive (world_size * tokens per rank)")
        elif op.startswith("alltoallv"):
            text = (f"AllToAllvDynamic: rank {rank}: send_counts[{peer}] is {value}, but only {capacity} rows "
                    f"could be sent to rank {peer}; only those were sent. Fix: 0 <= send_counts[j] <= "
                    f"max_rows_per_peer (AllToAllvDynamic(group, max_rows_per_peer, ...)) and "
                    f"sum(send_counts) <= send.shape[0]")
        else:
            text = (f"{op}: rank {rank}: the count for peer/expert {peer} needs {value} rows, only {capacity} "
                    f"are available; the excess was neither read nor written. Fix: an EPBuffer expert holds "
                    f"world * max_tokens_per_rank rows, exceeded only if tokens list the same expert twice")
        super().__init__(text)


class InvalidIndexError(MoECommError, ValueError):
    """A device index (e.g. an expert id) was out of range; that slot was not routed."""

    def __init__(self, op: str, rank: int, value: int, bound: int):
        self.op, self.rank, self.value, self.bound = op, rank, value, bound
        super().__init__(
            f"{op}: rank {rank} got index {value}, valid range is [-1, {bound}); that slot was skipped")


class GlobalScaleError(MoECommError, ValueError):
    """An nvfp4 dispatch got rows from ``peer`` quantized with another global scale than ``rank``'s own:
    ``peer_scale`` and ``own_scale`` (float32 values). The rows were delivered as they are; the receiver
    dequantizes with its own scale, so those rows come out peer_scale / own_scale times their value."""

    def __init__(self, op: str, rank: int, peer: int, peer_scale: float, own_scale: float):
        self.op, self.rank, self.peer, self.peer_scale, self.own_scale = op, rank, peer, peer_scale, own_scale
        super().__init__(
            f"{op}: rank {rank}: rank {peer} quantized its nvfp4 rows with global_scale {peer_scale:g}, this "
            f"rank's is {own_scale:g}; every rank must pass the same global_scale (one dequantization for "
            f"every row of an expert): the layer's calibrated input scale, or 448 * 6 / the max |x| "
            f"all-reduced (MAX) over the ranks. This call's rows from rank {peer} (kept as sent) come out "
            f"{peer_scale / own_scale if own_scale else float('inf'):g} times their value when dequantized "
            f"with this rank's scale")


def f32_of_bits(bits: int) -> float:
    """The float32 whose bit pattern is the low 32 bits of ``bits`` (a device word)."""
    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]


class LaunchError(MoECommError):
    """One or more ranks of ``moe_comm.launch`` raised or died.

    ``failures`` maps rank -> description, in the order the failures were seen (the first is what ended the
    launch); ``results`` holds every rank's return value (None where it failed).
    """

    def __init__(self, failures: dict[int, str], results: list):
        self.failures, self.results = failures, results
        first = next(iter(failures))
        lines = [f"rank {r}: {msg}" for r, msg in failures.items()]
        super().__init__(f"launch failed on rank {first} first: {failures[first].splitlines()[0]}; failed rank(s) "
                         + ", ".join(map(str, sorted(failures))) + "\n" + "\n".join(lines))


def error_kind(err: MoECommError) -> str:
    """Short name of an error's kind, as the metrics label it (``moe_comm.metrics``): timeout, abort,
    desync, excluded, capacity, invalid_index, global_scale, or other."""
    for cls, kind in ((CommTimeoutError, "timeout"), (CommAbortedError, "abort"), (CommDesyncError, "desync"),
                      (ExcludedError, "excluded"), (CapacityError, "capacity"), (InvalidIndexError, "invalid_index"),
                      (GlobalScaleError, "global_scale")):
        if isinstance(err, cls):
            return kind
    return "other"


# ---- error word ---------------------------------------------------------------------------------
# Word layout (int64 [ERR_WORDS]); the first error since the host last released the word wins:
#   [0] code (ERR_*; 0 = no error), written last with a system-scope release
#   [1] op id (OPS index)   [2] rank that saw it   [3] peer rank / expert / slot
#   [4] offending value     [5] bound or capacity  [6] 1 if a later error found the word taken (dropped)
ERR_WORDS = 8
ERR_DROPPED = 6
ERR_NONE, ERR_TIMEOUT, ERR_CAPACITY, ERR_INDEX, ERR_ABORTED, ERR_DESYNC = 0, 1, 2, 3, 4, 5
ERR_SCALE = 6   # data error: a source's nvfp4 global scale (value, its bits) differs from this rank's (bound)
GROUP_CODES = (ERR_TIMEOUT, ERR_ABORTED, ERR_DESYNC)   # group-wide: sticky until reset()

# Op ids the kernels record; index = id.
OPS = ("alltoallv", "alltoallv.combine", "dispatch", "combine", "barrier", "prefill.dispatch", "prefill.combine",
       "deep_ep.dispatch", "combine_ready")
READY_OP = "combine_ready"   # a combine send's wait for a local expert's ready word (peer field: the expert)


def op_id(name: str) -> int:
    return OPS.index(name)


def decode_error(word, timeout_s: float) -> MoECommError | None:
    """Turn a host copy of the error word (sequence of ints) into an exception, or None."""
    code, op, rank, peer, value, bound = (int(v) for v in word[:6])
    if code == ERR_NONE:
        return None
    name = OPS[op] if 0 <= op < len(OPS) else f"op#{op}"
    if code == ERR_TIMEOUT:
        if name == READY_OP:   # this rank waited for its own expert ``peer``: not a peer rank's fault
            return CommTimeoutError(name, rank, rank, timeout_s, expert=peer)
        return CommTimeoutError(name, rank, peer, timeout_s)
    if code == ERR_CAPACITY:
        return CapacityError(name, rank, peer, value, bound)
    if code == ERR_INDEX:
        return InvalidIndexError(name, rank, value, bound)
    if code == ERR_ABORTED:
        return CommAbortedError(name, rank, peer)
    if code == ERR_DESYNC:
        return CommDesyncError(name, rank, peer, value, bound)
    if code == ERR_SCALE:
        return GlobalScaleError(name, rank, peer, f32_of_bits(value), f32_of_bits(bound))
    return MoECommError(f"{name}: rank {rank}: unknown device error code {code}")
