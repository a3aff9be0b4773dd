"""One direction of one op on one rank: its symmetric landing zone, control words and call counters."""

from __future__ import annotations

import torch

from .interpreter import kernel_for
from .planner import next_pow2
from .triton_kernels.sync import abort_kernel


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

    Ordering on CUDA: the send phase of call i+1 waits (``torch.cuda.Stream.wait_event``) for the
    receive phase of call i on this rank, whatever streams they were launched on. Together with the
    flags this is the back-pressure that keeps a sender from overwriting a zone a peer still reads.
    """

    def __init__(self, group, name: str, data_shape, data_dtype: torch.dtype, ctrl_words: int = 2,
                 flag_word: int | None = None):
        heap, dev, world = group.heap, group.device, group.world_size
        self.group, self.name = group, name
        self.ctrl_words = ctrl_words
        self.flag_word = ctrl_words - 1 if flag_word is None else flag_word
        self.data = heap.alloc(f"{name}.data", data_shape, data_dtype)
        self.ctrl = heap.alloc(f"{name}.ctrl", (2, world, ctrl_words), torch.int64)
        self.send_seq = torch.zeros(1, dtype=torch.int64, device=dev)
        self.recv_seq = torch.zeros(1, dtype=torch.int64, device=dev)
        self.done = torch.zeros(world + 2, dtype=torch.int32, device=dev)
        self._recv_event = None  # (CUDA event after the last receive phase, recorded while capturing?)
        group.register(self)

    @property
    def symmetric_bytes(self) -> int:
        return sum(b.local.numel() * b.local.element_size() for b in (self.data, self.ctrl))

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
        kernel_for(abort_kernel, g.device)[(1,)](
            self.ctrl.peer_ptrs, self.send_seq, self.recv_seq, g.state, g.rank,
            CTRL_WORDS=self.ctrl_words, FLAG_WORD=self.flag_word, WORLD=g.world_size,
            WORLD_P2=next_pow2(g.world_size))
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
        self.group.heap.free(self.ctrl)
        self.group.heap.free(self.data)
