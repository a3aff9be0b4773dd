"""The transformers experts modules the door knows: their weight layout, sharding, and the local experts.

transformers' ``@use_experts_implementation`` experts hold every expert's weights as 3-D tensors and tell
their layout by flags set on the module (``has_gate``, ``has_bias``, ``is_transposed``,
``is_concatenated``, ``has_post_expert_norm``); the gate itself is the module's ``_apply_gate`` (the
default SiLU(gate) * up on concatenated [gate; up] columns, or the model's own, e.g. gpt-oss's clamped,
interleaved one). The door reads the flags, keeps only this rank's experts (``shard``) and computes them
with the module's own gate and activation (``decode_experts``, ``prefill_expert``), so the math is the
model's and only the layout work is ours.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..experts import gated_views, masked_expert_mlp

# Weights of an experts module, expert-major ([E, ...]); which exist depends on the flags.
WEIGHT_NAMES = ("gate_up_proj", "gate_up_proj_bias", "up_proj", "up_proj_bias", "down_proj", "down_proj_bias")
FLAG_NAMES = ("has_gate", "has_bias", "is_transposed", "is_concatenated", "has_post_expert_norm")


class UnsupportedExpertsError(TypeError):
    """A model's experts module is not one the transformers door can run (``layout_of`` says why)."""


@dataclass(frozen=True)
class ExpertsLayout:
    """How one transformers experts module holds its weights (before sharding)."""

    num_experts: int     # E: the model's experts (the first dimension of every weight)
    hidden: int          # H: the model's hidden size (rows in and out)
    intermediate: int    # I: one expert's width (the gate/up projection has 2I outputs when gated)
    has_gate: bool       # gate_up_proj + the module's _apply_gate; else up_proj + act_fn
    has_bias: bool       # *_proj_bias [E, out] added after each projection
    transposed: bool     # weights [E, in, out] (gpt-oss) instead of transformers' usual [E, out, in]
    post_norm: bool      # the module's post_expert_norm follows each expert
    masked: bool         # fits ``serving.experts.masked_expert_mlp``: SiLU(gate) * up over concatenated
    #                      [gate; up], no bias, no post-expert norm (Qwen3-MoE, Mixtral, DeepSeek-V3, ...)
    dtype: torch.dtype   # the weights' dtype (the dispatch moves rows of it)


def is_experts_module(module: nn.Module) -> bool:
    """Looks like an MoE experts module: decorated by ``use_experts_implementation`` (its flags are set),
    or named ``*Experts`` with 3-D expert weights. Either must be one the door knows (``layout_of``)."""
    if all(hasattr(module, f) for f in FLAG_NAMES) and hasattr(module, "_is_expert_parallel"):
        return True
    return type(module).__name__.endswith("Experts") and any(
        isinstance(getattr(module, n, None), torch.Tensor) and getattr(module, n).dim() == 3 for n in WEIGHT_NAMES)


def _unsupported(module: nn.Module, why: str) -> UnsupportedExpertsError:
    return UnsupportedExpertsError(
        f"moe_comm's transformers door does not know the experts module {type(module).__name__} "
        f"({type(module).__module__}): {why}. It runs experts decorated by transformers' "
        f"@use_experts_implementation whose weights are gate_up_proj [E, 2I, H] (or up_proj [E, I, H]) and "
        f"down_proj [E, H, I], optionally transposed ([E, in, out]) and with *_proj_bias [E, out]. Fix: run this "
        f"model with experts_implementation='eager' or 'grouped_mm' (no expert parallelism), or give its experts "
        f"that layout")


def layout_of(module: nn.Module) -> ExpertsLayout:
    """The module's ``ExpertsLayout``; ``UnsupportedExpertsError`` naming what is missing otherwise."""
    missing = [f for f in FLAG_NAMES if not hasattr(module, f)]
    if missing:
        raise _unsupported(module, f"it is not decorated by @use_experts_implementation (no {', '.join(missing)})")
    if getattr(module, "_is_expert_parallel", False):
        raise _unsupported(module, "it is already sharded by transformers' own expert parallelism (tp_plan); "
                                   "load the model without a tp_plan")
    gated, bias, tr = bool(module.has_gate), bool(module.has_bias), bool(module.is_transposed)
    up_name = "gate_up_proj" if gated else "up_proj"
    names = [up_name, "down_proj"] + ([up_name + "_bias", "down_proj_bias"] if bias else [])
    for n in names:
        w = getattr(module, n, None)
        if not isinstance(w, torch.Tensor):
            raise _unsupported(module, f"it has no tensor {n}")
        if not w.is_floating_point() or w.element_size() < 2:
            raise _unsupported(module, f"{n} is {w.dtype} (quantized experts are not supported: the door "
                                       f"computes the experts from bf16/fp16/fp32 weights)")
    extra = [n for n, _ in module.named_parameters(recurse=False) if n not in names]
    if extra:
        raise _unsupported(module, f"it has weights the door would not shard: {', '.join(extra)}")
    up, down = getattr(module, up_name), module.down_proj
    E = up.shape[0]
    if up.dim() != 3 or down.dim() != 3 or down.shape[0] != E:
        raise _unsupported(module, f"{up_name} {tuple(up.shape)} and down_proj {tuple(down.shape)} are not [E, ., .]")
    H, I_out = (up.shape[1], up.shape[2]) if tr else (up.shape[2], up.shape[1])
    inter = I_out // 2 if gated else I_out
    if (gated and I_out % 2) or tuple(down.shape[1:]) != ((inter, H) if tr else (H, inter)):
        raise _unsupported(module, f"{up_name} {tuple(up.shape)} and down_proj {tuple(down.shape)} do not agree on "
                                   f"one hidden size and expert width")
    if bias and (tuple(getattr(module, up_name + "_bias").shape) != (E, I_out)
                 or tuple(module.down_proj_bias.shape) != (E, H)):
        raise _unsupported(module, "its biases are not [E, out]")
    from transformers.integrations.moe import _default_apply_gate  # noqa: PLC0415
    masked = (gated and not bias and bool(module.is_concatenated) and not module.has_post_expert_norm
              and getattr(type(module)._apply_gate, "__code__", None) is _default_apply_gate.__code__
              and _is_silu(getattr(module, "act_fn", None)))
    return ExpertsLayout(E, int(H), int(inter), gated, bias, tr, bool(module.has_post_expert_norm), masked, up.dtype)


def _is_silu(act) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation" or act is F.silu


def expert_weight_bytes(module: nn.Module) -> int:
    """Bytes of the module's expert weights as they are now."""
    return sum(t.numel() * t.element_size() for n in WEIGHT_NAMES
               if isinstance(t := getattr(module, n, None), torch.Tensor))


def shard(module: nn.Module, lo: int, hi: int) -> None:
    """Keep experts [lo, hi) of every weight: new parameters holding copies of those rows only, so the
    full tensors are freed once nothing else refers to them (e.g. a memory-mapped checkpoint's pages)."""
    for n in WEIGHT_NAMES:
        w = getattr(module, n, None)
        if isinstance(w, torch.Tensor):
            setattr(module, n, nn.Parameter(w.detach()[lo:hi].clone(), requires_grad=False))


def _project(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    """x [L, R, in] through L experts' weights w ([L, out, in], or [L, in, out] transposed) + b [L, out]."""
    y = torch.bmm(x, w if transposed else w.transpose(1, 2))
    return y if b is None else y + b[:, None, :]


def experts_mlp(module: nn.Module, lay: ExpertsLayout, x: torch.Tensor, sel: slice = slice(None)) -> torch.Tensor:
    """The local experts ``sel`` of a sharded module on x [L', R, H] (row block e through expert sel[e]) ->
    [L', R, H]: the module's projections, biases, gate (``_apply_gate``) or activation, and post-expert
    norm, batched over experts with ``torch.bmm``. Every row is computed (rows past a count too)."""
    up_name = "gate_up_proj" if lay.has_gate else "up_proj"
    bias = (lambda n: getattr(module, n)[sel]) if lay.has_bias else (lambda n: None)
    h = _project(x, getattr(module, up_name)[sel], bias(up_name + "_bias"), lay.transposed)
    h = module._apply_gate(h) if lay.has_gate else module.act_fn(h)
    y = _project(h, module.down_proj[sel], bias("down_proj_bias"), lay.transposed)
    return module.post_expert_norm(y) if lay.post_norm else y


def decode_experts(module: nn.Module, lay: ExpertsLayout, x: torch.Tensor, counts: torch.Tensor,
                   masked: bool = True, max_active: int | None = None,
                   expected_rows: int | None = None) -> torch.Tensor:
    """The EPBuffer layout: x [L, R, H] with rows x[e, :counts[e]] for local expert e (counts int32 on the
    device) -> [L, R, H], rows past a count unspecified. With ``masked``, SiLU-gated experts without biases
    run the masked Triton kernel (``serving.experts.masked_expert_mlp``: no host read, experts without rows
    skipped; ``max_active`` bounds the experts with rows, ``expected_rows`` picks its row tile); otherwise
    ``experts_mlp`` over every row."""
    if not (masked and lay.masked):
        return experts_mlp(module, lay, x)
    gate, up, down = gated_views(module.gate_up_proj, module.down_proj, lay.transposed)
    return masked_expert_mlp(x, counts, gate, up, down, expected_rows=expected_rows, max_active=max_active)


def prefill_expert(module: nn.Module, lay: ExpertsLayout):
    """``prefill_chunks.local_experts``'s per-expert function: (local expert e, rows [n, H]) -> [n, H]."""
    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        return experts_mlp(module, lay, rows[None], slice(e, e + 1))[0]
    return expert
