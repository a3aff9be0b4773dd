"""The transformers experts modules the door knows: their weight layout, sharding, and the local experts.

transformers' ``@use_experts_implementation`` experts hold every expert's weights as 3-D tensors and tell
their layout by flags set on the module (``has_gate``, ``has_bias``, ``is_transposed``,
``is_concatenated``, ``has_post_expert_norm``); the gate itself is the module's ``_apply_gate`` (the
default SiLU(gate) * up on concatenated [gate; up] columns, or the model's own, e.g. gpt-oss's clamped,
interleaved one). The door reads the flags, keeps only this rank's experts (``shard``) and computes them
with the module's own gate and activation (``decode_experts``, ``prefill_expert``), so the math is the
model's and only the layout work is ours.

fp8 checkpoints (``FineGrainedFP8Config``: DeepSeek-V3, Qwen3-*-FP8) load as transformers' ``FP8Experts``:
weights float8_e4m3fn with one scale per 128 x 128 block (``gate_up_proj_scale_inv``,
``down_proj_scale_inv``: float32, or float8_e8m0fnu with ``scale_fmt="ue8m0"``). ``layout_of`` takes them
(``ExpertsLayout.fp8``) where the fused MoE layer computes them exactly (block 128 x 128, scale grids as
``moe_layer.fp8_scale_grids``; ``fp8_refusal`` and the grid check say where not, with the fix), and the
prefill path dequantizes the experts it runs, per call (``experts_mlp``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...moe_layer import fp8_scale_grids
from ...planner import FP8_WEIGHT_BLOCK
from ...reference import dequantize_fp8_w13, dequantize_fp8_weight
from ..experts import gated_views, masked_expert_mlp

# Weights of an experts module, expert-major ([E, ...]); which exist depends on the flags (the scales: fp8).
SCALE_SUFFIX = "_scale_inv"   # FP8Experts' block scales of weight n: n + SCALE_SUFFIX
WEIGHT_NAMES = ("gate_up_proj", "gate_up_proj_bias", "up_proj", "up_proj_bias", "down_proj", "down_proj_bias",
                "gate_up_proj" + SCALE_SUFFIX, "up_proj" + SCALE_SUFFIX, "down_proj" + SCALE_SUFFIX)
FP8_WEIGHT_DTYPE = torch.float8_e4m3fn   # FP8Experts' weights (fp4 experts hold int8: two e2m1 per byte)
FP8_SCALE_DTYPES = (torch.float32, torch.float8_e8m0fnu)   # scale_fmt "float" and "ue8m0" (powers of two)
FP8_BLOCK = (FP8_WEIGHT_BLOCK, FP8_WEIGHT_BLOCK)   # the only block_size the fused kernels read
FP8_GATE_LIMITS = ("gate_softcap", "swiglu_alpha", "limit")   # FP8Experts._apply_gate is SiLU(gate) * up iff all None
DEQUANTIZE_FIX = ("load the checkpoint with quantization_config=FineGrainedFP8Config(dequantize=True) (bf16 "
                  "experts, which the door runs on every path, at twice the weight memory)")
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
    dtype: torch.dtype   # the rows' dtype (the dispatch moves rows of it): the weights', or with fp8 the model's
    fp8: bool = False    # transformers' FP8Experts: weights float8_e4m3fn, 128 x 128 block scales *_scale_inv
    #                      (float32 or ue8m0) as ``moe_layer.fp8_scale_grids``; only the fused layer decodes them


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


def layout_of(module: nn.Module, dtype: torch.dtype | None = None) -> ExpertsLayout:
    """The module's ``ExpertsLayout``; ``UnsupportedExpertsError`` naming what is missing otherwise. ``dtype``:
    the model's dtype (its rows'), needed for fp8 experts only (``rows_dtype``)."""
    missing = [f for f in FLAG_NAMES if not hasattr(module, f)]
    if missing:
        raise _unsupported(module, f"it is not decorated by @use_experts_implementation (no {', '.join(missing)})")
    if getattr(module, "_is_expert_parallel", False):
        raise _unsupported(module, "it is already sharded by transformers' own expert parallelism (tp_plan); "
                                   "load the model without a tp_plan")
    gated, bias, tr = bool(module.has_gate), bool(module.has_bias), bool(module.is_transposed)
    up_name = "gate_up_proj" if gated else "up_proj"
    names = [up_name, "down_proj"] + ([up_name + "_bias", "down_proj_bias"] if bias else [])
    fp8 = _is_fp8_experts(module, up_name)
    if fp8:
        why = fp8_refusal(module, up_name)
        if why:
            raise UnsupportedExpertsError(f"moe_comm's transformers door cannot run the fp8 experts "
                                          f"{type(module).__name__}: {why}")
        names += [up_name + SCALE_SUFFIX, "down_proj" + SCALE_SUFFIX]
    for n in names:
        w = getattr(module, n, None)
        if not isinstance(w, torch.Tensor):
            raise _unsupported(module, f"it has no tensor {n}")
        if not fp8 and (not w.is_floating_point() or w.element_size() < 2):
            raise _unsupported(module, f"{n} is {w.dtype} (quantized experts other than transformers' FP8Experts "
                                       f"are not supported: the door computes the experts from bf16/fp16/fp32 "
                                       f"weights)")
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
    if fp8:
        _check_fp8_grids(module, up_name, int(H), int(inter))
    masked = (gated and not bias and bool(module.is_concatenated) and not module.has_post_expert_norm
              and (_fp8_gate_is_silu(module) if fp8 else _default_gate(module))
              and _is_silu(getattr(module, "act_fn", None)))
    if fp8 and (dtype is None or not dtype.is_floating_point or dtype.itemsize < 2):
        raise _unsupported(module, f"the model's dtype is {dtype} (its fp8 experts compute on rows of the model's "
                                   f"bf16/fp16/fp32 dtype: pass a model whose embeddings are in it)")
    return ExpertsLayout(E, int(H), int(inter), gated, bias, tr, bool(module.has_post_expert_norm), masked,
                         dtype if fp8 else up.dtype, fp8)


def _default_gate(module: nn.Module) -> bool:
    from transformers.integrations.moe import _default_apply_gate  # noqa: PLC0415
    return getattr(type(module)._apply_gate, "__code__", None) is _default_apply_gate.__code__


def _fp8_gate_is_silu(module: nn.Module) -> bool:
    """FP8Experts' own gate, without its softcap or clamps: act_fn(gate) * up over [gate; up] halves."""
    from transformers.integrations.finegrained_fp8 import FP8Experts  # noqa: PLC0415
    return (getattr(type(module)._apply_gate, "__code__", None) is FP8Experts._apply_gate.__code__
            and all(getattr(module, a, None) is None for a in FP8_GATE_LIMITS))


def rows_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype a model's MoE layers get their rows in (its input embeddings', else ``config.dtype``): what
    fp8 experts compute in. None if neither is a float type of 2 bytes or more."""
    get = getattr(model, "get_input_embeddings", None)
    w = getattr(get() if get else None, "weight", None)
    for d in (getattr(w, "dtype", None), getattr(getattr(model, "config", None), "dtype", None)):
        if isinstance(d, torch.dtype) and d.is_floating_point and d.itemsize >= 2:
            return d
    return None


def _is_fp8_experts(module: nn.Module, up_name: str) -> bool:
    """transformers' FP8Experts (or a module holding its parameters): 1-byte weights with *_scale_inv scales."""
    w = getattr(module, up_name, None)
    return (isinstance(w, torch.Tensor) and w.element_size() == 1
            and isinstance(getattr(module, up_name + SCALE_SUFFIX, None), torch.Tensor))


def fp8_refusal(module: nn.Module, up_name: str) -> str | None:
    """Why the door does not run these fp8 experts (None: it does), with the fix."""
    w, s = getattr(module, up_name), getattr(module, up_name + SCALE_SUFFIX)
    if w.dtype == torch.int8:
        return (f"its weights are fp4 (expert_dtype='fp4': int8-packed e2m1 with per-32 scales), which the fused "
                f"kernels do not compute. Fix: {DEQUANTIZE_FIX}")
    if w.dtype != FP8_WEIGHT_DTYPE or module.down_proj.dtype != FP8_WEIGHT_DTYPE:
        return (f"its weights are {w.dtype} and {module.down_proj.dtype}, not {FP8_WEIGHT_DTYPE}. Fix: "
                f"{DEQUANTIZE_FIX}")
    if getattr(module, "is_transposed", False):
        return (f"its weights are stored transposed ([E, in, out]; FP8Experts holds [E, out, in]): their block "
                f"scales would not follow a transposed copy. Fix: {DEQUANTIZE_FIX}")
    block = getattr(module, "block_size", None)
    if block is None or tuple(block) != FP8_BLOCK:
        return (f"block_size={block} (the fused kernels read one scale per {FP8_BLOCK[0]} x {FP8_BLOCK[1]} "
                f"block, DeepSeek-V3's and Qwen3-FP8's weight_block_size). Fix: {DEQUANTIZE_FIX}")
    scheme = getattr(module, "activation_scheme", "dynamic")
    if scheme != "dynamic":
        return (f"activation_scheme={scheme!r}: its calibrated activation scales quantize each expert's input, "
                f"and the fused layer computes on the model's rows unquantized, so it would not compute this "
                f"checkpoint's experts (the door ignores no parameter). Fix: {DEQUANTIZE_FIX}")
    if s.dtype not in FP8_SCALE_DTYPES or module.down_proj_scale_inv.dtype not in FP8_SCALE_DTYPES:
        return (f"its scales are {s.dtype} and {module.down_proj_scale_inv.dtype} (the door takes float32 and "
                f"float8_e8m0fnu scales). Fix: {DEQUANTIZE_FIX}")
    return None


def _check_fp8_grids(module: nn.Module, up_name: str, hidden: int, inter: int) -> None:
    E = module.down_proj.shape[0]
    for n, (rows, cols) in zip((up_name, "down_proj"), fp8_scale_grids(hidden, inter)):
        got = tuple(getattr(module, n + SCALE_SUFFIX).shape)
        if got != (E, rows, cols):
            raise UnsupportedExpertsError(
                f"moe_comm's transformers door cannot run the fp8 experts {type(module).__name__}: {n}{SCALE_SUFFIX} "
                f"is {list(got)}, not [{E}, {rows}, {cols}] (hidden {hidden}, expert width {inter}: one scale per "
                f"128 x 128 block, gate_proj's block rows then up_proj's, as transformers merges a checkpoint's "
                f"scales). A grid of ceil(2I / 128) block rows over the concatenated [gate; up] rows (an expert "
                f"width that is not a multiple of 128, quantized after the merge) puts one scale across gate and "
                f"up rows: not exactly convertible. Fix: {DEQUANTIZE_FIX}")


def fp8_scales(t: torch.Tensor) -> torch.Tensor:
    """Block scales as float32 (ue8m0 scales are powers of two: exact)."""
    return t if t.dtype == torch.float32 else t.float()


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


def _weight(module: nn.Module, lay: ExpertsLayout, name: str, sel: slice) -> torch.Tensor:
    """Weights ``name`` of the experts ``sel`` in lay.dtype: the module's own, or fp8 dequantized here (a
    temporary of those experts only: ``reference.dequantize_fp8_w13`` / ``dequantize_fp8_weight``, the
    values the fused layer's kernels compute with)."""
    w = getattr(module, name)[sel]
    if not lay.fp8:
        return w
    scale = fp8_scales(getattr(module, name + SCALE_SUFFIX)[sel])
    return (dequantize_fp8_w13 if name == "gate_up_proj" else dequantize_fp8_weight)(w, scale, lay.dtype)


def experts_mlp(module: nn.Module, lay: ExpertsLayout, x: torch.Tensor, sel: slice = slice(None)) -> torch.Tensor:
    """The local experts ``sel`` of a sharded module on x [L', R, H] (row block e through expert sel[e]) ->
    [L', R, H]: the module's projections, biases, gate (``_apply_gate``) or activation, and post-expert
    norm, batched over experts with ``torch.bmm`` (fp8 weights: dequantized per call). Every row is computed
    (rows past a count too)."""
    up_name = "gate_up_proj" if lay.has_gate else "up_proj"
    bias = (lambda n: getattr(module, n)[sel]) if lay.has_bias else (lambda n: None)
    h = _project(x, _weight(module, lay, up_name, sel), bias(up_name + "_bias"), lay.transposed)
    h = module._apply_gate(h) if lay.has_gate else module.act_fn(h)
    y = _project(h, _weight(module, lay, "down_proj", sel), bias("down_proj_bias"), lay.transposed)
    return module.post_expert_norm(y) if lay.post_norm else y


def decode_experts(module: nn.Module, lay: ExpertsLayout, x: torch.Tensor, counts: torch.Tensor,
                   masked: bool = True, max_active: int | None = None,
                   expected_rows: int | None = None) -> torch.Tensor:
    """The EPBuffer layout: x [L, R, H] with rows x[e, :counts[e]] for local expert e (counts int32 on the
    device) -> [L, R, H], rows past a count unspecified. With ``masked``, SiLU-gated experts without biases
    run the masked Triton kernel (``serving.experts.masked_expert_mlp``: no host read, experts without rows
    skipped; ``max_active`` bounds the experts with rows, ``expected_rows`` picks its row tile); otherwise
    ``experts_mlp`` over every row."""
    if not (masked and lay.masked) or lay.fp8:   # (fp8 layers decode fused: shard_experts refuses otherwise)
        return experts_mlp(module, lay, x)
    gate, up, down = gated_views(module.gate_up_proj, module.down_proj, lay.transposed)
    return masked_expert_mlp(x, counts, gate, up, down, expected_rows=expected_rows, max_active=max_active)


def prefill_expert(module: nn.Module, lay: ExpertsLayout):
    """``prefill_chunks.local_experts``'s per-expert function: (local expert e, rows [n, H]) -> [n, H]."""
    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        return experts_mlp(module, lay, rows[None], slice(e, e + 1))[0]
    return expert
