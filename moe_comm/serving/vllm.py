"""vLLM adapter: a FusedMoEPrepareAndFinalize (BatchedExperts activation format) backed by EPBuffer.

vLLM's modular MoE kernel is prepare -> experts -> finalize. Here:

- prepare  = dispatch (with the fp8 quantization fused into it when the buffer was built with
  ``fp8_dispatch=True``). It returns the expert-major tensor [E_local, world*max_tokens_per_rank, hidden],
  its scales, and ExpertTokensMetadata whose ``expert_num_tokens`` is the dispatch's int32 [E_local]
  device counts (``expert_num_tokens_cpu`` stays None: no host copy, so CUDA graphs can capture it).
- finalize = combine, with the router weights applied inside the combine kernel (the experts hand
  the weighting to us through TopKWeightAndReduceDelegate), written in place into vLLM's output.

vLLM is imported only when ``MoECommPrepareAndFinalize`` (or ``make_prepare_finalize``) is first used;
``EPBufferPrepareFinalize`` holds all the logic and needs no vLLM (the tests drive it directly).
Tested against vLLM 0.33 and 0.32 (``FusedMoEPrepareAndFinalizeModular``: ``prepare`` takes
``defer_input_quant``, ``finalize`` writes into ``output`` and returns None); older releases that call the
base class ``FusedMoEPrepareAndFinalize`` are detected and used instead.

Faults: every prepare first raises, by name, the error the group recorded in an earlier step
(``moe_comm.serving.ep_group.check_group``), so vLLM's worker stops on it instead of serving on.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

import torch

from .ep_group import check_group, process_group, shared_buffer, use_group

__all__ = ["EPBufferPrepareFinalize", "ExpertTokens", "MoECommPrepareAndFinalize", "make_prepare_finalize",
           "prepare_finalize_class", "use_group"]

_MK = "vllm.model_executor.layers.fused_moe.modular_kernel"
_WEIGHT_AND_REDUCE = "vllm.model_executor.layers.fused_moe.topk_weight_and_reduce"
_FP8_BLOCK = [128, 128]  # the quantization EPBuffer's fp8 dispatch produces: 1x128 blocks, float32 scales


@dataclass
class ExpertTokens:
    """Stand-in for vLLM's ExpertTokensMetadata where vLLM is absent (same field names)."""

    expert_num_tokens: torch.Tensor            # int32 [E_local] on the device
    expert_num_tokens_cpu: torch.Tensor | None = None


class EPBufferPrepareFinalize:
    """prepare/finalize over one EPBuffer, in the calling convention of vLLM's modular MoE kernel.

    One instance per MoE layer is fine; layers may share one EPBuffer (calls alternate between its
    two buffer sets). ``prepare`` and ``finalize`` must alternate per micro-batch, as in vLLM.
    Async (``prepare_async`` / ``finalize_async``) maps onto the buffer's send and receive phases.
    """

    def __init__(self, ep, ubatch_id=None):
        self.ep = ep
        self._ubatch_id = ubatch_id or (lambda: 0)  # vLLM's dual-batch overlap: one handle per micro-batch
        self._handles: dict[int, object] = {}

    # ---- what vLLM asks before building the experts ----------------------------------------------
    def max_num_tokens_per_rank(self) -> int:
        return self.ep.max_tokens_per_rank

    def num_dispatchers(self) -> int:
        return self.ep.group.world_size

    def topk_indices_dtype(self) -> torch.dtype | None:
        return None  # dispatch takes int32 and int64 ids alike

    def output_is_reduced(self) -> bool:
        return True  # combine sums every expert's output on the token's own rank: nothing left to reduce

    def supports_async(self) -> bool:
        return True

    # ---- hooks the vLLM subclass overrides -------------------------------------------------------
    def _expert_tokens(self, counts: torch.Tensor):
        return ExpertTokens(expert_num_tokens=counts)

    def _check_weight_and_reduce(self, weight_and_reduce_impl) -> None:
        """vLLM passes the experts' TopKWeightAndReduce; ours must be the delegate (we weight in combine)."""

    def _quantize_after_dispatch(self, x: torch.Tensor, quant_config):
        raise NotImplementedError(
            f"moe-comm dispatches bf16/fp16, or fp8 in 1x128 blocks (fp8_dispatch=True); quantization "
            f"{getattr(quant_config, 'quant_dtype', None)} with block shape "
            f"{getattr(quant_config, 'block_shape', None)} needs the vLLM adapter (MoECommPrepareAndFinalize)")

    # ---- prepare ---------------------------------------------------------------------------------
    def _dispatched(self, d, quant_config, defer_input_quant: bool):
        """(x, scales) the experts expect, from a DispatchResult."""
        quant_dtype = getattr(quant_config, "quant_dtype", None)
        if self.ep.fp8_dispatch:
            if defer_input_quant or quant_dtype != torch.float8_e4m3fn or \
                    list(getattr(quant_config, "block_shape", None) or []) != _FP8_BLOCK:
                raise ValueError("this EPBuffer dispatches fp8 in 1x128 blocks, but the experts want "
                                 f"quant_dtype={quant_dtype}, block_shape={getattr(quant_config, 'block_shape', None)}"
                                 f"{' unquantized' if defer_input_quant else ''}: build it with fp8_dispatch=False")
            return d.x, d.scales
        if quant_dtype is None or defer_input_quant:
            return d.x, None
        return self._quantize_after_dispatch(d.x, quant_config)

    def prepare_async(self, a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      num_experts: int, expert_map, apply_router_weight_on_input: bool, quant_config,
                      defer_input_quant: bool = False):
        """Send phase of the dispatch now (the whole dispatch at world 1); returns (hook, receiver) as vLLM
        expects.

        a1           [M, hidden] activations, M <= max_num_tokens_per_rank()
        topk_weights [M, topk] float; topk_ids [M, topk] global expert ids (-1 = not routed)
        expert_map   ignored: experts are placed linearly (rank r owns [r*E_local, (r+1)*E_local))
        hook()       runs the receive phase (waits for every peer's tokens)
        receiver()   -> (x [E_local, world*max_tokens_per_rank, hidden], scales or None,
                        ExpertTokensMetadata(expert_num_tokens=int32 [E_local] device counts), None, None)
        """
        check_group(self.ep.group)  # a fault of the previous step is raised here, by name
        if num_experts != self.ep.num_experts:
            raise ValueError(f"vLLM has {num_experts} experts, the EPBuffer was built for {self.ep.num_experts}")
        if apply_router_weight_on_input:
            if topk_ids.shape[1] != 1:
                raise ValueError("apply_router_weight_on_input needs topk == 1")
            a1 = a1 * topk_weights.to(a1.dtype)
        # A one-rank group dispatches at once: split phases there would only copy a1 for the later kernel.
        whole = self.ep.group.world_size == 1
        d = self.ep.dispatch(a1, topk_ids, phase="both" if whole else "send")
        ubatch, received = self._ubatch_id(), [d] if whole else []

        def hook():
            if not received:
                received.append(self.ep.dispatch(None, None, phase="recv"))

        def receiver():
            hook()
            d = received[0]
            self._handles[ubatch] = d.handle
            x, scales = self._dispatched(d, quant_config, defer_input_quant)
            return x, scales, self._expert_tokens(d.counts), None, None

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
        """Send phase of the combine now; returns (hook, receiver); after receiver() ``output`` is valid.

        output              [M, hidden], written in place: output[t] = sum over routed k of
                            topk_weights[t, k] * fused_expert_output[row of (t, k)]
        fused_expert_output [E_local, world*max_tokens_per_rank, hidden]: the experts' unweighted output,
                            rows [:expert_num_tokens[e]] valid
        """
        self._check_weight_and_reduce(weight_and_reduce_impl)
        handle = self._handles.pop(self._ubatch_id(), None)
        if handle is None:
            raise RuntimeError("finalize without a matching prepare on this micro-batch")
        weights = torch.ones_like(topk_weights) if apply_router_weight_on_input else topk_weights
        self.ep.combine(fused_expert_output, weights, handle, out=output, phase="send")
        done = []

        def hook():
            if not done:
                self.ep.combine(None, None, None, out=output, phase="recv")
                done.append(True)

        return hook, hook

    def finalize(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
                 weight_and_reduce_impl) -> None:
        """Combine in one call (see ``finalize_async``)."""
        _, receiver = self.finalize_async(output, fused_expert_output, topk_weights, topk_ids,
                                          apply_router_weight_on_input, weight_and_reduce_impl)
        receiver()


# ---- the vLLM class (built on first use) ----------------------------------------------------------

@functools.cache
def prepare_finalize_class() -> type:
    """``MoECommPrepareAndFinalize``: EPBufferPrepareFinalize on vLLM's prepare/finalize base class."""
    mk = importlib.import_module(_MK)
    base = getattr(mk, "FusedMoEPrepareAndFinalizeModular", None) or mk.FusedMoEPrepareAndFinalize
    delegate = getattr(importlib.import_module(_WEIGHT_AND_REDUCE), "TopKWeightAndReduceDelegate", None)
    try:  # dual-batch overlap keeps one dispatch in flight per micro-batch
        ubatch_id = importlib.import_module("vllm.v1.worker.ubatching").dbo_current_ubatch_id
    except (ImportError, AttributeError):
        ubatch_id = None
    meta_fields = set(getattr(mk.ExpertTokensMetadata, "__dataclass_fields__", ()))

    class MoECommPrepareAndFinalize(EPBufferPrepareFinalize, base):
        """vLLM prepare/finalize on a moe-comm EPBuffer (BatchedExperts format; see moe_comm.serving.vllm)."""

        def __init__(self, ep):
            base.__init__(self)
            EPBufferPrepareFinalize.__init__(self, ep, ubatch_id)

        @property
        def activation_format(self):
            return mk.FusedMoEActivationFormat.BatchedExperts

        def _expert_tokens(self, counts):
            fields = dict(expert_num_tokens=counts, expert_num_tokens_cpu=None)
            return mk.ExpertTokensMetadata(**{k: v for k, v in fields.items() if k in meta_fields})

        def _check_weight_and_reduce(self, weight_and_reduce_impl):
            if delegate is not None and not isinstance(weight_and_reduce_impl, delegate):
                raise ValueError(f"moe-comm applies the router weights in combine; the experts passed "
                                 f"{type(weight_and_reduce_impl).__name__}, expected TopKWeightAndReduceDelegate")

        def _quantize_after_dispatch(self, x, quant_config):
            utils = importlib.import_module("vllm.model_executor.layers.fused_moe.utils")
            experts, rows, hidden = x.shape
            xq, scales = utils.moe_kernel_quantize_input(
                x.view(-1, hidden), quant_config.a1_scale, quant_config.quant_dtype,
                quant_config.per_act_token_quant, quant_config.block_shape)
            if scales is not None and hasattr(utils, "normalize_batched_scales_shape"):
                scales = utils.normalize_batched_scales_shape(scales, experts)
            return xq.view(experts, rows, -1), scales

    return MoECommPrepareAndFinalize


def __getattr__(name):
    if name == "MoECommPrepareAndFinalize":
        return prepare_finalize_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---- building one from vLLM's MoE config ----------------------------------------------------------

def make_prepare_finalize(moe, quant_config, options: dict | None = None):
    """Build MoECommPrepareAndFinalize for a vLLM FusedMoEConfig ``moe``.

    options (from ``--additional-config '{"moe_comm": {...}}'``): backend ("auto"), timeout_s (30),
    fp8_dispatch ("auto": on when the experts take fp8 in 1x128 blocks). Layers with the same shapes share
    one EPBuffer. The EP group must be the whole torch.distributed world (data parallel x expert parallel,
    tensor parallel 1), with the default linear expert placement.
    """
    options = dict(options or {})
    par = moe.moe_parallel_config
    group = process_group(options.get("backend", "auto"), options.get("timeout_s", 30.0))
    if (par.ep_size, par.ep_rank) != (group.world_size, group.rank):
        raise NotImplementedError(
            f"moe-comm needs the expert-parallel group to be the whole world: vLLM has ep_size={par.ep_size} "
            f"ep_rank={par.ep_rank}, torch.distributed has world_size={group.world_size} rank={group.rank} "
            "(use tensor-parallel size 1 with --enable-expert-parallel and data parallelism)")
    fp8 = options.get("fp8_dispatch", "auto")
    if fp8 == "auto":
        fp8 = (getattr(quant_config, "quant_dtype", None) == torch.float8_e4m3fn
               and list(getattr(quant_config, "block_shape", None) or []) == _FP8_BLOCK)
    ep = shared_buffer(group, moe.num_experts, moe.hidden_dim, moe.max_num_tokens, moe.experts_per_token,
                       moe.in_dtype, bool(fp8))
    return prepare_finalize_class()(ep)
