"""The door's fused decode path: a decode-size step's MoE layer as one ``moe_comm.MoELayer`` call.

``MoELayer`` fuses dispatch -> gate/up -> down + combine for SiLU-gated experts without biases: w13
[E_local, 2I, H] (gate rows, then up rows) and w2 [E_local, H, I]. A transformers experts module that
``ExpertsLayout.masked`` accepts (SiLU(gate) * up over concatenated [gate; up], no bias, no post-expert
norm) computes exactly that: its ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] ARE w13 and w2
(used in place, no copy); a transposed one ([E, in, out]) gets one contiguous copy of each, counted in
``ShardReport.fused_copy_bytes``. Every other module (gpt-oss: biases, its clamped interleaved gate) and
an fp8 dispatch cannot be expressed by the fused kernels: ``unfusable`` says why, and such layers keep
the EPBuffer path (``layer_path="auto"``) or ``shard_experts`` refuses (``layer_path="fused"``).

transformers' ``FP8Experts`` (fp8 checkpoints: ``ExpertsLayout.fp8``) hold exactly the fused layer's fp8
form: ``gate_up_proj`` / ``down_proj`` float8_e4m3fn are w13 / w2 and their ``*_scale_inv`` (gate's block rows
then up's) w13_scale / w2_scale, used in place; ue8m0 scales are widened to float32 once (exact: powers
of two), a counted copy. The kernels dequantize each weight tile in registers (no dequantized weights are
kept). The fused layer is such layers' only decode path: "auto" fuses them at any ``decode_tokens`` (as
``MoELayer``'s "auto" does), and ``shard_experts`` refuses "unfused" and whatever ``unfusable`` names.

One ``MoELayer`` per distinct (experts, hidden, width, dtype, fp8) serves every model layer of that shape (its
EPBuffer is the layer's largest buffer: one per model layer would multiply it by the layer count); each
call first points it at its model layer's weights (``MoELayer.set_weights``: no launch rebuilt).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...moe_layer import FUSED_MAX_TOKENS, MoELayer
from .experts import SCALE_SUFFIX, ExpertsLayout, fp8_scales

LAYER_PATHS = ("unfused", "fused", "auto")
FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)   # what MoELayer computes in
ROW_ALIGN_BYTES = 16   # MoELayer: hidden * element size must be a multiple of this


@dataclass
class FusedExperts:
    """One model layer's decode path through a shared ``MoELayer``."""

    layer: MoELayer       # shared by every model layer of this shape (``Door.fused_layers``)
    w13: torch.Tensor     # [E_local, 2I, H] this layer's gate rows then up rows (the module's own, or a copy)
    w2: torch.Tensor      # [E_local, H, I] its down projection (likewise)
    copied_bytes: int     # bytes of w13, w2 and scales that are copies made for the fused layer (0: the module's own)
    w13_scale: torch.Tensor | None = None   # fp8: float32 [E_local, 2 ceil(I/128), ceil(H/128)] (None: not fp8)
    w2_scale: torch.Tensor | None = None    # fp8: float32 [E_local, ceil(H/128), ceil(I/128)]


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
    if path == "auto" and decode_tokens > FUSED_MAX_TOKENS and not lay.fp8:
        return (f"layer_path='auto' and decode_tokens={decode_tokens} > moe_layer.FUSED_MAX_TOKENS "
                f"({FUSED_MAX_TOKENS}): the unfused path is assumed faster there")
    return None


def fp8_refusal_message(module: nn.Module, why: str, path: str) -> str:
    """``shard_experts``' refusal of fp8 experts that the fused layer cannot run (``unfusable``'s ``why``)."""
    fix = ("layer_path='fused' or 'auto'" if path == "unfused" else
           "load the checkpoint with quantization_config=FineGrainedFP8Config(dequantize=True) (bf16 experts, "
           "at twice the weight memory)")
    return (f"{type(module).__name__} holds fp8 experts (float8_e4m3fn weights, 128 x 128 block scales), which the "
            f"door computes only through the fused MoE layer (it dequantizes each weight tile in registers; no "
            f"other decode path reads fp8 weights), and that cannot run here: {why}. Fix: {fix}")


def fused_weights(module: nn.Module, lay: ExpertsLayout) -> tuple[list, int]:
    """([w13, w2, w13_scale, w2_scale], bytes copied) of a sharded experts module that ``unfusable`` accepts:
    its own tensors when they are laid out as the layer's already, else one contiguous copy (transposed [E, in,
    out] weights; ue8m0 scales widened to float32). Scales are None unless fp8."""
    own = [module.gate_up_proj.detach(), module.down_proj.detach()]
    got = [(w.transpose(1, 2) if lay.transposed else w).contiguous() for w in own]
    if lay.fp8:
        scales = [getattr(module, n + SCALE_SUFFIX).detach() for n in ("gate_up_proj", "down_proj")]
        own += scales
        got += [fp8_scales(t).contiguous() for t in scales]
    copied = sum(w.numel() * w.element_size() for w, o in zip(got, own) if w.data_ptr() != o.data_ptr())
    return got + [None] * (4 - len(got)), copied


def fused_experts(shared: dict, group, module: nn.Module, lay: ExpertsLayout, topk: int,
                  decode_tokens: int) -> FusedExperts:
    """The model layer's ``FusedExperts``; its ``MoELayer`` from ``shared`` (keyed by shape), made at first
    need (collective: every rank binds the same layers in the same order)."""
    (w13, w2, s13, s2), copied = fused_weights(module, lay)
    key = (lay.num_experts, lay.hidden, lay.intermediate, lay.dtype, lay.fp8)
    if key not in shared:
        shared[key] = MoELayer(group, lay.num_experts, lay.hidden, lay.intermediate, decode_tokens, topk, w13, w2,
                               dtype=lay.dtype, path="fused", w13_scale=s13, w2_scale=s2)
    return FusedExperts(shared[key], w13, w2, copied, s13, s2)


def run_fused(f: FusedExperts, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """One decode-size MoE layer: x [T, H] (T <= decode_tokens, the MoELayer's max_tokens_per_rank; the
    step's plan guarantees it), topk_idx [T, K] global expert ids, topk_weights [T, K] float32 -> [T, H]."""
    f.layer.set_weights(f.w13, f.w2, f.w13_scale, f.w2_scale)
    return f.layer(x, topk_idx, topk_weights)
