"""SGLang dispatcher: SGLang's ``BaseDispatcher`` interface in both DeepEP formats, backed by moe-comm.

SGLang's MoE layer calls ``dispatcher.dispatch(hidden_states, topk_output)``, runs its experts on the
result, then ``dispatcher.combine(combine_input)``. SGLang's DeepEP dispatcher has two modes, picked by
``--deepep-mode``: ``low_latency`` (decode), ``normal`` (prefill) and ``auto`` (per batch: normal when the
batch has an extend, i.e. prefill tokens, else low latency: SGLang's ``DeepEPMode.resolve``). This one has
the same three, with the mode resolved once per dispatch and kept until its combine:

- low latency = EPBuffer.dispatch, returned as SGLang's ``DeepEPLLDispatchOutput``: the expert-major
  layout its DeepEP low-latency expert kernels take (DeepGEMM's masked grouped GEMM and friends), which
  is EPBuffer's own layout, so the tokens are not copied (with fp8 the scale tensor, 1/32 of the fp8
  payload's bytes, 1/128 with UE8M0, is copied whole into DeepEP's column-major order on every dispatch):
      hidden_states        [E_local, world * max_tokens_per_rank, hidden] (bf16, or float8_e4m3fn with fp8)
      hidden_states_scale  None, or with fp8 float32 [E_local, world * max_tokens_per_rank, hidden // 128]
                           ("e4m3", "e4m3-pow2") or int32 [.., hidden // 512] packed UE8M0 ("e4m3-ue8m0",
                           DeepEP's use_ue8m0, what DeepGEMM's UE8M0 path takes), column-major over the
                           token rows as DeepEP returns it (stride 1 on dim 1)
      masked_m             int32 [E_local] on the device: valid rows per local expert
      expected_m           int: (T * world * topk + num_experts) // num_experts, as SGLang computes it
      topk_ids, topk_weights  the router's, unchanged
  combine = EPBuffer.combine of ``DeepEPLLCombineInput.hidden_states`` (the experts' unweighted output,
  same layout, rows [:masked_m[e]] valid) with the router weights applied inside the combine kernel;
  returns [T, hidden].
- normal = PrefillBuffer.dispatch, returned as SGLang's ``DeepEPNormalDispatchOutput`` in DeepEP's
  normal-mode layout (``moe_comm.compat.deep_ep_layout.PackedReceive``; the count N is read on the host,
  as DeepEP's normal mode does):
      hidden_states        [N, hidden]: every token with an expert on this rank, once, in (source rank,
                           token index) order (bf16, or float8_e4m3fn with fp8)
      hidden_states_scale  None, or with fp8 float32 [N, hidden // 128] or int32 [N, hidden // 512] packed
                           UE8M0, row-major, as DeepEP's normal mode returns them
  With fp8 the tokens are quantized on the way, once, in the buffer's format; or dispatch() is given them
  pre-quantized, hidden_states = (codes [T, hidden] float8_e4m3fn, scales) in that format (as SGLang's
  DeepEP path quantizes before DeepEP's normal dispatch; any strides), and they arrive as given: no
  dequantization, no requantization.
      topk_ids             int64 [N, topk]: local expert ids, -1 where the slot's expert is elsewhere
      topk_weights         float32 [N, topk], 0 where the id is -1
      num_recv_tokens_per_expert  list of E_local ints (slots per local expert; rounded up to 128 where
                           SGLang's DeepGEMM path asks DeepEP for that alignment)
  combine = PrefillBuffer.combine of ``DeepEPNormalCombineInput.hidden_states`` [N, hidden] (each row the
  token's local experts, weighted and summed, as SGLang's normal-mode experts produce it): every rank's row
  of a token summed at the token's rank (unweighted, as DeepEP's normal combine), [T, hidden].

Each dispatch feeds the received counts to SGLang's expert-distribution recorder (EPLB statistics), as
SGLang's DeepEP dispatchers do (``on_deepep_dispatch_low_latency`` / ``on_deepep_dispatch_normal``).

``dispatch_a``/``dispatch_b`` and ``combine_a``/``combine_b`` (SGLang's split calls) map onto the
buffers' send and receive phases. Every dispatch first raises, by name, an error the group recorded in
an earlier step (``moe_comm.serving.ep_group.check_group``).

Faults: after ``moe_comm.serving.ep_group.recover()`` has excluded a dead rank, the next dispatch writes
the group's live ranks into SGLang's elastic-EP active-rank mask (``ElasticEPStateManager.instance()
.active_ranks``, 1 = active), where SGLang has one (a server started with ``--elastic-ep-backend``), so
SGLang's EPLB sees the change as it does from its Mooncake and NIXL dispatchers; without that state
nothing is written. SGLang does not call ``recover()`` itself: its engine stops on the named error.

Limits: each mode has a capacity, tokens per rank per dispatch (MOE_COMM_SGLANG_MAX_TOKENS for low
latency, MOE_COMM_SGLANG_PREFILL_MAX_TOKENS for normal); a larger batch raises ValueError, so cap SGLang's
per-rank batch (--cuda-graph-max-bs for decode, --chunked-prefill-size for prefill) at them. Two-batch
overlap (two dispatches in flight) and fused shared experts are not supported (clear errors).

SGLang is imported only when ``dispatcher_class()`` (or ``make_dispatcher``) is first used;
``EPBufferDispatcher``, ``PrefillBufferDispatcher`` and ``ModeDispatcher`` hold all the logic and need no
SGLang. Switched on by the plugin (moe_comm.serving.sglang_plugin); tested against SGLang 0.5.23.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from typing import NamedTuple

import torch

from .. import formats
from ..compat.deep_ep_layout import PackedReceive, column_major_scales, dispatch_layout
from .ep_group import check_group, process_group, shared_buffer

__all__ = ["EPBufferDispatcher", "LowLatencyDispatchOutput", "ModeDispatcher", "NormalDispatchOutput",
           "PrefillBufferDispatcher", "dispatcher_class", "elastic_active_ranks", "env_options", "make_dispatcher",
           "options_from_env", "switch_from_env"]

logger = logging.getLogger(__name__)
_announced: set = set()   # the dispatcher classes this process has logged building

_DISPATCHER = "sglang.srt.layers.moe.token_dispatcher"
_EPLB = "sglang.srt.eplb.expert_distribution"
_MOE_UTILS = "sglang.srt.layers.moe.utils"
_ELASTIC_EP = "sglang.srt.elastic_ep.elastic_ep"
_DP_ATTENTION = "sglang.srt.layers.dp_attention"
_DEEP_GEMM = "sglang.srt.layers.deep_gemm_wrapper.configurer"
_ENV_PREFIX = "MOE_COMM_SGLANG"
DEFAULT_MAX_TOKENS_PER_RANK = 128  # SGLang's default for SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK
DEFAULT_PREFILL_MAX_TOKENS_PER_RANK = 4096   # normal mode: tokens per rank per dispatch (a prefill chunk)
MODES = ("low_latency", "normal", "auto")    # SGLang's --deepep-mode values
DEEPGEMM_ALIGNMENT = 128   # what SGLang's normal dispatcher asks DeepEP to round counts to for DeepGEMM


class LowLatencyDispatchOutput(NamedTuple):
    """Stand-in for SGLang's DeepEPLLDispatchOutput where SGLang is absent (same fields, same order)."""

    hidden_states: torch.Tensor
    hidden_states_scale: torch.Tensor | None
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    masked_m: torch.Tensor
    expected_m: int


class NormalDispatchOutput(NamedTuple):
    """Stand-in for SGLang's DeepEPNormalDispatchOutput where SGLang is absent (same fields, same order)."""

    hidden_states: torch.Tensor
    hidden_states_scale: torch.Tensor | None
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    num_recv_tokens_per_expert: list


class _LiveRanks:
    """Writes the group's live ranks into the framework's active-rank mask (both modes)."""

    def __init__(self):
        self._published = None  # the live ranks last written into the framework's active-rank mask

    def _active_ranks(self) -> torch.Tensor | None:
        """Hook: the framework's active-rank mask (int [ranks], 1 = active), or None where it has none."""
        return None

    def _publish_live_ranks(self, group) -> None:
        """Make the framework's active-rank mask equal to the group's live ranks (written only when they
        changed since the last write: a host-to-device copy, no sync)."""
        active = self._active_ranks()
        live = tuple(group.live_ranks)
        if active is None or live == self._published:
            return
        mask = torch.zeros(active.shape, dtype=active.dtype)
        mask[list(live)] = 1
        active.copy_(mask)
        self._published = live


class _Dispatcher(_LiveRanks):
    """SGLang's dispatcher calling convention over one moe-comm op (``self.op``: an EPBuffer or a
    PrefillBuffer): ``dispatch`` = ``dispatch_a`` (send phase; the whole dispatch at world 1) then
    ``dispatch_b`` (receive phase), ``combine`` = ``combine_a`` then ``combine_b``. Dispatch and combine
    alternate, one dispatch in flight. Subclasses implement ``_send``, ``_receive`` and ``_combine_send``."""

    def __init__(self, op):
        super().__init__()
        self.op = op
        self._pending = None   # what ``_send`` returned, between dispatch_a and dispatch_b
        self._answer = None    # (tokens, what ``_receive`` kept): the dispatch the next combine answers
        self._out = None       # the combine's [T, hidden] output between combine_a and combine_b

    def _send(self, hidden_states: torch.Tensor, topk_output, phase: str):
        """Launch the dispatch's ``phase`` ("send", or "both" at world 1); returns what ``_receive`` needs."""
        raise NotImplementedError

    def _receive(self, pending):
        """Finish the dispatch; returns (dispatch output, (tokens, what ``_combine_send`` needs))."""
        raise NotImplementedError

    def _combine_send(self, kept, combine_input, out: torch.Tensor) -> None:
        """Launch the combine's send phase of ``combine_input``, answering the dispatch that kept ``kept``."""
        raise NotImplementedError

    # ---- dispatch --------------------------------------------------------------------------------
    def dispatch_a(self, hidden_states: torch.Tensor, topk_output) -> None:
        """Send phase (the whole dispatch at world 1)."""
        check_group(self.op.group)
        self._publish_live_ranks(self.op.group)
        if self._pending is not None or self._answer is not None:
            raise RuntimeError("dispatch while an earlier dispatch is still waiting for its "
                               "dispatch_b/combine (two-batch overlap is not supported)")
        self._pending = self._send(hidden_states, topk_output, "both" if self.op.group.world_size == 1 else "send")

    def dispatch_b(self):
        """Receive phase: -> the mode's dispatch output (see the module doc)."""
        if self._pending is None:
            raise RuntimeError("dispatch_b without dispatch_a")
        pending, self._pending = self._pending, None
        output, self._answer = self._receive(pending)
        return output

    def dispatch(self, hidden_states: torch.Tensor, topk_output):
        self.dispatch_a(hidden_states, topk_output)
        return self.dispatch_b()

    # ---- combine ---------------------------------------------------------------------------------
    def combine_a(self, combine_input) -> None:
        """Send phase of the combine of ``combine_input.hidden_states``."""
        if self._answer is None:
            raise RuntimeError("combine without a matching dispatch")
        # The dispatch is answered whatever the send does: a send that raises (bad input, a failed group)
        # must not leave this dispatcher refusing every later dispatch.
        (tokens, kept), self._answer = self._answer, None
        self._out = torch.empty((tokens, self.op.hidden), dtype=self.op.dtype, device=self.op.group.device)
        self._combine_send(kept, combine_input, self._out)

    def combine_b(self) -> torch.Tensor:
        """Receive phase: -> [T, hidden], this rank's tokens with their experts' outputs reduced."""
        out, self._out = self._out, None
        self.op.combine(out=out, phase="recv")
        return out

    def combine(self, combine_input) -> torch.Tensor:
        self.combine_a(combine_input)
        return self.combine_b()


class EPBufferDispatcher(_Dispatcher):
    """Low latency: dispatch/combine over one EPBuffer, in SGLang's dispatcher calling convention (module doc).

    dispatch(hidden_states [T, hidden], topk_output with .topk_ids [T, topk] int32/int64 global expert
    ids (-1 = not routed) and .topk_weights [T, topk] float), T <= ep.max_tokens_per_rank. Dispatch and
    combine alternate; one dispatch is in flight per dispatcher (SGLang's two-batch overlap, which keeps
    two, is not supported: d.x has one set per buffer). combine_input.hidden_states: [E_local, R, hidden];
    its ``topk_weights``, if given and not None, replace the dispatch's. combine_b -> [T, hidden],
    y[t] = sum_k topk_weights[t, k] * expert output of (t, k).
    """

    def __init__(self, ep):
        super().__init__(ep)
        self.ep = ep

    def _output(self, *fields):
        return LowLatencyDispatchOutput(*fields)

    def _record_counts(self, counts: torch.Tensor) -> None:
        """Hook for the framework's expert-load statistics (int32 [E_local] device counts)."""

    def _send(self, hidden_states, topk_output, phase):
        ids, weights = topk_output.topk_ids, topk_output.topk_weights
        return ids, weights, hidden_states.shape[0], self.ep.dispatch(hidden_states, ids, phase=phase)

    def _receive(self, pending):
        """-> DeepEPLLDispatchOutput (see the module doc)."""
        ids, weights, tokens, d = pending
        if d is None:
            d = self.ep.dispatch(None, None, phase="recv")
        self._record_counts(d.counts)
        scales = None if d.scales is None else column_major_scales(d.scales)
        world, topk, experts = self.ep.group.world_size, self.ep.topk, self.ep.num_experts
        expected_m = (tokens * world * topk + experts) // experts
        output = self._output(d.x, scales, ids, weights, d.counts, expected_m)
        return output, (d.handle.num_tokens, (d.handle, weights))

    def _combine_send(self, kept, combine_input, out):
        handle, weights = kept
        given = getattr(combine_input, "topk_weights", None)
        self.ep.combine(combine_input.hidden_states, weights if given is None else given, handle, out=out,
                        phase="send")


class PrefillBufferDispatcher(_Dispatcher):
    """Normal mode: dispatch/combine over one PrefillBuffer, in SGLang's dispatcher calling convention
    (DeepEP normal-mode layout; see the module doc).

    dispatch(hidden_states [T, hidden] (or, with an fp8 buffer, pre-quantized (codes, scales) in its format:
    PrefillBuffer.dispatch), topk_output with .topk_ids [T, topk] int32/int64 global ids (-1 = not routed)
    and .topk_weights [T, topk] float), T <= buf.max_tokens_per_rank. Dispatch and combine
    alternate; one dispatch is in flight per buffer (the PrefillBuffer answers each dispatch with its
    combine before the next). Eager: the receive reads the counts on the host (DeepEP's normal mode too).
    combine_input.hidden_states: [N, hidden], one row per received token; combine_b -> [T, hidden],
    y[t] = sum over the ranks holding t's experts of their rows.
    """

    def __init__(self, buf, expert_alignment: int = 1):
        super().__init__(buf)
        self.buf, self.expert_alignment = buf, int(expert_alignment)

    def _output(self, *fields):
        return NormalDispatchOutput(*fields)

    def _record_counts(self, counts: list, topk_ids: torch.Tensor) -> None:
        """Hook for the framework's expert-load statistics (list of E_local ints, the router's ids)."""

    def _send(self, hidden_states, topk_output, phase):
        ids, weights = topk_output.topk_ids, topk_output.topk_weights.to(torch.float32)
        return ids, self.buf.dispatch(hidden_states, ids, weights, phase=phase)

    def _receive(self, pending):
        """-> DeepEPNormalDispatchOutput (see the module doc)."""
        ids, d = pending
        if d is None:
            d = self.buf.dispatch(phase="recv")
        recv = PackedReceive(d, self.expert_alignment)
        self._record_counts(recv.counts, ids)
        output = self._output(recv.x, recv.scales, recv.topk_idx, recv.topk_weights, recv.counts)
        return output, (recv.handle.num_tokens, recv)

    def _combine_send(self, recv, combine_input, out):
        recv.combine(self.buf, combine_input.hidden_states, out=out, phase="send")


class ModeDispatcher:
    """SGLang's ``--deepep-mode`` over the two: ``low_latency`` (EPBufferDispatcher) and/or ``normal``
    (PrefillBufferDispatcher). With both (auto), ``resolve()`` -> "normal" | "low_latency" picks one at
    each dispatch_a (SGLang: normal when the batch has an extend); the pick holds until that dispatch's
    combine_b. ``self.ep`` / ``self.buf``: the low-latency EPBuffer / the normal PrefillBuffer, or None."""

    def __init__(self, low_latency: EPBufferDispatcher | None, normal: PrefillBufferDispatcher | None,
                 resolve=None):
        if low_latency is None and normal is None:
            raise ValueError("ModeDispatcher needs a low-latency or a normal dispatcher")
        self.low_latency, self.normal = low_latency, normal
        self.ep = None if low_latency is None else low_latency.ep
        self.buf = None if normal is None else normal.buf
        self._resolve = resolve or (lambda: "normal" if low_latency is None else "low_latency")
        self._current = None   # the mode's dispatcher from dispatch_a to combine_b

    @property
    def mode(self) -> str:
        """"low_latency", "normal" or "auto": the modes this dispatcher was built with."""
        return "auto" if self.low_latency and self.normal else "normal" if self.normal else "low_latency"

    def _pick(self):
        mode = self._resolve()
        inner = self.normal if mode == "normal" else self.low_latency if mode == "low_latency" else None
        if inner is None:
            raise RuntimeError(f"this batch resolves to DeepEP mode {mode!r}, but the dispatcher was built for "
                               f"{self.mode!r} only: run SGLang with --deepep-mode {mode} or auto")
        return inner

    def _inner(self, what: str):
        if self._current is None:
            raise RuntimeError(f"{what} without a matching dispatch")
        return self._current

    def dispatch_a(self, hidden_states, topk_output) -> None:
        inner = self._current if self._current is not None else self._pick()
        inner.dispatch_a(hidden_states, topk_output)   # refuses a second dispatch in flight itself
        self._current = inner

    def dispatch_b(self):
        return self._inner("dispatch_b").dispatch_b()

    def dispatch(self, hidden_states, topk_output):
        self.dispatch_a(hidden_states, topk_output)
        return self.dispatch_b()

    def combine_a(self, combine_input) -> None:
        self._inner("combine").combine_a(combine_input)

    def combine_b(self) -> torch.Tensor:
        inner, self._current = self._inner("combine_b"), None
        return inner.combine_b()

    def combine(self, combine_input) -> torch.Tensor:
        self.combine_a(combine_input)
        return self.combine_b()


# ---- the SGLang class (built on first use) --------------------------------------------------------

@functools.cache
def dispatcher_class() -> type:
    """``MoECommDispatcher``: ModeDispatcher on SGLang's BaseDispatcher, with SGLang's output types,
    expert-distribution recorder, elastic-EP mask and ``--deepep-mode`` resolution.

    ``MoECommDispatcher(ep=None, prefill=None, expert_alignment=None)``: ep an EPBuffer (low latency),
    prefill a PrefillBuffer (normal), at least one; both = auto, resolved per dispatch as SGLang's
    DeepEPDispatcher resolves it (``DeepEPMode.AUTO.resolve(get_is_extend_in_batch())``).
    expert_alignment: the normal mode's count alignment (None: 128 where SGLang's DeepGEMM path is on, as
    its normal dispatcher asks DeepEP, else 1)."""
    sgl = importlib.import_module(_DISPATCHER)
    recorder = importlib.import_module(_EPLB).get_global_expert_distribution_recorder
    moe_utils = importlib.import_module(_MOE_UTILS)
    extend_in_batch = importlib.import_module(_DP_ATTENTION).get_is_extend_in_batch

    def check_format(combine_input, want, layout):
        if combine_input.format != want:
            raise ValueError(f"moe-comm combines DeepEP {layout}; got a {combine_input.format} combine input: run "
                             "SGLang with --moe-a2a-backend deepep --deepep-mode low_latency, normal or auto")

    class LowLatency(EPBufferDispatcher):
        def _output(self, *fields):
            return sgl.DeepEPLLDispatchOutput(*fields)

        def _record_counts(self, counts):  # SGLang's expert-distribution recorder (EPLB), as DeepEP's does
            recorder().on_deepep_dispatch_low_latency(counts)

        def _active_ranks(self):
            return elastic_active_ranks()

        def combine_a(self, combine_input) -> None:
            check_format(combine_input, sgl.CombineInputFormat.DEEPEP_LL,
                         "low-latency layout ([E_local, R, hidden], --deepep-mode low_latency)")
            EPBufferDispatcher.combine_a(self, combine_input)

    class Normal(PrefillBufferDispatcher):
        def _output(self, *fields):
            return sgl.DeepEPNormalDispatchOutput(*fields)

        def _record_counts(self, counts, topk_ids):
            per_rank, per_expert, _ = dispatch_layout(topk_ids, self.buf.num_experts, self.buf.group.world_size)
            recorder().on_deepep_dispatch_normal(counts, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=None,
                                                 num_tokens_per_expert=per_expert)

        def _active_ranks(self):
            return elastic_active_ranks()

        def combine_a(self, combine_input) -> None:
            check_format(combine_input, sgl.CombineInputFormat.DEEPEP_NORMAL,
                         "normal-mode layout ([N, hidden], --deepep-mode normal)")
            PrefillBufferDispatcher.combine_a(self, combine_input)

    def resolve():
        return moe_utils.DeepEPMode.AUTO.resolve(extend_in_batch()).value

    class MoECommDispatcher(ModeDispatcher, sgl.BaseDispatcher):
        """SGLang dispatcher on moe-comm (DeepEP low-latency and normal formats; moe_comm.serving.sglang)."""

        def __init__(self, ep=None, prefill=None, expert_alignment=None):
            sgl.BaseDispatcher.__init__(self)
            if expert_alignment is None:
                expert_alignment = DEEPGEMM_ALIGNMENT if _deep_gemm_enabled() else 1
            ModeDispatcher.__init__(self, None if ep is None else LowLatency(ep),
                                    None if prefill is None else Normal(prefill, expert_alignment),
                                    resolve if ep is not None and prefill is not None else None)

        # BaseDispatcher's hook machinery replaces self.dispatch/self.combine by wrappers that call the
        # originals with keywords: keep the keyword names SGLang uses.
        def dispatch(self, hidden_states, topk_output):
            return ModeDispatcher.dispatch(self, hidden_states, topk_output)

        def combine(self, combine_input):
            return ModeDispatcher.combine(self, combine_input)

    return MoECommDispatcher


def _deep_gemm_enabled() -> bool:
    """Whether SGLang's DeepGEMM path is on (its normal-mode dispatcher then asks for counts aligned to 128)."""
    try:
        return bool(importlib.import_module(_DEEP_GEMM).ENABLE_JIT_DEEPGEMM)
    except ImportError:
        return False


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

def switch_from_env(environ=None) -> bool | None:
    """MOE_COMM_SGLANG: True (1, true, yes, on), False (0, false, no, off, empty) or None (unset)."""
    env = os.environ if environ is None else environ
    value = env.get(_ENV_PREFIX)
    return None if value is None else value.strip().lower() not in ("", "0", "false", "no", "off")


def env_options(environ=None) -> dict:
    """moe-comm's SGLang options from the environment: MOE_COMM_SGLANG_BACKEND (auto),
    MOE_COMM_SGLANG_TIMEOUT_S (30), MOE_COMM_SGLANG_FP8 (0: dispatch bf16; 1: float8_e4m3fn in 1x128 blocks,
    float32 scales; or an fp8 format of moe_comm.formats: e4m3, e4m3-pow2 (power-of-two float32 scales),
    e4m3-ue8m0 (packed UE8M0 scales: DeepGEMM's UE8M0 path, hidden % 512 == 0); the option
    ``dispatch_format``; DeepEP formats only), MOE_COMM_SGLANG_MAX_TOKENS
    (SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK, else 128: tokens per rank per low-latency dispatch),
    MOE_COMM_SGLANG_PREFILL_MAX_TOKENS (4096: tokens per rank per normal-mode or Standard-format dispatch,
    at least SGLang's per-rank prefill chunk). The DeepEP mode is SGLang's --deepep-mode."""
    env = os.environ if environ is None else environ
    max_tokens = env.get(f"{_ENV_PREFIX}_MAX_TOKENS") or env.get("SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK")
    return dict(backend=env.get(f"{_ENV_PREFIX}_BACKEND", "auto"),
                timeout_s=float(env.get(f"{_ENV_PREFIX}_TIMEOUT_S", "30")),
                dispatch_format=_fp8_option(env.get(f"{_ENV_PREFIX}_FP8", "0")),
                max_tokens_per_rank=int(max_tokens or DEFAULT_MAX_TOKENS_PER_RANK),
                prefill_max_tokens_per_rank=int(env.get(f"{_ENV_PREFIX}_PREFILL_MAX_TOKENS")
                                                or DEFAULT_PREFILL_MAX_TOKENS_PER_RANK))


def options_from_env(environ=None) -> dict | None:
    """``env_options`` when MOE_COMM_SGLANG=1 switches moe-comm on under SGLang's DeepEP backend, else None
    (``--moe-a2a-backend customized`` needs no switch: moe_comm.serving.sglang_plugin)."""
    return env_options(environ) if switch_from_env(environ) else None


def _fp8_option(value: str):
    """MOE_COMM_SGLANG_FP8 -> dispatch_format: "0" None, "1" "e4m3", else an fp8 format name
    (``moe_comm.formats``; ValueError naming them for another value)."""
    value = value.strip()
    if value in ("0", "", "1"):
        return formats.E4M3 if value == "1" else None
    if value not in formats.FP8_FORMATS:
        raise ValueError(f"MOE_COMM_SGLANG_FP8={value!r}: use 0, 1 or an fp8 format {formats.FP8_FORMATS}")
    return value


def make_dispatcher(moe_runner_config, options: dict, customized: bool = False):
    """moe-comm's dispatcher for one SGLang MoE layer (its MoeRunnerConfig). Under SGLang's DeepEP backend
    (customized=False) a MoECommDispatcher for SGLang's --deepep-mode (``options["deepep_mode"]`` overrides
    it): an EPBuffer for low_latency, a PrefillBuffer for normal, both for auto. Under
    ``--moe-a2a-backend customized`` a MoECommStandardDispatcher on a PrefillBuffer
    (moe_comm.serving.sglang_standard). Layers with the same shapes share the buffers. Expert parallelism
    must span the whole torch.distributed world, experts placed linearly (rank r owns [r*E_local,
    (r+1)*E_local)), as with SGLang's DeepEP backend."""
    cfg = moe_runner_config
    moe_utils = importlib.import_module(_MOE_UTILS)
    mode = "normal" if customized else options.get("deepep_mode") or moe_utils.get_deepep_mode().value
    if mode not in MODES:
        raise ValueError(f"deepep_mode={mode!r}: use one of {MODES}")
    if moe_utils.is_tbo_enabled():
        raise NotImplementedError("moe-comm's SGLang dispatcher keeps one dispatch in flight: run without "
                                  "--enable-two-batch-overlap")
    if cfg.num_fused_shared_experts:
        raise NotImplementedError("moe-comm dispatches routed experts only: run SGLang without shared-experts "
                                  "fusion (--disable-shared-experts-fusion), as with its DeepEP backend")
    # dispatch_format, or the earlier option fp8_dispatch=True ("e4m3"); both: ValueError unless they agree
    fmt = formats.dispatch_format_of(bool(options.get("fp8_dispatch", False)), options.get("dispatch_format"))
    if customized and fmt is not None:
        raise ValueError(f"dispatch_format={fmt!r}: SGLang's Standard format (--moe-a2a-backend customized) takes "
                         "the model's dtype; fp8 dispatch needs the DeepEP formats (--moe-a2a-backend deepep "
                         "with MOE_COMM_SGLANG=1), or set MOE_COMM_SGLANG_FP8=0")
    group = process_group(options.get("backend", "auto"), options.get("timeout_s", 30.0))
    if cfg.num_local_experts * group.world_size != cfg.num_experts:
        raise NotImplementedError(
            f"moe-comm needs expert parallelism over the whole world: SGLang has {cfg.num_experts} experts, "
            f"{cfg.num_local_experts} per rank, torch.distributed has {group.world_size} ranks "
            "(set --ep-size to the world size)")
    ep = prefill = None
    if mode != "normal":
        ep = shared_buffer(group, cfg.num_experts, cfg.hidden_size, int(options["max_tokens_per_rank"]),
                           cfg.top_k, cfg.params_dtype, fmt)
    if mode != "low_latency":
        prefill = shared_buffer(group, cfg.num_experts, cfg.hidden_size,
                                int(options.get("prefill_max_tokens_per_rank", DEFAULT_PREFILL_MAX_TOKENS_PER_RANK)),
                                cfg.top_k, cfg.params_dtype, fmt, prefill=True)
    if customized:
        from .sglang_standard import standard_dispatcher_class  # noqa: PLC0415
        dispatcher = standard_dispatcher_class()(prefill)
    else:
        dispatcher = dispatcher_class()(ep, prefill)
    name = type(dispatcher).__name__
    if name not in _announced:   # once per process: which of moe-comm's dispatchers SGLang's layers got
        _announced.add(name)
        logger.info("moe-comm: SGLang MoE layers get %s (rank %d of %d)", name, group.rank, group.world_size)
    return dispatcher
