"""MoELayer: dispatch -> expert GEMMs -> combine, with the GEMMs fused into the communication.

The layer holds the local experts' weights and an EPBuffer without d.x (``EPBuffer._copies_rows``). A call
is five launches at world > 1 (four at world 1: the dispatch is one kernel):

    send     dispatch_send_kernel                      the EPBuffer's dispatch send, unchanged
    experts  moe_gate_up_kernel                        reads each tile's rows where they landed, as
                                                       soon as their sources' flags are there
             dispatch_recv_kernel (COPY=False)         the dispatch's metadata: row_of, src, counts, ...
             moe_down_combine_kernel                   each output tile straight into its slot's place,
                                                       then the combine flags
    recv     combine_recv_kernel                       the EPBuffer's combine receive, unchanged

Phases ``send``, ``experts`` and ``recv`` split a call for overlap and for loopback worlds (every rank's
send, then every rank's experts, then every rank's recv). See ``MoELayer``.
"""

from __future__ import annotations

import torch

from .checks import check_tensor
from .ep import EPBuffer, EPHandle
from .errors import GroupError, MoECommError, op_id
from .launches import Launch
from .planner import FP8_WEIGHT_BLOCK, MoELayerPlan, next_pow2, plan_moe_layer, vector_aligned
from .serving.experts import masked_expert_mlp
from .triton_kernels.moe_down_combine import moe_down_combine_kernel
from .triton_kernels.moe_gate_up import moe_gate_up_kernel

PHASES = ("send", "experts", "recv", "both")
PATHS = ("auto", "fused", "unfused")
# The crossover of path="auto": a layer whose max_tokens_per_rank is above it runs the unfused path
# (dispatch + masked batched experts + combine). NOT MEASURED: no GPU has run either path yet; 128 is the
# largest decode batch per rank of the target (the fused Hopper port measured elsewhere loses at
# 8192 tokens). scripts/gpu_quick.py's "moe_layer" step measures both paths to set it (bench/NOTES.md).
FUSED_MAX_TOKENS = 128


FP8_WEIGHT_DTYPE = torch.float8_e4m3fn   # fp8 expert weights (with w13_scale / w2_scale)


def _blocks(n: int) -> int:
    """Scale blocks along a weight dimension of n (the last one shorter)."""
    return -(-n // FP8_WEIGHT_BLOCK)


def fp8_scale_grids(hidden: int, intermediate: int) -> tuple:
    """(block rows, block columns) of the block scales an fp8 layer holds: w13 (gate's block rows, then
    up's: ``reference.dequantize_fp8_w13``), then w2."""
    return (2 * _blocks(intermediate), _blocks(hidden)), (_blocks(hidden), _blocks(intermediate))


class _FusedEPBuffer(EPBuffer):
    """The layer's EPBuffer. Fused: no d.x; the dispatch receive is preceded (world > 1) or followed (world 1)
    by the gate/up kernel, the combine send is the down kernel, and the combine receive reads this rank's
    own slots from the layer's rows (``_own_out``) through ``_own_codes``. Unfused: an EPBuffer."""

    def __init__(self, layer: "MoELayer", group, num_experts, hidden, max_tokens_per_rank, topk, dtype, fused):
        self._layer, self.fused = layer, fused
        self._copies_rows = not fused
        super().__init__(group, num_experts, hidden, max_tokens_per_rank, topk, dtype=dtype)

    def _allocate(self) -> None:
        super()._allocate()
        if not self.fused:
            return
        p, dev = self._ep_plan, self.group.device
        inter = self._layer.intermediate
        self._h = torch.empty((p.experts_per_rank, p.capacity, inter), dtype=p.dtype, device=dev)
        self._own_out = torch.empty((p.max_tokens * p.topk, p.hidden), dtype=p.dtype, device=dev)
        self._own_codes = torch.full((p.world, p.max_tokens, p.topk), -1, dtype=torch.int32, device=dev)

    def _check_dispatch_inputs(self, x, topk_idx, global_scale) -> int:
        T = super()._check_dispatch_inputs(x, topk_idx, global_scale)
        self._layer._check_weights_input(self._layer._given_weights, T)
        # phase="both": a bad out is refused here, where the rank can still take part by aborting (at the
        # receive the call has run: its recv would stay pending and the next call would refuse to start)
        self._check_combine_recv_inputs(T, None, self._layer._given_out)
        return T

    def _build_launches(self, p) -> tuple[dict, dict]:
        sets = super()._build_launches(p)
        if not self.fused:
            return sets
        layer, g, dch, cch = self._layer, self.group, self._dispatch_ch, self._combine_ch
        lp = plan_moe_layer(p, layer.intermediate, g.device)
        common = dict(WORLD=g.world_size, WORLD_P2=next_pow2(g.world_size), M=p.max_tokens, CAP=p.capacity,
                      TOPK=p.topk, TOPK_P2=next_pow2(p.topk), EXPERTS_PER_RANK=p.experts_per_rank, HIDDEN=p.hidden,
                      INTER=layer.intermediate, BM=lp.block_rows, BK=lp.block_k, grp=g.state,
                      status_ptr=g.status.local, rank=g.rank,
                      PRECISION="ieee" if p.dtype == torch.float32 else "tf32")
        for s, launches in zip(self._sets, sets):
            launches["gate_up"] = Launch(
                moe_gate_up_kernel, g.device, lp.gate_grid, data_ptr=dch.data.local, ctrl_ptr=dch.ctrl.local,
                seq_ptr=dch.recv_seq, src_ptr=s.src, counts_ptr=s.counts, W_FP8=layer.fp8_weights, h_ptr=self._h,
                OP=op_id("dispatch"), META=p.x_words + p.scale_words, ROW_WORDS=p.row_words,
                CTRL_WORDS=p.dispatch_ctrl_words, BN=lp.gate_cols, SCAN=lp.scan_slots, **self._recv_put_args(p),
                **common)
            launches["combine_send"] = Launch(
                moe_down_combine_kernel, g.device, lp.down_grid,
                aligned=vector_aligned(self._own_out, cch.data.local, *((cch.stage.local,) if cch.put else ())),
                h_ptr=self._h, W_FP8=layer.fp8_weights, counts_ptr=s.counts, src_ptr=s.src, row_of_ptr=s.row_of,
                src_tokens_ptr=s.src_tokens, runs_ptr=s.runs, own_codes_ptr=self._own_codes,
                data_ptrs_ptr=cch.data.peer_ptrs, ctrl_ptrs_ptr=cch.ctrl.peer_ptrs, seq_ptr=cch.send_seq,
                done_ptr=cch.done, OP=op_id("combine"), EXPERTS_P2=next_pow2(p.experts_per_rank),
                SLOT_WORDS=p.combine_words, ZONE_SLOTS=max(1, p.combine_zone_slots), BN=lp.down_cols,
                BS=lp.bookkeeping_slots, **cch.put_args(), **cch.trace_args(recv=False), **common)
            launches["combine_recv"] = self._combine_recv_launch(p, s, self._own_codes, p.max_tokens * p.topk)
        return sets

    def _receive(self, launches: dict, handle: EPHandle, xin, idx, gs) -> None:
        if not self.fused:
            super()._receive(launches, handle, xin, idx, gs)
        elif self.group.world_size == 1:   # the world-1 dispatch writes src and counts; the GEMM reads x by them
            super()._receive(launches, handle, xin, idx, gs)
            launches["gate_up"].run(x_ptr=xin, **self._layer._gate_up_weights())
        else:                            # the GEMM first: it waits for its rows' sources, not for every one
            launches["gate_up"].run(x_ptr=self._dummy.view(self._ep_plan.dtype), **self._layer._gate_up_weights())
            super()._receive(launches, handle, xin, idx, gs)

    def _check_expert_out(self, expert_out) -> None:
        if not self.fused:
            return super()._check_expert_out(expert_out)
        if expert_out is not self._own_out:
            raise TypeError("the layer's combine sends its own rows (an internal call: use MoELayer)")

    def _send_combine(self, handle: EPHandle, expert_out: torch.Tensor) -> None:
        if not self.fused:
            return super()._send_combine(handle, expert_out)
        self._dispatch_ch.after_previous()   # (CUDA) the activations come from this call's dispatch receive
        send = self._launches()[handle.call_index % 2]["combine_send"]
        send.run(expert_out_ptr=expert_out, w2_ptr=self._layer.w2, w2_scale_ptr=self._layer.w2_scale,
                 ALIGNED=send.aligned)


class MoELayer:
    """A Mixture-of-Experts layer whose expert GEMMs run fused with its communication (expert parallel,
    decode): the dispatch's rows are multiplied where they landed, as soon as their sources have sent, and
    each expert output tile is stored straight into the landing zone of the token's rank.

    ``MoELayer(group, num_experts, hidden, intermediate, max_tokens_per_rank, topk, w13, w2,
    dtype=torch.bfloat16, path="auto", fused_max_tokens=FUSED_MAX_TOKENS, *, w13_scale=None, w2_scale=None)``:
    rank r owns experts [r*E_local, (r+1)*E_local), E_local = num_experts // world.
        w13  [E_local, 2 * intermediate, hidden] dtype on group.device: rows [0, I) of expert e are its gate
             projection, rows [I, 2I) its up projection (a Linear's weight layout, DeepSeek's w1 and w3)
        w2   [E_local, hidden, intermediate] dtype: the down projection
        w13_scale, w2_scale  fp8 weights as DeepSeek-V3's checkpoints ship them: w13 and w2 float8_e4m3fn
             (same shapes), w13_scale float32 [E_local, 2 * ceil(I / 128), ceil(hidden / 128)] (gate's block rows, then up's, as
             vLLM's and SGLang's w13_weight_scale_inv: gate and up quantized separately) and w2_scale
             float32 [E_local, ceil(hidden / 128), ceil(I / 128)] (``weight_scale_inv``: one scale per 128 x
             128 block of rows x columns, the last blocks shorter). The layer then computes exactly as with
             the weights ``reference.dequantize_fp8_weight(w, scale, dtype)`` = (fp8.float() * scale).to(dtype)
             (w13: ``reference.dequantize_fp8_w13``, each half by its own blocks)
             (one rounding): its kernels dequantize each weight tile so in registers before tl.dot, so the
             results are those of this layer given those dequantized weights, bit for bit (tests/
             test_moe_layer_fp8.py). Tokens, activations and output stay in dtype. Fused path only
             (``path="auto"`` picks it; ``path="unfused"`` raises ValueError). ``layer.fp8_weights``.
        dtype  bfloat16, float16 or float32 (tokens, weights and output). hidden * element size must be a
             multiple of 16 bytes. The layer keeps references to the weights (``set_weights`` replaces them).
        path  "fused" (the kernels above), "unfused" (EPBuffer.dispatch, the masked batched experts of
             moe_comm.serving.experts, EPBuffer.combine: the same results, for large batches where the fused
             kernels' per-tile waits and row search cost more than the saved pass) or "auto": fused when
             max_tokens_per_rank <= fused_max_tokens (FUSED_MAX_TOKENS, not yet measured on a GPU) or the
             weights are fp8. Chosen once, here: every rank must run the same kernels, and T differs between
             ranks. ``layer.path``.
    Every rank builds its layer in the same order (collective); on a loopback world one per group, in rank
    order. Buffers are allocated by the first call (collective).

    layer(x, topk_idx, topk_weights, *, out=None, phase="both") -> y [T, hidden] dtype
        x             [T, hidden] dtype, 0 <= T <= max_tokens_per_rank (T = 0 still takes part)
        topk_idx      [T, topk] int32/int64 expert ids, -1 = slot not routed (as EPBuffer.dispatch: ids out of
                      range are not routed and raise InvalidIndexError at the end of the call)
        topk_weights  [T, topk] float32/bfloat16/float16/float64
        out           optional [T, hidden] dtype contiguous: written in place and returned
        y[t] = sum over k ascending with topk_idx[t, k] routed of topk_weights[t, k] * MLP_e(x[t]), in float32,
        rounded once; MLP_e(v) = (SiLU(v @ gate_e.T) * (v @ up_e.T)) @ down_e.T with float32 accumulation,
        the activation and the expert output each rounded once to dtype (``moe_comm.reference.moe_layer``).
        Tokens with no routed slot get zeros. The combine sum is that of EPBuffer.combine (same order, same
        bits, given the same expert rows); the GEMMs' inner order is tl.dot's.

    Phases: ``phase="send"`` (dispatch send: x, topk_idx and topk_weights are taken here and may change once
    it returns), ``phase="experts"`` (GEMMs and combine send; no tensors), ``phase="recv"`` (combine
    receive; ``out`` may be given here) split a call; "both" runs all three. Loopback worlds must be
    driven phase by phase (every rank's send, then every rank's experts, then every rank's recv).
    Returns None from "send" and "experts".

    Valid rows and async semantics: y is complete when the recv phase's kernels are (on CUDA, in stream
    order; every launch of the layer waits for its previous one on this rank, whatever streams they are
    on). Graph semantics: every launch has a fixed shape, counts are read only on the device, call counters
    live on the device: a captured call replays with new inputs (and the weights it was captured with:
    ``set_weights``). Run one eager call before capturing.

    Faults: as for EPBuffer (docs/faults.md). Every wait is bounded (group.timeout_s); a peer that never
    sends makes every rank that waits for it record CommTimeoutError naming it, raised at the end of the
    call (a failed call's y is NaN, never partial), and every later call raises it until group.reset();
    the next call after reset() is exact. A data error (InvalidIndexError, CapacityError) found by the
    dispatch is raised at the end of the call, after the combine (so that the group stays in step), with
    ``err.result`` the call's y. Bad host-visible input (shape, dtype, T) raises before anything is lost
    (the rank takes part by aborting, as the ops do).

    Memory: ``buffer_bytes`` (``MoELayerPlan``), ``MoELayer.required_bytes(...)`` without a group: the
    EPBuffer's without d.x, plus activations [E_local, world*M, I], the own slots' rows [M*topk, hidden]
    and their codes; at most the EPBuffer's (dispatch + combine) when I < hidden at decode shapes. The
    weights are the caller's (``MoELayer.weight_bytes``: 3 * I * hidden * element size per local expert,
    with fp8 weights 3 * I * hidden bytes plus 4 bytes per 128 x 128 block of scales).
    """

    def __init__(self, group, num_experts: int, hidden: int, intermediate: int, max_tokens_per_rank: int,
                 topk: int, w13: torch.Tensor, w2: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                 path: str = "auto", fused_max_tokens: int = FUSED_MAX_TOKENS, *,
                 w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None):
        if isinstance(intermediate, bool) or not isinstance(intermediate, int) or intermediate < 1:
            raise ValueError(f"intermediate must be a positive int, got {intermediate!r}")
        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {path!r}")
        # fp8 weights: the scales say so (or fp8 weights without them, which set_weights refuses, naming them)
        self.fp8_weights = w13_scale is not None or w2_scale is not None or FP8_WEIGHT_DTYPE in (
            getattr(w13, "dtype", None), getattr(w2, "dtype", None))
        if self.fp8_weights and path == "unfused":
            raise ValueError("fp8 weights (w13_scale, w2_scale) run on the fused path only: pass path='fused' "
                             "(or 'auto'), or dequantize them (reference.dequantize_fp8_weight) for the unfused path")
        if path == "auto":
            path = "fused" if max_tokens_per_rank <= fused_max_tokens or self.fp8_weights else "unfused"
        self.group, self.intermediate, self.dtype, self.path = group, int(intermediate), dtype, path
        self._given_weights = None
        self._given_out = None      # out of a phase="both" call, checked with the send's inputs
        self.ep = _FusedEPBuffer(self, group, num_experts, hidden, max_tokens_per_rank, topk, dtype,
                                 fused=path == "fused")
        self.num_experts, self.hidden, self.topk = self.ep.num_experts, self.ep.hidden, self.ep.topk
        self.max_tokens_per_rank, self.num_local_experts = self.ep.max_tokens_per_rank, self.ep.num_local_experts
        self.w13 = self.w2 = self.w13_scale = self.w2_scale = None
        self.set_weights(w13, w2, w13_scale, w2_scale)
        self._weights = None        # topk_weights of the call between its send and experts phases
        self._held = None           # a data error of this call's dispatch, raised at the end of the call
        group.register(self)        # reset(): a call in progress is dropped, as the ops drop theirs

    # ---- sizes -------------------------------------------------------------------------------------------
    @property
    def plan(self) -> MoELayerPlan:
        return plan_moe_layer(self.ep.plan, self.intermediate, self.group.device)

    @property
    def buffer_bytes(self) -> int:
        """Bytes the layer's buffers hold once allocated: the fused plan's, or the EPBuffer's (unfused; the
        expert outputs it allocates per call are not counted)."""
        return self.plan.buffer_bytes if self.path == "fused" else self.ep.buffer_bytes

    @staticmethod
    def required_bytes(world_size: int, num_experts: int, hidden: int, intermediate: int, max_tokens_per_rank: int,
                       topk: int, dtype: torch.dtype = torch.bfloat16, path: str = "fused") -> int:
        """``buffer_bytes`` of a layer with these sizes and path ("fused" or "unfused"), without a group and
        without allocating."""
        ep = EPBuffer._plan(world_size, num_experts, hidden, max_tokens_per_rank, topk, dtype, False, "cpu")
        return plan_moe_layer(ep, intermediate, "cpu").buffer_bytes if path == "fused" else ep.buffer_bytes

    @staticmethod
    def weight_bytes(num_local_experts: int, hidden: int, intermediate: int, dtype: torch.dtype = torch.bfloat16,
                     fp8: bool = False) -> int:
        """Bytes of one rank's expert weights (w13 and w2; with ``fp8``, float8_e4m3fn and their float32
        block scales): what a decode step reads per active expert, the layer's floor."""
        per_expert = 3 * intermediate * hidden * (1 if fp8 else dtype.itemsize)
        if fp8:
            per_expert += 4 * sum(r * c for r, c in fp8_scale_grids(hidden, intermediate))
        return num_local_experts * per_expert

    # ---- weights -----------------------------------------------------------------------------------------
    def set_weights(self, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None = None,
                    w2_scale: torch.Tensor | None = None) -> None:
        """Replace the experts' weights (shapes and dtype as at construction, fp8 with their scales if the
        layer's are; contiguous, on group.device). The next call uses them; no launch is rebuilt (the launches
        take the weights at each call), so one layer can serve many model layers of one shape, each call with
        its own weights (the transformers door). Graphs: a launch takes the weights' addresses when it is
        issued, so a captured call replays with the tensors current at its capture (``set_weights`` after
        the capture changes no replay; an in-place copy into those tensors does). Capture each model layer's
        call after its own ``set_weights``."""
        L, H, inter = self.num_local_experts, self.hidden, self.intermediate
        wdtype = FP8_WEIGHT_DTYPE if self.fp8_weights else self.dtype
        fix = f"pass the local experts' weights, dtype {wdtype}, contiguous, on {self.group.device}"
        check_tensor("w13", w13, self.group.device, (wdtype,), (L, 2 * inter, H), fix)
        check_tensor("w2", w2, self.group.device, (wdtype,), (L, H, inter), fix)
        named = [("w13", w13), ("w2", w2)]
        if self.fp8_weights:
            sfix = ("pass the block scales (DeepSeek's weight_scale_inv), float32, one per 128 x 128 block of "
                    f"rows x columns, contiguous, on {self.group.device}")
            for name, t, (rows, cols) in zip(("w13_scale", "w2_scale"), (w13_scale, w2_scale), fp8_scale_grids(H, inter)):
                if t is None:
                    raise TypeError(f"{name} is missing: fp8 weights need their block scales ({sfix})")
                check_tensor(name, t, self.group.device, (torch.float32,), (L, rows, cols), sfix)
                named.append((name, t))
        elif w13_scale is not None or w2_scale is not None:
            raise TypeError(f"w13_scale/w2_scale given for a layer built with {self.dtype} weights: build the layer "
                            "with fp8 weights and their scales, or pass no scales")
        for name, w in named:
            if not w.is_contiguous():
                raise ValueError(f"{name} must be contiguous ({name}.contiguous() fixes it)")
        # Passed to the launches at each call (they bind no caller's tensor): no rebuild.
        self.w13, self.w2, self.w13_scale, self.w2_scale = w13, w2, w13_scale, w2_scale

    def _gate_up_weights(self) -> dict:
        """The gate/up launch's weight arguments of this call."""
        return dict(w13_ptr=self.w13, w13_scale_ptr=self.w13_scale)

    def _check_weights_input(self, topk_weights, T: int) -> None:
        check_tensor("topk_weights", topk_weights, self.group.device,
                     (torch.float32, torch.bfloat16, torch.float16, torch.float64), (T, self.topk))

    # ---- the call ----------------------------------------------------------------------------------------
    def __call__(self, x: torch.Tensor | None = None, topk_idx: torch.Tensor | None = None,
                 topk_weights: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                 phase: str = "both") -> torch.Tensor | None:
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        g = self.group
        if phase == "both" and g.backend == "loopback" and g.world_size > 1:
            raise ValueError("loopback groups hold every rank in one process: call phase='send' on every rank, "
                             "then phase='experts' on every rank, then phase='recv' on every rank")
        if phase in ("send", "both"):
            self._send(x, topk_idx, topk_weights, out if phase == "both" else None)
        if phase in ("experts", "both"):
            self._experts()
        if phase in ("recv", "both"):
            return self._recv(out)
        return None

    def _send(self, x, topk_idx, topk_weights, out=None) -> None:
        ep = self.ep
        if ep._allocated:
            ep._combine_ch.after_previous()   # (CUDA) this call's rows overwrite what the last call's kernels read
        self._given_weights, self._given_out = topk_weights, out
        try:
            ep.dispatch(x, topk_idx, phase="send")
        finally:
            self._given_weights = self._given_out = None
        self._weights = topk_weights.contiguous() if topk_weights.shape[0] else topk_weights

    def _experts(self) -> None:
        if self._weights is None:
            raise RuntimeError("MoELayer: phase='experts' needs a preceding phase='send'")
        try:
            d = self.ep.dispatch(phase="recv")
        except MoECommError as e:   # a data error carries the dispatch result: the call goes on, raised at its end
            if isinstance(e, GroupError) or getattr(e, "result", None) is None:
                self._weights = None
                raise
            d, self._held = e.result, e
        weights, self._weights = self._weights, None
        if self.path == "fused":
            self.ep.combine(self.ep._own_out, weights, d.handle, phase="send")
            return
        I = self.intermediate
        expert_out = masked_expert_mlp(d.x, d.counts, self.w13[:, :I].transpose(1, 2), self.w13[:, I:].transpose(1, 2),
                                       self.w2.transpose(1, 2))
        self.ep.combine(expert_out, weights, d.handle, phase="send")

    def _recv(self, out) -> torch.Tensor:
        held, self._held = self._held, None
        y = self.ep.combine(phase="recv", out=out)
        if held is not None:
            held.result = held.call_result = y
            raise held
        return y

    def reset(self) -> None:
        """``group.reset()``: the call in progress (if any) is dropped, as its ops' pending phases are."""
        self._weights = self._held = None

    def close(self) -> None:
        """Free the buffers (collective). Any later call raises ClosedError."""
        self.ep.close()
