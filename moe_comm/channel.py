"""One direction of one op on one rank: its symmetric landing zone, control words and call counters."""

from __future__ import annotations

import weakref

import torch

from .interpreter import kernel_for
from .planner import channel_done_words, next_pow2, stage_ctrl_shape
from .triton_kernels import nvshmem_bitcode
from .trace.recorder import new_ring, prepare_first_row
from .triton_kernels.sync import abort_kernel, drain_kernel

# Kernels that carry NVSHMEM calls when launched with PUT: the send kernels (the put transport) and every
# kernel that may record a group-wide error (its status broadcast to the peers reached by puts). Their
# builds without PUT hold no NVSHMEM state and are left alone (``nvshmem_bitcode.holds_device_state``).
PUT_KERNELS = ("a2a_send_kernel", "dispatch_send_kernel", "combine_send_kernel", "abort_kernel",
               "a2a_recv_kernel", "dispatch_recv_kernel", "combine_recv_kernel", "drain_kernel",
               "fail_group_kernel", "prefill_dispatch_send_kernel", "prefill_dispatch_recv_kernel",
               "prefill_dispatch_pull_kernel", "prefill_combine_send_kernel", "prefill_combine_forward_kernel",
               "prefill_combine_recv_kernel", "prefill_release_kernel", "moe_gate_up_kernel", "moe_down_combine_kernel")


def register_put_kernels() -> None:
    """CUDA modules of these kernels get ``nvshmemx_cumodule_init`` on load where they carry NVSHMEM calls."""
    nvshmem_bitcode.install_module_init_hook()
    for name in PUT_KERNELS:
        nvshmem_bitcode.register_kernel(name)


# The capture of a stream whose graph torch cannot name (a capture not begun by ``torch.cuda.CUDAGraph``,
# or a torch without ``get_currently_capturing_graph``): such captures are told apart from eager launches
# only, as before capture ids were used.
UNIDENTIFIED_CAPTURE = "capture not begun by torch.cuda.CUDAGraph"


def current_capture():
    """The CUDA graph capture the current stream takes part in: None when it is not capturing; else a weak
    reference to the ``torch.cuda.CUDAGraph`` being captured (``CUDAGraph.get_currently_capturing_graph``
    looks it up by the stream's capture id, so a side stream joined into the capture gives the same one,
    and two captures under way at once give two); ``UNIDENTIFIED_CAPTURE`` when torch cannot name it. Weak:
    a channel does not keep a graph (and its memory pool) alive. Two values are the same capture when
    they compare equal (live weak references compare as their graphs; a dead one equals only itself)."""
    if not torch.cuda.is_current_stream_capturing():
        return None
    try:
        return weakref.ref(torch.cuda.CUDAGraph.get_currently_capturing_graph())
    except (AttributeError, RuntimeError, TypeError):
        return UNIDENTIFIED_CAPTURE


def waits_for_previous(same_stream: bool, previous_capture, capture) -> bool:
    """Whether a launch must wait (``wait_event``) for the channel's previous launch: only on another
    stream (one stream is in order already), and only within one capture sequence, or both eager
    (``current_capture`` values): a captured launch cannot depend on an eager one nor on another capture's
    (CUDA rejects the dependency and invalidates the capture); order those by the replay stream."""
    return not same_stream and previous_capture == capture


class Channel:
    """Symmetric buffers + device-side signalling state of one op direction (e.g. a2a forward).

    data      symmetric, ``data_shape`` ``data_dtype``; by convention [2 zones, ...] (zone = call % 2)
    ctrl      symmetric int64 [2 zones, world source ranks, ctrl_words]; word ``flag_word`` of each is
              the flag (default: the last word)
    send_seq  int64 [1] on device: calls whose send phase ran since the last reset (advanced by the send
              kernel, so a CUDA graph replay keeps counting; the host never reads it)
    recv_seq  int64 [1] on device: calls whose receive phase ran (advanced by the receive kernel). The
              receive owns its counter, so send and receive may run on different streams.
    done      int32 [world + 3] on device: arrival counters of "last program publishes" (zero between
              launches): [j] per destination of a send, [world] the send total, [world + 1] the receive;
              [world + 2] the receive's entry counter (flight recorder only: its first program to enter
              records the start, ``triton_kernels/trace.py``)
    stage, stage_ctrl
              put transport only (``group.uses_put``): symmetric ``stage_shape`` ``data_dtype`` (default
              ``data_shape``: two zones) and int64 [2 zones, world, ctrl_words], this rank's staged copy of
              what it sends to each peer by puts, zone ``call % 2``: reused only once a receive proves the
              NIC read it, never quieted (``moe_comm/triton_kernels/transport.py``); None otherwise
    trace     int64 [group.trace_calls + 1, record words]: the flight recorder of this channel's calls
              (``moe_comm/trace/layout.py``; one unused row when tracing is off); ``row_bytes``: bytes
              of one row its records count (set by the op)
    wait_stats int64 [2, world] on device: [0, j] cumulative ns this rank's receives waited for source
              j's flag, [1, j] how many waits got it (accumulated while tracing is on; ``reset()`` keeps
              both)
    calls_before_reset
              host int: ``recv_seq`` summed over the epochs before this one (``reset()`` adds it before
              zeroing the counter), so that calls since the channel was made = this + recv_seq
              (``moe_comm.metrics``; world 1 launches one kernel per call and counts none)
    epoch_calls
              host dict: epoch -> ``recv_seq`` at the reset that ended it (``moe_comm.metrics`` counts the
              calls of an epoch whose records a later epoch's calls overwrote unread)

    Ordering on CUDA: every launch of the channel (send, receive, abort) waits
    (``torch.cuda.Stream.wait_event``) for the previous one on this rank, whatever streams they were
    launched on: recv(i) after send(i), send(i+1) after recv(i), so send(i+1) after send(i) and recv(i+1)
    after recv(i) too. A receive never reads the call number of another receive still running, a send
    never reuses one, and a receive never holds the SMs its own send needs. With the flags this is the
    back-pressure that keeps a sender from overwriting a zone a peer still reads. Never across a graph
    capture boundary: a launch captured in a graph does not wait for an eager one, nor the reverse, nor
    for a launch of another capture (``current_capture``: captures are told apart by their graph, found
    by the stream's capture id); order those by the stream the graph is replayed on.
    """

    def __init__(self, group, name: str, data_shape, data_dtype: torch.dtype, ctrl_words: int = 2,
                 flag_word: int | None = None, stage_shape=None):
        heap, dev, world = group.heap, group.device, group.world_size
        self.group, self.name = group, name
        self.ctrl_words = ctrl_words
        self.flag_word = ctrl_words - 1 if flag_word is None else flag_word
        self.data = heap.alloc(f"{name}.data", data_shape, data_dtype)
        self.ctrl = heap.alloc(f"{name}.ctrl", (2, world, ctrl_words), torch.int64)
        self.send_seq = torch.zeros(1, dtype=torch.int64, device=dev)
        self.recv_seq = torch.zeros(1, dtype=torch.int64, device=dev)
        self.done = torch.zeros(channel_done_words(world), dtype=torch.int32, device=dev)
        self.trace = new_ring(world, group.trace_calls, dev)
        self.wait_stats = torch.zeros((2, world), dtype=torch.int64, device=dev)
        self.calls_before_reset = 0
        self.epoch_calls: dict[int, int] = {}
        self.row_bytes = 0
        self.put = group.uses_put
        self.stage = self.stage_ctrl = None
        if self.put:  # collective: MOE_COMM_TRANSPORT and the heap's reachability agree on every rank
            stage_shape = tuple(data_shape) if stage_shape is None else tuple(stage_shape)
            self.stage = heap.alloc(f"{name}.stage", stage_shape, data_dtype)
            self.stage_ctrl = heap.alloc(f"{name}.stage_ctrl", stage_ctrl_shape(world, ctrl_words), torch.int64)
        self._put_args = dict(stage_ptr=self.data.local, stage_ctrl_ptr=self.ctrl.local, PUT=False)
        if self.put:   # PUT and, on CUDA, the bitcode (checked once per group, not per launch)
            self._put_args = dict(stage_ptr=self.stage.local, stage_ctrl_ptr=self.stage_ctrl.local,
                                  **group.put_launch_args())
        self._ordered = dev.type == "cuda"  # launches ordered by CUDA events (``after_previous``)
        self._last_event = None  # (CUDA event after this channel's last launch, its stream, its capture)
        self._drain_op = None    # op id of an aborted call whose receive side is still owed (``drain``)
        group.register(self)

    @property
    def symmetric_bytes(self) -> int:
        bufs = (self.data, self.ctrl) + ((self.stage, self.stage_ctrl) if self.put else ())
        return sum(b.local.numel() * b.local.element_size() for b in bufs)

    def put_args(self) -> dict:
        """Send-kernel arguments of the put transport: the staging buffers (this channel's own buffers as
        never-read placeholders when no peer uses puts), ``PUT``, and on CUDA the NVSHMEM bitcode."""
        return dict(self._put_args)

    def trace_args(self, recv: bool) -> dict:
        """Flight-recorder arguments of a send (``recv`` False) or receive kernel of this channel."""
        args = dict(trace_ptr=self.trace, TRACE=self.group.trace_calls > 0, TRACE_N=self.trace.shape[0])
        if recv:
            args["wait_ptr"] = self.wait_stats
        return args

    # ---- ordering between the launches of consecutive phases (CUDA streams) -------------------------
    def after_previous(self) -> None:
        """Make the current stream wait for this channel's previous launch on this rank (CUDA only)."""
        if self._last_event is None:
            return
        event, stream, capture = self._last_event
        current = torch.cuda.current_stream(self.group.device)
        if waits_for_previous(current == stream, capture, current_capture()):
            current.wait_event(event)

    def launched(self) -> None:
        """Mark the end of a launch of this channel on the current stream (CUDA only)."""
        if not self._ordered:
            return
        event, stream = torch.cuda.Event(), torch.cuda.current_stream(self.group.device)
        event.record(stream)
        self._last_event = (event, stream, current_capture())

    def before_send(self) -> None:
        """Order this send after the channel's previous launch, then finish the receive side of an
        aborted call (``drain``)."""
        self.after_previous()
        self.drain()

    def before_recv(self) -> None:
        """Order this receive after this rank's send of the call (the channel's previous launch)."""
        self.after_previous()

    # ---- faults ------------------------------------------------------------------------------------
    def abort(self, op: int) -> None:
        """Take part in this call of op ``op`` (``errors.OPS`` id) without sending or waiting: ABORT to
        every live peer, the send count advanced (``abort_kernel``). Its receive side (``drain``) is owed
        to the next launch of this channel: waiting here would wait for peers that have not come to
        the call yet (on loopback, always)."""
        g = self.group
        self.before_send()
        put = self.put_args()
        del put["stage_ptr"], put["stage_ctrl_ptr"]
        kernel_for(abort_kernel, g.device)[(1,)](
            self.ctrl.peer_ptrs, self.send_seq, g.state, g.rank,
            CTRL_WORDS=self.ctrl_words, FLAG_WORD=self.flag_word, WORLD=g.world_size,
            WORLD_P2=next_pow2(g.world_size), **put)
        self._drain_op = op
        self.launched()

    def drain(self) -> None:
        """If the last call was aborted here: wait (bounded) for every live peer's flag of it, data or
        ABORT, and advance the receive count (``drain_kernel``). Every peer publishes that flag only
        after its receive of the call before, so the next send cannot overwrite a zone a peer still
        reads: the protection a made call gets from its own receive phase."""
        if self._drain_op is None:
            return
        g, op, self._drain_op = self.group, self._drain_op, None
        kernel_for(drain_kernel, g.device)[(1,)](
            self.ctrl.local, self.recv_seq, g.state, g.status.local, op, g.rank,
            CTRL_WORDS=self.ctrl_words, FLAG_WORD=self.flag_word, WORLD=g.world_size,
            WORLD_P2=next_pow2(g.world_size), **g.put_launch_args())

    def reset(self) -> None:
        """Local part of ``group.reset()`` (the device is idle): counters and this rank's flags to zero,
        and the flight recorder's row of the new epoch's first call cleared (``prepare_first_row``)."""
        calls = int(self.recv_seq)
        self.calls_before_reset += calls
        self.epoch_calls[self.group.epoch] = calls   # (the group bumps its epoch after its members' reset)
        self.send_seq.zero_()
        self.recv_seq.zero_()
        self.done.zero_()
        self.ctrl.local.zero_()
        prepare_first_row(self.trace)
        self._last_event = None
        self._drain_op = None

    def free(self) -> None:
        """Free the symmetric buffers (the op's ``close()``, collective). On CUDA, first wait (on the host)
        for the channel's last launch: every launch waits for the one before, so no kernel of the op still
        runs on these buffers, nor on the op's local ones (the op's own tensors, allocated on whatever
        stream its first call ran, used by the phases on theirs), when their memory is handed back."""
        if self._last_event is not None:
            self._last_event[0].synchronize()
            self._last_event = None
        self.group.unregister(self)
        if self.put:
            self.group.heap.free(self.stage_ctrl)
            self.group.heap.free(self.stage)
        self.group.heap.free(self.ctrl)
        self.group.heap.free(self.data)
