"""MoELayer with fp8 e4m3 expert weights and DeepSeek-V3's 128x128 block scales (w13_scale, w2_scale).

The contract: the layer computes exactly as with the dequantized weights ``reference.dequantize_fp8_weight``
((fp8.float() * scale).to(dtype), one rounding), since its kernels dequantize each weight tile so before
tl.dot. So: against ``reference.moe_layer`` on those weights bit for bit on exact inputs (power-of-two
scales) and within the derived bound on random ones (scales drawn per block, all different, so a scale
read from another block shows); and against the bf16 layer given the dequantized weights bit for bit on
random inputs (the same GEMM tile on the same values). Sizes that are not multiples of 128 (the last
scale blocks shorter; w13's gate and up halves each in their own blocks, as checkpoints hold them). Worlds 1 and 2 (loopback and rank
processes) in make test; more worlds, 2x2 emulated nodes, puts and program orders under ``sweep``.
What the emulations can show is in test_moe_layer_matrix.py's docstring."""

import pytest
import torch

import moe_comm
from moe_comm import MoELayer, reference
from moe_comm.heap.shm import RANKS_PER_NODE_ENV
from moe_comm.interpret_order import ORDER_ENV, SEED_ENV
from moe_comm.planner import FP8_WEIGHT_BLOCK, SHAPES_ENV

from budget import sweep
from moe_layer_cases import (FP8_CONFIGS, LayerConfig, fp8_block_quantize, layer_inputs, make_layer,
                             run_loopback_cases, run_loopback_layers, run_shm_cases)

# make test's representatives: each config, each routing once (random with -1 ids, all to one expert,
# nothing routed), exact and random inputs; T = 0, 1, odd and max over the ranks (moe_layer_cases).
PAIRS = ((0, "random"), (0, "one_expert"), (1, "none"), (1, "random"))


def test_dequantized_weight_is_each_block_times_its_scale():
    """reference.dequantize_fp8_weight against the definition written block by block, on sizes that are not
    multiples of the block (the last blocks shorter), and the one rounding to the dtype."""
    g = torch.Generator().manual_seed(3)
    N, K = 2 * FP8_WEIGHT_BLOCK + 5, FP8_WEIGHT_BLOCK + 24
    w = (torch.randn(2, N, K, generator=g) * 40).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 3, 2, generator=g) + 0.01
    want = torch.empty(2, N, K)
    for i in range(3):
        for j in range(2):
            rows, cols = slice(i * FP8_WEIGHT_BLOCK, (i + 1) * FP8_WEIGHT_BLOCK), slice(j * FP8_WEIGHT_BLOCK, (j + 1) * FP8_WEIGHT_BLOCK)
            want[:, rows, cols] = w[:, rows, cols].float() * scale[:, i, j, None, None]
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert torch.equal(reference.dequantize_fp8_weight(w, scale, dtype), want.to(dtype))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world,pairs", [(1, PAIRS), (2, PAIRS), sweep(3, None), sweep(2, None)])
def test_fp8_layer_equals_the_reference_loopback(world, pairs):
    groups = moe_comm.init(backend="loopback", world_size=world, device="cpu")
    assert run_loopback_cases(groups, pairs=pairs, table=FP8_CONFIGS) == []


def _shm(group, pairs):
    return run_shm_cases(group, pairs=pairs, table=FP8_CONFIGS)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world,pairs", [(2, ((0, "random"), (1, "one_expert"))), sweep(3, None), sweep(4, None)])
def test_fp8_layer_equals_the_reference_shm(world, pairs):
    """Rank processes (phase='both' and split, out= in place)."""
    errs = moe_comm.launch(_shm, world, pairs, backend="shm", timeout_s=180)
    assert [e for r in errs for e in r] == []


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cfg", FP8_CONFIGS, ids=["bf16", "fp16"])
def test_fp8_layer_equals_the_layer_on_dequantized_weights_bit_for_bit(cfg):
    """Random inputs and scales: the fp8 layer gives the bits of the layer in the dtype given
    reference.dequantize_fp8_weight's weights, world 2 (every expert routed, rows from both ranks)."""
    groups = moe_comm.init(backend="loopback", world_size=2, device="cpu")
    inputs = layer_inputs(2, [cfg.max_tokens, 3], cfg.experts_per_rank, cfg.hidden, cfg.inter, cfg.topk, 21,
                          exact=False, dtype=cfg.dtype, fp8=True)
    xs, idxs, ws, w13s, w2s = inputs
    fp8 = [make_layer(g, cfg, **inputs.fp8[r]) for r, g in enumerate(groups)]
    plain = [make_layer(g, cfg, w13s[r], w2s[r]) for r, g in enumerate(groups)]
    assert [layer.fp8_weights for layer in fp8 + plain] == [True, True, False, False]
    got, want = run_loopback_layers(fp8, xs, idxs, ws), run_loopback_layers(plain, xs, idxs, ws)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(bool((y != 0).any()) for y in got)


# I > 128: w2's K (the intermediate size) spans two scale blocks, the second 8 wide, and its rows (hidden 136)
# two more; w13's gate and up halves two block rows each. FP8_CONFIGS have I < 128 (one k-block of w2), so an
# expert stride or k-block of w2's scales read wrong shows only here.
WIDE_I = LayerConfig(2, 136, 136, 2, 3, fp8=True)


@pytest.mark.timeout(600)
def test_fp8_w2_scales_over_several_k_blocks():
    """World 2 (every expert with rows), exact and random inputs: equal to the reference on the dequantized
    weights (one layer, set_weights with the next case's fp8 weights and scales between calls)."""
    groups = moe_comm.init(backend="loopback", world_size=2, device="cpu")
    assert run_loopback_cases(groups, table=(WIDE_I,), routings=("random", "one_expert")) == []


@pytest.mark.timeout(900)
@pytest.mark.parametrize("order,seed,world", [sweep("reverse", 0, 2), sweep("random", 1, 3)])
def test_fp8_program_orders_with_gpu_shapes(monkeypatch, order, seed, world):
    """The GPU launch shapes (16-row tiles, 64-column blocks: a column block of w13's up half spans two
    scale blocks) with each launch's programs in reverse or random order."""
    monkeypatch.setenv(ORDER_ENV, order)
    monkeypatch.setenv(SEED_ENV, str(seed))
    monkeypatch.setenv(SHAPES_ENV, "gpu")
    deep = (LayerConfig(2, 192, 80, 2, 16, fp8=True),)   # 3 + 16 tokens all to expert 0: more rows than a tile
    assert run_loopback_cases(moe_comm.init(backend="loopback", world_size=world, device="cpu"),
                              routings=("one_expert", "random"), table=deep) == []


@pytest.mark.timeout(900)
@pytest.mark.parametrize("transport", [sweep("put"), sweep("nodes")])
def test_fp8_puts_and_emulated_nodes(monkeypatch, transport):
    """Every peer over puts (loopback, world 2), or 2x2 emulated nodes (stores within, puts across)."""
    if transport == "put":
        monkeypatch.setenv("MOE_COMM_TRANSPORT", "put")
        assert run_loopback_cases(moe_comm.init(backend="loopback", world_size=2, device="cpu"),
                                  table=FP8_CONFIGS, pairs=PAIRS) == []
        return
    monkeypatch.setenv(RANKS_PER_NODE_ENV, "2")
    monkeypatch.delenv("MOE_COMM_TRANSPORT", raising=False)
    errs = moe_comm.launch(_shm, 4, ((0, "random"), (1, "one_expert")), backend="shm", timeout_s=240)
    assert [e for r in errs for e in r] == []


# ---- input errors, paths, bytes ----------------------------------------------------------------------------

def test_bad_fp8_weights_raise_naming_the_fix_and_the_next_call_is_exact():
    cfg = FP8_CONFIGS[0]
    (g,) = moe_comm.init(backend="loopback", world_size=1, device="cpu")
    inputs = layer_inputs(1, [4], cfg.experts_per_rank, cfg.hidden, cfg.inter, cfg.topk, 5, exact=True, fp8=True)
    xs, idxs, ws, w13s, w2s = inputs
    q = inputs.fp8[0]
    E, H, I, M, K = cfg.experts_per_rank, cfg.hidden, cfg.inter, cfg.max_tokens, cfg.topk

    def build(**kw):
        return MoELayer(g, E, H, I, M, K, **dict(q, **kw))
    with pytest.raises(TypeError, match="w13_scale is missing"):
        build(w13_scale=None)
    with pytest.raises(ValueError, match="w2_scale"):                   # w2's grid is [L, 2, 1]: [L, 1, 2] refused
        build(w2_scale=q["w2_scale"].transpose(1, 2).contiguous())
    with pytest.raises(TypeError, match="w2_scale.*float32"):
        build(w2_scale=q["w2_scale"].to(torch.bfloat16))
    with pytest.raises(ValueError, match="w13_scale must be contiguous"):
        build(w13_scale=q["w13_scale"].transpose(1, 2).contiguous().transpose(1, 2))
    with pytest.raises(TypeError, match="w2.*float8_e4m3fn"):
        build(w2=w2s[0])
    with pytest.raises(TypeError, match="w13_scale/w2_scale given"):
        MoELayer(g, E, H, I, M, K, w13s[0], w2s[0]).set_weights(w13s[0], w2s[0], q["w13_scale"], q["w2_scale"])
    with pytest.raises(ValueError, match="fused path only: pass path='fused'"):
        build(path="unfused")
    layer = build(fused_max_tokens=1)   # auto: the fp8 weights run fused whatever the tokens
    assert layer.path == "fused" and layer.fp8_weights
    with pytest.raises(TypeError, match="w13_scale is missing"):
        layer.set_weights(q["w13"], q["w2"])
    y = layer(xs[0], idxs[0], ws[0])   # the layer kept its weights: exact
    assert torch.equal(y, reference.moe_layer(xs, idxs, ws, w13s, w2s, E, M)[0])


def test_weight_bytes_halve_with_fp8_plus_the_scales():
    """DeepSeek-V3 EP8 (32 local experts, hidden 7168, I 2048): bf16 2.63 GiB, fp8 half of it plus one
    float32 per 128x128 block (32 * (32 * 56 + 56 * 16) * 4 bytes)."""
    bf16 = MoELayer.weight_bytes(32, 7168, 2048)
    fp8 = MoELayer.weight_bytes(32, 7168, 2048, fp8=True)
    assert bf16 == 32 * 3 * 2048 * 7168 * 2
    assert fp8 == bf16 // 2 + 32 * (32 * 56 + 56 * 16) * 4
    assert MoELayer.weight_bytes(1, 192, 80, fp8=True) == 3 * 192 * 80 + (2 * 2 + 2 * 1) * 4   # ceil per grid


def test_fp8_w13_scales_as_checkpoints_hold_them_with_i_not_a_multiple_of_128():
    """DeepSeek-V3's checkpoints quantize gate_proj (w1) and up_proj (w3) separately, each in its own 128 x 128
    blocks; vLLM's and SGLang's fused w13_weight_scale_inv is [E, 2 * ceil(I / 128), ceil(H / 128)]: w1's block
    rows, then w3's; the layer takes that layout. At I = 80, bit for bit against the layer given the dequantized
    weights. (When the layer read w13_scale as [E, ceil(2I / 128), ...] over the concatenated rows, up rows
    80..127 took gate's scale here, silently: the shapes agree at I = 80.)"""
    E, H, I, M, K = 2, 64, 80, 4, 2
    (g,) = moe_comm.init(backend="loopback", world_size=1, device="cpu")
    inputs = layer_inputs(1, [M], E, H, I, K, 7, exact=False)
    xs, idxs, ws, w13s, w2s = inputs
    gate, up = w13s[0][:, :I], w13s[0][:, I:] * 7   # up's blocks with other scales than gate's
    g13 = torch.Generator().manual_seed(8)
    (q1, s1), (q3, s3), (q2, s2) = (fp8_block_quantize(w, g13, False) for w in (gate, up, w2s[0]))
    w13q, w13_scale = torch.cat([q1, q3], 1).contiguous(), torch.cat([s1, s3], 1).contiguous()
    deq13 = torch.cat([reference.dequantize_fp8_weight(q1, s1, torch.bfloat16),
                       reference.dequantize_fp8_weight(q3, s3, torch.bfloat16)], 1).contiguous()
    deq2 = reference.dequantize_fp8_weight(q2, s2, torch.bfloat16)
    fp8 = MoELayer(g, E, H, I, M, K, w13q, q2, w13_scale=w13_scale, w2_scale=s2)
    plain = MoELayer(g, E, H, I, M, K, deq13, deq2, path="fused")
    assert torch.equal(fp8(xs[0], idxs[0], ws[0]), plain(xs[0], idxs[0], ws[0]))
