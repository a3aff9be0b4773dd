"""The transformers door's test cases: tiny random models of each family generate on moe-comm ranks, and
every MoE call, every logit and every token is checked against transformers' own code in this process.

A rank (``rank_run``) records every MoE call of its own forwards: the experts module's inputs
(hidden_states, top_k_index, top_k_weights, exactly as the model passed them) and the door's output.
``check_rank`` then runs transformers' "eager" generation of the rank's prompts here three ways:

1. Plain: its tokens must equal the rank's, except from a step where transformers' own top two logits tie
   to within TIE_ULPS units in the last place (fp8 dispatch excepted: a lossy transfer may change a choice).
2. Replayed: each experts module's output is replaced by the door's recorded output for the same call. The
   inputs each call gets must equal the recorded ones bitwise, and the logits must equal the rank's
   bitwise: everything outside the experts (attention over the rank's own sequences, shared experts, the
   router, padding) is transformers' code on the same inputs, so the door changed nothing but the experts'
   outputs.
3. In the same replay, each recorded output is compared with transformers' eager experts output on the same
   inputs (all experts, this process) within the bound below, element by element.

Bound (``moe_bound``): the door and transformers compute the same expression y = sum_k w_k * f_k(x) with
different roundings and summation orders (the door: expert GEMMs batched over ranks' rows, float32
accumulation, the combine summing in float32 in k order (EPBuffer) or the ranks' partial rows in rank
order (PrefillBuffer); transformers: per-expert F.linear, index_add_ in the model's dtype in expert
order). With u the unit roundoff of the dtype (2**-24 float32, 2**-8 bfloat16), float32 accumulation of n
products within gamma_n * sum|products| (gamma_n = n*2**-24 / (1 - n*2**-24)), each computes, to first
order in u, within e_y of the exact value:
    p = W1 x + b1                 e_p = (gamma_H + u) (|W1||x| + |b1|)  [+ |W1| |x8 - x| with an fp8 dispatch]
    h = gate(p)                   e_h = |dh/dp| e_p + c u (|h| + |dh/dp| |p|)   (c = 6 roundings inside a gate)
    o = W2 h + b2                 e_o = |W2| e_h + (gamma_I + u) (|W2||h| + |b2|)
    y = sum_k w_k o_k             e_y = sum_k |w_k| e_o,k + (gamma_K + (K + 2) u) sum_k |w_k o_k|
((K + 2) u: the products w_k o_k rounded to the dtype, transformers rounding each partial sum to the dtype,
the PrefillBuffer's partial rows rounded to the dtype per rank, and the final cast.) So |y_door - y_eager|
<= 2 e_y, computed in float64 from the call's own values and the full weights. |dh/dp| is the gate's
exact derivative at p (autograd; every gate here maps each input to one output).
"""

from __future__ import annotations

import sys
import weakref

import torch

import hf_fp8
from moe_comm import moe_layer
from moe_comm.reference import dequantize_fp8, quantize_fp8
from moe_comm.serving.hf import generate as gen
from moe_comm.serving.hf.experts import layout_of
from moe_comm.serving.hf.tiny import tiny_model

UNIT = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8}
U32 = 2.0 ** -24          # float32 accumulation (torch's CPU GEMMs and the door's kernels accumulate in float32)
TIE_ULPS = 2              # a different token is accepted only where transformers' top two logits are this close
GATE_ROUNDINGS = 6        # roundings inside the gates covered (gpt-oss: clamp, alpha * g, sigmoid, product, +1, product)


def gamma(n: int) -> float:
    return n * U32 / (1 - n * U32)


def config(family: str, world: int, dtype: str = "float32", layers: int = 2, new_tokens: int = 16,
           options: dict | None = None, seed: int = 0, hidden: int = 64, idle_rank: int | None = None,
           device: str = "cpu", intermediate: int | None = None, fp8: dict | None = None) -> dict:
    """One case. Experts: 8, or 6 at world 3 (a world must divide them). decode_tokens 4 and prefill_tokens
    4 unless ``options`` say otherwise: prompts (up to 2 x 6 tokens on a rank) go through the PrefillBuffer
    in several chunks, the decode steps (1-2 tokens per rank) through the EPBuffer. ``idle_rank``: a rank
    with no prompts (it takes part in every step through ``finish``). ``device``: where the models run
    (the rank's group's device; transformers' reference runs there too). ``fp8``: the experts as an fp8
    checkpoint's (``hf_fp8.fp8_model``: dict(scale_fmt, quantizer)): the ranks run transformers' FP8Experts,
    the reference transformers' eager experts on the weights its CPU load dequantizes."""
    opts = dict(decode_tokens=4, prefill_tokens=4)
    opts.update(options or {})
    return dict(family=family, world=world, dtype=dtype, layers=layers, new_tokens=new_tokens, options=opts,
                seed=seed, idle_rank=idle_rank, device=device, fp8=fp8,
                model=dict(layers=layers, experts=6 if world % 3 == 0 else 8, hidden=hidden, intermediate=intermediate))


def build(case: dict, impl: str = "eager"):
    """The case's model (the same random weights in every process), on the case's device; an fp8 case's
    "eager" model is transformers' CPU computation of its checkpoint (``hf_fp8.fp8_model``)."""
    model = tiny_model(case["family"], gen.DTYPES[case["dtype"]], case["seed"], experts_implementation=impl,
                       **case["model"])
    if case.get("fp8"):
        model = hf_fp8.fp8_model(model, case["fp8"], case["seed"], eager_reference=impl == "eager")
    return model.to(case["device"])


def prompts(case: dict, rank: int) -> list[list[int]]:
    return [] if rank == case["idle_rank"] else gen.prompts_for(rank, case["world"], case["seed"])


def rank_run(group, case: dict) -> dict:
    """One rank: bind, generate this rank's prompts with every MoE call recorded, finish."""
    preloaded = "transformers.generation.utils" in sys.modules   # by the fork server (group.PRELOAD_IF_IMPORTED)
    import moe_comm.serving.hf as hf  # noqa: PLC0415
    from moe_comm.serving.hf import door as door_mod  # noqa: PLC0415
    torch.set_num_threads(1)
    model = build(case, "moe_comm")
    full = [weakref.ref(p) for m in model.modules() if type(m).__name__.endswith("Experts")
            for p in m.parameters(recurse=False)]
    report = hf.shard_experts(model, group, **case["options"])   # the full weights: freed by refcount, no gc
    calls, call_steps = [], []
    run_layer = door_mod.run_layer

    def recording(layer, x, idx, w):
        y = run_layer(layer, x, idx, w)
        if x.shape[0]:
            calls.append((x.clone(), idx.clone(), w.clone(), y.clone()))
            call_steps.append((layer.door.steps - 1, layer.index, layer.door.plan.prefill))
        return y

    door_mod.run_layer = recording
    fused_runs, own_build = _count_fused_launches()
    try:
        mine = prompts(case, group.rank)
        tokens = logits = None
        if mine:
            tokens, logits = gen.generate(model, mine, case["new_tokens"])
        hf.finish(model)
    finally:
        door_mod.run_layer = run_layer
        moe_layer._FusedEPBuffer._build_launches = own_build
    door = model._moe_comm_door
    return dict(tokens=tokens, logits=logits, calls=calls, call_steps=call_steps, report=report, taken=dict(door.taken),
                masked_layers=sum(door.masked and layer.layout.masked for layer in door.layers),   # Triton kernel
                fused_runs=fused_runs, shared_moe_layers=len(door.fused_layers),
                full_weights_freed=all(r() is None for r in full), preloaded=preloaded)


def _count_fused_launches():
    """Count this process's launches of the fused kernels (MoELayer's gate/up and down + combine) from here on:
    ({kernel: launches}, the original ``_FusedEPBuffer._build_launches`` to put back)."""
    runs = dict(gate_up=0, combine_send=0)
    build = moe_layer._FusedEPBuffer._build_launches

    def counting(ep, plan):
        sets = build(ep, plan)
        for launches in sets if ep.fused else ():
            for name in runs:
                launches[name].run = _counted(launches[name].run, runs, name)
        return sets

    moe_layer._FusedEPBuffer._build_launches = counting
    return runs, build


def _counted(run, runs: dict, name: str):
    def counted(**args):
        runs[name] += 1
        return run(**args)
    return counted


def check_rank(case: dict, rank: int, res: dict) -> dict:
    """Checks 1-3 of the module docstring for one rank's result; returns what was measured."""
    mine = prompts(case, rank)
    if not mine:
        assert res["tokens"] is None and not res["calls"], f"rank {rank} had no prompts but made MoE calls"
        return dict(calls=0)
    torch.set_num_threads(1)
    fmt = case["options"].get("dispatch_format")
    model = build(case)
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    calls = iter(res["calls"])
    worst = dict(calls=0, max_err=0.0, max_ratio=0.0)

    def replay(module, args, kwargs, out):
        x, idx, w = (list(args) + list(kwargs.values()))[:3]
        rx, ridx, rw, ry = next(calls)
        assert torch.equal(x, rx) and torch.equal(idx, ridx) and torch.equal(w, rw), (
            f"rank {rank}: MoE call {worst['calls']} got other inputs than the rank's")
        bound = moe_bound(module, x, idx, w, fmt)
        err = (ry.double() - out.double()).abs()
        over = err > bound
        assert not over.any(), (f"rank {rank}: MoE call {worst['calls']}: door output differs from transformers' "
                                f"eager by {err[over].max().item():.3g} where the bound is "
                                f"{bound[over][err[over].argmax()].item():.3g} ({int(over.sum())} elements over)")
        worst["calls"] += 1
        worst["max_err"] = max(worst["max_err"], err.max().item())
        worst["max_ratio"] = max(worst["max_ratio"], (err / bound.clamp_min(1e-300)).max().item())
        return ry

    hooks = [m.register_forward_hook(replay, with_kwargs=True) for m in experts]
    try:
        tokens, logits = gen.generate(model, mine, case["new_tokens"])
    finally:
        for h in hooks:
            h.remove()
    assert next(calls, None) is None, f"rank {rank}: the rank made more MoE calls than transformers' replay"
    assert torch.equal(tokens, res["tokens"]) and torch.equal(logits, res["logits"]), (
        f"rank {rank}: with the door's expert outputs replayed, transformers' logits differ from the rank's by "
        f"{(logits - res['logits']).abs().max().item():.3g}: something outside the experts changed")
    want_tokens, want_logits = gen.generate(model, mine, case["new_tokens"])   # the same model, hooks removed
    worst["logits_vs_eager"] = (res["logits"] - want_logits).abs().max().item()
    worst["near_ties"] = [] if fmt else _same_tokens(rank, gen.DTYPES[case["dtype"]], res["tokens"], want_tokens,
                                                            want_logits)
    return worst


def _same_tokens(rank, dtype, tokens, want_tokens, want_logits) -> list:
    """Check 1: every row's tokens equal transformers', except from a step where transformers' own top two
    logits tie to within TIE_ULPS units in the last place of the logits' dtype (a bfloat16 logit near 4 is a
    multiple of 2**-5: exact ties happen, and a difference of one rounding breaks them either way; the
    difference itself is accounted for by checks 2 and 3). Returns those (row, step)."""
    ties = []
    for b in range(tokens.shape[0]):
        for s in range(tokens.shape[1]):
            got, want = int(tokens[b, s]), int(want_tokens[b, s])
            if got == want:
                continue
            margin = (want_logits[s, b, want] - want_logits[s, b, got]).item()
            ulp = torch.finfo(dtype).eps * 2.0 ** torch.frexp(want_logits[s, b].abs().max()).exponent.item() / 2
            assert margin <= TIE_ULPS * ulp, (
                f"rank {rank}: prompt {b} step {s}: token {got} != transformers' {want}, and transformers' logits "
                f"put {want} {margin:.3g} above {got}, more than {TIE_ULPS} units in the last place ({ulp:.3g}): "
                f"not a tie")
            ties.append((b, s))
            break   # the sequences differ from here: the replay compared the rest
    return ties


def moe_bound(module, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, fmt: str | None) -> torch.Tensor:
    """2 e_y of the module docstring, [T, H] float64, for one call of ``module`` (all experts present)."""
    lay = layout_of(module)
    u, K = UNIT[lay.dtype], idx.shape[1]
    x64 = x.double()
    ex = (dequantize_fp8(*quantize_fp8(x.float(), fmt=fmt)).double() - x64).abs() if fmt else torch.zeros_like(x64)
    mag = torch.zeros_like(x64)
    err = torch.zeros_like(x64)
    for k in range(K):
        o, e_o = _expert_bound(module, lay, idx[:, k], x64, ex, u)
        wk = w[:, k, None].double().abs()
        err += wk * e_o
        mag += wk * o.abs()
    return 2 * (err + (gamma(K) + (K + 2) * u) * mag)


def _weights(module, lay, name: str, ids: torch.Tensor) -> torch.Tensor:
    """The weights ``name`` of each row's expert in float64, as [n, out, in]."""
    wt = getattr(module, name).detach()[ids].double()
    return wt.transpose(1, 2) if lay.transposed else wt


def _expert_bound(module, lay, ids, x, ex, u):
    up = "gate_up_proj" if lay.has_gate else "up_proj"
    W1, W2 = _weights(module, lay, up, ids), _weights(module, lay, "down_proj", ids)
    b1 = getattr(module, up + "_bias").detach()[ids].double() if lay.has_bias else torch.zeros(1, dtype=x.dtype, device=x.device)
    b2 = module.down_proj_bias.detach()[ids].double() if lay.has_bias else torch.zeros(1, dtype=x.dtype, device=x.device)
    mv = lambda W, v: torch.einsum("noi,ni->no", W, v)   # noqa: E731
    p = mv(W1, x) + b1
    e_p = (gamma(lay.hidden) + u) * (mv(W1.abs(), x.abs()) + b1.abs()) + mv(W1.abs(), ex)
    gate = (lambda q: module._apply_gate(q)) if lay.has_gate else (lambda q: module.act_fn(q))
    with torch.enable_grad():   # (generate runs under no_grad)
        pq = p.clone().requires_grad_(True)
        h = gate(pq)
        (g,) = torch.autograd.grad(h.sum(), pq)
    h = h.detach()
    s = torch.sign(g)
    jabs = lambda v: torch.func.jvp(gate, (p,), (s * v,))[1]   # noqa: E731  (|dh/dp| v: one input per output)
    e_h = jabs(e_p) + GATE_ROUNDINGS * u * (h.abs() + jabs(p.abs()))
    o = mv(W2, h) + b2
    e_o = mv(W2.abs(), e_h) + (gamma(lay.intermediate) + u) * (mv(W2.abs(), h.abs()) + b2.abs())
    return o, e_o

