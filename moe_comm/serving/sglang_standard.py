"""SGLang's ``--moe-a2a-backend customized``: moe-comm's dispatcher in SGLang's Standard format.

SGLang 0.5.23 names a ``customized`` all-to-all backend (``MoeA2ABackend.CUSTOMIZED``) for third-party
dispatchers and leaves the dispatcher to a plugin: its own factory (``create_moe_dispatcher``) raises
``NotImplementedError("Unsupported a2a backend: MoeA2ABackend.CUSTOMIZED")``, and moe-comm's plugin
(moe_comm.serving.sglang_plugin) answers it through SGLang's HookRegistry. Under ``customized`` SGLang
runs its models as for the other all-to-all backends (tokens scattered over the ranks, no all-reduce of the
MoE output), and its experts are those of its default runners, which take the Standard format (the format
of its own StandardDispatcher under expert parallelism): so this dispatcher produces that format, over one
PrefillBuffer (``--deepep-mode`` does not apply; DeepEP's low-latency layout needs DeepEP's expert
kernels: ``--moe-a2a-backend deepep`` with MOE_COMM_SGLANG=1, moe_comm.serving.sglang).

dispatch(hidden_states [T, hidden] (the buffer's dtype), topk_output: a standard top-k output, .topk_ids
[T, topk] int32/int64 global ids (-1 = not routed), .topk_weights [T, topk] float), T <= the buffer's
max_tokens_per_rank -> SGLang's ``StandardDispatchOutput``:
    hidden_states        [N, hidden]: every token with an expert on this rank, once, in (source rank,
                         token index) order (DeepEP's normal-mode receive, ``PackedReceive``; N is read on
                         the host, so a dispatch is not CUDA-graph capturable: RuntimeError while capturing)
    hidden_states_scale  None
    topk_output          ``StandardTopKOutput(topk_weights float32 [N, topk], topk_ids int32 [N, topk],
                         router_logits None)``: local expert ids (0..E_local-1), weights 0 where the slot's
                         expert lives on another rank. Those slots hold -1 (the drop sentinel SGLang's
                         Triton runner skips), or, with ``fill_unrouted`` (the default on CPU: SGLang's CPU
                         experts, ``moe_forward_native``, index an expert for every slot, fail on -1 and
                         count an id repeated in a row once), the smallest local ids the row does not hold
                         (``fill_unrouted_slots``; needs E_local >= topk): those experts' outputs on the
                         row are computed (extra work) and enter the row's sum times 0, adding exactly 0
                         while they are finite. Also with ``fill_unrouted``, an empty receive (N = 0)
                         comes as one row of zeros whose slots all weigh 0 (moe_forward_native cannot
                         take 0 rows), and the combine leaves that row's output out.
combine(StandardCombineInput(hidden_states [N, hidden]: each row the token's local experts, weighted and
summed, as SGLang's experts return it)) -> [T, hidden]: every rank's row of a token summed at the token's
rank, in float32 in rank order (PrefillBuffer.combine).

Expert-load statistics: SGLang's TopK records the routed ids for every backend (``on_select_experts``);
its Standard path adds nothing at dispatch, nor does this one. The elastic-EP mask and the group check
are those of moe_comm.serving.sglang's dispatchers.
"""

from __future__ import annotations

import functools
import importlib
from typing import NamedTuple

import torch

from .sglang import _DISPATCHER, PrefillBufferDispatcher, elastic_active_ranks

__all__ = ["StandardDispatchOutput", "StandardFormatDispatcher", "fill_unrouted_slots",
           "standard_dispatcher_class"]

_TOPK = "sglang.srt.layers.moe.topk"
LOCAL_ID_DTYPE = torch.int32   # SGLang's StandardDispatcher maps global ids to int32 local ids


class StandardTopKOutput(NamedTuple):
    """Stand-in for SGLang's StandardTopKOutput where SGLang is absent (same fields, same order)."""

    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    router_logits: torch.Tensor | None


class StandardDispatchOutput(NamedTuple):
    """Stand-in for SGLang's StandardDispatchOutput where SGLang is absent (same leading fields)."""

    hidden_states: torch.Tensor
    hidden_states_scale: torch.Tensor | None
    topk_output: StandardTopKOutput


def fill_unrouted_slots(topk_ids: torch.Tensor, num_local_experts: int) -> torch.Tensor:
    """int [N, K] local ids with -1 -> the same with the -1s of each row replaced by the smallest local ids
    (0..num_local_experts-1) the row does not hold, in slot order: every row's ids distinct (as the router
    gives them). For expert kernels that index an expert for every slot; the caller keeps those slots'
    weights at 0. Needs num_local_experts >= K (ValueError otherwise)."""
    n, k = topk_ids.shape
    if num_local_experts < k:
        raise ValueError(f"{num_local_experts} local experts cannot fill {k} distinct slots per row: SGLang's CPU "
                         "experts need at least top-k experts per rank (use fewer ranks)")
    live = topk_ids >= 0
    held = torch.zeros((n, num_local_experts + 1), dtype=torch.int8, device=topk_ids.device)
    held.scatter_(1, torch.where(live, topk_ids, num_local_experts).long(), 1)   # column L: the -1s
    free = torch.argsort(held[:, :num_local_experts], dim=1, stable=True)   # ids not held first, ascending
    nth_dead = torch.cumsum(~live, dim=1) - 1                                # a -1 slot's index among them
    filled = free.gather(1, nth_dead.clamp(min=0)).to(topk_ids.dtype)
    return torch.where(live, topk_ids, filled)


class StandardFormatDispatcher(PrefillBufferDispatcher):
    """PrefillBuffer dispatch/combine in SGLang's Standard format (module doc). ``fill_unrouted``: None =
    on a CPU group (SGLang's CPU experts), else as given."""

    def __init__(self, buf, fill_unrouted: bool | None = None):
        super().__init__(buf)
        self.fill_unrouted = buf.group.device.type == "cpu" if fill_unrouted is None else bool(fill_unrouted)
        self.num_local_experts = buf.num_experts // buf.group.world_size
        self._padded = False   # this dispatch's output carries the placeholder row (an empty receive on CPU)
        if self.fill_unrouted:
            fill_unrouted_slots(torch.empty((0, buf.topk), dtype=LOCAL_ID_DTYPE), self.num_local_experts)  # checks

    def _topk(self, *fields):
        return StandardTopKOutput(*fields)

    def _output(self, x, scales, topk_ids, topk_weights, counts):
        ids = topk_ids.to(LOCAL_ID_DTYPE)
        self._padded = self.fill_unrouted and x.shape[0] == 0
        if self._padded:   # SGLang's CPU experts cannot take 0 rows: one zero row, every slot of weight 0
            x, topk_weights = x.new_zeros((1, x.shape[1])), topk_weights.new_zeros((1, topk_weights.shape[1]))
            ids = torch.full((1, ids.shape[1]), -1, dtype=LOCAL_ID_DTYPE, device=ids.device)
        if self.fill_unrouted:
            ids = fill_unrouted_slots(ids, self.num_local_experts)
        return StandardDispatchOutput(x, scales, self._topk(topk_weights, ids, None))

    def _combine_send(self, recv, combine_input, out):
        if self._padded:   # the placeholder row's output is not a received token's: leave it out
            combine_input = StandardDispatchOutput(combine_input.hidden_states[:0], None, None)
        super()._combine_send(recv, combine_input, out)

    def dispatch_a(self, hidden_states, topk_output) -> None:
        if self.op.group.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("moe-comm's Standard-format dispatch reads its received count on the host and "
                               "cannot be captured in a CUDA graph: run SGLang with --disable-cuda-graph, or "
                               "use --moe-a2a-backend deepep with MOE_COMM_SGLANG=1 (its low-latency mode is "
                               "capturable)")
        super().dispatch_a(hidden_states, topk_output)


@functools.cache
def standard_dispatcher_class() -> type:
    """``MoECommStandardDispatcher``: StandardFormatDispatcher on SGLang's BaseDispatcher, with SGLang's
    StandardDispatchOutput / StandardTopKOutput and its elastic-EP mask.

    ``MoECommStandardDispatcher(prefill, fill_unrouted=None)``: prefill a PrefillBuffer."""
    sgl = importlib.import_module(_DISPATCHER)
    topk = importlib.import_module(_TOPK)

    class MoECommStandardDispatcher(StandardFormatDispatcher, sgl.BaseDispatcher):
        """SGLang dispatcher on moe-comm for --moe-a2a-backend customized (moe_comm.serving.sglang_standard)."""

        def __init__(self, prefill, fill_unrouted=None):
            sgl.BaseDispatcher.__init__(self)
            StandardFormatDispatcher.__init__(self, prefill, fill_unrouted)

        def _topk(self, *fields):
            return topk.StandardTopKOutput(*fields)

        def _output(self, x, scales, topk_ids, topk_weights, counts):
            out = StandardFormatDispatcher._output(self, x, scales, topk_ids, topk_weights, counts)
            return sgl.StandardDispatchOutput(hidden_states=out.hidden_states, hidden_states_scale=None,
                                              topk_output=out.topk_output)

        def _active_ranks(self):
            return elastic_active_ranks()

        def dispatch_a(self, hidden_states, topk_output) -> None:
            if not topk.TopKOutputChecker.format_is_standard(topk_output):
                raise ValueError(f"moe-comm dispatches standard top-k outputs (ids and weights); got "
                                 f"{topk_output.format}: use a MoE runner backend whose top-k is standard "
                                 "(--moe-runner-backend triton, or auto on CPU)")
            StandardFormatDispatcher.dispatch_a(self, hidden_states, topk_output)

        def combine_a(self, combine_input) -> None:
            if combine_input.format != sgl.CombineInputFormat.STANDARD:
                raise ValueError(f"moe-comm's customized backend combines SGLang's Standard format ([N, hidden], "
                                 f"one row per received token); got a {combine_input.format} combine input")
            StandardFormatDispatcher.combine_a(self, combine_input)

        # BaseDispatcher's hook machinery calls the originals with keywords: keep SGLang's names.
        def dispatch(self, hidden_states, topk_output):
            return StandardFormatDispatcher.dispatch(self, hidden_states, topk_output)

        def combine(self, combine_input):
            return StandardFormatDispatcher.combine(self, combine_input)

    return MoECommStandardDispatcher
