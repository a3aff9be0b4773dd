"""The door's fused decode path: a decode-size step's MoE layer as one ``moe_comm.MoELayer`` call.

``MoELayer`` fuses dispatch -> gate/up -> down + combine for SiLU-gated experts without biases: w13
[E_local, 2I, H] (gate rows, then up rows) and w2 [E_local, H, I]. A transformers experts module that
``ExpertsLayout.masked`` accepts (SiLU(gate) * up over concatenated [gate; up], no bias, no post-expert
norm) computes exactly that: its ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] ARE w13 and w2
(used in place, no copy); a transposed one ([E, in, out]) gets one contiguous copy of each, counted in
``ShardReport.fused_copy_bytes``. Every other module (gpt-oss: biases, its clamped interleaved gate) and
an fp8 dispatch cannot be expressed by the fused kernels: ``unfusable`` says why, and such layers keep
the EPBuffer path (``layer_path="auto"``) or ``shard_experts`` refuses (``layer_path="fused"``).

One ``MoELayer`` per distinct (experts, hidden, width, dtype) serves every model layer of that shape (its
EPBuffer is the layer's largest buffer: one per model layer would multiply it by the layer count); each
call first points it at its model layer's weights (``MoELayer.set_weights``: no launch rebuilt).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...moe_layer import FUSED_MAX_TOKENS, MoELayer
from .experts import ExpertsLayout

LAYER_PATHS = ("unfused", "fused", "auto")
FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)   # what MoELayer computes in
ROW_ALIGN_BYTES = 16   # MoELayer: hidden * element size must be a multiple of this


@dataclass
class FusedExperts:
    """One model layer's decode path through a shared ``MoELayer``."""

    layer: MoELayer       # shared by every model layer of this shape (``Door.fused_layers``)
    w13: torch.Tensor     # [E_local, 2I, H] this layer's gate rows then up rows (the module's own, or a copy)
    w2: torch.Tensor      # [E_local, H, I] its down projection (likewise)
    copied_bytes: int     # bytes of w13 and w2 that are copies made for the fused layer (0: the module's own)


def unfusable(lay: ExpertsLayout, dispatch_format, decode_tokens: int, path: str) -> str | None:
    """Why ``layer_path=path`` does not run this layer through the fused kernels (None: it does)."""
    if path == "unfused":
        return "layer_path='unfused'"
    if not lay.masked:
        return ("its experts are not SiLU(gate) * up over concatenated [gate; up] weights without biases or a "
                "post-expert norm (the only MLP the fused kernels compute)")
    if dispatch_format is not None:
        return f"dispatch_format={dispatch_format!r} (the fused layer moves rows in the model's dtype)"
    if lay.dtype not in FUSED_DTYPES:
        return f"the experts are {lay.dtype} (the fused layer computes in bfloat16, float16 or float32)"
    if lay.hidden * lay.dtype.itemsize % ROW_ALIGN_BYTES:
        return f"hidden {lay.hidden} x {lay.dtype.itemsize} bytes is not a multiple of {ROW_ALIGN_BYTES} bytes"
    if path == "auto" and decode_tokens > FUSED_MAX_TOKENS:
        return (f"layer_path='auto' and decode_tokens={decode_tokens} > moe_layer.FUSED_MAX_TOKENS "
                f"({FUSED_MAX_TOKENS}): the unfused path is assumed faster there")
    return None


def fused_weights(module: nn.Module, lay: ExpertsLayout) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(w13, w2, bytes copied) of a sharded experts module that ``unfusable`` accepts: its own tensors when
    they are laid out as w13/w2 already, else one contiguous copy (transposed [E, in, out] weights)."""
    up, down = module.gate_up_proj.detach(), module.down_proj.detach()
    w13, w2 = ((w.transpose(1, 2) if lay.transposed else w).contiguous() for w in (up, down))
    copied = sum(w.numel() * w.element_size() for w, own in ((w13, up), (w2, down)) if w.data_ptr() != own.data_ptr())
    return w13, w2, copied


def fused_experts(shared: dict, group, module: nn.Module, lay: ExpertsLayout, topk: int,
                  decode_tokens: int) -> FusedExperts:
    """The model layer's ``FusedExperts``; its ``MoELayer`` from ``shared`` (keyed by shape), made at first
    need (collective: every rank binds the same layers in the same order)."""
    w13, w2, copied = fused_weights(module, lay)
    key = (lay.num_experts, lay.hidden, lay.intermediate, lay.dtype)
    if key not in shared:
        shared[key] = MoELayer(group, lay.num_experts, lay.hidden, lay.intermediate, decode_tokens, topk, w13, w2,
                               dtype=lay.dtype, path="fused")
    return FusedExperts(shared[key], w13, w2, copied)


def run_fused(f: FusedExperts, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """One decode-size MoE layer: x [T, H] (T <= decode_tokens, the MoELayer's max_tokens_per_rank; the
    step's plan guarantees it), topk_idx [T, K] global expert ids, topk_weights [T, K] float32 -> [T, H]."""
    f.layer.set_weights(f.w13, f.w2)
    return f.layer(x, topk_idx, topk_weights)
