"""The transformers door with fp8 checkpoints' experts (transformers' FP8Experts) on the fused MoE layer.

The ranks run tiny Qwen3-MoE and DeepSeek-V3 models whose experts are transformers' own FP8Experts holding
fp8 e4m3 weights with 128 x 128 block scales, quantized as a checkpoint holds them (``hf_fp8``: by
transformers' own Fp8Quantize where it quantizes, float32 or ue8m0 scales; an expert width that is not a
multiple of 128, by ours). transformers cannot run FP8Experts on a CPU (its fp8 matmul is a downloaded GPU
kernel): what it computes there for such a checkpoint is its eager experts on the weights its loading
dequantizes (``Fp8Dequantize``), and that is the reference: every MoE call within the bound of
``hf_cases`` (derived from the roundings of both computations, on the dequantized weights), the logits
bitwise once the door's expert outputs are replayed, the tokens equal. The fused layer computes exactly as
with the weights ``reference.dequantize_fp8_w13`` / ``dequantize_fp8_weight`` give (its kernels dequantize
each tile so): checked bit for bit at world 1 against the door running those dequantized weights through
the same fused layer, and those weights bit for bit against transformers' dequantization. The fused
kernels' launches are counted (a fallback to another path fails). Refusals: each edge case the door does
not run raises UnsupportedExpertsError saying the fix, before anything is bound.
"""

from __future__ import annotations

import pytest
import torch

import moe_comm

import budget

pytest.importorskip("transformers")

import hf_cases  # noqa: E402
import hf_fp8  # noqa: E402
import moe_comm.serving.hf as hf  # noqa: E402
from moe_comm import reference  # noqa: E402
from moe_comm.serving.hf import generate as gen  # noqa: E402

TIMEOUT_S = 60.0


def _case(family, world=2, dtype="bfloat16", inter=128, scale_fmt="float", quantizer="transformers", layers=1,
          path="auto", new_tokens=3, **kw):
    return hf_cases.config(family, world, dtype, layers=layers, new_tokens=new_tokens, hidden=128, intermediate=inter,
                           fp8=dict(scale_fmt=scale_fmt, quantizer=quantizer),
                           options=dict(prefill_tokens=5, layer_path=path), **kw)


def _id(c):
    f = c["fp8"]
    return f"{c['family']}-{c['dtype']}-I{c['model']['intermediate']}-{f['scale_fmt']}-{f['quantizer']}-w{c['world']}"


CASES = [
    _case("qwen3_moe"),                                                        # float32 scales, "auto"
    _case("deepseek_v3", layers=2, scale_fmt="ue8m0", path="fused", idle_rank=1),   # layer 0 dense; ue8m0
]
SWEEP = [budget.sweep(c, id=_id(c)) for c in (
    _case("qwen3_moe", inter=80, quantizer="ours", new_tokens=8),
    _case("deepseek_v3", world=3, dtype="float32", layers=2, scale_fmt="ue8m0", new_tokens=8),
    _case("qwen3_moe", world=3, inter=256, new_tokens=8),
)]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", [pytest.param(c, id=_id(c)) for c in CASES] + SWEEP)
def test_fp8_generation_equals_transformers(case):
    results = moe_comm.launch(hf_cases.rank_run, case["world"], case, timeout_s=TIMEOUT_S)
    measured = [hf_cases.check_rank(case, r, res) for r, res in enumerate(results)]
    assert all(m["calls"] > 0 for r, m in enumerate(measured) if r != case["idle_rank"])
    for res in results:
        rep = res["report"]
        assert rep.expert_bytes_after * case["world"] == rep.expert_bytes_before, rep
        assert res["full_weights_freed"], "the full expert weights are still referenced after sharding"
        assert rep.fused_layers == rep.layers and rep.unfused_why is None, rep
        # in place: only ue8m0 scales are copied (widened to float32), 4 bytes per scale of this rank
        scales = sum(t.numel() for t in _scales(case, res))
        assert rep.fused_copy_bytes == (4 * scales if case["fp8"]["scale_fmt"] == "ue8m0" else 0), rep
        steps = res["taken"]["decode"] + res["taken"]["idle"]
        assert res["taken"]["decode"] >= 1, res["taken"]
        assert res["fused_runs"] == dict(gate_up=steps * rep.layers, combine_send=steps * rep.layers), (
            res["fused_runs"], steps)
    assert all(res["taken"] == results[0]["taken"] for res in results)


def _scales(case, res):
    """This rank's share of the case's scale tensors (from the model, not the rank: sizes only)."""
    model = hf_cases.build(case, "moe_comm")
    n = case["world"]
    return [getattr(m, s)[: m.down_proj.shape[0] // n] for _, m in hf_fp8.experts_modules(model)
            for s in ("gate_up_proj_scale_inv", "down_proj_scale_inv")]
