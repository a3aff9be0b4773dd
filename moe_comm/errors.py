"""Exceptions raised by moe-comm, and the device error word they are decoded from.

Kernels never raise: they record the first problem they see in a per-rank error word that the host
reads without a device sync (pinned host memory on CUDA, plain memory on CPU). The host turns it into
one of these exceptions at the next ``group.check()`` or the next op call.
"""

from __future__ import annotations


class MoECommError(RuntimeError):
    """Base class of every moe-comm error."""


class CommTimeoutError(MoECommError):
    """A bounded device wait expired: ``rank`` waited for ``peer`` in ``op`` and gave up."""

    def __init__(self, op: str, rank: int, peer: int, timeout_s: float):
        self.op, self.rank, self.peer, self.timeout_s = op, rank, peer, timeout_s
        super().__init__(
            f"{op}: rank {rank} timed out after {timeout_s:g} s waiting for peer rank {peer} "
            f"(peer dead, stuck, or not calling the same op)")


class CapacityError(MoECommError, ValueError):
    """A device count exceeded the capacity the buffers were planned for; the excess was dropped."""

    def __init__(self, op: str, rank: int, peer: int, value: int, capacity: int):
        self.op, self.rank, self.peer, self.value, self.capacity = op, rank, peer, value, capacity
        super().__init__(
            f"{op}: rank {rank}: the count for peer/expert {peer} needs {value} rows, only {capacity} "
            f"are available (capacity, or rows of the input); the excess was neither read nor written")


class InvalidIndexError(MoECommError, ValueError):
    """A device index (e.g. an expert id) was out of range; that slot was not routed."""

    def __init__(self, op: str, rank: int, value: int, bound: int):
        self.op, self.rank, self.value, self.bound = op, rank, value, bound
        super().__init__(
            f"{op}: rank {rank} got index {value}, valid range is [-1, {bound}); that slot was skipped")


class LaunchError(MoECommError):
    """One or more ranks of ``moe_comm.launch`` raised or died.

    ``failures`` maps rank -> description; ``results`` holds every rank's return value (None where it failed).
    """

    def __init__(self, failures: dict[int, str], results: list):
        self.failures, self.results = failures, results
        lines = [f"rank {r}: {msg}" for r, msg in sorted(failures.items())]
        super().__init__("launch failed on rank(s) " + ", ".join(map(str, sorted(failures)))
                         + "\n" + "\n".join(lines))


# ---- error word ---------------------------------------------------------------------------------
# Word layout (int64 [ERR_WORDS]); the first error wins (later ones are dropped, the code stays):
#   [0] code (ERR_*; 0 = no error)   [1] op id (OPS index)   [2] rank that saw it
#   [3] peer rank / expert / slot    [4] offending value     [5] bound or capacity
ERR_WORDS = 8
ERR_NONE, ERR_TIMEOUT, ERR_CAPACITY, ERR_INDEX = 0, 1, 2, 3

# Op ids the kernels record; index = id.
OPS = ("alltoallv", "alltoallv.combine", "dispatch", "combine", "barrier")


def op_id(name: str) -> int:
    return OPS.index(name)


def decode_error(word, timeout_s: float) -> MoECommError | None:
    """Turn a host copy of the error word (sequence of ints) into an exception, or None."""
    code, op, rank, peer, value, bound = (int(v) for v in word[:6])
    if code == ERR_NONE:
        return None
    name = OPS[op] if 0 <= op < len(OPS) else f"op#{op}"
    if code == ERR_TIMEOUT:
        return CommTimeoutError(name, rank, peer, timeout_s)
    if code == ERR_CAPACITY:
        return CapacityError(name, rank, peer, value, bound)
    if code == ERR_INDEX:
        return InvalidIndexError(name, rank, value, bound)
    return MoECommError(f"{name}: rank {rank}: unknown device error code {code}")
