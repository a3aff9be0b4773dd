"""The host side of one op on one rank: phase order, the call between its phases, where errors surface.

Every op (AllToAllvDynamic forward and reverse, dispatch, combine) runs the same state machine:

    idle --send--> pending --recv--> idle            (phase="both" = send then recv in one call)

Rules (the fault model, docs/faults.md):

- Before anything is launched, ``begin(phase)`` refuses an op on a closed group, an unknown phase, a
  phase out of order, or ``phase="both"`` on a multi-rank loopback world. These raise without touching
  any state (lossless): the rank has not joined the call, and the pending one (if any) is kept.
- Inputs of the send phase are validated by ``validate(fn)``. An input error (TypeError/ValueError) is
  raised, but a multi-rank rank first takes part in the call without sending or waiting
  (``Channel.abort``): a rank never skips a call its peers make. If every rank saw the error, nobody
  waits and the group stays usable; a peer that made the call raises CommAbortedError (group-wide).
- Errors recorded by the kernels are raised at the end of an op (``finish``: after the receive phase is
  launched), never before a launch: no rank skips a call because of an error its peers do not see. A
  data error carries the result of the call that recorded it (``CommGroup.attribute_data_error``); a
  group-wide error is sticky until ``group.reset()``.
- Launches: on CUDA every launch of an op (send, receive, abort) waits for its previous launch on this
  rank, whatever streams they are on (``Channel.after_previous``; never across a graph capture boundary).
- Memory across streams: what the send phase leaves for the receive (``sent``/``take``) may have been
  allocated, or given by the caller, on the send's stream and is read or written by the receive's
  kernels on another: the receive records every such tensor for its stream (``record_for_current_stream``)
  before launching, so the caching allocator does not hand its memory to another tensor until the
  receive's work is done (a copy the op made, e.g. the world-1 dispatch's inputs, combine's contiguous
  ``expert_out``, AllToAllvDynamic's reverse output, dies with the call). The op's own buffers live
  until ``close()``, which waits for the last launch (``Channel.free``).
- Input errors of a receive phase (``topk_weights``/``out`` given there) raise before its launch and keep
  the pending call: fix the input and call the receive phase again.
"""

from __future__ import annotations

import torch

from .errors import op_id

PHASES = ("send", "recv", "both")


def record_for_current_stream(items, device) -> None:
    """``Tensor.record_stream`` of the current stream of CUDA ``device`` for every CUDA tensor among
    ``items`` (others are skipped): the caching allocator then reuses such a tensor's memory only after
    the work queued on this stream when the tensor is freed. A no-op for a tensor allocated on this
    stream, or not by the caching allocator; nothing off CUDA."""
    if device.type != "cuda":
        return
    stream = torch.cuda.current_stream(device)
    for t in items:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            t.record_stream(stream)


class PhasedOp:
    """State machine of one op on one rank (``name`` for messages, ``channel`` for abort and ordering)."""

    def __init__(self, group, name: str, channel=None):
        self.group, self.name, self.channel = group, name, channel
        self.pending = None       # what the send phase left for the receive phase; None when idle
        # Device counters of the op that moe_comm.metrics exports, set by the op: "expert_rows" int64
        # [E_local] (slots received per local expert), "excluded_rows" int64 [1] (slots / rows addressed to
        # excluded ranks, not sent). Read without a sync (on CUDA through copies: see moe_comm.metrics).
        self.counters: dict[str, object] = {}
        self._call = None         # the group's record of the call in progress (data error attribution)
        self._closed = False
        group.register(self)

    # ---- phases ----------------------------------------------------------------------------------
    def begin(self, phase: str) -> tuple[bool, bool]:
        """Validate ``phase`` against the call order; returns (run send, run recv). Raises before anything
        is launched."""
        if self._closed:
            from .errors import ClosedError  # noqa: PLC0415
            raise ClosedError(f"{self.name}: used after close()")
        self.group.ensure_open()
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        g = self.group
        if phase == "both" and g.backend == "loopback" and g.world_size > 1:
            raise ValueError("loopback groups hold every rank in one process: call phase='send' on every "
                             "rank, then phase='recv' on every rank (phase='both' would wait for peers "
                             "that have not sent yet)")
        if phase != "recv" and self.pending is not None:
            raise RuntimeError(f"{self.name}: the previous call's phase='recv' has not run yet")
        if phase == "recv" and self.pending is None:
            raise RuntimeError(f"{self.name}: phase='recv' needs a preceding phase='send'")
        return phase != "recv", phase != "send"

    def validate(self, check):
        """Run the send phase's input checks ``check()`` and return its value. On an input error, take
        part in the call by aborting (multi-rank) before raising it."""
        try:
            return check()
        except (TypeError, ValueError):
            if self.channel is not None and self.group.world_size > 1:
                self.channel.abort(op_id(self.name))
            raise

    def before_send(self) -> None:
        if self.channel is not None:
            self.channel.before_send()

    def sent(self, pending) -> None:
        """The send phase is launched; ``pending`` is what its receive phase needs (a tuple, or one item):
        the tensors among its items are recorded for the receive's stream by ``take``."""
        if self.channel is not None:
            self.channel.launched()
        self.pending = pending
        self._call = self.group.begin_call(self.name)

    def take(self):
        """The receive phase takes the pending call (the op is idle again once it returns); it is
        launched next, ordered after the send."""
        if self.channel is not None:
            self.channel.before_recv()
        pending, self.pending = self.pending, None
        record_for_current_stream(pending if isinstance(pending, tuple) else (pending,), self.group.device)
        return pending

    def finish(self, result):
        """The receive phase is launched: order the next launch after it, then raise recorded errors."""
        if self.channel is not None:
            self.channel.launched()
        call, self._call = self._call, None
        return self.group.finish_op(result, call)

    # ---- group events --------------------------------------------------------------------------------
    def reset(self) -> None:
        """``group.reset()``: a pending call is dropped (its receive phase will never run)."""
        self.pending = self._call = None

    def mark_closed(self) -> None:
        self._closed = True
        self.pending = None
