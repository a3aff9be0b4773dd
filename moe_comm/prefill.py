"""PrefillBuffer: high-throughput expert-parallel dispatch and combine for thousands of tokens per rank.

Why a class of its own rather than an ``EPBuffer`` mode: the two share no buffer and no output layout.
EPBuffer (decode) lands token-major rows and copies them into an expert-major output sized for every
token of every rank on one expert (L * W * M rows: ~30 GB at DeepSeek-V3 EP8 with 8192 tokens); here the
landing zone *is* the output, rank-major, W * M rows, and the combine reads the partial rows where the
experts left them instead of landing them at the source. A mode would carry both sets of buffers, plans
and checks behind one name. The machinery is shared: ``Channel`` (symmetric buffers, flags, counters),
``PhasedOp`` (phases, aborts, where errors surface), ``sync.py``, ``copy.py``, ``quant.py``, the routing
functions and ``planner.plan_ep``'s launch shapes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from . import formats
from .channel import Channel
from .checks import check_tensor, check_words
from .ep import EPBuffer, check_global_scale
from .errors import ClosedError, op_id
from .interpreter import kernel_for
from .launches import Launch
from .op_buffer import OpBuffer
from .phased import PhasedOp
from .planner import PrefillPlan, check_replaced_plan, next_pow2, plan_prefill
from .topology import node_layout
from .triton_kernels.prefill_combine import (prefill_combine_forward_kernel, prefill_combine_recv_kernel,
                                             prefill_combine_send_kernel, prefill_release_kernel)
from .triton_kernels.prefill_dispatch import (prefill_dispatch_pull_kernel, prefill_dispatch_recv_kernel,
                                              prefill_dispatch_send_kernel)
from .triton_kernels.routing import histogram_bins

WEIGHT_DTYPE = torch.float32


@dataclass
class PrefillHandle:
    """What ``combine`` needs from one dispatch. Valid for exactly one combine, in dispatch order: that of
    the oldest dispatch not yet combined (with zones=2, the next dispatch may run before it)."""

    call_index: int           # dispatch calls on this buffer before this one
    num_tokens: int           # T: tokens this rank dispatched (the combine returns [T, hidden])
    routed: torch.Tensor      # int32 [M, topk]: 1 + the expert's rank where slot (t, k) is routed, else 0
    owner: int                # id() of the PrefillBuffer that made it
    epoch: int                # group epoch when it was made (a handle does not survive group.reset())
    zone: int = 0             # the landing zone of the call (0, or 1 with zones=2)


@dataclass
class PrefillDispatchResult:
    """What one rank receives from ``PrefillBuffer.dispatch`` (R = world * M, L = experts per rank), in the
    call's landing zone (``handle.zone``).

    recv_x             [R, hidden] dtype, or float8_e4m3fn with an fp8 dispatch format, or uint8 [R, hidden // 2]
                       with dispatch_format="nvfp4" (two e2m1 codes per byte, reference.quantize_nvfp4). Row
                       s*M + t is token t of source rank s, for t < src_tokens[s] and a recv_topk_idx entry
                       >= 0 in that row; every other row is unspecified.
    recv_scales        with an fp8 format (recv_x ~= q * scale per 128 columns, reference.quantize_fp8 in the
                       buffer's format, ``moe_comm.formats``): float32 [R, hidden // 128], or int32 [R, hidden //
                       512] packed UE8M0 ("e4m3-ue8m0"); float8_e4m3fn [R, hidden // 16] with nvfp4 (linear
                       layout); else None. Same valid rows.
    recv_topk_idx      int32 [R, topk]: the local id (0..L-1) of slot k's expert where it lives on this
                       rank, -1 elsewhere. Valid for rows s*M + t, t < src_tokens[s].
    recv_topk_weights  float32 [R, topk]: the slot's weight where recv_topk_idx >= 0, 0 elsewhere.
    src_tokens         int32 [world] on the device: tokens each source dispatched (0 for an excluded one).
    expert_counts      int32 [L] on the device: valid (row, k) slots per local expert.
    handle             PrefillHandle for ``combine``.
    global_scale       with nvfp4, the float32 [1] tensor given to the dispatch (the same on every rank:
                       one that differs raises GlobalScaleError, as in EPBuffer.dispatch), else None.
    All of them are views of this rank's landing zone of the call (or of small device tensors of that
    zone): valid until this rank's combine send phase of the same call, which writes the partial rows
    over recv_x. Once every rank's combine has returned, peers may write a later call's rows into the
    zone at any time: it is not the caller's between calls. With zones=2 the next dispatch uses the
    other zone: this result stays valid while it runs.
    """

    recv_x: torch.Tensor
    recv_scales: torch.Tensor | None
    recv_topk_idx: torch.Tensor
    recv_topk_weights: torch.Tensor
    src_tokens: torch.Tensor
    expert_counts: torch.Tensor
    handle: PrefillHandle
    global_scale: torch.Tensor | None = None

    def received_rows(self) -> torch.Tensor:
        """bool [R] on the device: row s*M + t holds a token of source s (t < src_tokens[s]). Computed on
        the device from the counts (no host read: capturable)."""
        R = self.recv_x.shape[0]
        m = R // self.src_tokens.shape[0]
        t = torch.arange(R, device=self.recv_x.device)
        return t % m < self.src_tokens.repeat_interleave(m)

    def masked_topk(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_idx int32 [R, topk], topk_weights float32 [R, topk]) defined on every row: the local ids
        and weights of ``recv_topk_idx`` / ``recv_topk_weights``, with -1 and 0 on rows no source wrote
        (``received_rows``), for expert kernels that route over all R rows. New tensors; capturable."""
        live = self.received_rows()[:, None] & (self.recv_topk_idx >= 0)
        return (torch.where(live, self.recv_topk_idx, -1),
                torch.where(live, self.recv_topk_weights, 0.0))

    def exact(self) -> dict:
        """The valid rows only, for eager callers that want exact sizes (reads the counts on the host: a
        sync, and not capturable). Returns dict(rows int64 [N]: their row in the rank-major layout, in
        order, x [N, hidden], scales [N, hidden // 128] or None, topk_idx int32 [N, topk], topk_weights
        float32 [N, topk]) as copies. The combine still takes [R, hidden]: ``expert_out[rows] = y``."""
        mine = self.received_rows() & (self.recv_topk_idx >= 0).any(dim=1)
        rows = mine.nonzero().flatten()
        return dict(rows=rows, x=self.recv_x[rows], scales=None if self.recv_scales is None else self.recv_scales[rows],
                    topk_idx=self.recv_topk_idx[rows], topk_weights=self.recv_topk_weights[rows])


@dataclass
class _Zone:
    """One landing zone of a rank and the small device tensors of the call that uses it."""

    recv_x: torch.Tensor
    recv_scales: torch.Tensor | None
    recv_idx: torch.Tensor
    recv_weights: torch.Tensor
    routed: torch.Tensor       # int32 [M, K]: the combine's mask (PrefillHandle.routed)
    src_tokens: torch.Tensor   # int32 [world]
    counts: torch.Tensor       # int32 [L]
    peer_ptrs: torch.Tensor    # int64 [world]: this zone on every rank (0 where a peer is not mapped)
    words: torch.Tensor        # int32 [zone_words]: this rank's zone
    rows: torch.Tensor         # [R, hidden] dtype: the zone's combine layout (the partial rows over recv_x)
    stamp: torch.Tensor        # int64 [1]: the flag of the zone's latest dispatch (its routing rows carry it)
    inbox: torch.Tensor        # [N * M, hidden] dtype: the zone's node inbox (with puts; else a placeholder)
    launches: dict             # name -> ``Launch`` (``moe_comm.launches``) of every kernel that reads or writes it


class _CombineChannel:
    """The combine's channel as ``PhasedOp`` sees it (every other method is the channel's): an abort also
    releases the zones (this rank reads none), so that when every rank aborted the call the next dispatch
    does not wait for it."""

    def __init__(self, channel: Channel, node_args: dict):
        self.channel, self.node_args = channel, node_args   # node_args: PUT, G, G_P2 (and NVSHMEM's bitcode)
        # What PhasedOp calls at every op call, bound here: an attribute found by __getattr__ costs a
        # failed lookup first.
        self.before_send, self.before_recv, self.launched = channel.before_send, channel.before_recv, channel.launched

    def __getattr__(self, name):
        return getattr(self.channel, name)

    def abort(self, op: int) -> None:
        ch, g = self.channel, self.channel.group
        ch.abort(op)
        kernel_for(prefill_release_kernel, g.device)[(1,)](
            ch.ctrl.peer_ptrs, ch.send_seq, g.state, g.rank, WORLD=g.world_size, WORLD_P2=next_pow2(g.world_size),
            **self.node_args)


class PrefillBuffer(OpBuffer):
    """Expert-parallel dispatch / combine of one rank for prefill (DeepEP normal-mode style, rank-major).

    ``PrefillBuffer(group, num_experts, hidden, max_tokens_per_rank, topk, dtype=torch.bfloat16,
    fp8_dispatch=False, zones=1, dispatch_format=None, combine_format=None)``: rank r owns experts [r*L,
    (r+1)*L), L = num_experts // world. Buffers are collective (every rank builds its PrefillBuffer in the
    same order, with the same sizes and zones; on a loopback world one per group, in rank order) and
    allocated by the first ``dispatch``.
    zones=2 holds two landing zones (twice the memory) that consecutive dispatches alternate between, so
    the dispatch of chunk i+1 may run before the combine of chunk i (``prefill_chunks.prefill_moe``).

    Formats as EPBuffer's (``moe_comm.formats``, docs/formats.md): dispatch_format None, "e4m3" (fp8;
    fp8_dispatch=True is the same), "e4m3-pow2", "e4m3-ue8m0" or "nvfp4", combine_format None or "e4m3" (the
    partial rows cross as fp8 and are summed in float32). Across nodes the fp8 combine and the nvfp4 dispatch
    raise ValueError here (docs/formats.md "Bad combinations").

    dispatch(x, topk_idx, topk_weights, *, phase="both", global_scale=None) -> PrefillDispatchResult
        x             [T, hidden] dtype on group.device, 0 <= T <= max_tokens_per_rank; copied as 4-byte
                      words: a contiguous x off a 4-byte boundary (a bf16 view at an odd element) raises
                      ValueError (``x.clone()`` fixes it); a non-contiguous one is copied first.
                      With an fp8 dispatch format, x may also be pre-quantized: a tuple (codes [T, hidden]
                      float8_e4m3fn, scales) in the buffer's format (``moe_comm.formats``: float32 [T, hidden
                      // 128] for "e4m3" and "e4m3-pow2", int32 [T, hidden // 512] packed UE8M0 for
                      "e4m3-ue8m0"; any strides, e.g. column-major, are copied to row-major first). The
                      codes and scales are sent as they are (not dequantized or requantized, nor checked:
                      recv_x / recv_scales hold them bit for bit); a tuple of another format raises
                      before any launch, naming the format to build the buffer with.
        topk_idx      [T, topk] int32/int64 expert ids; -1 = not routed. Ids outside [-1, num_experts) are
                      not routed and raise InvalidIndexError (a ValueError carrying the result) at the end
                      of the call; nothing is written for them.
        topk_weights  [T, topk] float32
        global_scale  nvfp4 only, required there: as for EPBuffer.dispatch
        Each token is read once and crosses to a rank at most once, however many of its experts live
        there; with an fp8 dispatch format a bf16/fp16/fp32 x is quantized on the way (float8_e4m3fn, one
        scale per 128 columns in the buffer's format: reference.quantize_fp8), with nvfp4 to TensorRT-LLM's
        NVFP4 (reference.quantize_nvfp4). See PrefillDispatchResult.

    combine(expert_out, handle, *, out=None, phase="both") -> [T, hidden] dtype
        expert_out  [R, hidden] dtype: row q is this rank's partial output for received row q (its local
                    experts' outputs, weighted and summed, as a grouped-GEMM MoE kernel produces them);
                    only rows that hold a local expert are read. ``expert_out`` may be ``recv_x`` itself
                    (bf16/fp16/fp32 dispatch, written in place): then nothing is copied. On a word
                    boundary, as x. With combine_format="e4m3" the send quantizes the rows into the zone:
                    expert_out must then not lie in the zone (ValueError; pass a tensor of its own).
        handle      the PrefillDispatchResult.handle of the latest dispatch
        out         optional [T, hidden] dtype contiguous tensor, written in place and returned
        y[t] = sum over the ranks d = 0..world-1 holding one of token t's experts (ascending d) of rank d's
        partial row for t, in float32, rounded to dtype: bitwise reproducible from run to run. A token
        with no routed slot gets zeros. With combine_format="e4m3" each partial row enters the sum as
        reference.fp8_round_trip of it.

    Order: every dispatch is answered by one combine, in dispatch order; at most ``zones`` dispatches
    are in flight (dispatched, their combine's receive phase not yet run): RuntimeError before any
    launch otherwise, since the next one would write a zone still being read. A dispatch's send also
    waits on the device until every rank's combine has finished reading the zones of the calls this
    rank has combined (and, on CUDA, its launch waits for this rank's latest combine launch, whatever
    the streams). Phases
    (``phase="send"`` then ``"recv"``) and loopback worlds as for EPBuffer. Nothing is read on the host:
    counts stay on the device and every launch has a fixed shape (CUDA-graph capturable at the fixed
    capacity max_tokens_per_rank).

    Faults (README "Faults and recovery", ``moe_comm.phased``): bad inputs raise before any launch (a
    multi-rank rank first aborts the call, so its peers do not hang); waits are bounded by
    group.timeout_s and a missing peer raises CommTimeoutError, sticky until group.reset(); a failed
    dispatch leaves zero counts and a failed combine NaN rows, never stale data. Excluded ranks
    (``group.exclude``) send and receive nothing; slots routed to them are counted in ``excluded_slots``
    and skipped by the combine.

    Memory (``buffer_bytes``, ``planner.PrefillPlan``): ``zones`` symmetric zones of W*M rows (payload +
    8*topk bytes each) plus control words: 0.88 GiB per rank at DeepSeek-V3 EP16 with 4096 tokens per
    rank in bf16 (DeepEP V2: 1.13 GiB), and the same with zones=2 and 2048 tokens per zone (4096 tokens
    in two overlapped chunks). ``PrefillBuffer.required_bytes(...)`` evaluates it without a group.
    Across nodes (a group that reaches some peers by NVSHMEM puts, ``group.uses_put``; docs/prefill.md
    "Across nodes"): a token crosses to each other node holding one of its experts once, to this rank's
    rail there, whose node's ranks load it over NVLink; the combine reduces inside each node first and
    sums node by node in ascending order (the result differs from one node's only in rounding each other
    node's partial sum to dtype once, ``reference.prefill_combine(..., ranks_per_node=G)``). Nodes must be
    G consecutive ranks (NotImplementedError otherwise); a loopback group of several ranks per node with
    put peers is refused (its node reduction waits inside the send phase for the node's other ranks).
    The memory grows by a routing plane per zone and a node inbox of N x M rows per zone (``plan``).
    """

    def __init__(self, group, num_experts: int, hidden: int, max_tokens_per_rank: int, topk: int,
                 dtype: torch.dtype = torch.bfloat16, fp8_dispatch: bool = False, zones: int = 1,
                 dispatch_format: str | None = None, combine_format: str | None = None):
        ranks_per_node = None
        if group.uses_put and group.world_size > 1:
            layout = node_layout(group.transports, group.rank)
            if group.backend == "loopback" and layout.ranks_per_node > 1:
                raise NotImplementedError(
                    "PrefillBuffer on a loopback group whose nodes have several ranks and reach the other nodes "
                    "by puts: its combine reduces inside each node within the send phase, waiting for the node's "
                    "other ranks, which a loopback world runs one after another; use the shm heap "
                    "(moe_comm.launch) or MOE_COMM_TRANSPORT=put (nodes of one rank)")
            ranks_per_node = layout.ranks_per_node
        self.plan = self._plan(group.world_size, num_experts, hidden, max_tokens_per_rank, topk, dtype,
                               fp8_dispatch, group.device, zones, ranks_per_node, dispatch_format, combine_format)
        self.group = group
        self.num_experts, self.hidden, self.topk = int(num_experts), int(hidden), int(topk)
        ep = self.plan.ep
        self.max_tokens_per_rank, self.dtype = int(max_tokens_per_rank), dtype
        self.fp8_dispatch = ep.fp8                    # the dispatch sends fp8 (any of the fp8 formats)
        self.dispatch_format = ep.dispatch_format     # (formats.DISPATCH_FORMATS)
        self.combine_format = formats.E4M3 if ep.combine_fp8 else None
        self.num_local_experts = self.plan.ep.experts_per_rank
        self.zones = self.plan.zones
        dev = group.device
        self._stats = torch.zeros(self.num_local_experts, dtype=torch.int64, device=dev)
        self._excluded = torch.zeros(1, dtype=torch.int64, device=dev)
        self._allocated = self._closed = False
        self._calls = 0             # dispatch send phases begun
        self._in_flight = deque()   # handles of this epoch's dispatches whose combine receive has not run
        self._epoch = None          # the group epoch of _in_flight and _next_zone
        self._next_zone = 0         # dispatches of this epoch (the zone of the next one: mod zones)

    # ---- planning --------------------------------------------------------------------------------
    @property
    def plan(self) -> PrefillPlan:
        """Buffers and launch shapes (``moe_comm.planner.PrefillPlan``). Once the buffer has allocated (its
        first call) a new plan may change only launch shapes (``planner.check_replaced_plan``), and every
        zone's launches are rebuilt for it."""
        return self._prefill_plan

    @plan.setter
    def plan(self, p: PrefillPlan) -> None:
        if getattr(self, "_allocated", False):
            check_replaced_plan("PrefillBuffer", self._prefill_plan, p)
        self._prefill_plan = p
        if getattr(self, "_allocated", False):
            for zone in self._zones:
                zone.launches = self._build_launches(zone)

    @staticmethod
    def _plan(world, num_experts, hidden, max_tokens_per_rank, topk, dtype, fp8_dispatch, device,
              zones: int = 1, ranks_per_node: int | None = None, dispatch_format=None,
              combine_format=None) -> PrefillPlan:
        """``ranks_per_node``: G of a group with put peers (``required_bytes(..., ranks_per_node=8)``: the
        memory across nodes of 8 GPUs), None for one node. The formats as EPBuffer's; across nodes the fp8
        combine (the node-first reduction forwards rows of the dtype) and the nvfp4 dispatch (its send is not
        block-uniform compiled with the put path) raise ValueError."""
        ep = EPBuffer._plan(world, num_experts, hidden, max_tokens_per_rank, topk, dtype, fp8_dispatch, device,
                            dispatch_format, combine_format)  # checks sizes and formats
        if ranks_per_node is not None and world > 1 and ep.combine_fp8:
            raise ValueError("combine_format='e4m3' is one node only: across nodes (a group reaching some peers by "
                             "puts) the PrefillBuffer's combine sums each node's rows on that node and forwards the "
                             "sum in the buffer's dtype, so there is no fp8 row to send; use combine_format=None "
                             "there (EPBuffer's fp8 combine works across nodes)")
        if ranks_per_node is not None and world > 1 and ep.nvfp4:
            # Its one-warp send (512-byte tiles: 16-byte stores) compiled with the put path's waits branches
            # per thread around block-wide calls (tests/test_compile_sm90.py's uniformity rule); two warps
            # would halve the stores' width. Refused until the send is restructured.
            raise ValueError("dispatch_format='nvfp4' is one node only in PrefillBuffer: across nodes its send is "
                             "not yet block-uniform when compiled; use an fp8 dispatch_format there (or EPBuffer, "
                             "whose nvfp4 dispatch works across nodes)")
        return plan_prefill(world, num_experts, hidden, max_tokens_per_rank, topk, dtype, False, device,
                            zones, ranks_per_node, ep.dispatch_format, combine_format)

    @property
    def excluded_slots(self) -> torch.Tensor:
        """int64 [1] on the device: this rank's slots whose expert lives on an excluded rank, summed."""
        return self._excluded

    # ---- buffers ---------------------------------------------------------------------------------
    def _allocate(self) -> None:
        p, g = self.plan, self.group
        # The put path stages the payload rows it puts to other nodes (docs/prefill.md "Across nodes"); the
        # combine's own staging is one unused word (it puts from the zone); both stage control words.
        self._dispatch_ch = Channel(g, "prefill.dispatch", (p.zones, p.zone_words), torch.int32,
                                    ctrl_words=p.dispatch_ctrl_words, stage_shape=p.dispatch_stage_shape)
        self._combine_ch = Channel(g, "prefill.combine", p.combine_data_shape, torch.int32,
                                   ctrl_words=p.combine_ctrl_words, stage_shape=(1,))
        self._node_args = dict(g.put_launch_args() if p.put else {"PUT": False}, G=p.ranks_per_node,
                               G_P2=next_pow2(p.ranks_per_node))
        self._dispatch_op = PhasedOp(g, "prefill.dispatch", self._dispatch_ch)
        self._dispatch_op.counters = dict(expert_rows=self._stats, excluded_rows=self._excluded)
        self._combine_op = PhasedOp(g, "prefill.combine", _CombineChannel(self._combine_ch, self._node_args))
        self._dummy = torch.zeros(p.scratch_words, dtype=torch.int32, device=g.device)
        self._zones = [self._zone(z) for z in range(p.zones)]
        self._allocated = True

    def _zone(self, z: int) -> _Zone:
        """Views of landing zone ``z`` (``planner.PrefillPlan`` layout), its call's device tensors and
        every launch that reads or writes it."""
        p, dev = self.plan, self.group.device
        ep, R, H, K = p.ep, p.rows, p.ep.hidden, p.ep.topk
        words = self._dispatch_ch.data.local[z]
        x = words[p.x_offset:p.x_offset + R * ep.x_words].view(
            torch.uint8 if ep.nvfp4 else torch.float8_e4m3fn if ep.fp8 else ep.dtype).view(R, -1)
        scales = (words[p.scales_offset:p.scales_offset + R * ep.scale_words]
                  .view(ep.scale_dtype if ep.fp8 else torch.float8_e4m3fn).view(R, -1) if ep.scale_words else None)
        # the partial rows as the forward kernel reads them (put only: one node has no forward, and its
        # fp8 combine rows are not of the dtype)
        rows = (words[p.x_offset:p.x_offset + R * ep.out_words].view(ep.dtype).view(R, H) if p.put
                else self._dummy.view(ep.dtype))
        inbox = (self._combine_ch.data.local[z].view(ep.dtype).view(p.nodes * ep.max_tokens, H) if p.put
                 else self._dummy.view(ep.dtype))
        zone = _Zone(x, scales, words[:R * K].view(R, K), words[R * K:2 * R * K].view(WEIGHT_DTYPE).view(R, K),
                     routed=torch.zeros((ep.max_tokens, K), dtype=torch.int32, device=dev),
                     src_tokens=torch.zeros(self.group.world_size, dtype=torch.int32, device=dev),
                     counts=torch.zeros(ep.experts_per_rank, dtype=torch.int32, device=dev),
                     peer_ptrs=self._zone_peer_ptrs(z), words=words, rows=rows,
                     stamp=torch.zeros(1, dtype=torch.int64, device=dev), inbox=inbox, launches={})
        zone.launches = self._build_launches(zone)
        return zone

    def _zone_peer_ptrs(self, z: int) -> torch.Tensor:
        """int64 [world]: zone ``z`` on every rank, from the dispatch buffer's peer pointers (0 stays 0)."""
        peers = self._dispatch_ch.data.peer_ptrs
        return torch.where(peers != 0, peers + z * self.plan.zone_words * 4, 0)

    def _build_launches(self, zone: _Zone) -> dict:
        """Every launch of one zone (``moe_comm.launches``): its kernel (for this device), grid and the
        arguments that never change, built when the buffer allocates and again for a new plan (which sizes
        the zones alike: ``plan``): a call adds only its tensors, sizes and their alignment. With puts: the
        pull (receive phase) and the node reduction (``forward``, send phase) too."""
        p, ep, g = self.plan, self.plan.ep, self.group
        dch, cch = self._dispatch_ch, self._combine_ch
        sig = dict(grp=g.state, status_ptr=g.status.local, rank=g.rank, WORLD=g.world_size,
                   WORLD_P2=next_pow2(g.world_size))
        shape = dict(M=ep.max_tokens, TOPK=ep.topk)
        slots = dict(shape, TOPK_P2=next_pow2(ep.topk))
        nodes = self._node_args
        route = dict(ROUTE_OFFSET=p.route_offset if p.put else 0, RW=p.route_words)
        staged = {k: dch.put_args()[k] for k in ("stage_ptr", "stage_ctrl_ptr")}

        def launch(kernel, grid, **static):
            return Launch(kernel, g.device, grid, **static)

        out = dict(
            dispatch_send=launch(
                prefill_dispatch_send_kernel, ep.send_grid, routed_ptr=zone.routed, excluded_ptr=self._excluded,
                data_ptrs_ptr=zone.peer_ptrs, ctrl_ptrs_ptr=dch.ctrl.peer_ptrs, released_ptr=cch.ctrl.local,
                combine_seq_ptr=cch.recv_seq, seq_ptr=dch.send_seq, done_ptr=dch.done, stamp_ptr=zone.stamp,
                num_experts=self.num_experts, **staged,
                OP=op_id("prefill.dispatch"), EXPERTS_PER_RANK=ep.experts_per_rank, HIDDEN=ep.hidden,
                X_WORDS=ep.x_words, S_WORDS=ep.scale_words, X_OFFSET=p.x_offset, CTRL_WORDS=p.dispatch_ctrl_words,
                BT=ep.block_tokens, BW=ep.send_block_words, ROUTE_T=ep.route_tokens,
                BINS=histogram_bins(self.num_experts), FP8=ep.fp8, FP8_GROUPS=ep.fp8_block_groups,
                SCALE=ep.scale_mode, S_BLOCK=ep.scale_block_words, NVFP4=ep.nvfp4, NVFP4_GROUPS=ep.nvfp4_block_groups,
                NBLK=ep.send_programs, num_warps=ep.send_warps, NODES=p.nodes, NODES_P2=next_pow2(p.nodes),
                COUNT_SPAN=p.count_span, **route, **nodes, **slots, **sig),
            dispatch_recv=launch(
                prefill_dispatch_recv_kernel, (1,), src_tokens_ptr=zone.src_tokens, counts_ptr=zone.counts,
                stats_ptr=self._stats, ctrl_ptr=dch.ctrl.local, ctrl_ptrs_ptr=dch.ctrl.peer_ptrs, seq_ptr=dch.recv_seq,
                OP=op_id("prefill.dispatch"), EXPERTS_PER_RANK=ep.experts_per_rank,
                EXPERTS_P2=next_pow2(ep.experts_per_rank), CTRL_WORDS=p.dispatch_ctrl_words, NVFP4=ep.nvfp4,
                **nodes, **shape, **sig),
            combine_send=launch(
                prefill_combine_send_kernel, (p.copy_programs,), zone_ptr=zone.words,
                src_tokens_ptr=zone.src_tokens, ctrl_ptrs_ptr=cch.ctrl.peer_ptrs, seq_ptr=cch.send_seq,
                done_ptr=cch.done, OUT_WORDS=ep.out_words, X_OFFSET=p.x_offset, BR=p.copy_rows,
                BW=p.copy_words * 4 // ep.elem_size if ep.combine_fp8 else p.copy_words,   # fp8: elements
                ROW_WORDS=ep.combine_words, HIDDEN=ep.hidden, FP8=ep.combine_fp8, NBLK=p.copy_programs, **nodes,
                **slots, **sig),
            combine_recv=launch(
                prefill_combine_recv_kernel, ep.reduce_grid, routed_ptr=zone.routed, data_ptrs_ptr=zone.peer_ptrs,
                inbox_ptr=zone.inbox, ctrl_ptr=cch.ctrl.local, ctrl_ptrs_ptr=cch.ctrl.peer_ptrs, seq_ptr=cch.recv_seq,
                done_ptr=cch.done, OP=op_id("prefill.combine"), HIDDEN=ep.hidden, ROW_BYTES=ep.combine_words * 4,
                X_OFFSET=p.x_offset, BT=ep.block_tokens, BH=ep.block_hidden, NBLK=ep.reduce_programs,
                FP8=ep.combine_fp8, **nodes, **slots, **sig, num_warps=ep.reduce_warps))
        if p.put:
            grid = (p.node_programs, g.world_size)
            sig.pop("WORLD_P2")
            out["dispatch_pull"] = launch(
                prefill_dispatch_pull_kernel, grid, data_ptrs_ptr=zone.peer_ptrs, src_tokens_ptr=zone.src_tokens,
                stamp_ptr=zone.stamp, ctrl_ptr=dch.ctrl.local, ctrl_ptrs_ptr=dch.ctrl.peer_ptrs, seq_ptr=dch.recv_seq,
                done_ptr=dch.done, OP=op_id("prefill.dispatch"), CTRL_WORDS=p.dispatch_ctrl_words,
                EXPERTS_PER_RANK=ep.experts_per_rank, X_WORDS=ep.x_words,
                S_WORDS=ep.scale_words, X_OFFSET=p.x_offset, BT=p.pull_tokens, BW=p.pull_words,
                S_BW=next_pow2(max(1, ep.scale_words)), ALIGNED=ep.x_words % 4 == 0,
                WORLD_P2=next_pow2(g.world_size), **route, **nodes, **slots, **sig)
            out["combine_forward"] = launch(
                prefill_combine_forward_kernel, grid, rows_ptr=zone.rows, zone_ptr=zone.words,
                data_ptrs_ptr=zone.peer_ptrs, inbox_ptr=zone.inbox,
                src_tokens_ptr=zone.src_tokens, stamp_ptr=zone.stamp, ctrl_ptr=cch.ctrl.local,
                ctrl_ptrs_ptr=cch.ctrl.peer_ptrs, seq_ptr=cch.send_seq, done_ptr=cch.done,
                OP=op_id("prefill.combine"), EXPERTS_PER_RANK=ep.experts_per_rank, HIDDEN=ep.hidden,
                OUT_WORDS=ep.out_words, X_OFFSET=p.x_offset, BT=ep.block_tokens, BH=ep.block_hidden,
                ALIGNED=ep.out_words % 4 == 0, WORLD_P2=next_pow2(g.world_size), **route, **nodes, **slots, **sig)
        return out

    def _in_flight_now(self) -> deque:
        """The in-flight handles of the group's current epoch. A new epoch (``reset()``, ``exclude()``)
        drops the others, starts the zones over (every rank's counters restart together) and re-derives
        the zones' peer pointers from the buffer's (an exclusion points an excluded peer's at this rank's
        own copy)."""
        if self._epoch != self.group.epoch:
            self._epoch, self._next_zone = self.group.epoch, 0
            self._in_flight.clear()
            for z, zone in enumerate(self._zones):
                zone.peer_ptrs.copy_(self._zone_peer_ptrs(z))
        return self._in_flight

    # ---- dispatch --------------------------------------------------------------------------------
    def _check_dispatch_inputs(self, x, topk_idx, topk_weights, global_scale) -> int:
        ep, dev = self.plan.ep, self.group.device
        if isinstance(x, tuple):
            self._check_prequantized(x)
            x = x[0]
        else:
            check_tensor("x", x, dev, (ep.dtype,), (None, ep.hidden))
        T = x.shape[0]
        if T > ep.max_tokens:
            raise ValueError(f"x has {T} tokens, max_tokens_per_rank is {ep.max_tokens}: build the PrefillBuffer "
                             f"with a larger max_tokens_per_rank, or dispatch the batch in chunks of at most "
                             f"{ep.max_tokens} tokens")
        check_tensor("topk_idx", topk_idx, dev, (torch.int32, torch.int64), (T, ep.topk))
        check_tensor("topk_weights", topk_weights, dev, (WEIGHT_DTYPE,), (T, ep.topk))
        check_global_scale(global_scale, ep.nvfp4, dev)
        if not (ep.fp8 or ep.nvfp4):   # copied as words (quantizing sends read elements)
            check_words("x", x)
        return T

    def _check_prequantized(self, x: tuple) -> None:
        """A pre-quantized x = (codes, scales) of this buffer's format (class docstring), or the error that
        names the fix."""
        ep, dev, fmt = self.plan.ep, self.group.device, self.dispatch_format
        if not ep.fp8:
            raise TypeError(f"x is a (codes, scales) tuple, but this PrefillBuffer dispatches "
                            f"{'nvfp4' if ep.nvfp4 else self.dtype} (dispatch_format={fmt!r}): build it with "
                            "dispatch_format='e4m3' (float32 scales per 128 columns), 'e4m3-pow2' or 'e4m3-ue8m0' "
                            "(int32 packed UE8M0) to dispatch pre-quantized fp8 tokens, or pass unquantized x")
        if len(x) != 2:
            raise ValueError(f"a pre-quantized x is a tuple (codes, scales), got a tuple of {len(x)}")
        codes, scales = x
        check_tensor("x[0] (the fp8 codes)", codes, dev, (torch.float8_e4m3fn,), (None, ep.hidden))
        want = (codes.shape[0], ep.scale_words)
        if isinstance(scales, torch.Tensor) and (scales.dtype != ep.scale_dtype or tuple(scales.shape) != want):
            other = [f for f in formats.FP8_FORMATS
                     if formats.scale_dtype(f) == scales.dtype and scales.dim() == 2
                     and formats.scale_columns(f, ep.hidden) == scales.shape[-1]]
            fix = (f"build the PrefillBuffer with dispatch_format={other[0]!r} for these scales" if other else
                   f"pass scales of {fmt!r}: reference.quantize_fp8(x, fmt={fmt!r})")
            raise ValueError(f"x[1] (the scales) is {scales.dtype} {tuple(scales.shape)}; this PrefillBuffer's format "
                             f"{fmt!r} takes {ep.scale_dtype} {want} ([T, hidden // "
                             f"{ep.hidden // max(1, ep.scale_words)}]): {fix}")
        check_tensor("x[1] (the scales)", scales, dev, (ep.scale_dtype,), want)

    def dispatch(self, x: torch.Tensor | tuple | None = None, topk_idx: torch.Tensor | None = None,
                 topk_weights: torch.Tensor | None = None, *, phase: str = "both",
                 global_scale: torch.Tensor | None = None) -> PrefillDispatchResult | None:
        """Send this rank's tokens, once per rank holding one of their experts, into those ranks' zones; see
        the class docstring. phase="recv" takes no tensors."""
        self._ensure_allocated()
        g, op = self.group, self._dispatch_op
        in_flight = self._in_flight_now()
        if phase != "recv" and len(in_flight) == self.zones:
            raise RuntimeError(f"PrefillBuffer: the previous dispatch has not been combined (both phases); every "
                               f"dispatch is answered by one combine, and with zones={self.zones} at most "
                               f"{self.zones} may be in flight (the next one would write a landing zone still "
                               f"being read)")
        do_send, do_recv = op.begin(phase)
        if do_send:
            T = op.validate(lambda: self._check_dispatch_inputs(x, topk_idx, topk_weights, global_scale))
            self._combine_ch.after_previous()   # CUDA: after this rank's latest combine, which read the zones
            op.before_send()
            zone = self._next_zone % self.zones
            handle = PrefillHandle(self._calls, T, self._zones[zone].routed, id(self), g.epoch, zone)
            self._calls += 1
            self._next_zone += 1
            in_flight.append(handle)
            prequant = isinstance(x, tuple) and T > 0   # (codes, scales): copied as they are
            sin = self._dummy
            if prequant:   # codes as bytes, scales as words: copied, never converted
                xin, sin = x[0].contiguous().view(torch.uint8), x[1].contiguous().view(torch.int32)
                idx, w = topk_idx.contiguous(), topk_weights.contiguous()
            elif T > 0:
                xin = x.contiguous()   # the kernel reads its rows as words
                idx, w = topk_idx.contiguous(), topk_weights.contiguous()
            else:  # never read (T = 0), but the kernel needs valid pointers (of x's dtype: one compiled variant)
                xin, idx, w = self._dummy.view(self.dtype), self._dummy, self._dummy.view(WEIGHT_DTYPE)
            gs = global_scale if self.plan.ep.nvfp4 else self._dummy.view(torch.float32)   # read only with nvfp4
            send = self._zones[zone].launches["dispatch_send"]
            send.run(x_ptr=xin, scales_ptr=sin, idx_ptr=idx, weights_ptr=w, gscale_ptr=gs, num_tokens=T,
                     PREQUANT=prequant, ALIGNED=send.aligned_with(xin, sin))
            op.sent((handle, global_scale))
            if not do_recv:
                return None
        handle, global_scale = op.take()
        z = self._zones[handle.zone]
        z.launches["dispatch_recv"].run()
        if self.plan.put:   # the rows of the other nodes' sources, from their rails on this node
            z.launches["dispatch_pull"].run()
        return op.finish(PrefillDispatchResult(z.recv_x, z.recv_scales, z.recv_idx, z.recv_weights, z.src_tokens,
                                               z.counts, handle, global_scale))

    # ---- combine ---------------------------------------------------------------------------------
    def _check_handle(self, handle) -> None:
        if not isinstance(handle, PrefillHandle) or handle.owner != id(self):
            raise TypeError(f"handle must be the PrefillDispatchResult.handle of a dispatch on this PrefillBuffer, "
                            f"got {type(handle).__name__}")
        if handle.epoch != self.group.epoch:
            raise ValueError("stale handle: its dispatch was made before group.reset()/exclude()")
        in_flight = self._in_flight_now()
        if (not in_flight or handle is not in_flight[0]
                or (handle is in_flight[-1] and self._dispatch_op.pending is not None)):
            raise ValueError("stale handle: a handle is valid for one combine, that of the oldest dispatch not yet "
                             "combined, once its phase='recv' has run")

    def _check_outside_zones(self, expert_out) -> None:
        """ValueError if ``expert_out`` overlaps the landing zones (the fp8 combine's send writes its rows
        there while it reads: another program's rows could be overwritten before they are read)."""
        zones = self._dispatch_ch.data.local
        lo, hi = zones.data_ptr(), zones.data_ptr() + zones.numel() * zones.element_size()
        start = expert_out.data_ptr()
        if start < hi and start + expert_out.numel() * expert_out.element_size() > lo:
            raise ValueError("expert_out lies in this PrefillBuffer's landing zone (e.g. recv_x): with "
                             "combine_format='e4m3' the combine quantizes the partial rows into the zone, so they "
                             "must come from a tensor of their own (torch.empty_like(d.recv_x, dtype=...) or a "
                             ".clone())")

    def _check_out(self, T, out) -> None:
        if out is not None:
            check_tensor("out", out, self.group.device, (self.dtype,), (T, self.hidden))
            if not out.is_contiguous():
                raise ValueError("out must be contiguous (it is written in place)")

    def combine(self, expert_out: torch.Tensor | None = None, handle: PrefillHandle | None = None, *,
                out: torch.Tensor | None = None, phase: str = "both") -> torch.Tensor | None:
        """Sum every rank's partial rows of this rank's tokens (see the class docstring). phase="recv" takes
        no tensors but ``out`` (which then replaces the send's)."""
        if self._closed:
            raise ClosedError("PrefillBuffer: used after close()")
        if self._calls == 0:
            raise RuntimeError("combine needs the handle of a dispatch on this PrefillBuffer; none has run yet")
        p, g, op = self.plan, self.group, self._combine_op
        do_send, do_recv = op.begin(phase)
        if do_send:
            in_flight = self._in_flight_now()
            R, H = p.rows, self.hidden

            def check():
                self._check_handle(handle)
                check_tensor("expert_out", expert_out, g.device, (self.dtype,), (R, H))
                if p.ep.combine_fp8:   # quantized into the zone: it must not be read from there
                    self._check_outside_zones(expert_out)
                else:                  # copied as words
                    check_words("expert_out", expert_out)
                self._check_out(handle.num_tokens, out)
            try:
                op.validate(check)
            except (TypeError, ValueError):
                if in_flight and handle is in_flight[0]:
                    in_flight.popleft()   # a refused combine answers its dispatch (the call is aborted)
                raise
            op.before_send()
            in_place = (expert_out.data_ptr() == self._zones[handle.zone].recv_x.data_ptr()
                        and self.dispatch_format is None and not p.ep.combine_fp8)
            src = self._dummy.view(self.dtype) if in_place else expert_out.contiguous()   # read as words
            send = self._zones[handle.zone].launches["combine_send"]
            send.run(expert_out_ptr=src, IN_PLACE=in_place, ALIGNED=send.aligned_with(src))
            if p.put:   # the node reduction of the tokens of the other nodes' sources this rank is the rail of
                self._zones[handle.zone].launches["combine_forward"].run()
            op.sent((handle, out))
            if not do_recv:
                return None
        handle, out0 = op.pending
        self._check_out(handle.num_tokens, out)   # before taking: a refused output keeps the call pending
        op.take()
        in_flight = self._in_flight_now()
        if in_flight and in_flight[0] is handle:
            in_flight.popleft()   # its zone is free once this receive has read it (the next dispatch's wait)
        T, out = handle.num_tokens, out0 if out is None else out
        if out is None:
            out = torch.empty((T, self.hidden), dtype=self.dtype, device=g.device)
        recv = self._zones[handle.zone].launches["combine_recv"]
        recv.run(out_ptr=out if T > 0 else self._dummy.view(self.dtype), num_tokens=T, ALIGNED=recv.aligned_with(out))
        return op.finish(out)
