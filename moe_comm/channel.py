"""One direction of one op on one rank: its symmetric landing zone, control words and call counters."""

from __future__ import annotations

import torch

from .interpreter import kernel_for
from .planner import next_pow2
from .triton_kernels import nvshmem_bitcode
from .trace.recorder import new_ring
from .triton_kernels.sync import abort_kernel

PUT_KERNELS = ("a2a_send_kernel", "dispatch_send_kernel", "combine_send_kernel", "abort_kernel")


def register_put_kernels() -> None:
    """CUDA modules of the kernels that carry NVSHMEM calls get ``nvshmemx_cumodule_init`` on load."""
    nvshmem_bitcode.install_module_init_hook()
    for name in PUT_KERNELS:
        nvshmem_bitcode.register_kernel(name)


class Channel:
    """Symmetric buffers + device-side signalling state of one op direction (e.g. a2a forward).

    data      symmetric, ``data_shape`` ``data_dtype``; by convention [2 zones, ...] (zone = call % 2)
    ctrl      symmetric int64 [2 zones, world source ranks, ctrl_words]; word ``flag_word`` of each is
              the flag (default: the last word)
    send_seq  int64 [1] on device: calls whose send phase ran since the last reset (advanced by the send
              kernel, so a CUDA graph replay keeps counting; the host never reads it)
    recv_seq  int64 [1] on device: calls whose receive phase ran (advanced by the receive kernel). The
              receive owns its counter, so send and receive may run on different streams.
    done      int32 [world + 2] on device: arrival counters of "last program publishes" (zero between
              launches): [j] per destination of a send, [world] the send total, [world + 1] the receive
    stage, stage_ctrl
              put transport only (``group.uses_put``): symmetric ``stage_shape`` ``data_dtype`` and int64
              [world, ctrl_words], this rank's staged copy of what it sends to each peer by puts
              (``moe_comm/triton_kernels/transport.py``); None otherwise
    trace     int64 [group.trace_calls, record words]: the flight recorder of this channel's calls
              (``moe_comm/trace/layout.py``; one unused row when tracing is off); ``row_bytes``: bytes
              of one row its records count, ``rows_recorded``: False where the kernels record times only
              (both set by the op)
    wait_stats int64 [2, world] on device: [0, j] cumulative ns this rank's receives waited for source
              j's flag, [1, j] how many waits got it (accumulated while tracing is on; ``reset()`` keeps
              both)

    Ordering on CUDA: the send phase of call i+1 waits (``torch.cuda.Stream.wait_event``) for the
    receive phase of call i on this rank, whatever streams they were launched on. Together with the
    flags this is the back-pressure that keeps a sender from overwriting a zone a peer still reads.
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
        self.done = torch.zeros(world + 2, dtype=torch.int32, device=dev)
        self.trace = new_ring(world, group.trace_calls, dev)
        self.wait_stats = torch.zeros((2, world), dtype=torch.int64, device=dev)
        self.row_bytes, self.rows_recorded = 0, True
        self.put = group.uses_put
        self.stage = self.stage_ctrl = None
        if self.put:  # collective: MOE_COMM_TRANSPORT and the heap's reachability agree on every rank
            stage_shape = tuple(data_shape[1:]) if stage_shape is None else tuple(stage_shape)
            self.stage = heap.alloc(f"{name}.stage", stage_shape, data_dtype)
            self.stage_ctrl = heap.alloc(f"{name}.stage_ctrl", (world, ctrl_words), torch.int64)
        self._put_args = dict(stage_ptr=self.data.local, stage_ctrl_ptr=self.ctrl.local, PUT=False)
        if self.put:
            extra = {}
            if dev.type == "cuda":   # checked once here, not per launch: the pairing check reads the disk
                register_put_kernels()
                extra = nvshmem_bitcode.launch_options()
            self._put_args = dict(stage_ptr=self.stage.local, stage_ctrl_ptr=self.stage_ctrl.local, PUT=True,
                                  **extra)
        self._recv_event = None  # (CUDA event after the last receive phase, recorded while capturing?)
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

    # ---- ordering between the phases of consecutive calls (CUDA streams) -------------------------
    def before_send(self) -> None:
        """Order this send after the previous receive of this channel on this rank (CUDA only)."""
        if self._recv_event is None:
            return
        event, captured = self._recv_event
        if captured == torch.cuda.is_current_stream_capturing():  # never wait across a capture boundary
            torch.cuda.current_stream(self.group.device).wait_event(event)

    def after_recv(self) -> None:
        if self.group.device.type != "cuda":
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.group.device))
        self._recv_event = (event, torch.cuda.is_current_stream_capturing())

    # ---- faults ------------------------------------------------------------------------------------
    def abort(self) -> None:
        """Take part in this call without sending or waiting: ABORT to every live peer, both counters
        advanced (see ``abort_kernel``)."""
        g = self.group
        self.before_send()
        put = self.put_args()
        del put["stage_ptr"], put["stage_ctrl_ptr"]
        kernel_for(abort_kernel, g.device)[(1,)](
            self.ctrl.peer_ptrs, self.send_seq, self.recv_seq, g.state, g.rank,
            CTRL_WORDS=self.ctrl_words, FLAG_WORD=self.flag_word, WORLD=g.world_size,
            WORLD_P2=next_pow2(g.world_size), **put)
        self.after_recv()

    def reset(self) -> None:
        """Local part of ``group.reset()`` (the device is idle): counters and this rank's flags to zero."""
        self.send_seq.zero_()
        self.recv_seq.zero_()
        self.done.zero_()
        self.ctrl.local.zero_()
        self._recv_event = None

    def free(self) -> None:
        self.group.unregister(self)
        if self.put:
            self.group.heap.free(self.stage_ctrl)
            self.group.heap.free(self.stage)
        self.group.heap.free(self.ctrl)
        self.group.heap.free(self.data)
