"""AllToAllvDynamic: all-to-all-v whose split sizes never leave the device.

After NCCLX's AllToAllvDynamic ("Collective Communication for 100k+ GPUs"): the send counts are a device
tensor, the receive counts come back as a device tensor, and buffers are sized by a declared capacity
(``max_rows_per_peer``), so the host never syncs and the whole call can be captured in a CUDA graph and
replayed with new counts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .channel import Channel
from .checks import check_tensor, check_words
from .errors import op_id
from .launches import Launch, LaunchTable
from .phased import PhasedOp
from .planner import AllToAllvPlan, check_replaced_plan, next_pow2, plan_alltoallv
from .triton_kernels.alltoallv import a2a_local_kernel, a2a_recv_kernel, a2a_send_kernel


@dataclass
class A2AHandle:
    """Device metadata of one forward call, reused by ``combine`` (valid until two more forward calls)."""

    call_index: int             # host count of forward calls when this one was made
    num_rows: int               # N: rows of the forward's ``send``
    send_counts: torch.Tensor   # int32 [world]: rows actually sent to each rank (after clamping)
    send_offsets: torch.Tensor  # int64 [world]: row of ``send`` where rank j's rows start
    recv_counts: torch.Tensor   # int32 [world]: rows received from each rank
    owner: int = 0              # id() of the AllToAllvDynamic that made it
    epoch: int = 0              # group epoch when it was made (a handle does not survive group.reset())


@dataclass
class A2AResult:
    recv: torch.Tensor         # [world, max_rows_per_peer, *row_shape]: recv[i, :recv_counts[i]] = rank i's rows, in order
    recv_counts: torch.Tensor  # int32 [world] on device
    handle: A2AHandle


class AllToAllvDynamic:
    """All-to-all-v with device-resident counts.

    ``a2a(send, send_counts)``:
      send         [N, *row_shape] dtype on group.device; rows grouped by destination rank in rank order.
                   Rows are copied as words of the plan's size (up to 4 bytes): a contiguous send off that
                   boundary (a view at an odd element) raises ValueError (``send.clone()`` fixes it).
      send_counts  int32/int64 [world] on group.device; send_counts[j] <= max_rows_per_peer, sum <= N
      returns A2AResult(recv, recv_counts, handle); rows of ``recv`` past a count are unspecified.
    ``a2a.combine(rows, handle)``: the reverse. rows [world, max_rows_per_peer, *row_shape] (on a word, as
      send);
      rows[i, :recv_counts[i]] go back to rank i, into the positions its send rows had -> [N, *row_shape]
      (rows of the result that the forward did not send are unspecified).

    Device counts are validated in the kernel: rank j's rows start at the prefix sum of the counts as
    given; a count outside [0, max_rows_per_peer], or rows past N, are clamped (nothing is written or
    read out of bounds, and no other rank's rows move) and CapacityError is raised at the end of the
    call (CPU) or of the next one (CUDA). Rows addressed to an excluded rank (``group.exclude``) are
    dropped and counted in ``dropped_rows``; ``recv_counts`` of an excluded rank is 0.
    Outputs alternate between two sets: the result of call i stays valid during call i+1.
    Phases: ``phase="send"`` then ``phase="recv"`` (no tensors) split a call for overlap, on the same or
    different streams (on CUDA every launch of a direction waits for its previous one on this rank:
    ``moe_comm.channel.Channel``); loopback groups must be driven that way. At world 1 each call is one kernel, run by the send phase
    (rows go straight from the input to the output; the receive phase launches nothing). Graph capture:
    every launch has a fixed shape and reads counts only on the device; the call counters live on the
    device, so replays keep signalling right. Faults: see ``moe_comm.phased`` and docs/faults.md.
    """

    def __init__(self, group, max_rows_per_peer: int, row_shape, dtype: torch.dtype):
        group.ensure_open()
        if isinstance(max_rows_per_peer, bool) or int(max_rows_per_peer) < 1:
            raise ValueError(f"max_rows_per_peer must be >= 1, got {max_rows_per_peer}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        row_shape = (int(row_shape),) if isinstance(row_shape, int) else tuple(int(s) for s in row_shape)
        if any(s < 1 for s in row_shape):
            raise ValueError(f"row_shape must be positive, got {row_shape}")
        self.group, self.dtype, self.row_shape = group, dtype, row_shape
        self.max_rows_per_peer = int(max_rows_per_peer)
        self.plan = p = plan_alltoallv(group.world_size, self.max_rows_per_peer, row_shape, dtype, group.device,
                                       put=group.uses_put)
        self._fwd = Channel(group, "a2a.fwd", p.data_shape, p.copy.word_dtype)
        self._rev = Channel(group, "a2a.rev", p.data_shape, p.copy.word_dtype)
        self._fwd.row_bytes = self._rev.row_bytes = p.copy.row_words * p.copy.word_dtype.itemsize
        self._fwd_op = PhasedOp(group, "alltoallv", self._fwd)
        self._rev_op = PhasedOp(group, "alltoallv.combine", self._rev)
        dev, world = group.device, group.world_size
        self._recv = [torch.empty((world, self.max_rows_per_peer, *row_shape), dtype=dtype, device=dev)
                      for _ in range(2)]
        self._meta = [dict(recv_counts=torch.zeros(world, dtype=torch.int32, device=dev),
                           send_counts=torch.zeros(world, dtype=torch.int32, device=dev),
                           send_offsets=torch.zeros(world, dtype=torch.int64, device=dev)) for _ in range(2)]
        self._dropped = torch.zeros(1, dtype=torch.int64, device=dev)
        self._fwd_op.counters = dict(excluded_rows=self._dropped)
        self._calls = 0         # forward calls begun (host count; picks the output set)
        self._launch_table = LaunchTable()   # the launches of the plan in force (``_launches``)

    @property
    def plan(self) -> AllToAllvPlan:
        """Buffers and launch shapes (``moe_comm.planner.AllToAllvPlan``). The buffers are allocated with the
        op: a new plan may change only launch shapes (``planner.check_replaced_plan``); the launches follow
        it. The calls read ``_a2a_plan`` (a property costs a call)."""
        return self._a2a_plan

    @plan.setter
    def plan(self, p: AllToAllvPlan) -> None:
        # A group that reaches a peer by puts holds the staging (AllToAllvPlan.put), whoever sets the plan.
        p = replace(p, put=True) if self.group.uses_put and not p.put else p
        if hasattr(self, "_a2a_plan"):
            check_replaced_plan("AllToAllvDynamic", self._a2a_plan, p)
        self._a2a_plan = p

    @property
    def buffer_bytes(self) -> int:
        return self.plan.symmetric_bytes + self.plan.output_bytes

    @property
    def wait_stats(self) -> torch.Tensor:
        """int64 [2, world] on the device, with the flight recorder on (``moe_comm/trace``; zeros when
        off): [0, j] nanoseconds this rank's forward receives waited for rank j's flag, [1, j] how many
        waits, summed over calls. ``combine_wait_stats``: the same for the reverse."""
        return self._fwd.wait_stats

    @property
    def combine_wait_stats(self) -> torch.Tensor:
        return self._rev.wait_stats

    @property
    def dropped_rows(self) -> torch.Tensor:
        """int64 [1] on the device: forward rows addressed to excluded ranks and dropped, summed over calls."""
        return self._dropped

    # ---- helpers -------------------------------------------------------------------------------
    def _words(self, t: torch.Tensor, rows_dims: int) -> torch.Tensor:
        """View a [*rows, *row_shape] tensor as [*rows, row_words] words (no copy). This runs at every call:
        a one-dimensional row is viewed as words directly, others are flattened first (``flatten`` costs a
        third of a ``view`` with a shape)."""
        t = t.contiguous()
        if t.dim() != rows_dims + 1:
            t = t.flatten(rows_dims) if t.dim() > rows_dims else t.unsqueeze(-1)   # row_shape (): one element
        return t.view(self._a2a_plan.copy.word_dtype)

    def _rows_or_dummy(self, t: torch.Tensor, rows: int) -> torch.Tensor:
        """Words of ``t`` [rows, *row_shape]; a one-row scratch when there are no rows (never read)."""
        if rows > 0:
            return self._words(t, 1)
        c = self._a2a_plan.copy
        return torch.empty((1, c.row_words), dtype=c.word_dtype, device=self.group.device)

    def _launches(self) -> dict:
        """The launches of the plan in force (``moe_comm.launches``)."""
        return self._launch_table.get(self._a2a_plan, self._build_launches)

    def _build_launches(self, p: AllToAllvPlan) -> dict:
        """Direction (True: forward, False: reverse) -> kernel name -> ``Launch`` of every kernel a call of
        this world size makes, with every argument but the call's tensors, its sizes and their alignment;
        "recv_words": the two output sets as words (the forward's destination)."""
        g, dev, c = self.group, self.group.device, p.copy
        launches = dict(recv_words=[self._words(r, 2) for r in self._recv])
        for forward, ch in ((True, self._fwd), (False, self._rev)):
            common = dict(grp=g.state, rank=g.rank, max_rows=self.max_rows_per_peer,
                          OP=op_id("alltoallv" if forward else "alltoallv.combine"), FORWARD=forward,
                          ROW_WORDS=c.row_words, BLOCK_R=c.block_rows, BLOCK_C=c.block_words, NBLK=c.blocks_per_peer)
            if g.world_size == 1:  # one kernel per call, straight from the input to the output
                launches[forward] = dict(local=Launch(a2a_local_kernel, dev, (c.blocks_per_peer,),
                                                      aligned=c.vector_rows, dropped_ptr=self._dropped, **common))
                continue
            phase = dict(status_ptr=g.status.local, WORLD=g.world_size, WORLD_P2=next_pow2(g.world_size), **common)
            grid = (g.world_size, c.blocks_per_peer)
            launches[forward] = dict(
                send=Launch(a2a_send_kernel, dev, grid, aligned=c.vector_rows, dropped_ptr=self._dropped,
                            data_ptrs_ptr=ch.data.peer_ptrs, ctrl_ptrs_ptr=ch.ctrl.peer_ptrs, seq_ptr=ch.send_seq,
                            done_ptr=ch.done, **phase, **ch.put_args(), **ch.trace_args(recv=False)),
                recv=Launch(a2a_recv_kernel, dev, grid, aligned=c.vector_rows, data_ptr=ch.data.local,
                            ctrl_ptr=ch.ctrl.local, seq_ptr=ch.recv_seq, done_ptr=ch.done, **phase,
                            **ch.trace_args(recv=True), **g.put_launch_args()))
        return launches

    # ---- forward -------------------------------------------------------------------------------
    def __call__(self, send: torch.Tensor | None = None, send_counts: torch.Tensor | None = None, *,
                 phase: str = "both") -> A2AResult | None:
        op = self._fwd_op
        do_send, do_recv = op.begin(phase)
        if do_send:
            op.validate(lambda: self._check_forward(send, send_counts))
            op.before_send()
            k = self._calls % 2
            m = self._meta[k]
            n = send.shape[0]
            handle = A2AHandle(self._calls, n, m["send_counts"], m["send_offsets"], m["recv_counts"],
                               owner=id(self), epoch=self.group.epoch)
            self._calls += 1
            launches, src, counts = self._launches(), self._rows_or_dummy(send, n), send_counts.contiguous()
            if self.group.world_size == 1:  # one kernel: rows straight into this call's output set
                dst, local = launches["recv_words"][k], launches[True]["local"]
                local.run(src_ptr=src, counts_ptr=counts, kept_counts_ptr=m["send_counts"],
                          kept_offsets_ptr=m["send_offsets"], recv_counts_ptr=m["recv_counts"], dst_ptr=dst, n_rows=n,
                          ALIGNED=local.aligned_with(src, dst))
            else:
                send_ = launches[True]["send"]
                send_.run(src_ptr=src, counts_ptr=counts, kept_counts_ptr=m["send_counts"],
                          kept_offsets_ptr=m["send_offsets"], n_rows=n, ALIGNED=send_.aligned_with(src))
            op.sent((handle, k))
            if not do_recv:
                return None
        handle, k = op.take()
        if self.group.world_size > 1:
            launches = self._launches()
            dst, recv = launches["recv_words"][k], launches[True]["recv"]
            recv.run(dst_ptr=dst, recv_counts_ptr=handle.recv_counts, kept_counts_ptr=handle.send_counts,
                     kept_offsets_ptr=handle.send_offsets, ALIGNED=recv.aligned_with(dst))
        return op.finish(A2AResult(self._recv[k], handle.recv_counts, handle))

    def _check_forward(self, send, send_counts) -> None:
        world = self.group.world_size
        check_tensor("send_counts", send_counts, self.group.device, (torch.int32, torch.int64), (world,))
        check_tensor("send", send, self.group.device, self.dtype,
                     dtype_fix="build the op with AllToAllvDynamic(group, max_rows_per_peer, row_shape, dtype={dtype})")
        if send.dim() < 1 or tuple(send.shape[1:]) != self.row_shape:
            raise ValueError(f"send must be [N, *{self.row_shape}], got {tuple(send.shape)}")
        check_words("send", send, self._a2a_plan.copy.word_dtype.itemsize)

    # ---- reverse -------------------------------------------------------------------------------
    def combine(self, rows: torch.Tensor | None = None, handle: A2AHandle | None = None, *,
                phase: str = "both") -> torch.Tensor | None:
        op = self._rev_op
        do_send, do_recv = op.begin(phase)
        if do_send:
            op.validate(lambda: self._check_reverse(rows, handle))
            op.before_send()
            out = torch.empty((handle.num_rows, *self.row_shape), dtype=self.dtype, device=self.group.device)
            dst, src = self._rows_or_dummy(out, handle.num_rows), self._words(rows, 2)
            if self.group.world_size == 1:  # one kernel: rows straight back into ``out`` (the count the forward kept)
                local = self._launches()[False]["local"]
                local.run(src_ptr=src, counts_ptr=handle.send_counts, kept_counts_ptr=handle.send_counts,
                          kept_offsets_ptr=handle.send_offsets, recv_counts_ptr=handle.recv_counts, dst_ptr=dst,
                          n_rows=handle.num_rows, ALIGNED=local.aligned_with(src, dst))
            else:
                send = self._launches()[False]["send"]
                send.run(src_ptr=src, counts_ptr=handle.recv_counts, kept_counts_ptr=handle.recv_counts,
                         kept_offsets_ptr=handle.send_offsets, n_rows=0, ALIGNED=send.aligned_with(src))
            op.sent((handle, out, dst))
            if not do_recv:
                return None
        handle, out, dst = op.take()
        if self.group.world_size > 1:
            recv = self._launches()[False]["recv"]
            recv.run(dst_ptr=dst, recv_counts_ptr=handle.recv_counts, kept_counts_ptr=handle.send_counts,
                     kept_offsets_ptr=handle.send_offsets, ALIGNED=recv.aligned_with(dst))
        return op.finish(out)

    def _check_reverse(self, rows, handle) -> None:
        if not isinstance(handle, A2AHandle) or handle.owner != id(self):
            raise TypeError(f"handle must be the A2AHandle of a forward call of this AllToAllvDynamic, "
                            f"got {type(handle).__name__}")
        if handle.epoch != self.group.epoch:
            raise ValueError("stale handle: its forward call was made before group.reset()/exclude()")
        pending = self._fwd_op.pending is not None and self._fwd_op.pending[0] is handle
        if not (self._calls - 2 <= handle.call_index < self._calls) or pending:
            raise ValueError("stale handle: its forward call's metadata has been reused (a handle is "
                             "valid until two more forward calls) or its recv phase has not run")
        world = self.group.world_size
        check_tensor("rows", rows, self.group.device, self.dtype, (world, self.max_rows_per_peer, *self.row_shape))
        check_words("rows", rows, self._a2a_plan.copy.word_dtype.itemsize)

    def close(self) -> None:
        """Free the symmetric buffers (collective). Any later call raises ClosedError."""
        if self._rev is None:
            return
        for op in (self._fwd_op, self._rev_op):
            op.mark_closed()
        if self._rev is not None and not self.group.closed:
            self._rev.free()
            self._fwd.free()
        self._rev = self._fwd = None
