"""MoELayer compiled on a GPU (loopback worlds 2 and 3 on one device), against ``reference.moe_layer``: bit for
bit on exact inputs (every product and partial sum exact, so tl.dot's order cannot change a bit; see
tests/moe_layer_cases.py), within the derived bound on random ones, equal to the unfused path, and a
CUDA-graph capture replayed with new routing. Skipped without CUDA (conftest). Not yet run on a GPU."""

import pytest
import torch

import moe_comm

from moe_layer_cases import CONFIGS, FP8_CONFIGS, check_ranks, layer_inputs, run_loopback_layers

pytestmark = pytest.mark.gpu
DEV = "cuda:0"


def _to(dev, tensors):
    return [t.to(dev) for t in tensors]


def _layers(groups, cfg, w13s, w2s, path="fused"):
    return [moe_comm.MoELayer(g, cfg.experts_per_rank * len(groups), cfg.hidden, cfg.inter, cfg.max_tokens,
                              cfg.topk, w13s[r].to(DEV), w2s[r].to(DEV), dtype=cfg.dtype, path=path)
            for r, g in enumerate(groups)]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("exact", [True, False])
def test_layer_compiled_equals_the_reference_and_the_unfused_path(world, exact):
    cfg = CONFIGS[0]
    groups = moe_comm.init(backend="loopback", world_size=world, device=DEV, timeout_s=10)
    inputs = layer_inputs(world, [cfg.max_tokens, 0, 3][:world], cfg.experts_per_rank, cfg.hidden, cfg.inter,
                          cfg.topk, 7, exact)
    xs, idxs, ws = (_to(DEV, t) for t in inputs[:3])
    ys = {}
    for path in ("fused", "unfused"):
        ys[path] = [y.cpu() for y in run_loopback_layers(_layers(groups, cfg, *inputs[3:], path), xs, idxs, ws)]
    torch.cuda.synchronize()
    for g in groups:
        g.check()
    assert check_ranks(dict(enumerate(ys["fused"])), inputs, cfg, exact, f"W{world} exact={exact}") == []
    # The same GEMM tile and K step: a row's bits do not depend on the rows beside it (recorded if not)
    assert all(torch.equal(a, b) for a, b in zip(ys["fused"], ys["unfused"]))


def test_cuda_graph_replay_with_new_routing():
    cfg, world = CONFIGS[0], 2
    groups = moe_comm.init(backend="loopback", world_size=world, device=DEV, timeout_s=10)
    inputs = layer_inputs(world, [cfg.max_tokens] * world, cfg.experts_per_rank, cfg.hidden, cfg.inter, cfg.topk,
                          1, True)
    layers = _layers(groups, cfg, *inputs[3:])
    xs, idxs, ws = (_to(DEV, t) for t in inputs[:3])
    outs = [torch.empty_like(x) for x in xs]
    run_loopback_layers(layers, xs, idxs, ws, outs)   # allocates and compiles, outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_loopback_layers(layers, xs, idxs, ws, outs)
    for seed in range(2, 8):
        new = layer_inputs(world, [cfg.max_tokens] * world, cfg.experts_per_rank, cfg.hidden, cfg.inter, cfg.topk,
                           seed, True)
        for r in range(world):
            xs[r].copy_(new[0][r])
            idxs[r].copy_(new[1][r])
            ws[r].copy_(new[2][r])
            outs[r].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for g in groups:
            g.check()
        want = (new[0], new[1], new[2], inputs[3], inputs[4])   # the weights stay those of the capture
        assert check_ranks({r: outs[r].cpu() for r in range(world)}, want, cfg, True, f"replay {seed}") == []


@pytest.mark.parametrize("exact", [True, False])
def test_fp8_weights_compiled_equal_the_layer_on_dequantized_weights(exact):
    """fp8 e4m3 weights with 128x128 block scales (sizes not multiples of 128), world 2: against the reference
    on the dequantized weights (bit for bit on exact inputs, within the bound on random ones) and bit for bit
    against the bf16 fused layer given those dequantized weights (the tile dequantized in registers is the
    same values, so tl.dot gets the same operands)."""
    cfg, world = FP8_CONFIGS[0], 2
    groups = moe_comm.init(backend="loopback", world_size=world, device=DEV, timeout_s=10)
    inputs = layer_inputs(world, [cfg.max_tokens, 3], cfg.experts_per_rank, cfg.hidden, cfg.inter, cfg.topk, 9,
                          exact, fp8=True)
    xs, idxs, ws = (_to(DEV, t) for t in inputs[:3])
    fp8 = [moe_comm.MoELayer(g, cfg.experts_per_rank * world, cfg.hidden, cfg.inter, cfg.max_tokens, cfg.topk,
                             **{k: v.to(DEV) for k, v in inputs.fp8[r].items()}) for r, g in enumerate(groups)]
    got = [y.cpu() for y in run_loopback_layers(fp8, xs, idxs, ws)]
    plain = [y.cpu() for y in run_loopback_layers(_layers(groups, cfg, *inputs[3:]), xs, idxs, ws)]
    torch.cuda.synchronize()
    for g in groups:
        g.check()
    assert check_ranks(dict(enumerate(got)), inputs, cfg, exact, f"fp8 weights exact={exact}") == []
    assert all(torch.equal(a, b) for a, b in zip(got, plain))
