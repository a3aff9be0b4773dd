"""The transformers door (moe_comm.serving.hf) on one GPU: generation checked against transformers' own run
on the same GPU, and the decode step's time against transformers' local experts (issue 43).

    python bench/hf_door.py --out-dir DIR [--sections generate,decode] [--heaps nvshmem,loopback]
                            [--batches 1,8,64] [--iters 20] [--warmup 5] [--site-after DIR]
    python bench/hf_door.py --dry --out-dir DIR     # no GPU: tiny shapes, Triton's interpreter

generate  World 1 on the first heap (nvshmem where nvshmem4py imports, else loopback): tiny random models
          of Qwen3-MoE (float32), DeepSeek-V3 (bfloat16: shared experts, grouped top-k) and gpt-oss (bfloat16:
          biases, its own gate; on the other heaps Qwen3-MoE only: the families do not depend on the heap)
          generate 16 greedy tokens for two prompts of different lengths through the door
          (``expert_kernel="auto"``: the masked Triton expert kernel on CUDA for the SiLU-gated experts
          without biases, the module's own gate with torch.bmm for gpt-oss; the prompts' step through the
          PrefillBuffer in chunks, the decode steps through the EPBuffer), and Qwen3-MoE again with
          ``layer_path="fused"`` (the decode steps through moe_comm.MoELayer, its kernel launches counted).
          Every MoE call, logit and token is
          checked against transformers' "eager" run of the same model on the same GPU with the checks of the
          CPU tests (``tests/hf_cases.py``: tokens equal; logits bitwise equal once the door's expert outputs
          are replayed into transformers' model; each expert output within the bound derived from both
          computations' roundings, which assumes float32 accumulation: cuBLAS's reduced-precision bf16
          reductions are turned off here). Then a loopback world of 2 ranks in this process: the door
          refuses it (a model per rank needs a process per rank) and the line records the refusal, so
          several ranks on one GPU are not run by this script.
decode    A Qwen3-30B-A3B-shaped model in bfloat16: its MoE layers at full size (hidden 2048, 128 experts of
          width 768, top-8) and its attention's shapes (32 query heads, 4 KV heads of 128), 2 decoder layers
          and a 4096-token vocabulary (the rest scaled down to fit a short loan). At each batch (B sequences
          of one token, no KV cache: the attention of one position, the same in every implementation) it
          times, with CUDA events after an L2 flush (bench.common.time_us, p20/p50/p80):
            step     one model forward
            experts  the MoE layers' experts modules alone, on the inputs the model's routers gave them
          for transformers' experts_implementation "grouped_mm" (its fastest local path) and "eager", and
          for the door at world 1 on the first heap ("moe_comm": dispatch -> masked kernel -> combine, the
          rows copied locally: at world 1 the door's cost on one GPU, not expert parallelism's gain), and
          for the door with ``layer_path="fused"`` ("moe_comm-fused": one moe_comm.MoELayer per step and
          layer, on a second model with the same weights, since binding is for good). The
          floor (measured first: device copy bandwidth, bench/kernels.py) is the expert weight bytes a
          step must read, the experts that got a token in each MoE layer, at that bandwidth; the step's
          floor adds every other weight but the embedding table. Each implementation's experts output is
          compared with grouped_mm's (a sanity gate: within AGREE_REL of its largest value).

Every JSON line (OUT/hf_door.jsonl) carries device, versions and commit; in a --dry run they are labelled
as not GPU measurements (they only prove the script's logic). Exit status 1 if a check failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "tests")):   # moe_comm from this checkout; the door's checks (hf_cases)
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402

import moe_comm  # noqa: E402
from bench.common import JsonLines, environment, time_us  # noqa: E402

# (family, dtype, layer_path): layer_path "fused" runs the decode steps through moe_comm.MoELayer
GEN_CASES = (("qwen3_moe", "float32", "unfused"), ("qwen3_moe", "float32", "fused"),
             ("deepseek_v3", "bfloat16", "unfused"), ("gpt_oss", "bfloat16", "unfused"))
GEN_TOKENS = 16
DRY_GEN_CASES = (("qwen3_moe", "float32", "unfused"), ("qwen3_moe", "float32", "fused"))
DRY_GEN_TOKENS = 2
# Qwen3-30B-A3B's MoE and attention shapes; layers and vocabulary scaled down (module docstring).
QWEN3_30B_A3B = dict(hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144, num_experts=128,
                     num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     num_hidden_layers=2, vocab_size=4096, norm_topk_prob=True)
DRY_MODEL = dict(hidden_size=64, moe_intermediate_size=32, intermediate_size=64, num_experts=8,
                 num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 num_hidden_layers=1, vocab_size=96, norm_topk_prob=True)
LOCAL_IMPLS = ("grouped_mm", "eager")   # transformers' own, timed before the door binds the model
FUSED_IMPL = "moe_comm-fused"   # the door with layer_path="fused" (a second model: binding is for good)
AGREE_REL = 2.0 ** -4   # sanity gate of the decode section: |y - y_grouped_mm| <= this * max |y_grouped_mm|


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--sections", default="generate,decode")
    p.add_argument("--heaps", help="world-1 heaps (default: nvshmem where it imports, then loopback; dry: loopback)")
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], help="decode batches (GPU 1,8,64)")
    p.add_argument("--iters", type=int, help="timed calls per point (GPU 20)")
    p.add_argument("--warmup", type=int, help="untimed calls first (GPU 5)")
    p.add_argument("--timeout-s", type=float, default=30.0)
    p.add_argument("--site-after", help="a folder searched after the installed packages, if it exists (a GPU "
                                        "machine without transformers: its carried wheels, scripts/gpu_quick.py)")
    p.add_argument("--dry", action="store_true", help="CPU: tiny shapes, interpreter, one call per point")
    o = p.parse_args(argv)
    if o.site_after and os.path.isdir(o.site_after) and o.site_after not in sys.path:
        sys.path.append(o.site_after)
    cuda = torch.cuda.is_available() and not o.dry
    if not cuda and not o.dry:
        p.error("no GPU: run with --dry (the script's logic on tiny shapes)")
    o.device = torch.device("cuda") if cuda else torch.device("cpu")
    if o.heaps is None:
        import importlib.util  # noqa: PLC0415
        o.heaps = ("nvshmem," if cuda and importlib.util.find_spec("nvshmem") else "") + "loopback"
    o.heaps = o.heaps.split(",")
    o.batches = o.batches or ([1, 2] if o.dry else [1, 8, 64])
    o.iters = o.iters or (1 if o.dry else 20)
    o.warmup = o.warmup if o.warmup is not None else (0 if o.dry else 5)
    return o


def world1(heap: str, o):
    """This process's world-1 CommGroup on ``heap``, made at the first request and closed by ``main`` at the
    end (NVSHMEM is initialized once per process: every section and model shares the one group)."""
    if heap not in o.groups:
        o.groups[heap] = (moe_comm.init("loopback", world_size=1, device=o.device, timeout_s=o.timeout_s)[0]
                          if heap == "loopback" else moe_comm.init(heap, timeout_s=o.timeout_s))
    return o.groups[heap]


# ---- generate ------------------------------------------------------------------------------------

# cuBLAS settings under which transformers' GEMMs accumulate in float32, as hf_cases' bound assumes: set for
# the generate section only (the decode section times transformers with torch's defaults)
FLOAT32_ACCUMULATION = dict(allow_tf32=False, allow_bf16_reduced_precision_reduction=False,
                            allow_fp16_reduced_precision_reduction=False)


def section_generate(o, out: JsonLines) -> bool:
    import hf_cases  # noqa: PLC0415  (tests/hf_cases.py: the CPU tests' checks)
    matmul = torch.backends.cuda.matmul
    saved = {k: getattr(matmul, k) for k in FLOAT32_ACCUMULATION}
    for k, v in FLOAT32_ACCUMULATION.items():
        setattr(matmul, k, v)
    ok = True
    try:
        for heap in o.heaps:
            try:
                group = world1(heap, o)
            except Exception as e:  # noqa: BLE001  (recorded; the next heap runs)
                out.write(kind="error", section="generate", heap=heap, error=f"{type(e).__name__}: {e}")
                ok = False
                continue
            cases = DRY_GEN_CASES if o.dry else GEN_CASES
            for family, dtype, path in cases if heap == o.heaps[0] else cases[:1]:   # the families: first heap
                ok &= generate_case(hf_cases, group, heap, family, dtype, path, o, out)
    finally:
        for k, v in saved.items():
            setattr(matmul, k, v)
    return refused_loopback_world(o, out) and ok


def generate_case(hf_cases, group, heap, family, dtype, path, o, out) -> bool:
    """One tiny model through the door at world 1, checked as the CPU tests check it; one line."""
    new = DRY_GEN_TOKENS if o.dry else GEN_TOKENS
    case = hf_cases.config(family, 1, dtype, layers=1 if o.dry else 2, new_tokens=new, device=str(o.device),
                           options=dict(layer_path=path))
    head = dict(kind="generate", heap=heap, family=family, dtype=dtype, world=1, new_tokens=new, layer_path=path)
    t0 = time.perf_counter()
    try:
        res = hf_cases.rank_run(group, case)
        measured = hf_cases.check_rank(case, 0, res)
        taken = res["taken"]
        assert taken["prefill"] >= 1 and taken["decode"] >= 1 and taken["chunks"] > taken["prefill"], taken
        assert res["full_weights_freed"], "the full expert weights are still referenced after sharding"
        steps = (taken["decode"] + taken["idle"]) * res["report"].fused_layers
        assert res["fused_runs"] == dict(gate_up=steps, combine_send=steps), (res["fused_runs"], steps)
        assert (res["report"].fused_layers > 0) == (path == "fused"), res["report"]
    except Exception as e:  # noqa: BLE001  (a failed check is this line's result; the next case runs)
        out.write(**head, ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-2000:])
        print(f"generate {heap} {family} {dtype}: FAILED {type(e).__name__}: {e}", flush=True)
        return False
    kernel = "fused" if res["report"].fused_layers else "masked" if res["masked_layers"] == res["report"].layers \
        else "torch" if not res["masked_layers"] else "mixed"
    out.write(**head, ok=True, expert_kernel=kernel, tokens=res["tokens"].tolist(), moe_calls=measured["calls"],
              max_err=measured["max_err"], max_err_over_bound=measured["max_ratio"],
              logits_vs_eager=measured["logits_vs_eager"], near_ties=measured["near_ties"], steps=taken,
              seconds=time.perf_counter() - t0)
    print(f"generate {heap} {family} {dtype}: tokens equal to transformers' eager on {o.device.type}, "
          f"{kernel} experts, worst expert error {measured['max_ratio']:.2f} of its bound", flush=True)
    return True


def refused_loopback_world(o, out) -> bool:
    """A loopback world of 2 ranks in one process: the door must refuse it with its named error."""
    import moe_comm.serving.hf as hf  # noqa: PLC0415
    from moe_comm.serving.hf.tiny import tiny_model  # noqa: PLC0415
    groups = moe_comm.init("loopback", world_size=2, device=o.device, timeout_s=o.timeout_s)
    try:
        hf.shard_experts(tiny_model("qwen3_moe", layers=1).to(o.device), groups[0])
    except ValueError as e:
        out.write(kind="refused", heap="loopback", world=2, ok="one process per rank" in str(e), error=str(e))
        return "one process per rank" in str(e)
    finally:
        for g in groups:
            g.close()
    out.write(kind="refused", heap="loopback", world=2, ok=False, error="not refused: run generation there")
    return False


# ---- decode --------------------------------------------------------------------------------------

def decode_model(o):
    """The section's model, on the device, with transformers' grouped_mm experts."""
    import transformers  # noqa: PLC0415
    shape = DRY_MODEL if o.dry else QWEN3_30B_A3B
    cfg = transformers.Qwen3MoeConfig(**shape, max_position_embeddings=256, tie_word_embeddings=False,
                                      pad_token_id=0, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    with torch.device(o.device):
        model = transformers.AutoModelForCausalLM.from_config(
            cfg, dtype=torch.bfloat16, experts_implementation=LOCAL_IMPLS[0], attn_implementation="sdpa")
    return model.eval()


def experts_modules(model) -> list:
    from moe_comm.serving.hf.experts import is_experts_module  # noqa: PLC0415
    return [m for m in model.modules() if is_experts_module(m)]


def routed_inputs(model, ids) -> list[tuple]:
    """(hidden_states, top_k_index, top_k_weights) each experts module gets in one forward of ``ids``."""
    got = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: got.append(tuple(a.clone() for a in args[:3])))
             for m in experts_modules(model)]
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return got


def section_decode(o, out: JsonLines) -> bool:
    import moe_comm.serving.hf as hf  # noqa: PLC0415
    from bench.kernels import measure_floor  # noqa: PLC0415
    from moe_comm.serving.hf.experts import expert_weight_bytes  # noqa: PLC0415
    gbps, _ = measure_floor(SimpleNamespace(device=o.device, iters=o.iters, warmup=o.warmup), out)
    model = decode_model(o)
    experts = experts_modules(model)
    per_expert = expert_weight_bytes(experts[0]) // experts[0].num_experts
    embed = model.get_input_embeddings().weight
    other = sum(p.numel() * p.element_size() for p in model.parameters()) - sum(map(expert_weight_bytes, experts)) \
        - embed.numel() * embed.element_size()
    g = torch.Generator().manual_seed(1)
    ids = {b: torch.randint(1, model.config.vocab_size, (b, 1), generator=g).to(o.device) for b in o.batches}
    inputs = {b: routed_inputs(model, ids[b]) for b in o.batches}
    want = {}
    ok = True
    for impl in (*LOCAL_IMPLS, hf.IMPLEMENTATION, FUSED_IMPL):
        if impl == FUSED_IMPL:   # binding is for good: a second model (the same weights) for the fused path
            model = decode_model(o)
            experts = experts_modules(model)
        if impl in (hf.IMPLEMENTATION, FUSED_IMPL):   # the door comes last
            hf.shard_experts(model, world1(o.heaps[0], o), decode_tokens=max(o.batches),
                             prefill_tokens=max(o.batches), layer_path="fused" if impl == FUSED_IMPL else "unfused")
        else:
            model.set_experts_implementation(impl)
        for b in o.batches:
            ok &= time_point(o, out, model, experts, impl, b, ids[b], inputs[b], want, gbps, per_expert, other)
    return ok


def time_point(o, out, model, experts, impl, b, ids, inputs, want, gbps, per_expert, other) -> bool:
    """The step and the experts alone at batch ``b`` for one implementation: two lines."""
    kernel = None
    if impl in ("moe_comm", FUSED_IMPL):
        door = model._moe_comm_door
        kernel = "fused" if door.layers[0].fused else "masked" if door.masked and door.layers[0].layout.masked \
            else "torch"

    def run_experts(i=0):
        return [m(*args) for m, args in zip(experts, inputs)]

    with torch.no_grad():
        ys = run_experts()
        want.setdefault(b, ys)
        diff = max(((y.float() - w.float()).abs().max() / w.float().abs().max()).item() for y, w in zip(ys, want[b]))
        step = time_us(lambda i: model(input_ids=ids, use_cache=False), o.device, o.iters, o.warmup)
        alone = time_us(run_experts, o.device, o.iters, o.warmup)
    unique = [int(idx.unique().numel()) for _, idx, _ in inputs]
    expert_bytes = sum(unique) * per_expert
    floor_experts = expert_bytes / (gbps * 1e3)
    floor_step = (expert_bytes + other) / (gbps * 1e3)
    agrees = diff <= AGREE_REL
    head = dict(kind="result", impl=impl, batch=b, heap=o.heaps[0] if impl in ("moe_comm", FUSED_IMPL) else None,
                expert_kernel=kernel, experts_touched=unique, expert_bytes=expert_bytes, rel_diff_vs_grouped_mm=diff,
                agrees=agrees, config="qwen3-30b-a3b" if not o.dry else "tiny")
    for what, t, floor in (("step", step, floor_step), ("experts", alone, floor_experts)):
        out.write(**head, what=what, floor_us=floor, x_floor=t["p50_us"] / floor, **t)
    print(f"B={b:<3} {impl:<10} step {step['p50_us']:9.1f} us, experts {alone['p50_us']:9.1f} us "
          f"(floor {floor_experts:7.1f} us: {sum(unique)} experts' weights){'' if agrees else '  DISAGREES'}",
          flush=True)
    return agrees


def main(argv=None) -> int:
    o = parse_args(argv)
    out = JsonLines(os.path.join(o.out_dir, "hf_door.jsonl"), environment(o.device), o.dry)
    ok = True
    o.groups = {}
    try:
        for name in o.sections.split(","):
            section = dict(generate=section_generate, decode=section_decode)[name]
            try:
                ok &= section(o, out)
            except Exception as e:  # noqa: BLE001  (recorded; the next section runs)
                out.write(kind="error", section=name, error=f"{type(e).__name__}: {e}",
                          trace=traceback.format_exc()[-3000:])
                print(traceback.format_exc(), flush=True)
                ok = False
    finally:
        for group in o.groups.values():
            group.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
