"""AllToAllvDynamic: all-to-all-v whose split sizes never leave the device.

After NCCLX's AllToAllvDynamic ("Collective Communication for 100k+ GPUs"): the send counts are a device
tensor, the receive counts come back as a device tensor, and buffers are sized by a declared capacity
(``max_rows_per_peer``), so the host never syncs and the whole call can be captured in a CUDA graph and
replayed with new counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .channel import Channel
from .checks import check_tensor
from .errors import op_id
from .planner import next_pow2, plan_alltoallv
from .triton_kernels.alltoallv import a2a_local_kernel, a2a_recv_kernel, a2a_send_kernel


@dataclass
class A2AHandle:
    """Device metadata of one forward call, reused by ``combine`` (valid until two more forward calls)."""

    call_index: int             # host count of forward calls when this one was made
    num_rows: int               # N: rows of the forward's ``send``
    send_counts: torch.Tensor   # int32 [world]: rows actually sent to each rank (after clamping)
    send_offsets: torch.Tensor  # int64 [world]: row of ``send`` where rank j's rows start
    recv_counts: torch.Tensor   # int32 [world]: rows received from each rank


@dataclass
class A2AResult:
    recv: torch.Tensor         # [world, max_rows_per_peer, *row_shape]: recv[i, :recv_counts[i]] = rank i's rows, in order
    recv_counts: torch.Tensor  # int32 [world] on device
    handle: A2AHandle


class AllToAllvDynamic:
    """All-to-all-v with device-resident counts.

    ``a2a(send, send_counts)``:
      send         [N, *row_shape] dtype on group.device; rows grouped by destination rank in rank order
      send_counts  int32/int64 [world] on group.device; send_counts[j] <= max_rows_per_peer, sum <= N
      returns A2AResult(recv, recv_counts, handle); rows of ``recv`` past a count are unspecified.
    ``a2a.combine(rows, handle)``: the reverse. rows [world, max_rows_per_peer, *row_shape];
      rows[i, :recv_counts[i]] go back to rank i, into the positions its send rows had -> [N, *row_shape]
      (rows of the result that the forward did not send are unspecified).

    Device counts are validated in the kernel: a count outside [0, max_rows_per_peer], or counts that
    add up past N, are clamped (nothing is written or read out of bounds) and CapacityError is raised
    at the next check. Outputs alternate between two sets: the result of call i stays valid during
    call i+1. Phases: ``phase="send"`` then ``phase="recv"`` (no tensors) split a call for overlap;
    loopback groups must be driven that way. At world 1 each call is one kernel, run by the send phase
    (rows go straight from the input to the output; the receive phase launches nothing). Graph
    capture: every launch has a fixed shape and reads counts only on the device; the call counter lives
    on the device, so replays keep signalling right.
    """

    def __init__(self, group, max_rows_per_peer: int, row_shape, dtype: torch.dtype):
        if int(max_rows_per_peer) < 1:
            raise ValueError(f"max_rows_per_peer must be >= 1, got {max_rows_per_peer}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        row_shape = (int(row_shape),) if isinstance(row_shape, int) else tuple(int(s) for s in row_shape)
        if any(s < 1 for s in row_shape):
            raise ValueError(f"row_shape must be positive, got {row_shape}")
        self.group, self.dtype, self.row_shape = group, dtype, row_shape
        self.max_rows_per_peer = int(max_rows_per_peer)
        self.plan = p = plan_alltoallv(group.world_size, self.max_rows_per_peer, row_shape, dtype, group.device)
        self._fwd = Channel(group, "a2a.fwd", p.data_shape, p.copy.word_dtype)
        self._rev = Channel(group, "a2a.rev", p.data_shape, p.copy.word_dtype)
        dev, world = group.device, group.world_size
        self._recv = [torch.empty((world, self.max_rows_per_peer, *row_shape), dtype=dtype, device=dev)
                      for _ in range(2)]
        self._meta = [dict(recv_counts=torch.zeros(world, dtype=torch.int32, device=dev),
                           send_counts=torch.zeros(world, dtype=torch.int32, device=dev),
                           send_offsets=torch.zeros(world, dtype=torch.int64, device=dev)) for _ in range(2)]
        self._calls = 0         # forward calls begun (host count; picks the output set)
        self._pending = None    # forward: (handle, result) between send and recv phases
        self._rev_pending = None

    @property
    def buffer_bytes(self) -> int:
        return self.plan.symmetric_bytes + self.plan.output_bytes

    # ---- helpers -------------------------------------------------------------------------------
    def _words(self, t: torch.Tensor, rows_dims: int) -> torch.Tensor:
        """View a [*rows, *row_shape] tensor as [*rows, row_words] words (no copy)."""
        t = t.contiguous()
        return t.view(*t.shape[:rows_dims], -1).view(self.plan.copy.word_dtype)

    def _common(self, forward: bool):
        g, c = self.group, self.plan.copy
        return dict(err_addr=g.error_addr, rank=g.rank, max_rows=self.max_rows_per_peer,
                    OP=op_id("alltoallv" if forward else "alltoallv.combine"), FORWARD=forward,
                    WORLD=g.world_size, ROW_WORDS=c.row_words, BLOCK_R=c.block_rows,
                    BLOCK_C=c.block_words, NBLK=c.blocks_per_peer)

    def _local_args(self, forward: bool):
        """Arguments of the world-1 kernel: those of the two-phase kernels minus the signalling ones."""
        return {k: v for k, v in self._common(forward).items() if k != "WORLD"}

    def _grid(self):
        return (self.group.world_size, self.plan.copy.blocks_per_peer)

    # ---- forward -------------------------------------------------------------------------------
    def __call__(self, send: torch.Tensor | None = None, send_counts: torch.Tensor | None = None, *,
                 phase: str = "both") -> A2AResult | None:
        do_send, do_recv = self._fwd.phases(phase)
        self.group.check()
        if do_send:
            world = self.group.world_size
            check_tensor("send_counts", send_counts, self.group.device, (torch.int32, torch.int64), (world,))
            check_tensor("send", send, self.group.device, self.dtype)
            if send.dim() < 1 or tuple(send.shape[1:]) != self.row_shape:
                raise ValueError(f"send must be [N, *{self.row_shape}], got {tuple(send.shape)}")
            k = self._calls % 2
            m = self._meta[k]
            handle = A2AHandle(self._calls, send.shape[0], m["send_counts"], m["send_offsets"], m["recv_counts"])
            self._calls += 1
            ch = self._fwd
            src = self._words(send, 1) if send.shape[0] > 0 else torch.empty(
                (1, self.plan.copy.row_words), dtype=self.plan.copy.word_dtype, device=send.device)
            if world == 1:  # one kernel: rows straight into this call's output set
                a2a_local_kernel[self._grid()[1:]](
                    src, send_counts.contiguous(), m["send_counts"], m["send_offsets"], m["recv_counts"],
                    self._words(self._recv[k], 2), send.shape[0], **self._local_args(True))
            else:
                a2a_send_kernel[self._grid()](
                    src, send_counts.contiguous(), m["send_counts"], m["send_offsets"], send.shape[0],
                    ch.data.peer_ptrs, ch.ctrl.peer_ptrs, ch.seq, ch.done,
                    WORLD_P2=next_pow2(world), **self._common(True))
            ch.expect = "recv"
            self._pending = (handle, k)
            if not do_recv:
                self.group.check_after_launch()
                return None
        handle, k = self._pending
        ch = self._fwd
        if self.group.world_size > 1:
            a2a_recv_kernel[self._grid()](
                self._words(self._recv[k], 2), handle.recv_counts, handle.send_counts, handle.send_offsets,
                ch.data.local, ch.ctrl.local, ch.seq, timeout_ns=self.group.timeout_ns, **self._common(True))
        ch.expect, self._pending = "send", None
        self.group.check_after_launch()
        return A2AResult(self._recv[k], handle.recv_counts, handle)

    # ---- reverse -------------------------------------------------------------------------------
    def combine(self, rows: torch.Tensor | None = None, handle: A2AHandle | None = None, *,
                phase: str = "both") -> torch.Tensor | None:
        do_send, do_recv = self._rev.phases(phase)
        self.group.check()
        ch = self._rev
        if do_send:
            if not isinstance(handle, A2AHandle):
                raise TypeError(f"handle must be the A2AHandle of a forward call, got {type(handle).__name__}")
            if not (self._calls - 2 <= handle.call_index < self._calls) or (
                    self._pending is not None and self._pending[0] is handle):
                raise ValueError("stale handle: its forward call's metadata has been reused (a handle is "
                                 "valid until two more forward calls) or its recv phase has not run")
            world = self.group.world_size
            check_tensor("rows", rows, self.group.device, self.dtype,
                         (world, self.max_rows_per_peer, *self.row_shape))
            out = torch.empty((handle.num_rows, *self.row_shape), dtype=self.dtype, device=self.group.device)
            dst = self._words(out, 1) if handle.num_rows > 0 else torch.empty(
                (1, self.plan.copy.row_words), dtype=self.plan.copy.word_dtype, device=out.device)
            if world == 1:  # one kernel: rows straight back into ``out`` (the count the forward kept)
                a2a_local_kernel[self._grid()[1:]](
                    self._words(rows, 2), handle.send_counts, handle.send_counts, handle.send_offsets,
                    handle.recv_counts, dst, handle.num_rows, **self._local_args(False))
            else:
                a2a_send_kernel[self._grid()](
                    self._words(rows, 2), handle.recv_counts, handle.recv_counts, handle.send_offsets, 0,
                    ch.data.peer_ptrs, ch.ctrl.peer_ptrs, ch.seq, ch.done,
                    WORLD_P2=next_pow2(world), **self._common(False))
            ch.expect, self._rev_pending = "recv", (handle, out, dst)
            if not do_recv:
                self.group.check_after_launch()
                return None
        handle, out, dst = self._rev_pending
        if self.group.world_size > 1:
            a2a_recv_kernel[self._grid()](
                dst, handle.recv_counts, handle.send_counts, handle.send_offsets,
                ch.data.local, ch.ctrl.local, ch.seq, timeout_ns=self.group.timeout_ns, **self._common(False))
        ch.expect, self._rev_pending = "send", None
        self.group.check_after_launch()
        return out

    def close(self) -> None:
        """Free the symmetric buffers (collective)."""
        self._rev.free()
        self._fwd.free()
