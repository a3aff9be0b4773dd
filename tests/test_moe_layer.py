"""MoELayer (moe_comm/moe_layer.py) against reference.moe_layer: bit for bit on exact inputs, within the
derived bound (tests/moe_layer_cases.py) on random ones, and bit for bit against the unfused path
(dispatch + masked experts + combine) where both run the same GEMM tiles (the interpreter). The
matrix over worlds, transports and program orders is in test_moe_layer_matrix.py, the faults in
test_moe_layer_faults.py."""

import pytest
import torch

import moe_comm
from moe_comm import EPBuffer, MoELayer, reference
from moe_comm.serving.experts import masked_expert_mlp

from budget import sweep
from moe_layer_cases import (CONFIGS, PAIRS, check_ranks, exact_inputs_hold, layer_bound, layer_inputs, make_layer,
                             run_loopback_cases, run_loopback_layers, run_shm_cases)


# ---- the reference itself ----------------------------------------------------------------------------------

def _per_token(xs, idxs, ws, w13s, w2s, L):
    """y[t] = sum over k ascending of w * expert_mlp(x[t]) of the slot's expert, one token at a time."""
    out = []
    for x, idx, w in zip(xs, idxs, ws):
        y = torch.zeros(x.shape, dtype=torch.float32)
        for t in range(x.shape[0]):
            for k in range(idx.shape[1]):
                e = int(idx[t, k])
                if e >= 0:
                    row = reference.expert_mlp(x[t:t + 1], w13s[e // L][e % L], w2s[e // L][e % L])[0]
                    y[t] += float(w[t, k]) * row.float()
        out.append(y.to(x.dtype))
    return out


def test_reference_layer_is_dispatch_experts_combine():
    """On exact inputs the reference layer (dispatch, each expert's rows at once, combine) is the per-token
    formula bit for bit, at every world; the exact inputs are what they claim."""
    for world in (1, 2, 3):
        xs, idxs, ws, w13s, w2s = layer_inputs(world, [4, 0, 3][:world], 2, 64, 32, 2, world, exact=True)
        assert exact_inputs_hold(xs, w13s, w2s)
        got = reference.moe_layer(xs, idxs, ws, w13s, w2s, 2 * world, 4)
        want = _per_token(xs, idxs, ws, w13s, w2s, 2)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert any(bool((y != 0).any()) for y in got)


def _sequential_mlp(descending: bool):
    """expert_mlp with every dot product summed in a fixed order (k ascending, or descending) in float32,
    another order than the GEMM's; at least one of the two differs from any GEMM's order somewhere."""
    def dot(a, b):   # [N, K] x [M, K] -> [N, M], one float32 rounding per addition
        p = a.float()[:, None, :] * b.float()[None, :, :]
        return (p.flip(-1) if descending else p).cumsum(-1)[..., -1]

    def mlp(x, w13, w2):
        inter = w13.shape[0] // 2
        h = dot(x, w13)
        g, u = h[:, :inter], h[:, inter:]
        return dot((g * torch.sigmoid(g) * u).to(x.dtype), w2).to(x.dtype)
    return mlp


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_bound_covers_another_summation_order_and_is_not_vacuous(monkeypatch, dtype):
    """The derived bound holds between the reference and the same math summed in two other orders (left to
    right, right to left) and is small against the outputs (below 1/8 of max |y|). In float32 the orders
    must differ somewhere (in bfloat16 the final rounding hides almost every difference: a machine whose
    GEMM sums left to right gives equal outputs there)."""
    xs, idxs, ws, w13s, w2s = layer_inputs(2, [8, 7], 3, 256, 128, 2, 5, exact=False, dtype=dtype)
    ref = reference.moe_layer(xs, idxs, ws, w13s, w2s, 6, 8)
    bound = layer_bound(xs, idxs, ws, w13s, w2s, 6, 8)
    differs = []
    for descending in (False, True):
        monkeypatch.setattr(reference, "expert_mlp", _sequential_mlp(descending))
        other = reference.moe_layer(xs, idxs, ws, w13s, w2s, 6, 8)
        differs.append(any(not torch.equal(a, b) for a, b in zip(ref, other)))
        for r in range(2):
            diff = (ref[r].double() - other[r].double()).abs()
            assert bool((diff <= bound[r]).all())
            assert float(bound[r].max()) < float(ref[r].double().abs().max()) / 8
    if dtype == torch.float32:
        assert any(differs)


# ---- the fused layer ---------------------------------------------------------------------------------------

@pytest.mark.timeout(600)
@pytest.mark.parametrize("world,pairs", [(1, PAIRS), (2, PAIRS), sweep(1, None), sweep(2, None), sweep(3, None)])
def test_layer_equals_the_reference_loopback(world, pairs):
    """Configs x routings (random with -1, all to one expert, none; make test: each config and routing
    once), T in {0, 1, odd, max}, exact inputs (bit for bit) and random ones (within the derived bound),
    split in three phases."""
    groups = moe_comm.init(backend="loopback", world_size=world, device="cpu")
    assert run_loopback_cases(groups, pairs=pairs) == []


def _shm(group, pairs):
    return run_shm_cases(group, pairs=pairs)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("pairs", [((0, "random"), (2, "one_expert")), sweep(None)])
def test_layer_equals_the_reference_shm(pairs):
    """Two rank processes (phase='both', and split), out= written in place."""
    errs = moe_comm.launch(_shm, 2, pairs, backend="shm", timeout_s=120)
    assert [e for r in errs for e in r] == []


def _unfused(groups, cfg, xs, idxs, ws, w13s, w2s):
    """Our unfused path on a loopback world: EPBuffer.dispatch, the masked batched experts, EPBuffer.combine."""
    eps = [EPBuffer(g, cfg.experts_per_rank * len(groups), cfg.hidden, cfg.max_tokens, cfg.topk, dtype=cfg.dtype)
           for g in groups]
    I = cfg.inter
    for ep, x, i in zip(eps, xs, idxs):
        ep.dispatch(x, i, phase="send")
    ds = [ep.dispatch(phase="recv") for ep in eps]
    outs = [masked_expert_mlp(d.x, d.counts, w13[:, :I].transpose(1, 2), w13[:, I:].transpose(1, 2), w2.transpose(1, 2))
            for d, w13, w2 in zip(ds, w13s, w2s)]
    for ep, eo, w, d in zip(eps, outs, ws, ds):
        ep.combine(eo, w, d.handle, phase="send")
    ys = [ep.combine(phase="recv") for ep in eps]
    for ep in eps:
        ep.close()
    return ys


@pytest.mark.timeout(300)
def test_layer_equals_the_unfused_path_bit_for_bit():
    """Random inputs (where the reference allows a bound): the fused layer and dispatch + masked experts +
    combine give the same bits (the same GEMM tile, K step and combine; a row's result does not depend on
    the rows beside it in the interpreter's tl.dot), on a world of 2 and of 3."""
    cfg = CONFIGS[0]
    for world, tokens in ((2, [5, 3]),):
        groups = moe_comm.init(backend="loopback", world_size=world, device="cpu")
        xs, idxs, ws, w13s, w2s = layer_inputs(world, tokens, cfg.experts_per_rank, cfg.hidden, cfg.inter, cfg.topk,
                                               world, exact=False)
        layers = [make_layer(g, cfg, w13s[r], w2s[r]) for r, g in enumerate(groups)]
        fused = run_loopback_layers(layers, xs, idxs, ws)
        unfused = _unfused(groups, cfg, xs, idxs, ws, w13s, w2s)
        assert all(torch.equal(a, b) for a, b in zip(fused, unfused))
        assert any(bool((y != 0).any()) for y in fused)


@pytest.mark.timeout(300)
def test_switching_weights_rebuilds_no_launch_and_uses_the_new_weights(monkeypatch):
    """One layer, two weight pairs (as one shared layer serves every MoE layer of a model, the transformers
    door's fused path): calls with A, B, A each equal the reference with that call's weights bit for bit
    (exact inputs), and the launches are built once (the weights are per-call launch arguments)."""
    from moe_comm import moe_layer
    builds = []
    build = moe_layer._FusedEPBuffer._build_launches
    monkeypatch.setattr(moe_layer._FusedEPBuffer, "_build_launches", lambda ep, p: builds.append(p) or build(ep, p))
    cfg = CONFIGS[1]
    groups = moe_comm.init(backend="loopback", world_size=2, device="cpu")
    cases = [layer_inputs(2, [3, 2], cfg.experts_per_rank, cfg.hidden, cfg.inter, cfg.topk, seed, True)
             for seed in (5, 6)]
    assert not torch.equal(cases[0][3][0], cases[1][3][0])
    layers = [make_layer(g, cfg, cases[0][3][r], cases[0][4][r]) for r, g in enumerate(groups)]
    for c in (0, 1, 0):
        inputs = cases[c]
        for r, layer in enumerate(layers):
            layer.set_weights(inputs[3][r], inputs[4][r])
        ys = run_loopback_layers(layers, *inputs[:3])
        assert check_ranks(dict(enumerate(ys)), inputs, cfg, True, f"weights {c}") == []
    assert len(builds) == len(layers), "a weight switch rebuilt the launches"


# ---- memory, paths, input errors --------------------------------------------------------------------------

@pytest.mark.parametrize("hidden,inter,topk", [(7168, 2048, 8), (4096, 2048, 6)], ids=["DeepSeek-V3", "V4-Flash-like"])
@pytest.mark.parametrize("world,tokens", [(1, 128), (8, 128), (8, 512)])
def test_the_layer_needs_no_more_memory_than_dispatch_and_combine(world, tokens, hidden, inter, topk):
    """The issue's shapes (256 experts): the fused layer's buffers are at most the EPBuffer's (they are
    smaller: no d.x), and the planner's formula is what it says."""
    fused = MoELayer.required_bytes(world, 256, hidden, inter, tokens, topk)
    ep = EPBuffer.required_bytes(world, 256, hidden, tokens, topk)
    assert fused <= ep
    L, cap = 256 // world, world * tokens
    assert fused == ep - L * cap * hidden * 2 + L * cap * inter * 2 + tokens * topk * hidden * 2 + 4 * world * tokens * topk
    assert MoELayer.required_bytes(world, 256, hidden, inter, tokens, topk, path="unfused") == ep


@pytest.mark.parametrize("experts,hidden,inter,topk", [(8, 4096, 14336, 2), (128, 2048, 768, 8), (256, 7168, 2048, 8)],
                         ids=["Mixtral-8x7B", "Qwen3-30B-A3B", "DeepSeek-V3"])
@pytest.mark.parametrize("world,tokens", [(1, 1), (2, 128), (8, 512)])
def test_the_layer_needs_no_more_memory_than_the_unfused_path(experts, hidden, inter, topk, world, tokens):
    """Any width, I >= H too (Mixtral: the activations [E_local, W*M, I] are larger than the d.x they
    replace, so the layer can exceed the EPBuffer alone): the fused layer is never larger than what the
    unfused path holds at its peak, the EPBuffer plus the masked experts' activations [E_local, W*M, I]
    and outputs [E_local, W*M, H] (serving/experts.masked_bmm allocates both per call)."""
    fused = MoELayer.required_bytes(world, experts, hidden, inter, tokens, topk)
    L, cap = experts // world, world * tokens
    unfused_peak = EPBuffer.required_bytes(world, experts, hidden, tokens, topk) + L * cap * (inter + hidden) * 2
    assert fused <= unfused_peak


def _allocated_bytes(layer) -> int:
    """Bytes of every tensor the layer's buffers hold (symmetric and local): every tensor attribute of its
    EPBuffer (so a buffer added without its place in the plan is counted here, and fails the test)."""
    ep, seen, total = layer.ep, set(), 0
    tensors = [v for v in vars(ep).values() if isinstance(v, torch.Tensor)]
    for s in ep._sets:
        tensors += [s.src, s.counts, s.row_of, s.src_tokens, s.routed, s.runs, s.arrival, s.slot_key, s.id_base]
    for ch in (ep._dispatch_ch, ep._combine_ch):
        tensors += [ch.send_seq, ch.recv_seq, ch.done]
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total + ep._dispatch_ch.symmetric_bytes + ep._combine_ch.symmetric_bytes


@pytest.mark.parametrize("path", ["fused", "unfused"])
def test_buffer_bytes_counts_what_is_allocated(path):
    cfg = CONFIGS[0]
    groups = moe_comm.init(backend="loopback", world_size=2, device="cpu")
    xs, idxs, ws, w13s, w2s = layer_inputs(2, [3, 2], cfg.experts_per_rank, cfg.hidden, cfg.inter, cfg.topk, 1, True)
    layers = [MoELayer(g, 2 * cfg.experts_per_rank, cfg.hidden, cfg.inter, cfg.max_tokens, cfg.topk, w13s[r], w2s[r],
                       path=path) for r, g in enumerate(groups)]
    run_loopback_layers(layers, xs, idxs, ws)
    assert _allocated_bytes(layers[0]) == layers[0].buffer_bytes


@pytest.mark.timeout(300)
def test_the_auto_path_switches_at_the_crossover_and_both_paths_agree():
    """path="auto" runs the fused kernels up to fused_max_tokens tokens per rank and the unfused path above;
    both give the same bits (exact inputs: the reference's)."""
    cfg = CONFIGS[0]
    groups = moe_comm.init(backend="loopback", world_size=2, device="cpu")
    xs, idxs, ws, w13s, w2s = layer_inputs(2, [5, 4], cfg.experts_per_rank, cfg.hidden, cfg.inter, cfg.topk, 3, False)
    ys = {}
    for limit, path in ((5, "fused"), (4, "unfused")):
        layers = [MoELayer(g, 2 * cfg.experts_per_rank, cfg.hidden, cfg.inter, cfg.max_tokens, cfg.topk, w13s[r],
                           w2s[r], fused_max_tokens=limit) for r, g in enumerate(groups)]
        assert [layer.path for layer in layers] == [path, path]
        ys[path] = run_loopback_layers(layers, xs, idxs, ws)
    assert all(torch.equal(a, b) for a, b in zip(ys["fused"], ys["unfused"]))


def test_bad_input_raises_before_anything_is_lost():
    """Host-visible errors raise ValueError/TypeError naming the fix (world 1: nothing to abort), a phase out
    of order or after reset() raises RuntimeError, and the next call is exact."""
    cfg = CONFIGS[0]
    (g,) = moe_comm.init(backend="loopback", world_size=1, device="cpu")
    xs, idxs, ws, w13s, w2s = layer_inputs(1, [3], cfg.experts_per_rank, cfg.hidden, cfg.inter, cfg.topk, 4, True)
    with pytest.raises(TypeError, match="w13"):
        MoELayer(g, cfg.experts_per_rank, cfg.hidden, cfg.inter, cfg.max_tokens, cfg.topk, w13s[0].float(), w2s[0])
    with pytest.raises(ValueError, match="w2"):
        MoELayer(g, cfg.experts_per_rank, cfg.hidden, cfg.inter, cfg.max_tokens, cfg.topk, w13s[0], w2s[0][:, :, :8])
    with pytest.raises(ValueError, match="path"):
        MoELayer(g, cfg.experts_per_rank, cfg.hidden, cfg.inter, cfg.max_tokens, cfg.topk, w13s[0], w2s[0],
                 path="fast")
    layer = MoELayer(g, cfg.experts_per_rank, cfg.hidden, cfg.inter, cfg.max_tokens, cfg.topk, w13s[0], w2s[0])
    with pytest.raises(ValueError, match="topk_weights"):
        layer(xs[0], idxs[0], ws[0][:, :1])
    with pytest.raises(TypeError, match="topk_weights"):
        layer(xs[0], idxs[0], None)
    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        layer(torch.cat([xs[0]] * 2), torch.cat([idxs[0]] * 2), torch.cat([ws[0]] * 2))
    with pytest.raises(RuntimeError, match="phase='experts' needs a preceding phase='send'"):
        layer(phase="experts")
    with pytest.raises(ValueError, match="phase"):
        layer(xs[0], idxs[0], ws[0], phase="all")
    layer(xs[0], idxs[0], ws[0], phase="send")
    g.reset()   # drops the call in progress: its next phase needs a new send
    with pytest.raises(RuntimeError, match="phase='experts' needs a preceding phase='send'"):
        layer(phase="experts")
    y = layer(xs[0], idxs[0], ws[0])
    assert torch.equal(y, reference.moe_layer(xs, idxs, ws, w13s, w2s, cfg.experts_per_rank, cfg.max_tokens)[0])
