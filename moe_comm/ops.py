"""moe-comm as PyTorch custom ops (``torch.ops.moe_comm.*``), for model code under torch.compile.

``torch.compile(fullgraph=True)`` cannot trace into a Python object such as an EPBuffer, and it must
not treat a communication call as a pure function (it would drop or reorder it). So the ops here are
opaque custom ops with fake (meta) implementations and mutation annotations:

- every op writes its results into output tensors it declares as mutated (``Tensor(a!)``), so it is
  never dead-code-eliminated, calls on the same outputs keep their order, and inductor plans the
  output memory itself (static shapes, no host sync: CUDA graphs can capture the calls);
- the communication object is passed as an int id from ``register(obj)``; the DispatchResult /
  A2AResult ``handle`` (a Python object) stays in this module, queued per object: each forward call
  (dispatch, alltoallv) appends its handle, each reverse call (combine) takes the oldest one. So
  reverse calls must come in the order of their forward calls, as with the eager API.

The wrappers below (``dispatch``, ``combine``, ``alltoallv``, ``alltoallv_combine``) allocate the outputs
(shapes are static, from the object's configuration) and call the ops; use them in model code::

    ep = moe_comm.EPBuffer(group, num_experts, hidden, max_tokens_per_rank, topk)
    ep_id = moe_comm.ops.register(ep)

    @torch.compile(fullgraph=True)
    def moe(x, topk_idx, topk_weights):
        d = moe_comm.ops.dispatch(ep_id, x, topk_idx)
        expert_out = experts(d.x, d.counts)          # [E_local, world*max_tokens_per_rank, hidden]
        return moe_comm.ops.combine(ep_id, expert_out, topk_weights)

Cost: the eager ``EPBuffer.dispatch`` returns its internal receive buffers; the op copies them into its
own outputs (a compiled graph may reuse an op's output memory, which must not be the library's
buffer), i.e. one device copy of [E_local, world*max_tokens_per_rank, hidden]. ``combine`` writes
straight into its output (no copy). Use the eager API where that copy matters and the region is not
compiled (vLLM, for one, runs its MoE layer as an opaque op and uses EPBuffer directly).
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .triton_kernels.copy_rows import copy_valid_rows

__all__ = ["DispatchOutput", "alltoallv", "alltoallv_combine", "combine", "dispatch", "register",
           "unregister"]


# ---- registry of live communication objects ----------------------------------------------------

@dataclass(frozen=True)
class EPSpec:
    """Static output shapes of one EPBuffer's dispatch (what the fake implementations return)."""

    device: torch.device
    local_experts: int        # E_local = num_experts // world_size
    capacity: int             # world_size * max_tokens_per_rank: rows per local expert
    hidden: int
    recv_dtype: torch.dtype   # dtype of the dispatched x: the buffer's dtype, or float8_e4m3fn with fp8
    scale_cols: int           # scale words per row with fp8_dispatch (hidden // 128, or // 512 packed UE8M0), else 0
    scale_dtype: torch.dtype  # float32, or int32 (packed UE8M0 scales)
    out_dtype: torch.dtype    # dtype of x given to dispatch and of combine's result


@dataclass(frozen=True)
class A2ASpec:
    """Static output shapes of one AllToAllvDynamic."""

    device: torch.device
    world_size: int
    max_rows_per_peer: int
    row_shape: tuple
    dtype: torch.dtype


_OBJECTS: dict[int, object] = {}
_SPECS: dict[int, EPSpec | A2ASpec] = {}
_HANDLES: dict[int, collections.deque] = {}
_NEXT_ID = itertools.count(1)


def _spec_of(obj) -> EPSpec | A2ASpec:
    group = obj.group
    if hasattr(obj, "max_rows_per_peer"):  # AllToAllvDynamic
        return A2ASpec(group.device, group.world_size, int(obj.max_rows_per_peer), tuple(obj.row_shape),
                       obj.dtype)
    if hasattr(obj, "num_experts") and hasattr(obj, "max_tokens_per_rank"):  # EPBuffer
        world, fp8, p = group.world_size, bool(obj.fp8_dispatch), obj.plan
        return EPSpec(group.device, int(obj.num_experts) // world, world * int(obj.max_tokens_per_rank),
                      int(obj.hidden), torch.float8_e4m3fn if fp8 else obj.dtype, p.scale_words, p.scale_dtype,
                      obj.dtype)
    raise TypeError(f"register() takes an EPBuffer or an AllToAllvDynamic, got {type(obj).__name__}")


def register(obj) -> int:
    """Make ``obj`` (an EPBuffer or AllToAllvDynamic) callable from the ops; returns its int id.

    The registry holds a reference to ``obj`` until ``unregister(id)``.
    """
    spec = _spec_of(obj)
    obj_id = next(_NEXT_ID)
    _OBJECTS[obj_id], _SPECS[obj_id], _HANDLES[obj_id] = obj, spec, collections.deque()
    return obj_id


def unregister(obj_id: int) -> None:
    """Drop the registry's reference to the object (and any handles still queued for it)."""
    for table in (_OBJECTS, _SPECS, _HANDLES):
        table.pop(obj_id, None)


def _lookup(obj_id: int, kind: type):
    spec = _SPECS.get(obj_id)
    if not isinstance(spec, kind):
        what = "EPBuffer" if kind is EPSpec else "AllToAllvDynamic"
        raise ValueError(f"moe_comm.ops: id {obj_id} is not a registered {what} (see moe_comm.ops.register)")
    return _OBJECTS[obj_id], spec


def _take_handle(obj_id: int, op: str):
    queue = _HANDLES[obj_id]
    if not queue:
        raise RuntimeError(f"moe_comm.ops.{op}: no forward call is waiting for its reverse on id {obj_id} "
                           "(each combine needs an earlier dispatch / alltoallv on the same object)")
    return queue.popleft()


# ---- EPBuffer: dispatch / combine ----------------------------------------------------------------

@torch.library.custom_op("moe_comm::ep_dispatch",
                         mutates_args=("recv_x", "recv_scales", "recv_counts", "recv_src"))
def _ep_dispatch(buffer_id: int, x: torch.Tensor | None, topk_idx: torch.Tensor | None,
                 recv_x: torch.Tensor, recv_scales: torch.Tensor, recv_counts: torch.Tensor,
                 recv_src: torch.Tensor, phase: str) -> None:
    ep, spec = _lookup(buffer_id, EPSpec)
    d = ep.dispatch(x, topk_idx, phase=phase)
    if d is None:  # phase="send": results come with the matching phase="recv"
        return
    _HANDLES[buffer_id].append(d.handle)
    # Only the valid rows (counts on the device): rows past a count are unspecified in the op's contract.
    copy_valid_rows(d.x, recv_x, d.counts)
    if spec.scale_cols:
        copy_valid_rows(d.scales, recv_scales, d.counts)
    copy_valid_rows(d.src, recv_src, d.counts)
    recv_counts.copy_(d.counts)


@_ep_dispatch.register_fake
def _(buffer_id, x, topk_idx, recv_x, recv_scales, recv_counts, recv_src, phase):
    return None


@torch.library.custom_op("moe_comm::ep_combine", mutates_args=("out",))
def _ep_combine(buffer_id: int, expert_out: torch.Tensor | None, topk_weights: torch.Tensor | None,
                out: torch.Tensor, phase: str) -> None:
    ep, _ = _lookup(buffer_id, EPSpec)
    handle = _take_handle(buffer_id, "combine") if phase != "recv" else None
    ep.combine(expert_out, topk_weights, handle, out=out, phase=phase)


@_ep_combine.register_fake
def _(buffer_id, expert_out, topk_weights, out, phase):
    return None


class DispatchOutput(NamedTuple):
    """What ``dispatch`` returns (the op's own tensors; valid until you overwrite them).

    x       [E_local, world*max_tokens_per_rank, hidden] dtype (float8_e4m3fn with fp8_dispatch)
    scales  with fp8_dispatch [E_local, world*max_tokens_per_rank, hidden//128] float32, or hidden//512 int32
            packed UE8M0 ("e4m3-ue8m0"; EPBuffer's DispatchResult), else None
    counts  int32 [E_local]: rows x[e, :counts[e]] are valid, sorted by (source rank, token index)
    src     int32 [E_local, world*max_tokens_per_rank]: source_rank*max_tokens_per_rank + token_index
    Rows past a count are unspecified.
    """

    x: torch.Tensor
    scales: torch.Tensor | None
    counts: torch.Tensor
    src: torch.Tensor


def dispatch(buffer_id: int, x: torch.Tensor | None, topk_idx: torch.Tensor | None, *,
             out: DispatchOutput | None = None, phase: str = "both") -> DispatchOutput:
    """``EPBuffer.dispatch`` as an op. x [T, hidden], topk_idx [T, topk] int32/int64 (-1 = unrouted).

    ``out``: tensors to write into (e.g. a previous DispatchOutput, for static addresses); allocated
    when None. With ``phase="send"`` nothing is written yet: pass the same ``out`` to the matching
    ``phase="recv"`` call (loopback groups are driven that way), which also orders the two calls.
    """
    _, spec = _lookup(buffer_id, EPSpec)
    if out is None:
        rows = (spec.local_experts, spec.capacity)
        dev = spec.device
        out = DispatchOutput(torch.empty((*rows, spec.hidden), dtype=spec.recv_dtype, device=dev),
                             torch.empty((*rows, spec.scale_cols), dtype=spec.scale_dtype, device=dev),
                             torch.empty(spec.local_experts, dtype=torch.int32, device=dev),
                             torch.empty(rows, dtype=torch.int32, device=dev))
    scales = out.scales if out.scales is not None else torch.empty(
        (spec.local_experts, spec.capacity, 0), dtype=spec.scale_dtype, device=spec.device)
    torch.ops.moe_comm.ep_dispatch(buffer_id, x, topk_idx, out.x, scales, out.counts, out.src, phase)
    return DispatchOutput(out.x, scales if spec.scale_cols else None, out.counts, out.src)


def combine(buffer_id: int, expert_out: torch.Tensor | None, topk_weights: torch.Tensor | None, *,
            out: torch.Tensor | None = None, num_tokens: int | None = None,
            phase: str = "both") -> torch.Tensor:
    """``EPBuffer.combine`` as an op; uses the handle of the oldest dispatch not yet combined.

    expert_out [E_local, world*max_tokens_per_rank, hidden]; topk_weights [T, topk] (the dispatch's T).
    Returns ``out`` [T, hidden] (allocated when None, T taken from topk_weights or ``num_tokens``):
    out[t] = sum over routed k of topk_weights[t, k] * expert_out[row of (t, k)].
    """
    _, spec = _lookup(buffer_id, EPSpec)
    if out is None:
        rows = topk_weights.shape[0] if num_tokens is None else num_tokens
        out = torch.empty((rows, spec.hidden), dtype=spec.out_dtype, device=spec.device)
    torch.ops.moe_comm.ep_combine(buffer_id, expert_out, topk_weights, out, phase)
    return out


# ---- AllToAllvDynamic ----------------------------------------------------------------------------

@torch.library.custom_op("moe_comm::alltoallv", mutates_args=("recv", "recv_counts"))
def _alltoallv(a2a_id: int, send: torch.Tensor | None, send_counts: torch.Tensor | None,
               recv: torch.Tensor, recv_counts: torch.Tensor, phase: str) -> None:
    a2a, _ = _lookup(a2a_id, A2ASpec)
    if phase == "recv":
        res = a2a(phase="recv")
    else:
        res = a2a(send, send_counts, phase=phase)
    if res is None:
        return
    _HANDLES[a2a_id].append(res.handle)
    recv.copy_(res.recv)
    recv_counts.copy_(res.recv_counts)


@_alltoallv.register_fake
def _(a2a_id, send, send_counts, recv, recv_counts, phase):
    return None


@torch.library.custom_op("moe_comm::alltoallv_combine", mutates_args=("out",))
def _alltoallv_combine(a2a_id: int, rows: torch.Tensor | None, out: torch.Tensor, phase: str) -> None:
    a2a, _ = _lookup(a2a_id, A2ASpec)
    if phase == "recv":
        back = a2a.combine(phase="recv")
    else:
        back = a2a.combine(rows, _take_handle(a2a_id, "alltoallv_combine"), phase=phase)
    if back is not None:
        out.copy_(back)


@_alltoallv_combine.register_fake
def _(a2a_id, rows, out, phase):
    return None


def alltoallv(a2a_id: int, send: torch.Tensor | None, send_counts: torch.Tensor | None, *,
              out: tuple[torch.Tensor, torch.Tensor] | None = None,
              phase: str = "both") -> tuple[torch.Tensor, torch.Tensor]:
    """``AllToAllvDynamic.__call__`` as an op -> (recv, recv_counts).

    send [N, *row_shape], rows grouped by destination rank; send_counts int32/int64 [world].
    recv [world, max_rows_per_peer, *row_shape]: recv[i, :recv_counts[i]] = rank i's rows, in order;
    recv_counts int32 [world]. ``out``/``phase`` as in ``dispatch``.
    """
    _, spec = _lookup(a2a_id, A2ASpec)
    if out is None:
        out = (torch.empty((spec.world_size, spec.max_rows_per_peer, *spec.row_shape), dtype=spec.dtype,
                           device=spec.device),
               torch.empty(spec.world_size, dtype=torch.int32, device=spec.device))
    torch.ops.moe_comm.alltoallv(a2a_id, send, send_counts, out[0], out[1], phase)
    return out[0], out[1]


def alltoallv_combine(a2a_id: int, rows: torch.Tensor | None, *, num_rows: int | None = None,
                      out: torch.Tensor | None = None, phase: str = "both") -> torch.Tensor:
    """``AllToAllvDynamic.combine`` as an op, with the handle of the oldest forward not yet combined.

    rows [world, max_rows_per_peer, *row_shape]. Returns ``out`` [N, *row_shape] (N = the forward's
    number of send rows; give ``num_rows`` or ``out``): rows go back to the positions they were sent
    from; rows the forward did not send are unspecified.
    """
    _, spec = _lookup(a2a_id, A2ASpec)
    if out is None:
        if num_rows is None:
            raise ValueError("alltoallv_combine needs num_rows (the forward's N) or out")
        out = torch.empty((num_rows, *spec.row_shape), dtype=spec.dtype, device=spec.device)
    torch.ops.moe_comm.alltoallv_combine(a2a_id, rows, out, phase)
    return out
