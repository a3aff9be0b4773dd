"""The transformers door (moe_comm.serving.hf): transformers' own MoE models generate through moe-comm.

Tiny random models of Qwen3-MoE, Mixtral, DeepSeek-V3 (shared experts, grouped top-k) and gpt-oss
(biases, transposed weights, its own gate) run on shm ranks, each rank its own prompts (different lengths,
the last rank fewer), through both paths (prompts: PrefillBuffer in chunks; decode steps: EPBuffer), and
every MoE call, logit and token is checked against transformers' "eager" run in this process
(``hf_cases``: tokens equal; logits bitwise equal once the door's expert outputs are replayed into
transformers' model; each expert output within a bound derived from the roundings of both computations).
In the DeepSeek-V3 case one rank has no prompts: it takes part in every step through ``finish``.
`make test` runs one case per family (one or two MoE layers, few tokens); the sweep runs 16 tokens on 2, 3
and 2 x 2 emulated-node ranks for every family in float32 and bfloat16, and the fp8 dispatch.
What the emulated nodes show: the door's steps over the put path (messages on a wire between nodes);
not a real NIC.
"""

from __future__ import annotations

import pytest

import torch
from torch import nn

import moe_comm
from moe_comm.heap.shm import RANKS_PER_NODE_ENV

import budget

pytest.importorskip("transformers")

import hf_cases  # noqa: E402
import moe_comm.serving.hf as hf  # noqa: E402
from moe_comm.serving.hf import generate as gen  # noqa: E402
from moe_comm.serving.hf.tiny import tiny_model  # noqa: E402

TIMEOUT_S = 60.0


def _short(family, dtype, layers=1, idle_rank=None, **options):
    """make test's case of a family: 3 tokens (the prompts' step, then 2 decode steps), the prompts (10 tokens
    on rank 0) in 2 PrefillBuffer chunks of 5 (rank 1's 4 tokens all in the first: it sends none in the second)."""
    return hf_cases.config(family, 2, dtype, layers=layers, new_tokens=3, idle_rank=idle_rank,
                           options=dict(prefill_tokens=5, **options))


REPRESENTATIVE = [
    _short("qwen3_moe", "float32", expert_kernel="masked"),
    _short("qwen3_moe", "float32", layers=2, layer_path="fused"),   # two MoE layers share one MoELayer
    _short("mixtral", "bfloat16", layer_path="auto"),               # auto: fused (SiLU-gated, no biases)
    _short("deepseek_v3", "float32", layers=2, idle_rank=1),   # layer 0 dense
    _short("gpt_oss", "bfloat16", layer_path="auto"),               # auto: unfused (biases, its own gate)
]
FUSABLE = ("qwen3_moe", "mixtral", "deepseek_v3")   # SiLU(gate) * up, concatenated, no biases: MoELayer's MLP
SWEEP = [budget.sweep(hf_cases.config(f, w, d), id=f"{f}-{d}-w{w}")
         for f in ("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss") for d in ("float32", "bfloat16") for w in (2, 3)]
SWEEP += [budget.sweep(hf_cases.config(f, w, d, options=dict(layer_path="fused")), id=f"{f}-{d}-w{w}-fused")
          for f in FUSABLE for d in ("float32", "bfloat16") for w in (2, 3)]
NODES = [budget.sweep(hf_cases.config(f, 4, "bfloat16" if i % 2 else "float32"), id=f"{f}-2x2nodes")
         for i, f in enumerate(("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"))]
NODES += [budget.sweep(hf_cases.config(f, 4, "float32" if i % 2 else "bfloat16", options=dict(layer_path="fused")),
                       id=f"{f}-2x2nodes-fused") for i, f in enumerate(FUSABLE)]


def _case_id(c):
    path = c["options"].get("layer_path")
    return f"{c['family']}-{c['dtype']}-short" + (f"-{path}" if path else "")


def _run_and_check(case):
    results = moe_comm.launch(hf_cases.rank_run, case["world"], case, timeout_s=TIMEOUT_S)
    measured = [hf_cases.check_rank(case, r, res) for r, res in enumerate(results)]
    for res in results:
        rep = res["report"]
        assert rep.expert_bytes_after * case["world"] == rep.expert_bytes_before, rep
        assert res["full_weights_freed"], "the full expert weights are still referenced after sharding"
        assert res["preloaded"], "the rank imported transformers itself: the fork server did not preload it"
        if case["options"].get("expert_kernel") == "masked":
            assert res["masked_layers"] == rep.layers, "the masked Triton expert kernel did not run every layer"
        assert res["taken"]["prefill"] >= 1 and res["taken"]["decode"] >= 1, res["taken"]
        assert res["taken"]["chunks"] > res["taken"]["prefill"], "no prefill step ran in chunks"
        _check_layer_path(case, res)
    assert all(m["calls"] > 0 for r, m in enumerate(measured) if r != case["idle_rank"])
    assert all(res["taken"] == results[0]["taken"] for res in results), [res["taken"] for res in results]
    return results, measured


def _check_layer_path(case, res):
    """The layers the layer_path says are fused ran the fused kernels at every decode-size step (and idle
    step: T = 0 still takes part), through one shared MoELayer, reading the modules' own weights (no copy);
    the others never launched them, and the report says why."""
    rep, path = res["report"], case["options"].get("layer_path", "unfused")
    fused = path != "unfused" and case["family"] in FUSABLE and not case["options"].get("dispatch_format")
    assert rep.fused_layers == (rep.layers if fused else 0), rep
    assert (rep.unfused_why is None) == fused, rep
    if case["family"] == "gpt_oss" and path != "unfused":
        assert "biases" in rep.unfused_why, rep
    assert rep.fused_copy_bytes == 0, rep
    assert res["shared_moe_layers"] == (1 if fused else 0)
    steps = res["taken"]["decode"] + res["taken"]["idle"]
    assert res["fused_runs"] == dict(gate_up=steps * rep.fused_layers, combine_send=steps * rep.fused_layers), (
        res["fused_runs"], steps, rep.fused_layers)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", [pytest.param(c, id=_case_id(c)) for c in REPRESENTATIVE] + SWEEP)
def test_generation_equals_transformers(case):
    _run_and_check(case)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", NODES)
def test_generation_across_emulated_nodes(case, monkeypatch):
    monkeypatch.setenv(RANKS_PER_NODE_ENV, "2")
    _run_and_check(case)


def _stored_transposed(model):
    """Every experts module's weights stored as [E, in, out] (gpt-oss's layout) with is_transposed set: the same
    experts in the other layout transformers' flags describe (its eager Qwen3-MoE forward ignores the flag, so
    this model runs through the door only)."""
    for m in model.modules():
        if type(m).__name__ == "Qwen3MoeExperts":
            for n in ("gate_up_proj", "down_proj"):
                setattr(m, n, nn.Parameter(getattr(m, n).detach().transpose(1, 2).contiguous(), requires_grad=False))
            m.is_transposed = True
    return model


@pytest.mark.timeout(120)
def test_fused_path_reads_weights_in_place_or_makes_one_counted_copy():
    """World 1 (loopback), float32, 2 MoE layers, layer_path="fused": weights stored as transformers' usual
    [E, out, in] are w13/w2 already (the MoELayer reads the module's own tensors, no copy); stored transposed
    they are copied once, contiguous, and the report counts every byte. Both generate transformers' eager
    tokens (prompt through the PrefillBuffer, 3 decode steps through the fused kernels)."""
    (group,) = moe_comm.init(backend="loopback", world_size=1)
    prompts = gen.prompts_for(0, 1)
    want, _ = gen.generate(tiny_model("qwen3_moe", layers=2), prompts, 4)
    for transposed in (False, True):
        model = tiny_model("qwen3_moe", layers=2, experts_implementation="moe_comm")
        if transposed:
            _stored_transposed(model)
        rep = hf.shard_experts(model, group, decode_tokens=4, layer_path="fused")
        door = model._moe_comm_door
        assert rep.fused_layers == 2 and len(door.fused_layers) == 1, rep
        own = [layer.module.gate_up_proj.data_ptr() == layer.fused.w13.data_ptr() for layer in door.layers]
        assert own == [not transposed] * 2
        assert rep.fused_copy_bytes == (rep.expert_bytes_after if transposed else 0), rep
        assert all(layer.decode_buf is None for layer in door.layers)   # no decode EPBuffer: the MoELayer's own
        assert rep.buffer_bytes == door.layers[0].prefill_buf.buffer_bytes + door.layers[0].fused.layer.buffer_bytes
        got, _ = gen.generate(model, prompts, 4)
        assert door.taken["decode"] == 3 and torch.equal(got, want), (transposed, got, want)


@budget.SWEEP
@pytest.mark.timeout(400)
def test_fp8_dispatch_within_its_bound():
    """bf16 model, hidden 128, rows dispatched as e4m3 with float32 scales: each expert output within the bound
    plus the quantization error the bound carries; tokens may differ (not asserted)."""
    case = hf_cases.config("qwen3_moe", 2, "bfloat16", layers=1, new_tokens=4, hidden=128,
                           options=dict(dispatch_format="e4m3"))
    _run_and_check(case)
