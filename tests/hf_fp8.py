"""fp8 checkpoints' experts for the transformers door's tests: a tiny model whose experts are transformers'
own ``FP8Experts`` (swapped in by transformers' ``replace_with_fp8_linear``, as loading a
``FineGrainedFP8Config`` checkpoint does; every other Linear stays as it is), holding fp8 weights quantized
the way a checkpoint holds them (gate_proj, up_proj and down_proj each in its own 128 x 128 blocks, merged
into gate_up_proj / gate_up_proj_scale_inv by concatenation, as transformers' weight conversion merges a
checkpoint's), and the model transformers computes for such a checkpoint on a CPU: the same model with
those weights dequantized by transformers' own ``Fp8Dequantize`` (its CPU load path: ``validate_environment``
sets ``dequantize=True`` without a GPU, and the dequantization runs per projection, before the merge).
Not ``_dequantize_fp8_weight``: that is its backward pass's helper, which rounds each scale to the model's
dtype before the product (in bf16 a different weight, by up to one unit in the last place; in float32 the
same) and reads gate_up's grid over the concatenated rows.

Quantizer: transformers' own ``Fp8Quantize`` where it quantizes (a projection whose rows and columns are
multiples of 128; ``scale_fmt`` "float" or "ue8m0"); an expert width that is not (I = 80 here) it passes
through unquantized, so there the codes and scales come from ours (``moe_layer_cases.fp8_block_quantize``,
float32 scales), said by ``quantizer`` in the case.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from moe_comm.planner import FP8_WEIGHT_BLOCK

BLOCK = (FP8_WEIGHT_BLOCK, FP8_WEIGHT_BLOCK)


def fp8_config(scale_fmt: str = "float", block=BLOCK, activation_scheme: str = "dynamic", expert_dtype: str = "fp8"):
    from transformers import FineGrainedFP8Config  # noqa: PLC0415
    return FineGrainedFP8Config(weight_block_size=block, scale_fmt=scale_fmt, activation_scheme=activation_scheme,
                                expert_dtype=expert_dtype)


def experts_modules(model) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if n.endswith(".experts")]


def swap_in_fp8_experts(model, config) -> list[tuple[str, nn.Module, nn.Module]]:
    """Replace every experts module by transformers' FP8Experts (on the meta device, as loading does) with
    ``replace_with_fp8_linear``, every other Linear kept. Returns [(name, old module, new module)]."""
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear  # noqa: PLC0415
    old = experts_modules(model)
    keep = [re.escape(n) for n, m in model.named_modules() if type(m) is nn.Linear]
    replace_with_fp8_linear(model, modules_to_not_convert=keep, quantization_config=config)
    return [(n, m, model.get_submodule(n)) for n, m in old]


def _transformers_quantize(w: torch.Tensor, config) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers.integrations.finegrained_fp8 import Fp8Quantize  # noqa: PLC0415
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer  # noqa: PLC0415
    out = Fp8Quantize(FineGrainedFP8HfQuantizer(config))._quantize_one("w", w)
    assert out["w"].dtype == torch.float8_e4m3fn, f"transformers' Fp8Quantize left {tuple(w.shape)} unquantized"
    return out["w"], out["w_scale_inv"]


def _our_quantize(w: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    from moe_layer_cases import fp8_block_quantize  # noqa: PLC0415
    return fp8_block_quantize(w, torch.Generator().manual_seed(seed), False)


def quantize_projection(w: torch.Tensor, config, quantizer: str, seed: int):
    """One projection [E, out, in] -> (float8_e4m3fn codes, scales [E, ceil(out/128), ceil(in/128)])."""
    return _transformers_quantize(w, config) if quantizer == "transformers" else _our_quantize(w, seed)


def dequantize(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """transformers' CPU load path for one projection: ``Fp8Dequantize._dequantize_one``."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize  # noqa: PLC0415
    return Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=dtype)


def _varied(w: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """w [E, out, in] with each 128 x 128 block times its own factor in [1/2, 2): block scales that differ by up
    to 4x between experts, blocks and gate / up halves (random weights' blocks have nearly equal maxima, so a
    scale read from the wrong block would hide within the bound)."""
    E, N, K = w.shape
    f = 2.0 ** (2 * torch.rand(E, -(-N // BLOCK[0]), -(-K // BLOCK[1]), generator=g) - 1)
    return w * f.repeat_interleave(BLOCK[0], 1)[:, :N].repeat_interleave(BLOCK[1], 2)[..., :K]


def checkpoint_experts(module: nn.Module, config, quantizer: str, seed: int) -> dict:
    """A bf16/fp32 experts module's weights (each block varied: ``_varied``) as an fp8 checkpoint holds them,
    merged as transformers loads them: {gate_up_proj, gate_up_proj_scale_inv, down_proj, down_proj_scale_inv}
    and the dequantized {gate_up_proj, down_proj} transformers computes with on a CPU ('deq_' prefix)."""
    I = module.gate_up_proj.shape[1] // 2
    dtype = module.gate_up_proj.dtype
    g = torch.Generator().manual_seed(seed)
    parts = [module.gate_up_proj.detach()[:, :I], module.gate_up_proj.detach()[:, I:], module.down_proj.detach()]
    qs = [quantize_projection(_varied(p.float(), g), config, quantizer, seed + i) for i, p in enumerate(parts)]
    deq = [dequantize(q, s, dtype) for q, s in qs]
    return dict(gate_up_proj=torch.cat([qs[0][0], qs[1][0]], 1),
                gate_up_proj_scale_inv=torch.cat([qs[0][1], qs[1][1]], 1),
                down_proj=qs[2][0], down_proj_scale_inv=qs[2][1],
                deq_gate_up_proj=torch.cat(deq[:2], 1), deq_down_proj=deq[2])


def fp8_model(model, fp8: dict, seed: int, eager_reference: bool):
    """``model`` (bf16/fp32, its experts transformers' eager ones) as an fp8 checkpoint of it loads: on a GPU
    (``eager_reference`` False: FP8Experts holding the codes and scales) or on a CPU (True: the same
    experts modules holding transformers' dequantized weights). ``fp8``: dict(scale_fmt, quantizer)."""
    config = fp8_config(fp8.get("scale_fmt", "float"))
    olds = experts_modules(model)
    weights = [checkpoint_experts(m, config, fp8.get("quantizer", "transformers"), seed + 10 * i)
               for i, (_, m) in enumerate(olds)]
    if eager_reference:
        for (_, m), w in zip(olds, weights):
            for n in ("gate_up_proj", "down_proj"):
                setattr(m, n, nn.Parameter(w["deq_" + n], requires_grad=False))
        return model
    for (_, _, new), w in zip(swap_in_fp8_experts(model, config), weights):
        for n in ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv"):
            assert getattr(new, n).shape == w[n].shape and getattr(new, n).dtype == w[n].dtype, (n, w[n].shape)
            setattr(new, n, nn.Parameter(w[n], requires_grad=False))
    return model
