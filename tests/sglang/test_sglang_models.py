"""SGLang's own model code through ``--moe-a2a-backend customized`` on CPU ranks (``make test-sglang``).

What is SGLang's own code here: its plugin loader and HookRegistry (our entry point registers the
hooks), its command-line parser, ServerArgs / RuntimeContext / distributed and model-parallel setup over a
gloo world, Qwen3-MoE's MoE block (``Qwen3MoeSparseMoeBlock``: its router, TopK, FusedMoE with its weight
loader and its CPU experts ``moe_forward_native``) and, in the engine test, its whole engine
(``sglang.Engine``: scheduler processes, model runner, KV cache, torch-native attention, sampler).
What is ours: the dispatcher, the shm heap between the rank processes, and cpu_shims' placeholders
(torchvision, sgl_kernel and one attention-backend method, which raise if a placeholder is called).
Float32 only: the derived bound below is for float32 storage.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile

import pytest
import torch

import cpu_shims

cpu_shims.install()
pytest.importorskip("sglang.srt.plugins")

import moe_comm  # noqa: E402
from moe_comm import reference  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
H, I, E, K = 64, 32, 8, 2     # hidden, expert intermediate, experts, top-k (Qwen3-MoE's SwiGLU experts)
STEPS = [[5, 3], [4, 0]]      # tokens per rank in each step: the second has an idle rank (T = 0)
MAXT = 8                      # PrefillBuffer capacity, tokens per rank per dispatch
U32 = 2.0 ** -24              # float32 unit roundoff
SILU_LIPSCHITZ = 1.1          # max |silu'(x)| = 1.0998...
SILU_ULPS = 4                 # torch's float32 silu (x * sigmoid(x)): a few roundings


def _weights(seed=0):
    """Checkpoint-format tensors (gate_proj = w1, up_proj = w3, down_proj = w2; router weight)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.1   # noqa: E731
    return dict(gate=r(E, H), w1=r(E, I, H), w3=r(E, I, H), w2=r(E, H, I))


def _tokens(step, world):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(t, H, generator=g) for t in STEPS[step][:world]]


def _config():
    from transformers import Qwen3MoeConfig
    return Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                          norm_topk_prob=True)


def _sglang_block(a2a):
    """SGLang's Qwen3-MoE MoE block, its experts loaded through FusedMoE's own weight loader (which keeps
    this rank's experts only)."""
    from sglang.srt.models.qwen3_moe import Qwen3MoeSparseMoeBlock

    block = Qwen3MoeSparseMoeBlock(layer_id=0, config=_config())
    w = _weights()
    with torch.no_grad():
        block.gate.weight.copy_(w["gate"])
        for e in range(E):
            for shard, name in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                param = block.experts.w2_weight if shard == "w2" else block.experts.w13_weight
                block.experts.weight_loader(param, w[shard][e], f"experts.{e}.{name}.weight", shard, e)
    return block


def _block_rank(group, a2a, steps):
    """One SGLang rank: the block under ``a2a``, every step of ``steps``; SGLang's own dispatcher hooks
    record what our dispatch was given, what it returned and what the experts handed to the combine."""
    import sglang_world

    sglang_world.start(group, a2a, max_tokens=MAXT)
    block = _sglang_block(a2a)
    seen = {}
    d = block.experts.dispatcher
    d.register_pre_dispatch_hook(lambda _, h, t: seen.update(x=h.clone(), ids=t.topk_ids.clone(),
                                                             w=t.topk_weights.clone()))
    d.register_post_dispatch_hook(lambda _, out: seen.update(out=out._replace()))
    d.register_pre_combine_hook(lambda _, ci: seen.update(partial=ci.hidden_states.clone()))
    results = []
    for step in steps:
        xs = _tokens(step, group.world_size)
        with torch.no_grad():
            y = block(xs[group.rank] if group.world_size > 1 else torch.cat(xs))
        results.append(dict(y=y, **seen))
    return type(d).__name__, tuple(block.experts.w13_weight.shape), results


def _reference_rank(group, world):
    """SGLang's same block without expert parallelism (``--moe-a2a-backend none``, world 1, all experts,
    its StandardDispatcher), run on each EP rank's tokens on their own (the router sees the same batch)."""
    import sglang_world

    sglang_world.start(group, "none")
    block = _sglang_block("none")
    seen = {}
    block.experts.dispatcher.register_pre_dispatch_hook(
        lambda _, h, t: seen.update(ids=t.topk_ids.clone(), w=t.topk_weights.clone()))
    out = []
    for step in range(len(STEPS)):
        per_rank = []
        for x in _tokens(step, world):
            seen.clear()
            if x.shape[0] == 0:   # SGLang's CPU experts (moe_forward_native) cannot take an empty batch
                per_rank.append(None)
                continue
            with torch.no_grad():
                y = block(x)
            per_rank.append(dict(y=y, **seen))
        out.append(per_rank)
    return type(block.experts.dispatcher).__name__, out


def _transformers_block():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    block = Qwen3MoeSparseMoeBlock(_config())
    w = _weights()
    with torch.no_grad():
        block.gate.weight.copy_(w["gate"])
        block.experts.gate_up_proj.copy_(torch.cat([w["w1"], w["w3"]], dim=1))
        block.experts.down_proj.copy_(w["w2"])
    return block


def swiglu_moe_bound(x, ids, weights, world):
    """float64 [T, H]: how far two float32 evaluations of a SwiGLU MoE layer (y = sum_k w_k W2_e (silu(W1_e
    x) * W3_e x), e = ids[:, k], the same routing) may differ when they sum dot products in different orders
    (a CPU GEMM's order depends on the batch it is given) and split the top-k sum into per-rank partial
    sums added in float32 (over ``world`` ranks). Twice the first-order forward error bound of one
    evaluation: a dot product of n terms within gamma_n |a|.|b| (gamma_n = n u / (1 - n u)), each stored
    result within u of its value, silu Lipschitz 1.1 plus a few roundings, the top-k sum of K + world
    terms within gamma_{K+world} of the sum of magnitudes."""
    w = _weights()
    gam = lambda n: n * U32 / (1 - n * U32)   # noqa: E731
    x64 = x.double()
    total = torch.zeros(x.shape, dtype=torch.float64)
    mags = torch.zeros(x.shape, dtype=torch.float64)
    for k in range(ids.shape[1]):
        e, wk = ids[:, k].long(), weights[:, k].double().abs()[:, None]
        w1, w3, w2 = w["w1"][e].double(), w["w3"][e].double(), w["w2"][e].double()   # [T, I, H], [T, H, I]
        g, up = torch.einsum("th,tih->ti", x64, w1), torch.einsum("th,tih->ti", x64, w3)
        eg = (gam(H) + U32) * torch.einsum("th,tih->ti", x64.abs(), w1.abs())
        eu = (gam(H) + U32) * torch.einsum("th,tih->ti", x64.abs(), w3.abs())
        s = torch.nn.functional.silu(g)
        es = SILU_LIPSCHITZ * eg + (1 + SILU_ULPS) * U32 * (s.abs() + SILU_LIPSCHITZ * eg)
        h = s * up
        eh = s.abs() * eu + up.abs() * es + es * eu + U32 * (s.abs() + es) * (up.abs() + eu)
        y = torch.einsum("ti,thi->th", h, w2)
        ey = (torch.einsum("ti,thi->th", eh, w2.abs())
              + (gam(I) + U32) * torch.einsum("ti,thi->th", h.abs() + eh, w2.abs()))
        total += wk * ey
        mags += wk * (y.abs() + ey)
    return 2 * (total + (gam(K + world) + 2 * U32) * mags)


def _check_our_part(ranks, step, world):
    """Exact: each rank's StandardDispatchOutput is the prefill reference's receive (rows, local ids of
    the live slots, weights; the filled slots distinct, unused ids of weight 0), and each rank's output
    is the float32 sum, in rank order, of the partial rows SGLang's experts handed to the combines."""
    rec = [r[step] for r in ranks]
    want = reference.prefill_dispatch([r["x"] for r in rec], [r["ids"] for r in rec], [r["w"] for r in rec],
                                      E, MAXT)
    partials = []
    for d, (r, wd) in enumerate(zip(rec, want)):
        out, valid = r["out"], wd["valid"]
        assert torch.equal(out.hidden_states, wd["x"][valid]), (step, d)
        ids, wts = out.topk_output.topk_ids, out.topk_output.topk_weights
        live = wd["topk_idx"][valid] >= 0
        assert ids.dtype == torch.int32 and torch.equal(ids[live], wd["topk_idx"][valid][live]), (step, d)
        assert torch.equal(wts, wd["topk_weights"][valid]), (step, d)
        assert bool((wts[~live] == 0).all()) and all(len(set(row)) == K for row in ids.tolist())
        assert bool(((ids >= 0) & (ids < E // world)).all()), (step, d)   # filled for SGLang's CPU experts
        rows = torch.zeros((world * MAXT, H))
        rows[valid] = r["partial"]
        partials.append(rows)
    for s, y in enumerate(reference.prefill_combine(partials, [r["ids"] for r in rec], E, MAXT)):
        assert torch.equal(rec[s]["y"], y), (step, s)


@pytest.mark.timeout(900)
def test_qwen3_moe_block_through_customized_backend_world2():
    """SGLang's Qwen3-MoE block on 2 shm ranks (tp = ep = 2, --moe-a2a-backend customized, its router and
    CPU experts, 4 of 8 experts per rank), two steps (5 + 3 tokens, then 4 + 0): our part exact against
    the reference, and the block's output within the derived float32 bound of SGLang's same block
    without expert parallelism and of transformers' Qwen3MoeSparseMoeBlock on the same weights (routing
    bitwise the same in all three)."""
    world = 2
    got = moe_comm.launch(_block_rank, world, "customized", list(range(len(STEPS))), backend="shm", timeout_s=240)
    assert [g[:2] for g in got] == [("MoECommStandardDispatcher", (E // world, 2 * I, H))] * world
    ranks = [g[2] for g in got]
    (ref_name, ref), = moe_comm.launch(_reference_rank, 1, world, backend="shm", timeout_s=240)
    assert ref_name == "StandardDispatcher"
    hf = _transformers_block()
    worst = largest = 0.0
    for step in range(len(STEPS)):
        _check_our_part(ranks, step, world)
        for r, x in enumerate(_tokens(step, world)):
            mine, theirs = ranks[r][step], ref[step][r]
            if x.shape[0] == 0:
                assert mine["y"].shape == (0, H)
                continue
            assert torch.equal(mine["ids"], theirs["ids"]) and torch.equal(mine["w"], theirs["w"])
            with torch.no_grad():
                _, hf_w, hf_ids = hf.gate(x)
                hf_y = hf(x[None])[0]
            assert torch.equal(hf_ids.to(torch.int32), mine["ids"]) and torch.equal(hf_w, mine["w"])
            bound = swiglu_moe_bound(x, mine["ids"], mine["w"], world)
            for other in (theirs["y"], hf_y):
                diff = (mine["y"].double() - other.double()).abs()
                assert bool((diff <= bound).all()), (step, r, float((diff / bound).max()))
                worst, largest = max(worst, float((diff / bound).max())), max(largest, float(diff.max()))
    print(f"largest |difference| / bound: {worst:.3g}, largest |difference|: {largest:.3g}")


def _cli_rank(group):
    """SGLang's own argument parser, in a process where SGLang loaded its plugins."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()
    args = prepare_server_args(["--model-path", "dummy", "--device", "cpu", "--moe-a2a-backend", "customized"])
    return args.moe_a2a_backend


@pytest.mark.timeout(300)
def test_command_line_accepts_customized():
    """SGLang 0.5.23's parser lists every a2a backend but ``customized``; with moe-comm installed its
    --moe-a2a-backend takes it (the plugin's hook on ServerArgs.add_cli_args)."""
    assert moe_comm.launch(_cli_rank, 1, backend="shm", timeout_s=120) == ["customized"]


def _save_tiny_model(path):
    """A tiny random Qwen3-MoE checkpoint (config and safetensors, no download) and its greedy outputs
    from transformers' own model."""
    import engine_run
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=256, hidden_size=H, intermediate_size=2 * H, moe_intermediate_size=I,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=E, num_experts_per_tok=K, norm_topk_prob=True, max_position_embeddings=256,
                            tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).eval()
    model.save_pretrained(path)
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=engine_run.NEW_TOKENS, do_sample=False)[0, len(p):]
                .tolist() for p in engine_run.PROMPTS]


def _run_engine(model_dir, a2a, tp, timeout_s):
    """engine_run.py in its own process group (SGLang's engine starts several processes: a timeout ends
    them all); returns (output ids per prompt, the log)."""
    out = os.path.join(model_dir, "out.json")
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", SGLANG_CPU_OMP_THREADS_BIND="|".join(map(str, range(tp))),
               PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    env = {k: v for k, v in env.items() if not k.startswith("MOE_COMM_SGLANG")}
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "engine_run.py"), model_dir, out, a2a, str(tp)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"SGLang's engine did not finish in {timeout_s} s:\n{log[-4000:]}")
    assert proc.returncode == 0, log[-6000:]
    with open(out) as f:
        return json.load(f), log


@pytest.mark.timeout(900)
def test_engine_customized_world2_generates_transformers_tokens():
    """A live SGLang engine, tp = ep = 2 on two CPU ranks, --moe-a2a-backend customized: every MoE layer's
    dispatch and combine through moe-comm (both scheduler processes log building our dispatcher);
    each prompt's 8 greedy tokens equal transformers' own generation from the same checkpoint."""
    with tempfile.TemporaryDirectory() as tmp:
        want = _save_tiny_model(tmp)
        got, log = _run_engine(tmp, "customized", 2, timeout_s=780)
    assert got == want, (got, want)
    for rank in range(2):
        assert f"TP{rank} EP{rank}] moe-comm: SGLang MoE layers get MoECommStandardDispatcher (rank {rank} of 2)" \
            in log, log[-3000:]
