"""SGLang dispatcher: SGLang's ``BaseDispatcher`` interface (DeepEP low-latency formats) backed by EPBuffer.

SGLang's MoE layer calls ``dispatcher.dispatch(hidden_states, topk_output)``, runs its experts on the
result, then ``dispatcher.combine(combine_input)``. Here:

- dispatch = EPBuffer.dispatch, returned as SGLang's ``DeepEPLLDispatchOutput``: the expert-major
  layout its DeepEP low-latency expert kernels take (DeepGEMM's masked grouped GEMM and friends), which
  is EPBuffer's own layout, so the tokens are not copied (with fp8 the scale tensor, 1/32 of the fp8
  payload's bytes, is copied whole into DeepEP's column-major order on every dispatch):
      hidden_states        [E_local, world * max_tokens_per_rank, hidden] (bf16, or float8_e4m3fn with fp8)
      hidden_states_scale  None, or float32 [E_local, world * max_tokens_per_rank, hidden // 128] with
                           fp8, column-major over the token rows as DeepEP returns it (stride 1 on dim 1)
      masked_m             int32 [E_local] on the device: valid rows per local expert
      expected_m           int: (T * world * topk + num_experts) // num_experts, as SGLang computes it
      topk_ids, topk_weights  the router's, unchanged
- combine = EPBuffer.combine of ``DeepEPLLCombineInput.hidden_states`` (the experts' unweighted output,
  same layout, rows [:masked_m[e]] valid) with the router weights applied inside the combine kernel;
  returns [T, hidden].

Each dispatch feeds the received counts to SGLang's expert-distribution recorder (EPLB statistics), as
SGLang's DeepEP low-latency dispatcher does.

``dispatch_a``/``dispatch_b`` and ``combine_a``/``combine_b`` (SGLang's split calls) map onto the
buffer's send and receive phases. Every dispatch first raises, by name, an error the group recorded in
an earlier step (``moe_comm.serving.ep_group.check_group``).

Faults: after ``moe_comm.serving.ep_group.recover()`` has excluded a dead rank, the next dispatch writes
the group's live ranks into SGLang's elastic-EP active-rank mask (``ElasticEPStateManager.instance()
.active_ranks``, 1 = active), where SGLang has one (a server started with ``--elastic-ep-backend``), so
SGLang's EPLB sees the change as it does from its Mooncake and NIXL dispatchers; without that state
nothing is written. SGLang does not call ``recover()`` itself: its engine stops on the named error.

Limits: one layout, DeepEP's low-latency one, for every batch (there is no "normal" high-throughput
mode): a batch of more than max_tokens_per_rank tokens on a rank raises ValueError, so cap SGLang's
per-rank batch (e.g. --chunked-prefill-size, --cuda-graph-max-bs) at MOE_COMM_SGLANG_MAX_TOKENS.
Two-batch overlap (two dispatches in flight) and fused shared experts are not supported (clear errors).

SGLang is imported only when ``dispatcher_class()`` (or ``make_dispatcher``) is first used;
``EPBufferDispatcher`` holds all the logic and needs no SGLang. Switched on by the plugin
(moe_comm.serving.sglang_plugin); tested against SGLang 0.5.23.
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import NamedTuple

import torch

from ..compat.deep_ep_layout import column_major_scales
from .ep_group import check_group, process_group, shared_buffer

__all__ = ["EPBufferDispatcher", "LowLatencyDispatchOutput", "dispatcher_class", "elastic_active_ranks",
           "make_dispatcher", "options_from_env"]

_DISPATCHER = "sglang.srt.layers.moe.token_dispatcher"
_EPLB = "sglang.srt.eplb.expert_distribution"
_MOE_UTILS = "sglang.srt.layers.moe.utils"
_ELASTIC_EP = "sglang.srt.elastic_ep.elastic_ep"
_ENV_PREFIX = "MOE_COMM_SGLANG"
DEFAULT_MAX_TOKENS_PER_RANK = 128  # SGLang's default for SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK


class LowLatencyDispatchOutput(NamedTuple):
    """Stand-in for SGLang's DeepEPLLDispatchOutput where SGLang is absent (same fields, same order)."""

    hidden_states: torch.Tensor
    hidden_states_scale: torch.Tensor | None
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    masked_m: torch.Tensor
    expected_m: int


class EPBufferDispatcher:
    """dispatch/combine over one EPBuffer, in SGLang's dispatcher calling convention (see the module doc).

    dispatch(hidden_states [T, hidden], topk_output with .topk_ids [T, topk] int32/int64 global expert
    ids (-1 = not routed) and .topk_weights [T, topk] float), T <= ep.max_tokens_per_rank. Dispatch and
    combine alternate; one dispatch is in flight per dispatcher (SGLang's two-batch overlap, which keeps
    two, is not supported: d.x has one set per buffer).
    """

    def __init__(self, ep):
        self.ep = ep
        self._pending = None   # (topk_ids, topk_weights, T) between dispatch_a and dispatch_b
        self._handle = None    # the dispatch the next combine answers
        self._weights = None
        self._out = None       # the combine's [T, hidden] output between combine_a and combine_b
        self._published = None  # the live ranks last written into the framework's active-rank mask

    def _output(self, *fields):
        return LowLatencyDispatchOutput(*fields)

    def _record_counts(self, counts: torch.Tensor) -> None:
        """Hook for the framework's expert-load statistics (int32 [E_local] device counts)."""

    def _active_ranks(self) -> torch.Tensor | None:
        """Hook: the framework's active-rank mask (int [ranks], 1 = active), or None where it has none."""
        return None

    def _publish_live_ranks(self) -> None:
        """Make the framework's active-rank mask equal to the group's live ranks (written only when they
        changed since the last write: a host-to-device copy, no sync)."""
        active = self._active_ranks()
        live = tuple(self.ep.group.live_ranks)
        if active is None or live == self._published:
            return
        mask = torch.zeros(active.shape, dtype=active.dtype)
        mask[list(live)] = 1
        active.copy_(mask)
        self._published = live

    # ---- dispatch --------------------------------------------------------------------------------
    def dispatch_a(self, hidden_states: torch.Tensor, topk_output) -> None:
        """Send phase (the whole dispatch at world 1)."""
        check_group(self.ep.group)
        self._publish_live_ranks()
        if self._pending is not None or self._handle is not None:
            raise RuntimeError("dispatch while an earlier dispatch is still waiting for its "
                               "dispatch_b/combine (two-batch overlap is not supported)")
        ids, weights = topk_output.topk_ids, topk_output.topk_weights
        whole = self.ep.group.world_size == 1
        d = self.ep.dispatch(hidden_states, ids, phase="both" if whole else "send")
        self._pending = (ids, weights, hidden_states.shape[0], d)

    def dispatch_b(self):
        """Receive phase: -> DeepEPLLDispatchOutput (see the module doc)."""
        if self._pending is None:
            raise RuntimeError("dispatch_b without dispatch_a")
        ids, weights, tokens, d = self._pending
        self._pending = None
        if d is None:
            d = self.ep.dispatch(None, None, phase="recv")
        self._handle, self._weights = d.handle, weights
        self._record_counts(d.counts)
        scales = None if d.scales is None else column_major_scales(d.scales)
        world, topk, experts = self.ep.group.world_size, self.ep.topk, self.ep.num_experts
        expected_m = (tokens * world * topk + experts) // experts
        return self._output(d.x, scales, ids, weights, d.counts, expected_m)

    def dispatch(self, hidden_states: torch.Tensor, topk_output):
        self.dispatch_a(hidden_states, topk_output)
        return self.dispatch_b()

    # ---- combine ---------------------------------------------------------------------------------
    def combine_a(self, combine_input) -> None:
        """Send phase of the combine of ``combine_input.hidden_states`` [E_local, R, hidden]."""
        if self._handle is None:
            raise RuntimeError("combine without a matching dispatch")
        weights = getattr(combine_input, "topk_weights", None)
        weights = self._weights if weights is None else weights
        # The dispatch is answered whatever the send does: a send that raises (bad input, a failed group)
        # must not leave this dispatcher refusing every later dispatch.
        handle, self._handle, self._weights = self._handle, None, None
        self._out = torch.empty((handle.num_tokens, self.ep.hidden), dtype=self.ep.dtype,
                                device=self.ep.group.device)
        self.ep.combine(combine_input.hidden_states, weights, handle, out=self._out, phase="send")

    def combine_b(self) -> torch.Tensor:
        """Receive phase: -> [T, hidden], y[t] = sum_k topk_weights[t, k] * expert output of (t, k)."""
        out, self._out = self._out, None
        self.ep.combine(None, None, None, out=out, phase="recv")
        return out

    def combine(self, combine_input) -> torch.Tensor:
        self.combine_a(combine_input)
        return self.combine_b()


# ---- the SGLang class (built on first use) --------------------------------------------------------

@functools.cache
def dispatcher_class() -> type:
    """``MoECommDispatcher``: EPBufferDispatcher on SGLang's BaseDispatcher, with its output types."""
    sgl = importlib.import_module(_DISPATCHER)
    recorder = importlib.import_module(_EPLB).get_global_expert_distribution_recorder

    class MoECommDispatcher(EPBufferDispatcher, sgl.BaseDispatcher):
        """SGLang dispatcher on a moe-comm EPBuffer (DeepEP low-latency formats; moe_comm.serving.sglang)."""

        def __init__(self, ep):
            sgl.BaseDispatcher.__init__(self)
            EPBufferDispatcher.__init__(self, ep)

        def _output(self, *fields):
            return sgl.DeepEPLLDispatchOutput(*fields)

        def _record_counts(self, counts):  # SGLang's expert-distribution recorder (EPLB), as DeepEP's does
            recorder().on_deepep_dispatch_low_latency(counts)

        def _active_ranks(self):
            return elastic_active_ranks()

        def combine_a(self, combine_input) -> None:
            if combine_input.format != sgl.CombineInputFormat.DEEPEP_LL:
                raise ValueError(f"moe-comm combines DeepEP low-latency layout ([E_local, R, hidden]); got a "
                                 f"{combine_input.format} combine input: run SGLang with "
                                 "--moe-a2a-backend deepep --deepep-mode low_latency")
            EPBufferDispatcher.combine_a(self, combine_input)

        # BaseDispatcher's hook machinery replaces self.dispatch/self.combine by wrappers that call the
        # originals with keywords: keep the keyword names SGLang uses.
        def dispatch(self, hidden_states, topk_output):
            return EPBufferDispatcher.dispatch(self, hidden_states, topk_output)

        def combine(self, combine_input):
            return EPBufferDispatcher.combine(self, combine_input)

    return MoECommDispatcher


def elastic_active_ranks() -> torch.Tensor | None:
    """SGLang's elastic-EP active-rank mask (``ElasticEPStateManager.instance().active_ranks``, int32
    [max EP size], 1 = active), or None: an SGLang without elastic EP, or a server started without
    ``--elastic-ep-backend`` (no state)."""
    try:
        manager = importlib.import_module(_ELASTIC_EP).ElasticEPStateManager
    except (ImportError, AttributeError):
        return None
    state = manager.instance()
    return None if state is None else getattr(state, "active_ranks", None)


# ---- configuration and the factory ---------------------------------------------------------------

def options_from_env(environ=None) -> dict | None:
    """moe-comm's SGLang options, or None when it was not requested.

    MOE_COMM_SGLANG=1 switches it on; MOE_COMM_SGLANG_BACKEND (auto), MOE_COMM_SGLANG_TIMEOUT_S (30),
    MOE_COMM_SGLANG_FP8 (0: dispatch bf16; 1: float8_e4m3fn in 1x128 blocks, float32 scales),
    MOE_COMM_SGLANG_MAX_TOKENS (SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK, else 128: tokens per rank
    per dispatch).
    """
    env = os.environ if environ is None else environ
    if env.get(_ENV_PREFIX, "0").strip().lower() in ("", "0", "false", "no", "off"):
        return None
    max_tokens = env.get(f"{_ENV_PREFIX}_MAX_TOKENS") or env.get("SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK")
    return dict(backend=env.get(f"{_ENV_PREFIX}_BACKEND", "auto"),
                timeout_s=float(env.get(f"{_ENV_PREFIX}_TIMEOUT_S", "30")),
                fp8_dispatch=env.get(f"{_ENV_PREFIX}_FP8", "0").strip() == "1",
                max_tokens_per_rank=int(max_tokens or DEFAULT_MAX_TOKENS_PER_RANK))


def make_dispatcher(moe_runner_config, options: dict):
    """MoECommDispatcher for one SGLang MoE layer (its MoeRunnerConfig). Layers with the same shapes
    share one EPBuffer. Expert parallelism must span the whole torch.distributed world, experts placed
    linearly (rank r owns [r*E_local, (r+1)*E_local)), as with SGLang's DeepEP backend."""
    cfg = moe_runner_config
    if importlib.import_module(_MOE_UTILS).is_tbo_enabled():
        raise NotImplementedError("moe-comm's SGLang dispatcher keeps one dispatch in flight: run without "
                                  "--enable-two-batch-overlap")
    if cfg.num_fused_shared_experts:
        raise NotImplementedError("moe-comm dispatches routed experts only: run SGLang without shared-experts "
                                  "fusion (--disable-shared-experts-fusion), as with its DeepEP backend")
    group = process_group(options.get("backend", "auto"), options.get("timeout_s", 30.0))
    if cfg.num_local_experts * group.world_size != cfg.num_experts:
        raise NotImplementedError(
            f"moe-comm needs expert parallelism over the whole world: SGLang has {cfg.num_experts} experts, "
            f"{cfg.num_local_experts} per rank, torch.distributed has {group.world_size} ranks "
            "(set --ep-size to the world size)")
    ep = shared_buffer(group, cfg.num_experts, cfg.hidden_size, int(options["max_tokens_per_rank"]), cfg.top_k,
                       cfg.params_dtype, bool(options.get("fp8_dispatch", False)))
    return dispatcher_class()(ep)
