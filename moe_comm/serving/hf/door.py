"""The transformers door: a bound model's MoE layers as dispatch -> this rank's experts -> combine.

``Door`` holds what one bound model needs: its group, the step meetings (``steps.py``), the buffers
(one EPBuffer and one PrefillBuffer per distinct layer shape, shared by every layer: a layer's combine
returns before the next layer dispatches) and one ``Layer`` per experts module, in model order.
``experts_forward`` is the function registered in transformers' ``ExpertsInterface``; ``run_layer`` is
one MoE layer, and ``local_experts_decode`` / ``local_experts_prefill`` are the only places that compute
experts (the seam where another layer implementation plugs in). With ``layer_path`` "fused" or "auto" a
layer the fused kernels can express runs its decode-size steps as one ``moe_comm.MoELayer`` call instead
(dispatch -> gate/up -> down + combine fused: ``fused.py``), one MoELayer per distinct layer shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...prefill_chunks import local_experts, prefill_moe
from ...reference import dequantize_fp8
from ..ep_group import shared_buffer
from .experts import ExpertsLayout, decode_experts, prefill_expert
from .fused import FusedExperts, fused_experts, run_fused, unfusable
from .steps import KIND_FINISH, KIND_STEP, StepMeetings, StepPlan

IMPLEMENTATION = "moe_comm"   # the name registered in transformers' ExpertsInterface
LAYER_ATTR = "_moe_comm_layer"   # the attribute a bound experts module carries (its ``Layer``)


class NotBoundError(RuntimeError):
    """``experts_implementation="moe_comm"`` on a model that no ``shard_experts`` call bound to a group."""


class StepOrderError(RuntimeError):
    """This rank ran its MoE layers out of order, or with another token count than the step's first
    layer: the ranks can no longer be in step (local misuse; the other ranks will time out)."""


@dataclass
class Layer:
    """One bound experts module."""

    index: int            # its position among the model's MoE layers (0 = where a step begins)
    module: nn.Module     # the transformers experts module (sharded: experts [lo, hi) only)
    layout: ExpertsLayout
    door: "Door"
    decode_buf: object    # EPBuffer (decode-size steps), shared with every layer of the same shape; None if fused
    prefill_buf: object   # PrefillBuffer (prefill-size steps), likewise
    fused: FusedExperts | None = None   # decode-size steps through a shared moe_comm.MoELayer instead
    unfused_why: str | None = None      # why not fused (None when fused)


class Door:
    """A model bound to a CommGroup (made by ``shard_experts``)."""

    def __init__(self, group, topk: int, decode_tokens: int, prefill_tokens: int, dispatch_format, digest: int,
                 masked: bool, layer_path: str = "unfused"):
        self.group, self.topk, self.masked = group, topk, masked   # masked: the Triton masked expert kernel
        self.decode_tokens, self.prefill_tokens, self.dispatch_format = decode_tokens, prefill_tokens, dispatch_format
        self.meetings = StepMeetings(group, digest)
        self.layer_path = layer_path   # "unfused", "fused" or "auto" (shard_experts)
        self.fused_layers: dict = {}   # (E, H, I, dtype, fp8) -> the MoELayer every fused layer of that shape shares
        self.layers: list[Layer] = []
        self.steps = 0                 # steps begun
        self.plan: StepPlan | None = None
        self._next = 0                 # the MoE layer this rank runs next within the step (0: a new step)
        self._step_epoch = group.epoch
        self._tokens = 0               # this rank's T in the current step
        self.taken = dict(decode=0, prefill=0, chunks=0, idle=0)   # steps by path (idle: all ranks T = 0),
        #                                                              PrefillBuffer chunks per layer summed

    def add_layer(self, module: nn.Module, layout: ExpertsLayout) -> Layer:
        """Bind one experts module (already sharded). Collective (buffers and MoELayers are made in layer
        order on every rank); ``shard_experts`` has checked that "fused" can fuse it."""
        g, lay = self.group, layout
        why = unfusable(lay, self.dispatch_format, self.decode_tokens, self.layer_path)
        fused = None if why else fused_experts(self.fused_layers, g, module, lay, self.topk, self.decode_tokens)
        def buffer(tokens, prefill):
            return shared_buffer(g, lay.num_experts, lay.hidden, tokens, self.topk, lay.dtype, self.dispatch_format,
                                 prefill=prefill)
        decode_buf = None if fused else buffer(self.decode_tokens, False)
        layer = Layer(len(self.layers), module, lay, self, decode_buf, buffer(self.prefill_tokens, True), fused, why)
        self.layers.append(layer)
        return layer

    # ---- steps -------------------------------------------------------------------------------------
    def plan_of(self, met: dict[int, tuple[int, int]]) -> StepPlan:
        tokens = [0] * self.group.world_size
        for j, (_, t) in met.items():
            tokens[j] = t
        most = max(tokens)
        prefill = most > self.decode_tokens
        chunks = max(1, -(-most // self.prefill_tokens)) if prefill else 1
        return StepPlan(self.steps, tuple(tokens), prefill, chunks,
                        tuple(sorted(j for j, (k, _) in met.items() if k == KIND_FINISH)))

    def begin_step(self, kind: int, tokens: int) -> StepPlan:
        """The step's meeting (``steps.StepMeetings.meet``) and plan. A step left unfinished (an error
        in one of its layers) may only be followed once the group was reset."""
        if self._next != 0 and self.group.epoch == self._step_epoch:
            broken, self._next = self._next, 0
            raise StepOrderError(
                f"rank {self.group.rank}: step {self.steps - 1} stopped after MoE layer {broken - 1} of "
                f"{len(self.layers)} (an error during the forward); the other ranks are not in step with this "
                f"one: call group.reset() on every rank (moe_comm.serving.ep_group.recover), then step again")
        met = self.meetings.meet(kind, tokens, self.steps)
        self.plan = plan = self.plan_of(met)
        self.steps += 1
        if not self.all_finished(plan):
            path = "idle" if plan.max_tokens == 0 else "prefill" if plan.prefill else "decode"
            self.taken[path] += 1
            self.taken["chunks"] += plan.chunks if plan.prefill else 0
        self._step_epoch = self.group.epoch
        self._tokens = tokens
        return self.plan

    def all_finished(self, plan: StepPlan) -> bool:
        return len(plan.finishing) == len(self.group.live_ranks)

    def run_empty_step(self) -> None:
        """Take part in the current step with T = 0 through every MoE layer (after ``begin_step``)."""
        for layer in self.layers:
            lay = layer.layout
            x = torch.empty((0, lay.hidden), dtype=lay.dtype, device=self.group.device)
            idx = torch.empty((0, self.topk), dtype=torch.int64, device=self.group.device)
            run_layer(layer, x, idx, torch.empty((0, self.topk), dtype=torch.float32, device=self.group.device))


def experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts interface: hidden_states [T, H], top_k_index [T, K] (the model's routing:
    global expert ids), top_k_weights [T, K] -> [T, H], the weighted sum of the token's experts' outputs.
    The first MoE layer of a forward begins a step (the ranks meet and agree on its plan)."""
    layer = getattr(module, LAYER_ATTR, None)
    if layer is None:
        raise NotBoundError(
            f"experts_implementation='{IMPLEMENTATION}' runs each MoE layer across the ranks of a moe-comm group, "
            f"and this {type(module).__name__} is not bound to one: on every rank, after loading the model, call "
            f"moe_comm.serving.hf.shard_experts(model, group) with group = moe_comm.init() (under torchrun) or "
            f"the group moe_comm.launch passes; or load the model with experts_implementation='eager'")
    door = layer.door
    T = hidden_states.shape[0]
    if layer.index == 0:
        door.begin_step(KIND_STEP, T)
    elif layer.index != door._next or T != door._tokens:
        got = f"MoE layer {layer.index} with {T} tokens"
        want = f"MoE layer {door._next} with {door._tokens} tokens" if door._next else "MoE layer 0 (a new step)"
        door._next = 0
        raise StepOrderError(
            f"rank {door.group.rank}: {got}, expected {want}: every rank runs every MoE layer of the model once "
            f"per step, in model order, with the step's tokens (the model's own forward does; calling experts "
            f"modules one by one does not)")
    return run_layer(layer, hidden_states, top_k_index, top_k_weights)


@torch.no_grad()
def run_layer(layer: Layer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """One MoE layer of the current step: dispatch -> this rank's experts -> combine, through the
    EPBuffer (decode-size step; a fused layer: its MoELayer) or the PrefillBuffer in ``plan.chunks`` calls
    (prefill-size)."""
    door, lay = layer.door, layer.layout
    plan = door.plan
    door._next = (layer.index + 1) % len(door.layers)
    dtype = x.dtype
    x = x.to(lay.dtype).contiguous()
    w = topk_weights.to(torch.float32)
    if plan.prefill:
        buf = layer.prefill_buf
        y = prefill_moe(buf, x, topk_idx, w, local_experts_prefill(layer, buf), plan.chunks)
    elif layer.fused is not None:
        y = run_fused(layer.fused, x, topk_idx, w)
    else:
        buf = layer.decode_buf
        d = buf.dispatch(x, topk_idx)
        y = buf.combine(local_experts_decode(layer, d, plan), w, d.handle)
    return y.to(dtype)


def local_experts_decode(layer: Layer, d, plan: StepPlan) -> torch.Tensor:
    """This rank's experts on an EPBuffer dispatch's rows: d.x [L, R, H] (fp8: dequantized) -> [L, R, H]."""
    x = d.x if d.scales is None else dequantize_fp8(d.x, d.scales).to(layer.layout.dtype)
    active = sum(plan.tokens) * layer.door.topk   # experts with rows <= slots sent this step
    expected = -(-active // layer.layout.num_experts)   # rows an expert gets on average: the kernel's row tile
    return decode_experts(layer.module, layer.layout, x, d.counts, masked=layer.door.masked, max_active=active,
                          expected_rows=expected)


def local_experts_prefill(layer: Layer, buf):
    """``prefill_moe``'s experts argument: this rank's experts on a PrefillBuffer dispatch's rows."""
    return local_experts(buf, prefill_expert(layer.module, layer.layout))
