"""vLLM adapter: FusedMoEPrepareAndFinalize in both of vLLM's activation formats, backed by moe-comm.

vLLM's modular MoE kernel is prepare -> experts -> finalize, and each prepare/finalize has an activation
format that picks the experts it runs with. moe-comm has one for each, as DeepEP has (low-latency /
high-throughput):

- ``MoECommPrepareAndFinalize`` (BatchedExperts format, decode) on an EPBuffer:
  prepare = dispatch (with the fp8 quantization fused into it when the buffer was built with an fp8
  format, ``moe_comm.formats``). It returns the expert-major tensor [E_local, world*max_tokens_per_rank,
  hidden], its scales (float32 [.., hidden/128] row-major; with "e4m3-ue8m0" DeepEP's use_ue8m0 tensor,
  int32 [.., hidden/512] packed UE8M0, column-major over the rows as DeepEP returns it), and
  ExpertTokensMetadata whose ``expert_num_tokens`` is the dispatch's int32 [E_local]
  device counts (``expert_num_tokens_cpu`` stays None: no host copy, so CUDA graphs can capture it).
  finalize = combine, with the router weights applied inside the combine kernel (the experts hand
  the weighting to us through TopKWeightAndReduceDelegate), written in place into vLLM's output.
- ``MoECommStandardPrepareAndFinalize`` (Standard format, prefill) on a PrefillBuffer:
  prepare = dispatch; it returns the rank-major rows [world*max_tokens_per_rank, hidden] (each token once
  per rank, however many of its experts live there), their scales with fp8, ExpertTokensMetadata with the
  int32 [E_local] device slot counts, and the received top-k ids as *global* int64 expert ids with -1 for
  slots whose expert lives elsewhere and for every row no source wrote, plus their float32 weights (0
  there): the contract of vLLM's DeepEP V2 prepare in its graph mode, so experts that route over every
  row skip those (vLLM's CPU experts, which ignore expert_map, get int32 local ids instead:
  ``moe_comm.serving.vllm_cpu``). Nothing is read on the host. finalize = the experts' TopKWeightAndReduce
  (vLLM's experts mostly reduce themselves: NoOP) to one partial row per received token, then combine,
  which sums every rank's partial rows at the source into vLLM's output.

fp8 (the ``fp8_dispatch`` option, "auto" by default): "auto" dispatches fp8 in 1x128 blocks ("e4m3") when
the experts take fp8 in 1x128 blocks, and, in the BatchedExperts format, switches to packed UE8M0 scales
("e4m3-ue8m0", hidden % 512 == 0) when vLLM's ``post_init_setup`` finds experts that take them
(``supports_packed_ue8m0_act_scales()``), as vLLM's DeepEP low-latency prepare/finalize does; True/False
turn it on ("e4m3") or off; the ``dispatch_format`` option names an fp8 format of ``moe_comm.formats``
("e4m3", "e4m3-pow2", "e4m3-ue8m0") instead.

Which one a deployment gets is chosen the way vLLM chooses its own per-format prepare/finalize: from
one switch per engine, ``mode`` in the moe_comm options ("low_latency", "high_throughput", or "auto":
vLLM's ``--all2all-backend``, high throughput for its high-throughput backends). A disaggregated
deployment runs its prefill engines in one mode and its decode engines in the other
(``moe_comm.serving.vllm_plugin``).

vLLM is imported only when the vLLM classes (``prepare_finalize_class``, ``make_prepare_finalize``) are
first used; ``EPBufferPrepareFinalize`` and ``PrefillBufferPrepareFinalize`` hold all the logic and need no
vLLM (the tests drive them directly). Tested against vLLM 0.33 and 0.32
(``FusedMoEPrepareAndFinalizeModular``: ``prepare`` takes ``defer_input_quant``, ``finalize`` writes into
``output`` and returns None); older releases that call the base class ``FusedMoEPrepareAndFinalize`` are
detected and used instead.

Faults: every prepare first raises, by name, the error the group recorded in an earlier step
(``moe_comm.serving.ep_group.check_group``), so vLLM's worker stops on it instead of serving on.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

import torch

from .. import formats
from ..compat.deep_ep_layout import column_major_scales
from ..ep import EPBuffer
from .ep_group import check_group, process_group, shared_buffer, use_group
from .vllm_cpu import takes_local_ids

__all__ = ["EPBufferPrepareFinalize", "ExpertTokens", "MODES", "MoECommPrepareAndFinalize",
           "MoECommStandardPrepareAndFinalize", "PrefillBufferPrepareFinalize", "make_prepare_finalize",
           "prepare_finalize_class", "resolve_mode", "use_group"]

_MK = "vllm.model_executor.layers.fused_moe.modular_kernel"
_WEIGHT_AND_REDUCE = "vllm.model_executor.layers.fused_moe.topk_weight_and_reduce"
_FP8_BLOCK = [128, 128]  # the quantization moe-comm's fp8 dispatch produces: 1x128 blocks (every format)
MODES = ("low_latency", "high_throughput")
# vLLM's --all2all-backend values whose prepare/finalize is a high-throughput (Standard format) one; every
# other value makes "auto" low latency (BatchedExperts), moe-comm's mode before there was a choice.
HIGH_THROUGHPUT_BACKENDS = ("deepep_high_throughput", "deepep_v2", "mori_high_throughput")


@dataclass
class ExpertTokens:
    """Stand-in for vLLM's ExpertTokensMetadata where vLLM is absent (same field names)."""

    expert_num_tokens: torch.Tensor            # int32 [E_local] on the device
    expert_num_tokens_cpu: torch.Tensor | None = None


def resolve_mode(options: dict | None, all2all_backend: str | None) -> str:
    """"low_latency" or "high_throughput" for the moe_comm options' ``mode`` (default "low_latency";
    "auto" follows vLLM's ``all2all_backend`` as vLLM's own format choice does)."""
    mode = (options or {}).get("mode", "low_latency")
    if mode == "auto":
        return "high_throughput" if all2all_backend in HIGH_THROUGHPUT_BACKENDS else "low_latency"
    if mode not in MODES:
        raise ValueError(f"moe_comm option mode={mode!r}: use 'low_latency' (decode: BatchedExperts format, "
                         f"EPBuffer), 'high_throughput' (prefill: Standard format, PrefillBuffer) or 'auto' "
                         f"(from --all2all-backend)")
    return mode


class _PrepareFinalize:
    """What both formats share: vLLM's queries, the checks of a prepare, the quantization the experts
    ask for, one dispatch handle per micro-batch, and the split into send / receive phases.

    Subclasses: ``buf`` is the moe-comm buffer; ``_dispatch(a1, weights, ids, phase)`` and
    ``_received(d, quant_config, defer)`` -> vLLM's 5-tuple; ``_combine(output, fused, weights, ids,
    apply_on_input, weight_and_reduce_impl, handle, phase)``.
    """

    def __init__(self, buf, ubatch_id=None):
        self.buf = buf
        self._ubatch_id = ubatch_id or (lambda: 0)  # vLLM's dual-batch overlap: one handle per micro-batch
        self._handles: dict[int, object] = {}
        self.fp8_auto = False   # fp8_dispatch "auto": post_init_setup may pick packed UE8M0 scales

    # ---- what vLLM asks before building the experts ----------------------------------------------
    def max_num_tokens_per_rank(self) -> int:
        return self.buf.max_tokens_per_rank

    def num_dispatchers(self) -> int:
        return self.buf.group.world_size

    def topk_indices_dtype(self) -> torch.dtype | None:
        return None  # dispatch takes int32 and int64 ids alike

    def output_is_reduced(self) -> bool:
        return True  # combine sums every expert's output on the token's own rank: nothing left to reduce

    def supports_async(self) -> bool:
        return True

    def post_init_setup(self, fused_experts) -> None:
        """vLLM's hook once the experts are known: with fp8_dispatch "auto", an "e4m3" EPBuffer becomes its
        "e4m3-ue8m0" twin (``ep_group.shared_buffer``, hidden % 512 == 0) when the experts take packed
        UE8M0 activation scales, as vLLM's DeepEP low-latency prepare/finalize then dispatches
        (round_scale and use_ue8m0). Before the first prepare; every rank builds the same layers."""
        supports = getattr(fused_experts, "supports_packed_ue8m0_act_scales", None)
        buf = self.buf
        if (not self.fp8_auto or not isinstance(buf, EPBuffer) or buf.dispatch_format != formats.E4M3
                or supports is None or not supports() or buf.hidden % formats.hidden_multiple(formats.E4M3_UE8M0)):
            return
        self.buf = self.ep = shared_buffer(buf.group, buf.num_experts, buf.hidden, buf.max_tokens_per_rank,
                                           buf.topk, buf.dtype, formats.E4M3_UE8M0)

    # ---- hooks the vLLM subclass overrides -------------------------------------------------------
    def _expert_tokens(self, counts: torch.Tensor):
        return ExpertTokens(expert_num_tokens=counts)

    def _quantize_after_dispatch(self, x: torch.Tensor, quant_config):
        raise NotImplementedError(
            f"moe-comm dispatches bf16/fp16, or fp8 in 1x128 blocks (fp8_dispatch=True); quantization "
            f"{getattr(quant_config, 'quant_dtype', None)} with block shape "
            f"{getattr(quant_config, 'block_shape', None)} needs the vLLM adapter (prepare_finalize_class)")

    # ---- prepare ---------------------------------------------------------------------------------
    def _check_quant(self, quant_config, defer_input_quant: bool) -> None:
        """Before the dispatch (nothing launched yet): an fp8 dispatch must be what the experts take."""
        quant_dtype = getattr(quant_config, "quant_dtype", None)
        if self.buf.fp8_dispatch and (defer_input_quant or quant_dtype != torch.float8_e4m3fn or
                                      list(getattr(quant_config, "block_shape", None) or []) != _FP8_BLOCK):
            raise ValueError(f"this {type(self.buf).__name__} dispatches fp8 in 1x128 blocks, but the experts "
                             f"want quant_dtype={quant_dtype}, block_shape={getattr(quant_config, 'block_shape', None)}"
                             f"{' unquantized' if defer_input_quant else ''}: build it with fp8_dispatch=False")

    def _quantized(self, x, scales, quant_config, defer_input_quant: bool):
        """(x, scales) the experts expect, from the dispatched rows (and their fp8 scales)."""
        quant_dtype = getattr(quant_config, "quant_dtype", None)
        if self.buf.fp8_dispatch:
            return x, scales
        if quant_dtype is None or defer_input_quant:
            return x, None
        return self._quantize_after_dispatch(x, quant_config)

    def prepare_async(self, a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      num_experts: int, expert_map, apply_router_weight_on_input: bool, quant_config,
                      defer_input_quant: bool = False):
        """Send phase of the dispatch now (the whole dispatch at world 1); returns (hook, receiver) as vLLM
        expects: hook() runs the receive phase (waits for every peer's tokens), receiver() returns
        vLLM's (a1q, a1q_scale, expert_tokens_meta, topk_ids, topk_weights); see the subclass.

        a1           [M, hidden] activations, M <= max_num_tokens_per_rank()
        topk_weights [M, topk] float; topk_ids [M, topk] global expert ids (-1 = not routed)
        expert_map   ignored: experts are placed linearly (rank r owns [r*E_local, (r+1)*E_local))
        """
        check_group(self.buf.group)  # a fault of the previous step is raised here, by name
        self._check_quant(quant_config, defer_input_quant)
        if num_experts != self.buf.num_experts:
            raise ValueError(f"vLLM has {num_experts} experts, the {type(self.buf).__name__} was built for "
                             f"{self.buf.num_experts}")
        if apply_router_weight_on_input:
            if topk_ids.shape[1] != 1:
                raise ValueError("apply_router_weight_on_input needs topk == 1")
            a1 = a1 * topk_weights.to(a1.dtype)
        # A one-rank group dispatches at once: split phases there would only copy a1 for the later kernel.
        whole = self.buf.group.world_size == 1
        d = self._dispatch(a1, topk_weights, topk_ids, "both" if whole else "send")
        ubatch, received = self._ubatch_id(), [d] if whole else []

        def hook():
            if not received:
                received.append(self._dispatch(None, None, None, "recv"))

        def receiver():
            hook()
            d = received[0]
            self._handles[ubatch] = d.handle
            return self._received(d, quant_config, defer_input_quant)

        return hook, receiver

    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
                quant_config, defer_input_quant: bool = False):
        """Dispatch in one call; same arguments and result as ``prepare_async``'s receiver."""
        _, receiver = self.prepare_async(a1, topk_weights, topk_ids, num_experts, expert_map,
                                         apply_router_weight_on_input, quant_config, defer_input_quant)
        return receiver()

    # ---- finalize --------------------------------------------------------------------------------
    def finalize_async(self, output: torch.Tensor, fused_expert_output: torch.Tensor,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor, apply_router_weight_on_input: bool,
                       weight_and_reduce_impl):
        """Send phase of the combine now; returns (hook, receiver); after receiver() ``output`` [M, hidden]
        is valid (written in place). Shapes of ``fused_expert_output``: see the subclass."""
        handle = self._handles.pop(self._ubatch_id(), None)
        if handle is None:
            raise RuntimeError("finalize without a matching prepare on this micro-batch")
        self._combine(output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
                      weight_and_reduce_impl, handle)
        done = []

        def hook():
            if not done:
                self._combine_recv(output)
                done.append(True)

        return hook, hook

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
                 weight_and_reduce_impl) -> None:
        """Combine in one call (see ``finalize_async``)."""
        _, receiver = self.finalize_async(output, fused_expert_output, topk_weights, topk_ids,
                                          apply_router_weight_on_input, weight_and_reduce_impl)
        receiver()


class EPBufferPrepareFinalize(_PrepareFinalize):
    """prepare/finalize over one EPBuffer, in vLLM's BatchedExperts activation format (decode).

    One instance per MoE layer is fine; layers may share one EPBuffer (calls alternate between its
    two buffer sets). ``prepare`` and ``finalize`` must alternate per micro-batch, as in vLLM.
    Async (``prepare_async`` / ``finalize_async``) maps onto the buffer's send and receive phases.

    receiver() -> (x [E_local, world*max_tokens_per_rank, hidden], scales or None,
                   ExpertTokensMetadata(expert_num_tokens=int32 [E_local] device counts), None, None)
    finalize's fused_expert_output: [E_local, world*max_tokens_per_rank, hidden], the experts' unweighted
    output, rows [:expert_num_tokens[e]] valid; output[t] = sum over routed k of topk_weights[t, k] *
    fused_expert_output[row of (t, k)].
    """

    def __init__(self, ep, ubatch_id=None):
        super().__init__(ep, ubatch_id)
        self.ep = ep

    def _check_weight_and_reduce(self, weight_and_reduce_impl) -> None:
        """vLLM passes the experts' TopKWeightAndReduce; ours must be the delegate (we weight in combine)."""

    def _dispatch(self, a1, topk_weights, topk_ids, phase):
        return self.ep.dispatch(phase="recv") if phase == "recv" else self.ep.dispatch(a1, topk_ids, phase=phase)

    def _received(self, d, quant_config, defer_input_quant):
        x, scales = self._quantized(d.x, d.scales, quant_config, defer_input_quant)
        if self.buf.dispatch_format == formats.E4M3_UE8M0:   # DeepEP's use_ue8m0 layout, what the experts take
            scales = column_major_scales(scales)
        return x, scales, self._expert_tokens(d.counts), None, None

    def _combine(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
                 weight_and_reduce_impl, handle):
        self._check_weight_and_reduce(weight_and_reduce_impl)
        weights = torch.ones_like(topk_weights) if apply_router_weight_on_input else topk_weights
        self.ep.combine(fused_expert_output, weights, handle, out=output, phase="send")

    def _combine_recv(self, output):
        self.ep.combine(None, None, None, out=output, phase="recv")


class PrefillBufferPrepareFinalize(_PrepareFinalize):
    """prepare/finalize over one PrefillBuffer, in vLLM's Standard activation format (prefill).

    One instance per MoE layer; layers may share one PrefillBuffer (each prepare is answered by its
    finalize before the next prepare, as vLLM runs a layer). R = world * max_tokens_per_rank.

    receiver() -> (a1q [R, hidden] (dtype, or float8_e4m3fn with fp8_dispatch), a1q_scale [R, hidden/128]
                   float32 or None, ExpertTokensMetadata(expert_num_tokens=int32 [E_local] device counts of
                   routed (row, k) slots), topk_ids int64 [R, topk] global expert ids, topk_weights float32
                   [R, topk])
        Row s*M + t is token t of source rank s. topk_ids is -1 for every slot whose expert is on another
        rank and on every row no source wrote (its a1q row is unspecified), so experts that route over
        all R rows compute nothing there; topk_weights is 0 there. No host read (graph-capturable).
        Paired with experts that take local ids (vLLM's CPU experts, ``post_init_setup``): topk_ids int32
        [R, topk] *local* ids, 0 (with weight 0) where the global ids have -1.
    finalize's fused_expert_output: [R, hidden] partial rows (the token's local experts weighted and
    summed, what vLLM's experts produce with TopKWeightAndReduceNoOP), or what the experts'
    TopKWeightAndReduce turns into that ([R, topk, hidden] unweighted with the delegate: weighted and
    summed here in float32, k in order). output[t] = sum over the ranks holding one of token t's
    experts, ascending, of their partial rows (PrefillBuffer.combine: bitwise reproducible).
    """

    def __init__(self, buf, ubatch_id=None):
        super().__init__(buf, ubatch_id)
        self._rank_offset = buf.group.rank * buf.num_local_experts
        self.local_ids = False  # the experts take int32 local ids, never -1 (vLLM's CPU experts): post_init_setup

    def post_init_setup(self, fused_experts) -> None:
        """vLLM's hook once the experts are known: experts that index their local weights with the ids as
        given (vLLM's CPU experts, ``vllm_cpu.takes_local_ids``) get int32 local ids (see ``_received``)."""
        super().post_init_setup(fused_experts)
        self.local_ids = takes_local_ids(fused_experts)

    def _reduce(self, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
                weight_and_reduce_impl) -> torch.Tensor:
        """One partial row per received row, [R, hidden]. Without vLLM: already reduced, or [R, topk,
        hidden] unweighted expert outputs (weighted by topk_weights, summed in float32 in k order)."""
        if fused_expert_output.dim() == 2:
            return fused_expert_output
        w = torch.ones_like(topk_weights) if apply_router_weight_on_input else topk_weights
        acc = torch.zeros(fused_expert_output.shape[0], fused_expert_output.shape[2], dtype=torch.float32,
                          device=fused_expert_output.device)
        for k in range(fused_expert_output.shape[1]):
            acc += torch.where(topk_ids[:, k, None] >= 0, w[:, k, None] * fused_expert_output[:, k].float(), 0.0)
        return acc.to(fused_expert_output.dtype)

    def _dispatch(self, a1, topk_weights, topk_ids, phase):
        if phase == "recv":
            return self.buf.dispatch(phase="recv")
        return self.buf.dispatch(a1, topk_ids, topk_weights.to(torch.float32), phase=phase)

    def _received(self, d, quant_config, defer_input_quant):
        x, scales = self._quantized(d.recv_x, d.recv_scales, quant_config, defer_input_quant)
        ids, weights = d.masked_topk()
        if self.local_ids:   # local expert 0 with weight 0 where no local expert: an exact zero in the sum
            return x, scales, self._expert_tokens(d.expert_counts), ids.clamp(min=0).to(torch.int32), weights
        ids = torch.where(ids >= 0, ids.to(torch.int64) + self._rank_offset, -1)
        return x, scales, self._expert_tokens(d.expert_counts), ids, weights

    def _combine(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
                 weight_and_reduce_impl, handle):
        rows = self._reduce(fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
                            weight_and_reduce_impl)
        self.buf.combine(rows.to(self.buf.dtype), handle, out=output, phase="send")

    def _combine_recv(self, output):
        self.buf.combine(out=output, phase="recv")


# ---- the vLLM classes (built on first use) --------------------------------------------------------

FORMATS = {"low_latency": (EPBufferPrepareFinalize, "BatchedExperts", "MoECommPrepareAndFinalize"),
           "high_throughput": (PrefillBufferPrepareFinalize, "Standard", "MoECommStandardPrepareAndFinalize")}


@functools.cache
def prepare_finalize_class(mode: str = "low_latency") -> type:
    """vLLM's prepare/finalize class of a mode (``MODES``): ``MoECommPrepareAndFinalize`` (EPBuffer,
    BatchedExperts format) or ``MoECommStandardPrepareAndFinalize`` (PrefillBuffer, Standard format),
    built on vLLM's base class."""
    if mode not in FORMATS:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    logic, fmt, name = FORMATS[mode]
    mk = importlib.import_module(_MK)
    base = getattr(mk, "FusedMoEPrepareAndFinalizeModular", None) or mk.FusedMoEPrepareAndFinalize
    wr = importlib.import_module(_WEIGHT_AND_REDUCE)
    delegate = getattr(wr, "TopKWeightAndReduceDelegate", None)
    try:  # dual-batch overlap keeps one dispatch in flight per micro-batch
        ubatch_id = importlib.import_module("vllm.v1.worker.ubatching").dbo_current_ubatch_id
    except (ImportError, AttributeError):
        ubatch_id = None
    meta_fields = set(getattr(mk.ExpertTokensMetadata, "__dataclass_fields__", ()))

    def __init__(self, buf):
        base.__init__(self)
        logic.__init__(self, buf, ubatch_id)

    def _expert_tokens(self, counts):
        fields = dict(expert_num_tokens=counts, expert_num_tokens_cpu=None)
        return mk.ExpertTokensMetadata(**{k: v for k, v in fields.items() if k in meta_fields})

    def _check_weight_and_reduce(self, weight_and_reduce_impl):
        if delegate is not None and not isinstance(weight_and_reduce_impl, delegate):
            raise ValueError(f"moe-comm applies the router weights in combine; the experts passed "
                             f"{type(weight_and_reduce_impl).__name__}, expected TopKWeightAndReduceDelegate")

    def _reduce(self, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
                weight_and_reduce_impl):
        # As vLLM's high-throughput prepare/finalize: the experts' own reduction, the delegate meaning
        # "weight and sum contiguous [R, topk, hidden] rows"; NoOP returns already reduced rows as they are.
        if delegate is not None and isinstance(weight_and_reduce_impl, delegate):
            weight_and_reduce_impl = wr.TopKWeightAndReduceContiguous()
        return weight_and_reduce_impl.apply(output=None, fused_expert_output=fused_expert_output,
                                            topk_weights=topk_weights, topk_ids=topk_ids,
                                            apply_router_weight_on_input=apply_router_weight_on_input)

    def _quantize_after_dispatch(self, x, quant_config):
        utils = importlib.import_module("vllm.model_executor.layers.fused_moe.utils")
        xq, scales = utils.moe_kernel_quantize_input(
            x.reshape(-1, x.shape[-1]), quant_config.a1_scale, quant_config.quant_dtype,
            quant_config.per_act_token_quant, quant_config.block_shape)
        if x.dim() == 3 and scales is not None and hasattr(utils, "normalize_batched_scales_shape"):
            scales = utils.normalize_batched_scales_shape(scales, x.shape[0])
        return xq.view(*x.shape[:-1], -1), scales

    members = dict(__init__=__init__, _expert_tokens=_expert_tokens, _quantize_after_dispatch=_quantize_after_dispatch,
                   activation_format=property(lambda self: getattr(mk.FusedMoEActivationFormat, fmt)),
                   __doc__=f"vLLM prepare/finalize on a moe-comm {logic.__name__[:-len('PrepareFinalize')]} "
                           f"({fmt} format; see moe_comm.serving.vllm).")
    members["_check_weight_and_reduce" if logic is EPBufferPrepareFinalize else "_reduce"] = (
        _check_weight_and_reduce if logic is EPBufferPrepareFinalize else _reduce)
    return type(name, (logic, base), members)


def __getattr__(name):
    for mode, (_, _, cls_name) in FORMATS.items():
        if name == cls_name:
            return prepare_finalize_class(mode)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---- building one from vLLM's MoE config ----------------------------------------------------------

def make_prepare_finalize(moe, quant_config, options: dict | None = None):
    """Build the prepare/finalize of the requested mode for a vLLM FusedMoEConfig ``moe``.

    options (from ``--additional-config '{"moe_comm": {...}}'``): mode ("low_latency": EPBuffer,
    BatchedExperts; "high_throughput": PrefillBuffer, Standard; "auto": from vLLM's --all2all-backend,
    ``resolve_mode``), backend ("auto"), timeout_s (30), fp8_dispatch ("auto": "e4m3" when the experts take
    fp8 in 1x128 blocks, then packed UE8M0 if ``post_init_setup`` finds experts that take it; or False,
    True), dispatch_format (instead of fp8_dispatch: an fp8 format of ``moe_comm.formats``). Layers with
    the same shapes and format share one buffer;
    ``moe.max_num_tokens`` is its capacity (tokens per rank per call). The EP group must be the whole
    torch.distributed world (data parallel x expert parallel, tensor parallel 1), with the default linear
    expert placement.
    """
    options = dict(options or {})
    par = moe.moe_parallel_config
    mode = resolve_mode(options, getattr(par, "all2all_backend", None))
    group = process_group(options.get("backend", "auto"), options.get("timeout_s", 30.0))
    if (par.ep_size, par.ep_rank) != (group.world_size, group.rank):
        raise NotImplementedError(
            f"moe-comm needs the expert-parallel group to be the whole world: vLLM has ep_size={par.ep_size} "
            f"ep_rank={par.ep_rank}, torch.distributed has world_size={group.world_size} rank={group.rank} "
            "(use tensor-parallel size 1 with --enable-expert-parallel and data parallelism)")
    fp8, fmt = options.get("fp8_dispatch", "auto"), options.get("dispatch_format")
    auto = fp8 == "auto" and fmt is None
    if auto:
        fmt = formats.E4M3 if (getattr(quant_config, "quant_dtype", None) == torch.float8_e4m3fn
                               and list(getattr(quant_config, "block_shape", None) or []) == _FP8_BLOCK) else None
    else:   # ValueError naming the fix for a conflicting pair
        fmt = formats.dispatch_format_of(False if fp8 == "auto" else fp8, fmt)
    buf = shared_buffer(group, moe.num_experts, moe.hidden_dim, moe.max_num_tokens, moe.experts_per_token,
                        moe.in_dtype, fmt, prefill=mode == "high_throughput")
    pf = prepare_finalize_class(mode)(buf)
    pf.fp8_auto = auto
    return pf
