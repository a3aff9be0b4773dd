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
from moe_comm.heap.shm import RANKS_PER_NODE_ENV  # noqa: E402
from moe_comm import MoELayer, reference  # noqa: E402
from moe_layer_cases import run_loopback_layers  # noqa: E402
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


# make test: DeepSeek-V3 (layer 0 dense, ue8m0 scales, one rank idle); Qwen3-MoE with float32 scales and I = 80
# runs at world 1 in make test (test_fp8_door_equals_the_door_on_dequantized_weights_bit_for_bit), at 2 ranks here
CASES = [
    _case("deepseek_v3", layers=2, scale_fmt="ue8m0", path="fused", idle_rank=1),
]
SWEEP = [budget.sweep(c, id=_id(c)) for c in (
    _case("qwen3_moe"),                                                        # float32 scales, "auto"
    _case("qwen3_moe", inter=80, quantizer="ours", new_tokens=8),
    _case("deepseek_v3", world=3, dtype="float32", layers=2, scale_fmt="ue8m0", new_tokens=8),
    _case("qwen3_moe", world=3, inter=256, new_tokens=8),
)]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", [pytest.param(c, id=_id(c)) for c in CASES] + SWEEP)
def test_fp8_generation_equals_transformers(case):
    results = moe_comm.launch(hf_cases.rank_run, case["world"], case, timeout_s=TIMEOUT_S)
    measured = [hf_cases.check_rank(case, r, res) for r, res in enumerate(results)]
    model = hf_cases.build(case, "moe_comm")   # the ranks' model (all experts): sizes and weights to replay
    assert all(m["calls"] > 0 for r, m in enumerate(measured) if r != case["idle_rank"])
    for res in results:
        rep = res["report"]
        assert rep.expert_bytes_after * case["world"] == rep.expert_bytes_before, rep
        assert res["full_weights_freed"], "the full expert weights are still referenced after sharding"
        assert rep.fused_layers == rep.layers and rep.unfused_why is None, rep
        # in place: only ue8m0 scales are copied (widened to float32), 4 bytes per scale of this rank
        scales = sum(t.numel() for t in _scales(case, model))
        assert rep.fused_copy_bytes == (4 * scales if case["fp8"]["scale_fmt"] == "ue8m0" else 0), rep
        steps = res["taken"]["decode"] + res["taken"]["idle"]
        assert res["taken"]["decode"] >= 1, res["taken"]
        assert res["fused_runs"] == dict(gate_up=steps * rep.layers, combine_send=steps * rep.layers), (
            res["fused_runs"], steps)
    assert all(res["taken"] == results[0]["taken"] for res in results)
    assert _replay_on_dequantized_weights(case, results, model) > 0


# 2 x 2 emulated nodes (sweep): the fused fp8 layer's rows between nodes go by puts (messages on a wire, the
# other node's memory unmapped); what it shows and cannot is test_hf_door.py's (module docstring)
NODES = [budget.sweep(_case("deepseek_v3", world=4, layers=2, scale_fmt="ue8m0", path="fused"), id="deepseek_v3-2x2nodes")]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", NODES)
def test_fp8_generation_across_emulated_nodes(case, monkeypatch):
    monkeypatch.setenv(RANKS_PER_NODE_ENV, "2")
    test_fp8_generation_equals_transformers(case)


def _replay_on_dequantized_weights(case, results, model) -> int:
    """Every decode-size MoE call of the ranks again, here, through our MoELayer on a loopback world of the
    case's size given the weights ``reference.dequantize_fp8_w13`` / ``dequantize_fp8_weight`` make of each
    rank's fp8 experts: each rank's output must be the recorded one bit for bit (the fused fp8 kernels
    dequantize each tile so; the bound above cannot see a scale read from a block whose magnitude is
    close, e.g. gate's for up's in bf16). Returns the calls compared."""
    W, dtype = case["world"], gen.DTYPES[case["dtype"]]
    groups = moe_comm.init(backend="loopback", world_size=W)
    experts = [m for _, m in hf_fp8.experts_modules(model)]
    E, H, I = experts[0].down_proj.shape[0], experts[0].down_proj.shape[1], experts[0].down_proj.shape[2]
    L, K, M = E // W, model.config.num_experts_per_tok, case["options"]["decode_tokens"]

    def weights(m, r):
        sl = slice(r * L, (r + 1) * L)
        return (reference.dequantize_fp8_w13(m.gate_up_proj.detach()[sl], m.gate_up_proj_scale_inv[sl].float(), dtype),
                reference.dequantize_fp8_weight(m.down_proj.detach()[sl], m.down_proj_scale_inv[sl].float(), dtype))
    layers = [MoELayer(g, E, H, I, M, K, *weights(experts[0], r), dtype=dtype, path="fused")
              for r, g in enumerate(groups)]
    per_rank = [{s: c for s, c in zip(res["call_steps"], res["calls"])} for res in results]
    keys = sorted({s for calls in per_rank for s in calls if not s[2]})   # (step, MoE layer, prefill=False)
    empty = (torch.empty(0, H, dtype=dtype), torch.empty(0, K, dtype=torch.int64), torch.empty(0, K))
    for step, index, _ in keys:
        for r, layer in enumerate(layers):
            layer.set_weights(*weights(experts[index], r))
        ins = [calls.get((step, index, False), empty)[:3] for calls in per_rank]
        ys = run_loopback_layers(layers, *zip(*ins))
        for r, (calls, y) in enumerate(zip(per_rank, ys)):
            if (step, index, False) in calls:
                assert torch.equal(y, calls[(step, index, False)][3]), (
                    f"rank {r}: step {step} MoE layer {index}: the door's fused fp8 call differs from MoELayer on "
                    f"the dequantized weights by {(y - calls[(step, index, False)][3]).abs().max().item():.3g}")
    return len(keys)


def _scales(case, model):
    """This rank's share of the model's scale tensors (sizes only)."""
    n = case["world"]
    return [getattr(m, s)[: m.down_proj.shape[0] // n] for _, m in hf_fp8.experts_modules(model)
            for s in ("gate_up_proj_scale_inv", "down_proj_scale_inv")]


@pytest.mark.timeout(120)
def test_fp8_door_equals_the_door_on_dequantized_weights_bit_for_bit():
    """World 1 (loopback), bfloat16, expert width 80 (not a multiple of 128: one block row per half, the
    scales gate's then up's as transformers merges a checkpoint's): the door on FP8Experts (fused, weights
    and float32 scales read in place) gives the logits of the door on the weights ``reference.dequantize_fp8_w13``
    / ``dequantize_fp8_weight`` give, bit for bit (prompt through the PrefillBuffer: dequantized per call;
    decode steps through the fused kernels), and those weights are transformers' own dequantization of the
    checkpoint, bit for bit; its tokens are transformers' eager ones on them."""
    case = _case("qwen3_moe", world=1, inter=80, quantizer="ours", layers=2, new_tokens=4)
    (group,) = moe_comm.init(backend="loopback", world_size=1)
    fp8 = hf_cases.build(case, "moe_comm")
    plain = hf_cases.build(case)               # the same model, its bf16 experts given our dequantized weights
    want_model = hf_cases.build(case)          # transformers' CPU computation of the checkpoint
    dtype = gen.DTYPES[case["dtype"]]
    for (_, q), (_, p), (_, t) in zip(*(hf_fp8.experts_modules(m) for m in (fp8, plain, want_model))):
        s13, s2 = q.gate_up_proj_scale_inv.float(), q.down_proj_scale_inv.float()
        assert s13.shape[1] == 2   # gate's block row, then up's
        w13 = reference.dequantize_fp8_w13(q.gate_up_proj.detach(), s13, dtype)
        w2 = reference.dequantize_fp8_weight(q.down_proj.detach(), s2, dtype)
        assert torch.equal(w13, t.gate_up_proj) and torch.equal(w2, t.down_proj)   # = transformers' dequantization
        p.gate_up_proj, p.down_proj = (torch.nn.Parameter(w, requires_grad=False) for w in (w13, w2))
    reports = [hf.shard_experts(m, group, decode_tokens=4, layer_path="fused") for m in (fp8, plain)]
    assert [r.fused_layers for r in reports] == [2, 2] and reports[0].fused_copy_bytes == 0, reports
    for layer in fp8._moe_comm_door.layers:   # in place: the module's own fp8 weights and scales
        f, m = layer.fused, layer.module
        assert f.layer.fp8_weights and f.w13.data_ptr() == m.gate_up_proj.data_ptr()
        assert f.w2.data_ptr() == m.down_proj.data_ptr()
        assert f.w13_scale.data_ptr() == m.gate_up_proj_scale_inv.data_ptr()
        assert f.w2_scale.data_ptr() == m.down_proj_scale_inv.data_ptr()
    prompts = gen.prompts_for(0, 1)
    outs = []
    for m in (fp8, plain):
        runs, build = hf_cases._count_fused_launches()
        try:
            outs.append(gen.generate(m, prompts, 4))
        finally:
            hf_cases.moe_layer._FusedEPBuffer._build_launches = build
        assert m._moe_comm_door.taken["decode"] == 3 and runs == dict(gate_up=6, combine_send=6), runs   # 3 x 2 layers
    (got, got_logits), (same, same_logits) = outs
    assert torch.equal(got_logits, same_logits) and torch.equal(got, same)
    want, _ = gen.generate(want_model, prompts, 4)
    assert torch.equal(got, want), (got, want)


def _fp8_model(inter=128, **config):
    """A 1-layer Qwen3-MoE bf16 model with FP8Experts as ``hf_fp8.fp8_config(**config)`` builds them, weights
    on the meta device unless the config is the supported one (then quantized: ``hf_fp8.fp8_model``)."""
    from moe_comm.serving.hf.tiny import tiny_model  # noqa: PLC0415
    model = tiny_model("qwen3_moe", torch.bfloat16, layers=1, hidden=128, intermediate=inter,
                       experts_implementation="moe_comm")
    if config:
        hf_fp8.swap_in_fp8_experts(model, hf_fp8.fp8_config(**config))
        return model
    quantizer = "ours" if inter % hf_fp8.BLOCK[0] else "transformers"
    return hf_fp8.fp8_model(model, dict(scale_fmt="float", quantizer=quantizer), 0, eager_reference=False)


def _refused(model, match, **options):
    (group,) = moe_comm.init(backend="loopback", world_size=1)
    (_, experts), = hf_fp8.experts_modules(model)
    with pytest.raises(hf.UnsupportedExpertsError, match=match):
        hf.shard_experts(model, group, **options)
    assert getattr(model, "_moe_comm_door", None) is None and experts.gate_up_proj.shape[0] == 8   # nothing lost


DEQUANTIZE = r"FineGrainedFP8Config\(dequantize=True\)"


@pytest.mark.parametrize("config,options,match", [
    (dict(block=(64, 64)), {}, r"block_size=\(64, 64\).*" + DEQUANTIZE),
    (dict(block=None), {}, r"block_size=None.*" + DEQUANTIZE),
    (dict(activation_scheme="static"), {}, r"activation_scheme='static'.*" + DEQUANTIZE),
    (dict(expert_dtype="fp4"), {}, r"fp4.*" + DEQUANTIZE),
    ({}, dict(layer_path="unfused"), r"layer_path='unfused'.*Fix: layer_path='fused' or 'auto'"),
    ({}, dict(layer_path="auto", dispatch_format="e4m3"), r"dispatch_format='e4m3'.*" + DEQUANTIZE),
], ids=["block64", "per-tensor", "static", "fp4", "unfused", "fp8-dispatch"])
def test_fp8_edge_cases_refused_saying_the_fix(config, options, match):
    _refused(_fp8_model(**config), match, **options)


def test_fp8_experts_stored_transposed_refused():
    """An fp8 experts module flagged is_transposed: the fused layer would take a transposed copy of the weights
    but the scales' grid as it is (one scale per wrong block): refused before anything is sharded."""
    model = _fp8_model()
    (_, m), = hf_fp8.experts_modules(model)
    m.is_transposed = True
    _refused(model, r"stored transposed.*" + DEQUANTIZE, layer_path="fused")


def test_fp8_scales_over_the_concatenated_rows_refused():
    """I = 64: transformers' Fp8Quantize of the merged gate_up_proj [E, 128, 128] gives one block row over gate
    and up rows together ([E, 1, 1]), not gate's then up's ([E, 2, 1]): refused, naming the grid."""
    model = _fp8_model(inter=64)
    (_, m), = hf_fp8.experts_modules(model)
    q, s = hf_fp8.quantize_projection(m.gate_up_proj.detach().float(), hf_fp8.fp8_config(), "transformers", 0)
    assert tuple(s.shape) == (8, 1, 1)
    m.gate_up_proj, m.gate_up_proj_scale_inv = (torch.nn.Parameter(t, requires_grad=False) for t in (q, s))
    _refused(model, r"gate_up_proj_scale_inv is \[8, 1, 1\], not \[8, 2, 1\].*not exactly convertible",
             layer_path="fused")


def test_fp8_clamped_gate_refused_and_auto_fuses_at_any_decode_tokens():
    """FP8Experts with a clamp on its gate (``limit``, gpt-oss-style configs) is not SiLU(gate) * up: refused
    (no other decode path reads fp8). "auto" fuses fp8 experts even where decode_tokens > FUSED_MAX_TOKENS
    would pick the unfused path for bf16 ones (there is no unfused fp8 path)."""
    model = _fp8_model()
    (_, m), = hf_fp8.experts_modules(model)
    m.limit = 7.0
    _refused(model, r"not SiLU\(gate\) \* up.*" + DEQUANTIZE, layer_path="auto")
    (group,) = moe_comm.init(backend="loopback", world_size=1)
    big = hf_cases.moe_layer.FUSED_MAX_TOKENS + 1
    rep = hf.shard_experts(_fp8_model(), group, decode_tokens=big, layer_path="auto")
    assert rep.fused_layers == 1 and rep.unfused_why is None, rep


def _checkpoint_merge(experts, scale_fmt, per_expert):
    """transformers' own loading of an fp8 checkpoint's experts into ``experts``: the converters its fp8
    quantizer makes of the model's conversion mapping (``update_weight_conversions``: a copy of each weight
    converter for its ``weight_scale_inv``), their operations run on ``per_expert`` ({checkpoint name pattern:
    one tensor per expert}). Returns {experts' parameter name: merged tensor}."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping  # noqa: PLC0415
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer  # noqa: PLC0415
    holder = torch.nn.Module()
    holder.mlp, holder.config = torch.nn.Module(), experts.config
    holder.mlp.experts = experts
    quantizer = FineGrainedFP8HfQuantizer(hf_fp8.fp8_config(scale_fmt))
    quantizer.pre_quantized = True
    merged = {}
    for c in quantizer.update_weight_conversions(get_checkpoint_conversion_mapping("qwen2_moe"), holder):
        if not hasattr(c, "operations") or not all(p in per_expert for p in c.source_patterns):
            continue
        d = {p: list(per_expert[p]) for p in c.source_patterns}
        for op in c.operations:
            d = op.convert(d, source_patterns=c.source_patterns, target_patterns=c.target_patterns)
        (target, t), = d.items()
        merged[target.rpartition(".")[2]] = t
    return merged


def _fp8_experts(family, hidden, inter, scale_fmt, device="meta", experts=8):
    """transformers' FP8Experts of ``family`` at these sizes, built as its loading builds them (weights
    allocated, not initialized)."""
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS, FP8Experts  # noqa: PLC0415
    from transformers.integrations.moe import use_experts_implementation  # noqa: PLC0415
    from moe_comm.serving.hf.tiny import tiny_config  # noqa: PLC0415
    config = tiny_config(family, layers=1, hidden=hidden, experts=experts, intermediate=inter)
    cls = use_experts_implementation(experts_class=FP8Experts, experts_interface=ALL_FP8_EXPERTS_FUNCTIONS,
                                     has_bias=False, has_gate=True)
    with torch.device(device):
        return cls(config=config, block_size=hf_fp8.BLOCK, scale_fmt=scale_fmt)


def _per_expert(E, hidden, inter, scale_dtype, device, g=None):
    """An fp8 checkpoint's experts (DeepSeek-V3's names): per expert, gate_proj / up_proj [I, H] and down_proj
    [H, I] float8_e4m3fn, each with its own weight_scale_inv [ceil(out/128), ceil(in/128)]; on the CPU random
    codes and scales that differ per expert, block and projection (powers of two for ue8m0)."""
    cdiv = lambda a: -(-a // hf_fp8.BLOCK[0])   # noqa: E731

    def t(shape, dtype, lo=0):
        if device == "meta":
            return torch.empty(shape, dtype=dtype, device="meta")
        if dtype == torch.float8_e4m3fn:
            return (torch.randn(shape, generator=g) * 64).to(dtype)
        return (2.0 ** torch.randint(lo - 8, lo, shape, generator=g).float()).to(dtype)
    out = {}
    for n, (o, i), lo in (("gate_proj", (inter, hidden), 0), ("up_proj", (inter, hidden), 8),
                          ("down_proj", (hidden, inter), 16)):
        out[f"mlp.experts.*.{n}.weight"] = [t((o, i), torch.float8_e4m3fn) for _ in range(E)]
        out[f"mlp.experts.*.{n}.weight_scale_inv"] = [t((cdiv(o), cdiv(i)), scale_dtype, lo) for _ in range(E)]
    return out


@pytest.mark.parametrize("family,hidden,inter,scale_fmt", [
    ("deepseek_v3", 7168, 2048, "ue8m0"),   # DeepSeek-V3 / R1 (and Kimi K2's expert sizes)
    ("qwen3_moe", 2048, 768, "float"),      # Qwen3-30B-A3B-FP8
    ("qwen3_moe", 4096, 1536, "float"),     # Qwen3-235B-A22B-FP8
    ("qwen3_moe", 256, 96, "float"),        # expert widths that are not a multiple of 128 (and load:
    ("qwen3_moe", 256, 200, "float"),       # 2 ceil(I/128) = ceil(2I/128))
], ids=["deepseek-v3", "qwen3-30b-a3b", "qwen3-235b-a22b", "I96", "I200"])
def test_fp8_real_checkpoint_sizes_load_into_the_grid_the_door_takes(family, hidden, inter, scale_fmt):
    """At real checkpoints' sizes (meta tensors: shapes only), transformers' own loading merges a checkpoint's
    per-expert gate_proj / up_proj / down_proj weight_scale_inv into exactly the FP8Experts parameters it
    allocates, and the door takes that module with the grid ``moe_layer.fp8_scale_grids`` reads (gate's block
    rows, then up's)."""
    E = 8
    experts = _fp8_experts(family, hidden, inter, scale_fmt)
    scale_dtype = torch.float8_e8m0fnu if scale_fmt == "ue8m0" else torch.float32
    merged = _checkpoint_merge(experts, scale_fmt, _per_expert(E, hidden, inter, scale_dtype, "meta"))
    assert sorted(merged) == ["down_proj", "down_proj_scale_inv", "gate_up_proj", "gate_up_proj_scale_inv"]
    for n, t in merged.items():
        p = getattr(experts, n)
        assert (tuple(t.shape), t.dtype) == (tuple(p.shape), p.dtype), (n, t.shape, p.shape)
    lay = hf.layout_of(experts, torch.bfloat16)
    assert (lay.fp8, lay.masked, lay.num_experts, lay.hidden, lay.intermediate) == (True, True, E, hidden, inter)
    (r13, c13), (r2, c2) = hf_cases.moe_layer.fp8_scale_grids(hidden, inter)
    assert tuple(experts.gate_up_proj_scale_inv.shape) == (E, r13, c13)
    assert tuple(experts.down_proj_scale_inv.shape) == (E, r2, c2)


# (not I = 200: transformers' Fp8Dequantize takes its block rows from the grid, rows / ceil(I/128) = 100, not 128)
@pytest.mark.parametrize("inter,scale_fmt", [(256, "ue8m0"), (96, "float")])
def test_fp8_checkpoint_merge_is_gate_blocks_then_up_blocks(inter, scale_fmt):
    """transformers' own merge of a checkpoint's per-expert codes and scales (its converters' operations, real
    values at a small hidden size), dequantized as the fused layer computes (``reference.dequantize_fp8_w13``
    / ``dequantize_fp8_weight``), gives each projection's own dequantization by transformers
    (``Fp8Dequantize``, its CPU load path) bit for bit: the door's grid is the checkpoint's."""
    E, H = 4, 256
    experts = _fp8_experts("qwen3_moe", H, inter, scale_fmt, experts=E)
    scale_dtype = torch.float8_e8m0fnu if scale_fmt == "ue8m0" else torch.float32
    ck = _per_expert(E, H, inter, scale_dtype, "cpu", torch.Generator().manual_seed(3))
    merged = _checkpoint_merge(experts, scale_fmt, ck)
    from moe_comm.serving.hf.experts import fp8_scales  # noqa: PLC0415
    w13 = reference.dequantize_fp8_w13(merged["gate_up_proj"], fp8_scales(merged["gate_up_proj_scale_inv"]),
                                       torch.bfloat16)
    w2 = reference.dequantize_fp8_weight(merged["down_proj"], fp8_scales(merged["down_proj_scale_inv"]),
                                         torch.bfloat16)

    def deq(n):
        return torch.stack([hf_fp8.dequantize(q, s, torch.bfloat16) for q, s in
                            zip(ck[f"mlp.experts.*.{n}.weight"], ck[f"mlp.experts.*.{n}.weight_scale_inv"])])
    assert torch.equal(w13, torch.cat([deq("gate_proj"), deq("up_proj")], 1))
    assert torch.equal(w2, deq("down_proj"))


def test_fp8_quantized_after_the_merge_refused_at_its_allocated_grid():
    """A bf16 model quantized at loading (``FineGrainedFP8Config`` on a bf16 checkpoint) with an expert width
    that is not a multiple of 128 but 2I is (I = 192): FP8Experts allocates ceil(2I/128) = 3 block rows over
    the concatenated [gate; up] rows (transformers' Fp8Quantize fills them so), one of them across gate and up
    rows: refused saying the fix, not computed with a wrong scale."""
    experts = _fp8_experts("qwen3_moe", 256, 192, "float")
    assert tuple(experts.gate_up_proj_scale_inv.shape) == (8, 3, 2)
    with pytest.raises(hf.UnsupportedExpertsError, match=r"\[8, 3, 2\], not \[8, 4, 2\].*" + DEQUANTIZE):
        hf.layout_of(experts, torch.bfloat16)
