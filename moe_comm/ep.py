"""EPBuffer: expert-parallel dispatch and combine for decode, fused Triton kernels over symmetric memory.

A decode step calls ``dispatch`` and ``combine`` once per MoE layer each. Both are built for latency:
one send kernel and one receive kernel per call (one kernel at world 1), no host synchronization, no
atomics on remote memory, fixed launch shapes (CUDA-graph capturable), bounded waits. See ``EPBuffer``
for the contract.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import formats
from .channel import Channel
from .checks import check_tensor, check_words
from .errors import ClosedError, op_id
from .interpreter import kernel_for
from .launches import Launch, LaunchTable
from .op_buffer import OpBuffer
from .phased import PhasedOp
from .planner import VEC_BYTES, EPPlan, check_replaced_plan, next_pow2, plan_ep, vector_aligned
from .triton_kernels.combine import combine_recv_kernel, combine_send_kernel
from .triton_kernels.dispatch import dispatch_recv_kernel, dispatch_send_kernel
from .triton_kernels.dispatch_local import dispatch_local_kernel
from .triton_kernels.ready import signal_kernel
from .triton_kernels.routing import histogram_bins

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
DTYPE_FIX = "build the EPBuffer with EPBuffer(..., dtype={dtype}) (supported: bfloat16, float16, float32)"


@dataclass
class EPHandle:
    """What ``combine`` needs from one dispatch. Valid until two more dispatch calls on the same buffer.

    All tensors live on the group's device and belong to the buffer (two alternating sets).
    """

    call_index: int           # dispatch calls on this buffer before this one (selects the set)
    num_tokens: int           # T: tokens this rank dispatched (the combine returns [T, hidden])
    row_of: torch.Tensor      # int32 [world, M, topk]: for slot (s, t, k) routed here, the flat row
    #                           e * world*M + i of d.x that holds it; -1 = not routed here, -2 = dropped
    src_tokens: torch.Tensor  # int32 [world]: rows of each source rank in the dispatch's landing zone (its
    #                           tokens; for a put source, its tokens routed here)
    routed: torch.Tensor      # int32 [M, topk]: 1 + the expert's rank where this rank's slot (t, k) is routed
    #                           (valid id, live rank), else 0
    owner: int                # id() of the EPBuffer that made it
    epoch: int = 0            # group epoch when it was made (a handle does not survive group.reset())


@dataclass
class DispatchResult:
    """What one rank receives from ``EPBuffer.dispatch`` (E_local = experts per rank, R = world * M).

    x       [E_local, R, hidden] dtype, or float8_e4m3fn with an fp8 dispatch format, or with
            dispatch_format="nvfp4" uint8 [E_local, R, hidden // 2] (two e2m1 codes per byte, element 2j in
            the low nibble: ``.view(torch.float4_e2m1fn_x2)`` is the same bytes). Rows x[e, :counts[e]]
            hold the tokens routed to local expert e, packed and sorted by (source rank, token index, k);
            rows past counts[e] are unspecified. Overwritten by the next dispatch's receive phase.
    scales  with an fp8 format (x[e, i] ~= x8 * scale per 128 columns; ``moe_comm.formats``): float32
            [E_local, R, hidden // 128] ("e4m3": amax / 448; "e4m3-pow2": powers of two), or int32
            [E_local, R, hidden // 512] ("e4m3-ue8m0": the exponents e + 127 of the power-of-two scales,
            byte j of word i for group 4i + j, DeepEP's packing); float8_e4m3fn [E_local, R, hidden // 16]
            with nvfp4 (one per 16 columns, linear layout: swizzle it for a block-scaled GEMM); else None.
            Same validity as x.
    counts  int32 [E_local] on the device: valid rows per local expert (never read by the library).
    src     int32 [E_local, R]: source_rank * max_tokens_per_rank + token_index of each valid row.
    handle  EPHandle for ``combine``. counts, src and handle alternate between two sets: they stay
            valid until two more dispatch calls have started.
    global_scale  with nvfp4, the float32 [1] tensor given to the dispatch (every rank passes the same:
            x ~= e2m1 * scale / global_scale, ``reference.dequantize_nvfp4``; a source whose scale
            differs raises GlobalScaleError, its rows kept as sent), else None.
    """

    x: torch.Tensor
    scales: torch.Tensor | None
    counts: torch.Tensor
    src: torch.Tensor
    handle: EPHandle
    global_scale: torch.Tensor | None = None


@dataclass
class ArrivalWords:
    """Where a kernel of your own (a GEMM on d.x) waits for a dispatch's rows, source by source, while the
    receive is still running (world > 1; ``EPBuffer.arrival``, docs/moe-layer.md "Your own GEMM", and the
    Triton helpers of ``moe_comm.triton_kernels.arrival``). All tensors on the group's device.

    words   int64 [W]: words[s] becomes the call's flag (``arrival.arrival_flag``) once the receive has
            written source s's rows of every local expert into d.x (a release at system scope: acquire it);
            an excluded source's word too (it sends nothing); a source whose wait failed never
    counts  int32 [W, E_local + 1]: counts[s, e] = rows of local expert e from source s, written before
            words[s]; source s's rows of e are d.x[e, base : base + counts[s, e]] with base = the sum of
            counts[s', e] over s' < s (known once every s' <= s has arrived)
    call    int64 [1]: the dispatch channel's send count: the call's number once its send phase has run
    state   int64: the group state (its epoch: the flag is ``epoch << EPOCH_SHIFT | call``)
    status  int64: this rank's status words (a consumer's bounded wait reads and writes them)
    x       d.x: [E_local, W * max_tokens_per_rank, hidden] (the receive writes it; the same tensor every call)
    The words alternate between two sets like the rest of the metadata: valid until two more dispatches.
    """

    words: torch.Tensor
    counts: torch.Tensor
    call: torch.Tensor
    state: torch.Tensor
    status: torch.Tensor
    x: torch.Tensor


@dataclass
class ReadyWords:
    """Where a kernel of your own (the expert GEMM writing ``expert_out``) marks each local expert ready, so
    that ``combine(..., ready=words, phase="send")`` can be launched before every expert is done
    (``EPBuffer.ready_words``, docs/moe-layer.md "Ready words", the Triton helpers of
    ``moe_comm.triton_kernels.ready``). All tensors on the group's device; the same every call.

    words   int64 [E_local]: words[e] = the flag of the combine call that sends expert e's rows
            (``ready.ready_flag``), stored with a release at system scope once ALL of e's rows of expert_out
            are written (``ready.signal_expert``, or ``signal``). Set every local expert once per call
            (one with no rows too): the send finishes only once each one is
    call    int64 [1]: the combine's send count (advanced at the end of each send): the flag's call is call + 1,
            so read it in a kernel ordered after the previous combine call
    state   int64: the group state (its epoch: the flag is ``epoch << EPOCH_SHIFT | call + 1``, so a signal of
            an earlier call or epoch never satisfies a wait)
    """

    words: torch.Tensor
    call: torch.Tensor
    state: torch.Tensor

    def signal(self, experts: torch.Tensor | None = None) -> None:
        """Mark local experts ready from the current stream (after the work queued on it, e.g. a torch GEMM
        of those experts): ``experts`` an int64 tensor of local expert ids on the group's device (None:
        every one). One small kernel: the flag is computed on the device (nothing is read on the host),
        each word stored with a release at system scope. Capturable."""
        ids = self.words if experts is None else experts   # (all: not read)
        if ids.dtype != torch.int64 or ids.device != self.words.device or ids.dim() != 1:
            raise TypeError(f"experts must be a 1-d int64 tensor of local expert ids on {self.words.device}, "
                            f"got {ids.dtype} {tuple(ids.shape)} on {ids.device}")
        kernel_for(signal_kernel, self.words.device)[(1,)](self.words, ids, ids.numel(), self.state, self.call,
                                                         EXPERTS=self.words.numel(),
                                                         BLOCK=next_pow2(self.words.numel()), ALL=experts is None)


def check_global_scale(global_scale, nvfp4: bool, device) -> None:
    """The nvfp4 dispatch's ``global_scale``: required there (float32, one element, on ``device``), refused
    elsewhere (it would be ignored)."""
    if not nvfp4:
        if global_scale is not None:
            raise ValueError("global_scale is the nvfp4 dispatch's: this buffer's dispatch_format is not 'nvfp4' "
                             "(drop global_scale, or build the buffer with dispatch_format='nvfp4')")
        return
    if global_scale is None:
        raise TypeError("dispatch_format='nvfp4' needs global_scale=: a float32 tensor of one element on the "
                        "group's device, the same on every rank (the layer's calibrated input scale, or "
                        "moe_comm.reference.nvfp4_global_scale of the max |x| all-reduced over the ranks)")
    check_tensor("global_scale", global_scale, device, (torch.float32,))
    if global_scale.numel() != 1:
        raise ValueError(f"global_scale has shape {tuple(global_scale.shape)}: pass one element (shape (1,) or ())")


class _Set:
    """One of the two alternating metadata sets (tiny: no reason not to double-buffer them)."""

    def __init__(self, p: EPPlan, dev):
        L, cap, w, m, k = p.experts_per_rank, p.capacity, p.world, p.max_tokens, p.topk
        self.src = torch.zeros((L, cap), dtype=torch.int32, device=dev)
        self.counts = torch.zeros(L, dtype=torch.int32, device=dev)
        self.row_of = torch.full((w, m, k), -1, dtype=torch.int32, device=dev)
        self.src_tokens = torch.zeros(w, dtype=torch.int32, device=dev)
        self.routed = torch.zeros((m, k), dtype=torch.int32, device=dev)
        # runs     int32 [w, L + 1]: rows received from each source per local expert, then (put transport)
        #          the source's run base (its slots routed to lower ranks' experts), from the control words
        # arrival  int64 [w]: the receive's arrival words (``ArrivalWords``): arrival[s] = the call's flag
        #          once source s's rows are in d.x
        self.runs = torch.zeros((w, L + 1), dtype=torch.int32, device=dev)
        self.arrival = torch.zeros(w, dtype=torch.int64, device=dev)
        # Put transport only (``EPPlan.put``; else placeholders, never read): where the combine's runs go.
        #   slot_key int32 [m, k]: position * BINS + expert id of this rank's slot (t, k) (valid where routed)
        #   id_base  int32 [BINS]: this rank's slots with a lower expert id (slots sort by (id, position))
        if p.put:
            self.slot_key = torch.zeros((m, k), dtype=torch.int32, device=dev)
            self.id_base = torch.zeros(histogram_bins(p.num_experts), dtype=torch.int32, device=dev)
        else:
            self.slot_key = self.id_base = self.src_tokens


class EPBuffer(OpBuffer):
    """Expert-parallel dispatch / combine buffers of one rank (DeepEP low-latency style, for decode).

    ``EPBuffer(group, num_experts, hidden, max_tokens_per_rank, topk, dtype=torch.bfloat16,
    fp8_dispatch=False, dispatch_format=None, combine_format=None)``: rank r owns experts [r*E_local,
    (r+1)*E_local), E_local = num_experts // world. Formats (``moe_comm.formats``, docs/formats.md):
    dispatch_format None (dtype), "e4m3" (fp8 with float32 amax / 448 scales: DeepEP's use_fp8;
    ``fp8_dispatch=True`` is the same, the older spelling), "e4m3-pow2" (float32 scales rounded up to powers
    of two: DeepEP's round_scale), "e4m3-ue8m0" (those powers of two as UE8M0 exponents packed four per
    int32: DeepEP's use_ue8m0; hidden % 512 == 0) or "nvfp4" (TensorRT-LLM's NVFP4); combine_format None
    (dtype) or "e4m3" (the fp8 combine). The buffer keeps them in ``dispatch_format`` / ``combine_format``
    (``fp8_dispatch`` is True for every fp8 format). A combination a buffer cannot take (nvfp4 without
    hidden % 64 == 0, an fp8 combine of float32, fp8_dispatch=True with another dispatch_format, ...)
    raises ValueError/TypeError here, naming the fix.
    Every rank builds its EPBuffer in the same order (buffers are collective); on a loopback world build
    one per group, in rank order. Symmetric memory is allocated by the first ``dispatch`` (collective:
    every rank calls it); run one eager call before capturing a CUDA graph.

    dispatch(x, topk_idx, *, phase="both", global_scale=None) -> DispatchResult (None for phase="send")
        x         [T, hidden] dtype on group.device, 0 <= T <= max_tokens_per_rank (T = 0 still takes
                  part: every rank calls every phase of every op). Its rows are copied as 4-byte words: a
                  contiguous x that starts off a 4-byte boundary (a bf16 view at an odd element) raises
                  ValueError (``x.clone()`` fixes it); a non-contiguous one is copied first.
        topk_idx  [T, topk] int32/int64: expert ids; -1 = slot not routed. Ids outside [-1, num_experts)
                  are not routed either and raise InvalidIndexError (a ValueError) at the next check.
        global_scale  nvfp4 only (required there): float32 tensor of one element on group.device, finite
                  and > 0, the same on every rank (TensorRT-LLM's 448 * 6 / amax: a layer's calibrated
                  input scale, or ``reference.nvfp4_global_scale`` of the max |x| all-reduced over the
                  ranks); read on the device (capturable). It travels with the control words and every
                  receiver compares each live source's with its own (whether rows came or not): every
                  rank whose scale differs from another rank's raises GlobalScaleError (a ValueError
                  carrying the result, the rows kept as sent) at the end of the call
        Each token is read once and crosses to a rank at most once, however many of its experts live
        there; with an fp8 dispatch format it is quantized on the way (float8_e4m3fn, one scale per 128
        columns, in the format dispatch_format names: DeepEP's formats, bit for bit, see
        ``moe_comm.formats`` and reference.quantize_fp8), with nvfp4 to TensorRT-LLM's NVFP4
        (reference.quantize_nvfp4). See DispatchResult for the outputs.

    combine(expert_out, topk_weights, handle, *, out=None, phase="both", ready=None) -> [T, hidden] dtype
        expert_out    [E_local, R, hidden] dtype: row i of expert e is the output for d.x[e, i] (only
                      rows i < counts[e] are read); on a word boundary at world > 1, as x
        topk_weights  [T, topk] floating, the dispatch's T and topk
        handle        the DispatchResult.handle of the dispatch being answered
        out           optional [T, hidden] dtype contiguous tensor, written in place and returned
        y[t] = sum over k = 0..topk-1 with topk_idx[t, k] valid of topk_weights[t, k] * expert_out[row
        of (t, k)], in float32 in ascending k, then cast: bitwise reproducible across runs and world
        sizes. Tokens with no routed slot get zeros. With combine_format="e4m3" every row enters the sum
        as reference.fp8_round_trip of it (sent as float8_e4m3fn + a float32 scale per 128 columns;
        the token's rank's own rows quantized the same way): still reproducible across runs and world
        sizes, about half the bytes, and the error docs/formats.md measures.
        ready         optional ``ReadyWords`` of this buffer (``ready_words()``): expert_out need not be
                      written yet when the send phase is launched. The send (a kernel at every world size
                      then, world 1 included) reads expert e's rows only once words[e] holds this call's
                      flag, and ends only once every local expert's does, so the receive (ordered after the
                      send) reads this rank's own rows in place once they are ready. A local expert not
                      signalled within group.timeout_s fails the group: CommTimeoutError of op
                      "combine_ready" naming the rank and expert (``err.expert``), on every rank, until
                      group.reset(). Same results, bit for bit, as without it.

    Phases: ``phase="send"`` then ``phase="recv"`` split a call for overlap (the receive phase takes no
    tensors; the ones given to the send phase are used, except that ``topk_weights``/``out`` may be
    given at either; the combine's receive reads this rank's own share of ``expert_out`` in place, so
    keep it unchanged until then), on the same or different streams (on CUDA every launch of an op waits
    for its previous one on this rank: ``moe_comm.channel.Channel``). Loopback worlds must be driven
    that way (all ranks' sends, then all receives). At world 1 nothing crosses ranks, so each call is one kernel, run by the receive phase:
    the dispatch writes d.x straight from ``x`` and the combine reads every row of ``expert_out`` in
    place. A split world-1 dispatch copies ``x`` and ``topk_idx`` in its send phase, so that, as at any
    world size, they may change once the send phase returns.
    Calls alternate between two buffer sets, so dispatch i+1 may start while the outputs of dispatch i
    are read, except d.x / d.scales, of which there is one set: they are overwritten by the next
    dispatch's receive phase.

    Graph semantics: every launch has a fixed shape and reads counts only on the device; call counters
    live on the device, so a captured dispatch/combine replays correctly with new inputs. Nothing is
    read on the host except, on CPU, the error word after each call.

    Faults: waits are bounded by group.timeout_s; a dead or absent peer makes the waiting ranks record
    CommTimeoutError naming it (raised at the next check; on CPU right after the call). Counts from
    peers are clamped: no value can cause an out-of-bounds store. A local expert receiving more than R
    rows (possible only if tokens list the same expert several times) keeps the first R, the combine
    treats the rest as zero rows, and CapacityError is raised.

    Statistics: ``expert_token_counts`` (int64 [E_local], device) accumulates the rows received per local
    expert across calls, for load balancing; ``reset_expert_token_counts()`` zeroes it.

    Memory (``buffer_bytes``, from ``moe_comm.planner.EPPlan``; W world, M max_tokens_per_rank):
    symmetric 2*W*M*(p + 4*topk) bytes of dispatch landing zone + 2*M*topk*c of combine landing zone (c =
    H*elem, or H + H/32 rounded up to 16 with combine_format="e4m3"), local E_local*W*M*p for d.x (p =
    payload bytes per token: H*elem, or H + H/32 with fp8, H + H/128 with packed UE8M0, H/2 + H/16 with
    nvfp4), plus
    small metadata. DeepSeek-V3 decode (256 experts, hidden 7168, top-8, 128
    tokens per rank, EP8): 0.49 GiB per GPU in bf16, 0.27 GiB with fp8, against 1.78 GiB for DeepEP's
    low-latency buffer. ``EPBuffer.required_bytes(...)`` evaluates it without a group or allocation.
    """

    # Whether the receive writes d.x (and d.scales). A consumer that reads the rows where they landed
    # (moe_comm.MoELayer's fused kernels) builds the buffer without: d.x is then not allocated and the
    # receive writes only the metadata (counts, src, row_of, ...).
    _copies_rows = True

    def __init__(self, group, num_experts: int, hidden: int, max_tokens_per_rank: int, topk: int,
                 dtype: torch.dtype = torch.bfloat16, fp8_dispatch: bool = False, dispatch_format: str | None = None,
                 combine_format: str | None = None):
        self.group = group
        self.plan = self._plan(group.world_size, num_experts, hidden, max_tokens_per_rank, topk, dtype,
                               fp8_dispatch, group.device, dispatch_format, combine_format)
        self.num_experts, self.hidden, self.topk = int(num_experts), int(hidden), int(topk)
        self.max_tokens_per_rank, self.dtype = int(max_tokens_per_rank), dtype
        p = self.plan
        self.fp8_dispatch = p.fp8                   # the dispatch sends fp8 (any of the fp8 formats)
        self.dispatch_format = p.dispatch_format    # (formats.DISPATCH_FORMATS)
        self.combine_format = formats.E4M3 if p.combine_fp8 else None
        self.num_local_experts = self.plan.experts_per_rank
        self._stats = torch.zeros(self.num_local_experts, dtype=torch.int64, device=group.device)
        self._excluded = torch.zeros(1, dtype=torch.int64, device=group.device)
        self._allocated = False
        self._closed = False
        self._calls = 0               # dispatch send phases begun (picks the metadata set)
        self._launch_table = LaunchTable()   # the launches of the plan in force (``_launches``)

    # ---- planning --------------------------------------------------------------------------------
    @property
    def plan(self) -> EPPlan:
        """Buffers and launch shapes (``moe_comm.planner.EPPlan``). The calls read ``_ep_plan`` (a property
        costs a call, and they run at every step)."""
        return self._ep_plan

    @plan.setter
    def plan(self, p: EPPlan) -> None:
        # A group that reaches a peer by puts needs the put layout (EPPlan.with_put), whoever sets the plan.
        p = p.with_put() if self.group.uses_put and self.group.world_size > 1 and not p.put else p
        if getattr(self, "_allocated", False):   # buffers exist: only launch shapes may change
            check_replaced_plan("EPBuffer", self._ep_plan, p)
        self._ep_plan = p

    @staticmethod
    def _plan(world, num_experts, hidden, max_tokens_per_rank, topk, dtype, fp8_dispatch, device,
              dispatch_format=None, combine_format=None) -> EPPlan:
        for name, v in (("num_experts", num_experts), ("hidden", hidden),
                        ("max_tokens_per_rank", max_tokens_per_rank), ("topk", topk)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if num_experts % world:
            raise ValueError(f"num_experts={num_experts} must be a multiple of world_size={world} (rank r owns "
                             f"experts [r*E/W, (r+1)*E/W)): use {-(-num_experts // world) * world} experts, the "
                             f"extra ones selected by no token, or a world size that divides {num_experts}")
        if dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype!r}")
        fmt, combine = formats.resolve(hidden, dtype, fp8_dispatch, dispatch_format, combine_format)
        formats.check_compiled(fmt, device)
        if hidden * torch.empty((), dtype=dtype).element_size() % VEC_BYTES:
            raise ValueError(f"hidden * element size must be a multiple of {VEC_BYTES} bytes (rows move as 16-byte "
                             f"vectors), got hidden={hidden} {dtype}")
        if (num_experts // world) * max_tokens_per_rank * topk >= 2 ** 31:
            raise ValueError("experts per rank * max_tokens_per_rank * topk must stay below 2**31")
        return plan_ep(world, num_experts, hidden, max_tokens_per_rank, topk, dtype, False, device,
                       dispatch_format=fmt, combine_format=combine)

    @property
    def dispatch_wait_stats(self) -> torch.Tensor:
        """int64 [2, W] on the device, with the flight recorder on (``moe_comm/trace``; zeros when off):
        [0, j] nanoseconds this rank's dispatch receives waited for rank j's flag, [1, j] how many waits,
        summed over calls (the live counter: ``.clone()`` it for a snapshot; before the first call, when
        the buffers do not exist yet, a tensor of zeros)."""
        return self._dispatch_ch.wait_stats if self._allocated else self._no_waits()

    @property
    def combine_wait_stats(self) -> torch.Tensor:
        """``dispatch_wait_stats`` of the combine's receives."""
        return self._combine_ch.wait_stats if self._allocated else self._no_waits()

    def _no_waits(self) -> torch.Tensor:
        return torch.zeros((2, self.group.world_size), dtype=torch.int64, device=self.group.device)

    @property
    def excluded_slots(self) -> torch.Tensor:
        """int64 [1] on the device: this rank's (token, k) slots whose expert lives on an excluded rank
        (``group.exclude``), summed over dispatch calls. They were not routed: the combine treats them as
        unrouted (no weight), so a caller that wants them served re-routes to redundant experts."""
        return self._excluded

    def reset_expert_token_counts(self) -> None:
        """Zero ``expert_token_counts`` and ``excluded_slots``."""
        self._stats.zero_()
        self._excluded.zero_()

    # ---- buffers ---------------------------------------------------------------------------------
    def _allocate(self) -> None:
        p, g, dev = self.plan, self.group, self.group.device
        self._dispatch_ch = Channel(g, "ep.dispatch", p.dispatch_data_shape, torch.int32,
                                    ctrl_words=p.dispatch_ctrl_words)
        self._combine_ch = Channel(g, "ep.combine", p.combine_data_shape, torch.int32, ctrl_words=2,
                                   stage_shape=p.combine_stage_shape)
        self._dispatch_ch.row_bytes = (p.x_words + p.scale_words) * 4   # a row of d.x with its scales
        self._combine_ch.row_bytes = p.combine_words * 4                # a row of expert_out as it travels
        self._dispatch_op = PhasedOp(g, "dispatch", self._dispatch_ch)
        self._dispatch_op.counters = dict(expert_rows=self._stats, excluded_rows=self._excluded)
        self._combine_op = PhasedOp(g, "combine", self._combine_ch)
        shape = (p.experts_per_rank, p.capacity) if self._copies_rows else (0,)
        if p.nvfp4:   # two e2m1 codes per byte; four e4m3 scales per word
            self._x = torch.empty((*shape, p.hidden // 2), dtype=torch.uint8, device=dev)
            self._scales = torch.empty((*shape, 4 * p.scale_words), dtype=torch.float8_e4m3fn, device=dev)
        else:
            self._x = torch.empty((*shape, p.hidden), dtype=torch.float8_e4m3fn if p.fp8 else p.dtype, device=dev)
            self._scales = (torch.empty((*shape, p.scale_words), dtype=p.scale_dtype, device=dev) if p.fp8
                            else None)
        self._sets = [_Set(p, dev), _Set(p, dev)]
        # ready words (``ReadyWords``): int64 [E_local], words[e] = the flag of the combine call whose expert e
        # is ready; one set (the flag carries the call)
        self._ready = torch.zeros(p.experts_per_rank, dtype=torch.int64, device=dev)
        self._dummy = torch.zeros(p.scratch_words, dtype=torch.int32, device=dev)
        self._allocated = True

    # ---- checks ----------------------------------------------------------------------------------
    def _check_handle(self, handle) -> None:
        if not isinstance(handle, EPHandle) or handle.owner != id(self):
            raise TypeError(f"handle must be the DispatchResult.handle of a dispatch on this EPBuffer, "
                            f"got {type(handle).__name__}")
        if handle.epoch != self.group.epoch:
            raise ValueError("stale handle: its dispatch was made before group.reset()/exclude()")
        pending = self._dispatch_op.pending
        if handle.call_index < self._calls - 2 or (pending is not None and pending[0] is handle):
            raise ValueError("stale handle: its dispatch's metadata has been reused (a handle is valid until "
                             "two more dispatch calls) or its dispatch's phase='recv' has not run")

    def _check_dispatch_inputs(self, x, topk_idx, global_scale) -> int:
        p = self._ep_plan
        if isinstance(x, tuple):
            raise TypeError(f"x is a tuple (pre-quantized codes and scales?): EPBuffer.dispatch takes {p.dtype} x and "
                            f"quantizes it itself (fp8_dispatch); pass x unquantized, or dispatch pre-quantized "
                            f"tokens with moe_comm.PrefillBuffer")
        check_tensor("x", x, self.group.device, (p.dtype,), (None, p.hidden), DTYPE_FIX)
        T = x.shape[0]
        if T > p.max_tokens:
            raise ValueError(f"x has {T} tokens, max_tokens_per_rank is {p.max_tokens}: build the EPBuffer "
                             f"with a larger max_tokens_per_rank, or split the batch")
        check_tensor("topk_idx", topk_idx, self.group.device, (torch.int32, torch.int64), (T, p.topk))
        check_global_scale(global_scale, p.nvfp4, self.group.device)
        if not (p.fp8 or p.nvfp4):   # copied as words (quantizing sends read elements)
            check_words("x", x)
        return T

    def _check_combine_recv_inputs(self, T, topk_weights, out) -> None:
        p = self._ep_plan
        if topk_weights is not None:
            check_tensor("topk_weights", topk_weights, self.group.device,
                         (torch.float32, torch.bfloat16, torch.float16, torch.float64), (T, p.topk))
        if out is not None:
            check_tensor("out", out, self.group.device, (p.dtype,), (T, p.hidden), DTYPE_FIX)
            if not out.is_contiguous():
                raise ValueError("out must be contiguous (it is written in place)")

    # ---- launches --------------------------------------------------------------------------------
    def _launches(self) -> tuple[dict, dict]:
        """The launches of metadata set 0 and set 1 for the plan in force (``moe_comm.launches``)."""
        return self._launch_table.get(self._ep_plan, self._build_launches)

    def _recv_put_args(self, p: EPPlan) -> dict:
        """``PUT`` of the receive kernels: the put layout (``p.put``), and the status broadcast of a failed
        wait to the peers reached by puts (with, on CUDA, NVSHMEM's bitcode)."""
        args = self.group.put_launch_args() if p.put else {}
        args["PUT"] = p.put
        return args

    def _combine_recv_launch(self, p: EPPlan, s: _Set, row_of: torch.Tensor, rows: int) -> Launch:
        """The combine receive of metadata set ``s``: this rank's own slots are read from ``expert_out`` at the
        codes ``row_of[rank]`` gives (< ``rows``; -1 elsewhere, -2 dropped), the others from the landing zone."""
        g, cch = self.group, self._combine_ch
        return Launch(
            combine_recv_kernel, g.device, p.reduce_grid, aligned=vector_aligned(cch.data.local), routed_ptr=s.routed,
            row_of_ptr=row_of, slot_key_ptr=s.slot_key, id_base_ptr=s.id_base, data_ptr=cch.data.local,
            ctrl_ptr=cch.ctrl.local, seq_ptr=cch.recv_seq, done_ptr=cch.done, OP=op_id("combine"), ROWS=rows,
            SLOT_WORDS=p.combine_words, FP8=p.combine_fp8, **self._recv_put_args(p),
            ZONE_SLOTS=max(1, p.combine_zone_slots), BINS=histogram_bins(p.num_experts), HIDDEN=p.hidden,
            BT=p.block_tokens, BH=p.block_hidden, NBLK=p.reduce_programs, grp=g.state, status_ptr=g.status.local,
            rank=g.rank, WORLD=g.world_size, WORLD_P2=next_pow2(g.world_size), M=p.max_tokens, TOPK=p.topk,
            TOPK_P2=next_pow2(p.topk), **cch.trace_args(recv=True), num_warps=p.reduce_warps)

    def _build_launches(self, p: EPPlan) -> tuple[dict, dict]:
        """For each metadata set: kernel name -> ``Launch`` of every kernel a call of this world size makes,
        with every argument but the call's tensors, their sizes and their alignment."""
        g, dev, dch = self.group, self.group.device, self._dispatch_ch
        sig = dict(grp=g.state, status_ptr=g.status.local, rank=g.rank)
        common = dict(WORLD=g.world_size, WORLD_P2=next_pow2(g.world_size), M=p.max_tokens, TOPK=p.topk,
                      TOPK_P2=next_pow2(p.topk))
        routing = dict(num_experts=self.num_experts, HIDDEN=p.hidden, X_WORDS=p.x_words, S_WORDS=p.scale_words,
                       BT=p.block_tokens, BW=p.send_block_words, ROUTE_T=p.route_tokens,
                       BINS=histogram_bins(p.num_experts), FP8=p.fp8, FP8_GROUPS=p.fp8_block_groups,
                       SCALE=p.scale_mode, S_BLOCK=p.scale_block_words, NVFP4=p.nvfp4,
                       NVFP4_GROUPS=p.nvfp4_block_groups, NBLK=p.send_programs, num_warps=p.send_warps)
        rows = p.experts_per_rank * p.capacity
        x_words = self._x if p.fp8 else self._x.view(torch.int32)
        scales = self._scales if p.fp8 else self._dummy if self._scales is None else self._scales.view(torch.int32)
        sets = []
        for s in self._sets:
            combine_recv = self._combine_recv_launch(p, s, s.row_of, rows)
            # With ready words the send runs at every world size (at world 1 it only waits for them).
            send_ready = self._combine_send_launch(p, s, rows, self._ready)
            if g.world_size == 1:  # one kernel per call: no landing zone, no flags
                sets.append(dict(combine_recv=combine_recv, combine_send_ready=send_ready, dispatch_local=Launch(
                    dispatch_local_kernel, dev, p.local_grid if self._copies_rows else (p.local_grid[0], 1),
                    aligned=vector_aligned(x_words, self._scales),
                    out_x_ptr=x_words, out_scales_ptr=scales, out_src_ptr=s.src, out_counts_ptr=s.counts,
                    row_of_ptr=s.row_of, src_tokens_ptr=s.src_tokens, routed_ptr=s.routed, stats_ptr=self._stats,
                    excluded_ptr=self._excluded, grp=g.state, OP=op_id("dispatch"), CAP=p.capacity, TOPK=p.topk,
                    TOPK_P2=next_pow2(p.topk), COPY=self._copies_rows, **routing)))
                continue
            sets.append(dict(
                combine_recv=combine_recv,
                dispatch_send=Launch(
                    dispatch_send_kernel, dev, p.send_grid, routed_ptr=s.routed, excluded_ptr=self._excluded,
                    slot_key_ptr=s.slot_key, id_base_ptr=s.id_base, data_ptrs_ptr=dch.data.peer_ptrs,
                    ctrl_ptrs_ptr=dch.ctrl.peer_ptrs, seq_ptr=dch.send_seq, done_ptr=dch.done, OP=op_id("dispatch"),
                    EXPERTS_PER_RANK=p.experts_per_rank, ROW_WORDS=p.row_words, CTRL_WORDS=p.dispatch_ctrl_words,
                    **routing, **dch.put_args(), **sig, **common, **dch.trace_args(recv=False)),
                dispatch_recv=Launch(
                    dispatch_recv_kernel, dev, p.recv_grid,
                    aligned=vector_aligned(self._x, self._scales, dch.data.local),
                    out_x_ptr=self._x.view(torch.int32), out_scales_ptr=scales.view(torch.int32), out_src_ptr=s.src,
                    out_counts_ptr=s.counts, row_of_ptr=s.row_of, src_tokens_ptr=s.src_tokens, runs_ptr=s.runs,
                    stats_ptr=self._stats, arrival_ptr=s.arrival, data_ptr=dch.data.local, ctrl_ptr=dch.ctrl.local, seq_ptr=dch.recv_seq,
                    done_ptr=dch.done, OP=op_id("dispatch"), CAP=p.capacity, **self._recv_put_args(p),
                    EXPERTS_PER_RANK=p.experts_per_rank, EXPERTS_P2=next_pow2(p.experts_per_rank),
                    X_WORDS=p.x_words, S_WORDS=p.scale_words, S_WORDS_P2=next_pow2(max(p.scale_words, 1)),
                    ROW_WORDS=p.row_words, CTRL_WORDS=p.dispatch_ctrl_words, BS=p.recv_block_slots,
                    BW=p.recv_block_words, NVFP4=p.nvfp4, COPY=self._copies_rows, **sig, **common,
                    **dch.trace_args(recv=True)),
                combine_send=self._combine_send_launch(p, s, rows, None), combine_send_ready=send_ready))
        return tuple(sets)

    def _combine_send_launch(self, p: EPPlan, s: _Set, rows: int, ready: torch.Tensor | None) -> Launch:
        """The combine send of metadata set ``s``; with ``ready`` (the ready words) its READY variant."""
        g, cch = self.group, self._combine_ch
        return Launch(
            combine_send_kernel, g.device, (p.recv_programs,), row_of_ptr=s.row_of, src_tokens_ptr=s.src_tokens,
            runs_ptr=s.runs, data_ptrs_ptr=cch.data.peer_ptrs, ctrl_ptrs_ptr=cch.ctrl.peer_ptrs,
            seq_ptr=cch.send_seq, done_ptr=cch.done, ready_ptr=ready, ZONE_SLOTS=p.combine_zone_slots,
            EXPERTS_PER_RANK=p.experts_per_rank, EXPERTS_P2=next_pow2(p.experts_per_rank), CAP=p.capacity,
            ROWS=rows, X_WORDS=p.out_words, BS=p.block_slots, NBLK=p.recv_programs, HIDDEN=p.hidden,
            BW=p.out_block_words * 4 // p.elem_size if p.combine_fp8 else p.out_block_words,  # fp8: elements
            OP=op_id("combine"), SLOT_WORDS=p.combine_words, FP8=p.combine_fp8, **cch.put_args(), grp=g.state,
            status_ptr=g.status.local, rank=g.rank, WORLD=g.world_size, WORLD_P2=next_pow2(g.world_size),
            M=p.max_tokens, TOPK=p.topk, TOPK_P2=next_pow2(p.topk), **cch.trace_args(recv=False))

    # ---- dispatch --------------------------------------------------------------------------------
    def dispatch(self, x: torch.Tensor | None = None, topk_idx: torch.Tensor | None = None, *,
                 phase: str = "both", global_scale: torch.Tensor | None = None) -> DispatchResult | None:
        """Send this rank's tokens to the ranks owning their experts; receive this rank's experts' rows.

        See the class docstring. phase="recv" ignores ``x``, ``topk_idx`` and ``global_scale`` (those of the
        send are used).
        """
        self._ensure_allocated()
        p, g, op = self._ep_plan, self.group, self._dispatch_op
        do_send, do_recv = op.begin(phase)
        if do_send:
            T = op.validate(lambda: self._check_dispatch_inputs(x, topk_idx, global_scale))
            op.before_send()
            k = self._calls % 2
            s = self._sets[k]
            handle = EPHandle(self._calls, T, s.row_of, s.src_tokens, s.routed, id(self), g.epoch)
            self._calls += 1
            if T > 0:
                xin, idx = x.contiguous(), topk_idx.contiguous()   # the kernels read x's rows as words
            else:  # never read (T = 0), but the kernel needs valid pointers (of x's dtype: one compiled variant)
                xin, idx = self._dummy.view(p.dtype), self._dummy
            gs = global_scale if p.nvfp4 else self._dummy.view(torch.float32)   # read only with nvfp4
            if g.world_size > 1:
                send = self._launches()[k]["dispatch_send"]
                send.run(x_ptr=xin, idx_ptr=idx, gscale_ptr=gs, num_tokens=T, ALIGNED=send.aligned_with(xin))
            elif not do_recv:  # world 1, split: the kernel runs at the receive; the send consumes its inputs
                xin, idx = xin.clone(), idx.clone()
                if p.nvfp4:
                    gs = gs.clone()
            op.sent((handle, k, xin, idx, gs, global_scale))
            if not do_recv:
                return None
        handle, k, xin, idx, gs, global_scale = op.take()
        self._receive(self._launches()[k], handle, xin, idx, gs)
        s = self._sets[k]
        return op.finish(DispatchResult(self._x, self._scales, s.counts, s.src, handle, global_scale))

    def _receive(self, launches: dict, handle: EPHandle, xin, idx, gs) -> None:
        """Launch the receive phase of a dispatch: the world-1 kernel (which reads x and topk_idx), or the
        receive kernel."""
        if self.group.world_size == 1:
            local = launches["dispatch_local"]
            local.run(x_ptr=xin, idx_ptr=idx, gscale_ptr=gs, num_tokens=handle.num_tokens,
                      ALIGNED=local.aligned_with(xin))
        else:
            recv = launches["dispatch_recv"]
            recv.run(ALIGNED=recv.aligned)

    def arrival(self) -> ArrivalWords:
        """The arrival words of the dispatch whose send phase ran last and whose receive has not returned
        yet (``ArrivalWords``): launch a consumer kernel that waits on them after ``dispatch(...,
        phase="send")`` (on a stream ordered after it), then ``dispatch(phase="recv")`` on another stream;
        the consumer starts on a source's rows as soon as the receive has written them. World > 1 (at world
        1 the receive is one kernel that writes every row: run your GEMM after it). Keep the consumer's
        grid small enough that the receive's programs get SMs while it waits."""
        pending = self._dispatch_op.pending if self._allocated else None
        if pending is None:
            raise RuntimeError("arrival(): call dispatch(..., phase='send') first (the words are those of the "
                               "call whose receive phase has not run yet)")
        if self.group.world_size == 1:
            raise ValueError("arrival(): at world 1 the dispatch is one kernel: run your GEMM after it")
        s = self._sets[pending[1]]
        return ArrivalWords(s.arrival, s.runs, self._dispatch_ch.send_seq, self.group.state, self.group.status.local,
                            self._x)

    # ---- combine ---------------------------------------------------------------------------------
    def _check_expert_out(self, expert_out) -> None:
        """The combine's ``expert_out``: [E_local, R, hidden] of the buffer's dtype on the group's device (at
        world > 1 on a word boundary: the send copies its rows as words)."""
        p, g = self._ep_plan, self.group
        check_tensor("expert_out", expert_out, g.device, (p.dtype,), (p.experts_per_rank, p.capacity, p.hidden),
                     DTYPE_FIX)
        if g.world_size > 1 and not p.combine_fp8:   # the send copies its rows as words (at world 1,
            check_words("expert_out", expert_out)      # and quantizing them, it reads elements)

    def _send_combine(self, handle: EPHandle, expert_out: torch.Tensor) -> None:
        """Launch the send phase of a combine (nothing at world 1: the receive reads every row in place)."""
        if self.group.world_size > 1:
            send = self._launches()[handle.call_index % 2]["combine_send"]
            send.run(expert_out_ptr=expert_out, ALIGNED=send.aligned_with(expert_out))

    def _send_combine_ready(self, handle: EPHandle, expert_out: torch.Tensor) -> None:
        """Launch the send phase of a combine with ready words (at every world size: at world 1 it only waits)."""
        send = self._launches()[handle.call_index % 2]["combine_send_ready"]
        send.run(expert_out_ptr=expert_out, ALIGNED=send.aligned_with(expert_out))

    def ready_words(self) -> ReadyWords:
        """The ready words of this buffer (``ReadyWords``): pass them as ``combine(..., ready=words)`` and
        signal each local expert from the kernel that writes its rows of expert_out. Available once the
        first dispatch has run (it allocates the buffers); the same tensors every call."""
        if not self._allocated:
            raise RuntimeError("ready_words(): call dispatch first (the first dispatch allocates the buffers)")
        return ReadyWords(self._ready, self._combine_ch.send_seq, self.group.state)

    def _check_ready(self, ready) -> None:
        if not isinstance(ready, ReadyWords) or ready.words is not self._ready:
            raise TypeError(f"ready must be this EPBuffer's ready_words() (or None), got {type(ready).__name__}")

    def combine(self, expert_out: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None,
                handle: EPHandle | None = None, *, out: torch.Tensor | None = None,
                phase: str = "both", ready: ReadyWords | None = None) -> torch.Tensor | None:
        """Return expert outputs to their tokens and reduce them with ``topk_weights`` (see the class
        docstring). phase="recv" ignores ``expert_out``, ``handle`` and ``ready``; ``topk_weights`` and
        ``out`` may be given at either phase (at the receive they replace those of the send).

        ready (``ready_words()``): expert_out [E_local, R, hidden] may still be being written when the send
        phase is launched; its rows i < counts[e] of expert e must all be written before e is signalled.
        Overlap: launch your GEMM of expert_out on one stream and ``combine(..., ready=words,
        phase="send")`` on another (the send then waits, bounded, on the device: keep the GEMM's grid such
        that the send's programs get SMs, and the other way round), signal each local expert from the GEMM
        (``ready.signal_expert``) or after it on its stream (``words.signal(ids)``), then
        ``combine(phase="recv")``. Each signal must be issued after the previous combine call's send has
        ended (the flag it computes is ``epoch << EPOCH_SHIFT | call + 1``): any kernel ordered after this
        call's dispatch is. With phase="both" the send and the receive are launched together: the expert
        outputs must then be signalled by work already queued or running elsewhere. Graph capture: as
        without it (the words and counters are on the device, the flag is computed there)."""
        if self._closed:
            raise ClosedError("EPBuffer: used after close()")
        if self._calls == 0:
            raise RuntimeError("combine needs the handle of a dispatch on this EPBuffer; none has run yet")
        p, g, op = self._ep_plan, self.group, self._combine_op
        do_send, do_recv = op.begin(phase)
        if do_send:
            def check():
                self._check_handle(handle)
                self._check_expert_out(expert_out)
                self._check_combine_recv_inputs(handle.num_tokens, topk_weights, out)
                if ready is not None:
                    self._check_ready(ready)
                    if not expert_out.is_contiguous():   # a copy would be taken before the rows are ready
                        raise ValueError("with ready=, expert_out must be contiguous (a copy would read it "
                                         "before its experts are signalled): pass the tensor your GEMM writes")
            op.validate(check)
            op.before_send()
            expert_out = expert_out.contiguous()
            if ready is None:
                self._send_combine(handle, expert_out)
            else:
                self._send_combine_ready(handle, expert_out)
            op.sent((handle, expert_out, topk_weights, out))
            if not do_recv:
                return None
        handle, expert_out, w0, out0 = op.pending
        if not do_send:   # given at this receive (phase="both": checked with the send's); before taking: lossless
            self._check_combine_recv_inputs(handle.num_tokens, topk_weights, out)
        topk_weights = w0 if topk_weights is None else topk_weights
        out = out0 if out is None else out
        if topk_weights is None:
            raise TypeError("combine: topk_weights must be given at phase='send' or phase='recv'")
        op.take()
        T = handle.num_tokens
        if out is None:
            out = torch.empty((T, p.hidden), dtype=p.dtype, device=g.device)
        recv = self._launches()[handle.call_index % 2]["combine_recv"]
        recv.run(out_ptr=out if T > 0 else self._dummy.view(p.dtype), weights_ptr=topk_weights.contiguous() if T > 0
                 else self._dummy, expert_out_ptr=expert_out, num_tokens=T, ALIGNED=recv.aligned_with(out, expert_out))
        return op.finish(out)
