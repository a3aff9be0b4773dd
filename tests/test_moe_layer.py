"""MoELayer (moe_comm/moe_layer.py) against reference.moe_layer: bit for bit on exact inputs, within the
derived bound (tests/moe_layer_cases.py) on random ones, and bit for bit against the unfused path
(dispatch + masked experts + combine) where both run the same GEMM tiles (the interpreter). The
matrix over worlds, transports and program orders is in test_moe_layer_matrix.py, the faults in
test_moe_layer_faults.py."""

import pytest
import torch

import moe_comm
from moe_comm import EPBuffer, reference
from moe_comm.serving.experts import masked_expert_mlp

from moe_layer_cases import (CONFIGS, exact_inputs_hold, layer_bound, layer_inputs, make_layer, run_loopback_cases,
                             run_loopback_layers, run_shm_cases)


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
                    y[t] += float(w[t, k]) * reference.expert_mlp(x[t:t + 1], w13s[e // L][e % L], w2s[e // L][e % L])[0].float()
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


def _sequential_mlp(x, w13, w2):
    """expert_mlp with every dot product summed left to right in float32 (another order than the GEMM's)."""
    def dot(a, b):   # [N, K] x [M, K] -> [N, M], k ascending, one float32 rounding per addition
        return (a.float()[:, None, :] * b.float()[None, :, :]).cumsum(-1)[..., -1]
    inter = w13.shape[0] // 2
    h = dot(x, w13)
    g, u = h[:, :inter], h[:, inter:]
    return dot((g * torch.sigmoid(g) * u).to(x.dtype), w2).to(x.dtype)


def test_the_bound_covers_another_summation_order_and_is_not_vacuous(monkeypatch):
    """The derived bound holds between the reference and the same math summed in another order (left to
    right), which differs somewhere, and is small against the outputs (below 1/8 of max |y|)."""
    xs, idxs, ws, w13s, w2s = layer_inputs(2, [8, 7], 3, 256, 128, 2, 5, exact=False)
    ref = reference.moe_layer(xs, idxs, ws, w13s, w2s, 6, 8)
    bound = layer_bound(xs, idxs, ws, w13s, w2s, 6, 8)
    monkeypatch.setattr(reference, "expert_mlp", _sequential_mlp)
    other = reference.moe_layer(xs, idxs, ws, w13s, w2s, 6, 8)
    assert any(not torch.equal(a, b) for a, b in zip(ref, other))
    for r in range(2):
        diff = (ref[r].double() - other[r].double()).abs()
        assert bool((diff <= bound[r]).all())
        assert float(bound[r].max()) < float(ref[r].double().abs().max()) / 8


# ---- the fused layer ---------------------------------------------------------------------------------------

@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_layer_equals_the_reference_loopback(world):
    """Every config x routing (random with -1, all to one expert, none), T in {0, 1, odd, max}, exact
    inputs (bit for bit) and random ones (within the derived bound), split in three phases."""
    groups = moe_comm.init(backend="loopback", world_size=world, device="cpu")
    assert run_loopback_cases(groups) == []


@pytest.mark.timeout(300)
def test_layer_equals_the_reference_shm():
    """Two rank processes (phase='both', and split), out= written in place."""
    errs = moe_comm.launch(run_shm_cases, 2, backend="shm", timeout_s=60)
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
    for world, tokens in ((2, [5, 3]), (3, [4, 0, 5])):
        groups = moe_comm.init(backend="loopback", world_size=world, device="cpu")
        xs, idxs, ws, w13s, w2s = layer_inputs(world, tokens, cfg.experts_per_rank, cfg.hidden, cfg.inter, cfg.topk,
                                               world, exact=False)
        layers = [make_layer(g, cfg, w13s[r], w2s[r]) for r, g in enumerate(groups)]
        fused = run_loopback_layers(layers, xs, idxs, ws)
        unfused = _unfused(groups, cfg, xs, idxs, ws, w13s, w2s)
        assert all(torch.equal(a, b) for a, b in zip(fused, unfused))
        assert any(bool((y != 0).any()) for y in fused)
