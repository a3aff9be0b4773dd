"""MoELayer test cases: inputs, the derived error bound against ``reference.moe_layer``, and the checks.

Two kinds of inputs (every rank rebuilds every rank's from the seed):

- ``exact``: small integers and powers of two chosen so that every product and partial sum of both GEMMs is
  exact in float32 and SiLU is exact (gate = 0 or >= 32, where sigmoid is exactly 0.5 or 1 in float32),
  the activation and the expert output exact in the dtype. Then no summation order can change
  a bit, and the fused layer must equal ``reference.moe_layer`` bit for bit: only the combine's sums are
  rounded, in the fixed k order both use. ``exact_inputs_hold`` checks the claim on the inputs made.
- ``random``: normal tokens and weights. The GEMMs' summation order differs (tl.dot's against torch's), so
  the layer must lie within ``layer_bound`` of the reference, derived below.

The bound (per output element; u = 2**-24 float32's unit roundoff, gamma_n = n*u / (1 - n*u), eps the
dtype's unit roundoff, |.| elementwise, everything in float64 from the reference's own values):

1. gate and up: two float32 dot products over H in different orders each differ from the exact sum by at
   most gamma_H * S (S = |x| @ |w|.T), so from each other by Dg = 2 * gamma_H * Sg (Du likewise).
2. f = SiLU(g) * u: |SiLU'| <= 1.1, so |df| <= 1.1 * Dg * (|u| + Du) + (|SiLU(g)| + 1.1 * Dg) * Du; each side
   evaluates f in float32 (exp, a division, two products: within 8 ulps), so add 16 * u * (|f| + df).
3. Rounding to the dtype: two values d apart round at most d + eps * (|f1| + |f2|) apart.
4. The down GEMM: sum |da| |w2| over I, plus both sides' own float32 error 2 * gamma_I * (|a| + da) @ |w2|.T;
   then the dtype rounding as in 3.
5. The combine (same order, different inputs): sum over k of |w_k| * do_k, plus 2 * gamma_K * sum |w_k| (|o_k|
   + do_k) for the float32 roundings of the sums, then the output rounding as in 3.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_comm import reference
from moe_comm.planner import FP8_WEIGHT_BLOCK

U32 = 2.0 ** -24
SILU_SLOPE = 1.1             # max |d SiLU / dx| (1.0998 at x = 2.4)
F32_ELEMENTWISE_ULPS = 8     # float32 error of sigmoid, its product with g and with u, in ulps (each side)
EPS = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}


def gamma(n: int) -> float:
    return n * U32 / (1 - n * U32)


def _sparse(g, shape, values, per_row):
    """A tensor of ``shape`` [..., rows, cols] with ``per_row`` nonzeros per row drawn from ``values``."""
    out = torch.zeros(shape, dtype=torch.float32)
    flat = out.view(-1, shape[-1])
    vals = torch.tensor(values, dtype=torch.float32)
    for r in range(flat.shape[0]):
        cols = torch.randperm(shape[-1], generator=g)[:per_row]
        flat[r, cols] = vals[torch.randint(0, len(vals), (per_row,), generator=g)]
    return out


def make_weights(world: int, experts_per_rank: int, hidden: int, inter: int, seed: int, exact: bool,
                 dtype=torch.bfloat16):
    """Per rank (w13 [L, 2I, H], w2 [L, H, I]) in ``dtype``."""
    g = torch.Generator().manual_seed(seed + 7)
    out = []
    for _ in range(world):
        if exact:   # gate rows: two of {0, 32}; up rows: two of {0, +-1}; down rows: two of {+-1/32}
            gate = _sparse(g, (experts_per_rank, inter, hidden), (0.0, 32.0), 2)
            up = _sparse(g, (experts_per_rank, inter, hidden), (0.0, 1.0, -1.0), 2)
            w2 = _sparse(g, (experts_per_rank, hidden, inter), (1 / 32, -1 / 32), 2)
            w13 = torch.cat([gate, up], dim=1)
        else:
            w13 = torch.randn(experts_per_rank, 2 * inter, hidden, generator=g) / hidden ** 0.5
            w2 = torch.randn(experts_per_rank, hidden, inter, generator=g) / inter ** 0.5
        out.append((w13.to(dtype), w2.to(dtype)))
    return out


def make_tokens(xs, seed: int, exact: bool):
    """The ops' inputs' tokens made exact-friendly (entries 1 or 2) with ``exact``, else as they are."""
    if not exact:
        return xs
    g = torch.Generator().manual_seed(seed + 11)
    return [torch.randint(1, 3, x.shape, generator=g).to(x.dtype) for x in xs]


def exact_inputs_hold(xs, w13s, w2s) -> bool:
    """Every gate of every token and expert is 0 or >= 32 (float32's sigmoid is then exactly 0.5 or 1, so
    SiLU(g) is 0 or g), and every expert MLP computed so in float64 equals the reference's float32 one and
    is exact in the dtype: the premise of the bit-exact comparison."""
    for x in xs:
        if not x.shape[0]:
            continue
        for w13, w2 in zip(w13s, w2s):
            inter = w13.shape[1] // 2
            for e in range(w13.shape[0]):
                h = x.double() @ w13[e].double().T
                g, u = h[:, :inter], h[:, inter:]
                if not bool(((g == 0) | (g >= 32)).all()):
                    return False
                a = torch.where(g >= 32, g, 0.0) * u
                o = a @ w2[e].double().T
                if not (torch.equal(a.to(x.dtype).double(), a) and torch.equal(o.to(x.dtype).double(), o)
                        and torch.equal(reference.expert_mlp(x, w13[e], w2[e]).double(), o)):
                    return False
    return True


def _round_gap(d, a, eps):
    """Two values within d of each other, near |a|, after each is rounded to a format of unit roundoff eps."""
    return d + eps * (2 * a.abs() + d)


def expert_bound(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor):
    """(reference rows [N, H] as float64, their bound [N, H]) for one expert (steps 1-4 above)."""
    eps = EPS[x.dtype]
    inter = w13.shape[0] // 2
    xd, w13d, w2d = x.double(), w13.double(), w2.double()
    h = (x.float() @ w13.float().T).double()
    g, u = h[:, :inter], h[:, inter:]
    s = xd.abs() @ w13d.abs().T
    dg, du = 2 * gamma(x.shape[1]) * s[:, :inter], 2 * gamma(x.shape[1]) * s[:, inter:]
    silu = torch.nn.functional.silu(g)
    f = silu * u
    df = SILU_SLOPE * dg * (u.abs() + du) + (silu.abs() + SILU_SLOPE * dg) * du
    df = df + 2 * F32_ELEMENTWISE_ULPS * U32 * (f.abs() + df)
    da = _round_gap(df, f, eps)
    a = f.to(x.dtype).double()
    o = a @ w2d.T
    do = da @ w2d.abs().T + 2 * gamma(inter) * (a.abs() + da) @ w2d.abs().T
    return reference.expert_mlp(x, w13, w2).double(), _round_gap(do, o, eps)


def layer_bound(xs, idxs, ws, w13s, w2s, num_experts: int, max_tokens: int) -> list[torch.Tensor]:
    """Per rank float64 [T, H]: how far the fused layer's y may lie from ``reference.moe_layer``'s (step 5)."""
    world = len(xs)
    d = reference.dispatch(xs, idxs, num_experts, max_tokens)
    local = num_experts // world
    rows = reference.ep_rows(idxs, num_experts, max_tokens)
    where = {}
    for r in range(world):
        o_r, b_r = torch.zeros(d[r]["x"].shape, dtype=torch.float64), torch.zeros(d[r]["x"].shape, dtype=torch.float64)
        for e, n in enumerate(d[r]["counts"].tolist()):
            if n:
                o_r[e, :n], b_r[e, :n] = expert_bound(d[r]["x"][e, :n], w13s[r][e], w2s[r][e])
        for e in range(local):
            for i, key in enumerate(rows[r][e]):
                where[key] = (o_r[e, i], b_r[e, i])
    out = []
    for s in range(world):
        T, K = idxs[s].shape
        H = xs[s].shape[1]
        eps = EPS[xs[s].dtype]
        bound = torch.zeros((T, H), dtype=torch.float64)
        for t in range(T):
            y, dy, mag = torch.zeros(H, dtype=torch.float64), torch.zeros(H, dtype=torch.float64), torch.zeros(
                H, dtype=torch.float64)
            for k in range(K):
                hit = where.get((s, t, k))
                if hit is None:
                    continue
                wk = abs(float(ws[s][t, k]))
                y, dy, mag = y + float(ws[s][t, k]) * hit[0], dy + wk * hit[1], mag + wk * (hit[0].abs() + hit[1])
            bound[t] = _round_gap(dy + 2 * gamma(K) * mag, y, eps)
        out.append(bound)
    return out


class LayerInputs(tuple):
    """(xs, idxs, ws, w13s, w2s) as ``layer_inputs`` makes them, the weights as the reference takes them.
    ``fp8``: per rank dict(w13, w2, w13_scale, w2_scale) of fp8 weights whose dequantized values
    (``reference.dequantize_fp8_weight``) are w13s and w2s; None for weights in the dtype."""

    fp8 = None


def fp8_block_quantize(w, g, exact: bool):
    """w [L, N, K] -> (float8_e4m3fn codes, float32 scales [L, ceil(N / 128), ceil(K / 128)]), scales drawn
    from generator ``g`` as ``fp8_weights`` says."""
    L, N, K = w.shape
    grid = (L, -(-N // FP8_WEIGHT_BLOCK), -(-K // FP8_WEIGHT_BLOCK))
    if exact:
        scale = 2.0 ** torch.randint(-2, 3, grid, generator=g).float()
    else:
        blocks = torch.zeros(grid)
        wf = w.float().abs()
        for i in range(grid[1]):
            for j in range(grid[2]):
                blocks[:, i, j] = wf[:, i * FP8_WEIGHT_BLOCK:(i + 1) * FP8_WEIGHT_BLOCK,
                                     j * FP8_WEIGHT_BLOCK:(j + 1) * FP8_WEIGHT_BLOCK].amax(dim=(1, 2))
        scale = blocks.clamp(min=1e-4) / 448 * (0.5 + torch.rand(grid, generator=g))
    per_elem = scale.repeat_interleave(FP8_WEIGHT_BLOCK, 1)[:, :N].repeat_interleave(FP8_WEIGHT_BLOCK, 2)[..., :K]
    q = (w.float() / per_elem).clamp(-448, 448).to(torch.float8_e4m3fn)
    if exact:
        assert torch.equal(q.float() * per_elem, w.float()), "exact weights not representable in e4m3"
    return q, scale


def fp8_weights(w13s, w2s, seed: int, exact: bool):
    """fp8 e4m3 weights with 128x128 block scales near the given ones (``LayerInputs.fp8``; w13's gate and up
    halves each in their own blocks, ``reference.dequantize_fp8_w13``), and their
    dequantized values (the reference's weights). Each block's scale is drawn: a power of two in [1/4, 4]
    with ``exact`` (the exact weights' values divided by it are e4m3 values, so the dequantized weights are
    the exact ones), else a float32 in [1/2, 3/2) times the block's amax / 448 (every block's different,
    so a scale read from the wrong block changes the result)."""
    g = torch.Generator().manual_seed(seed + 13)
    fp8, deq13, deq2 = [], [], []
    for w13, w2 in zip(w13s, w2s):
        inter = w13.shape[1] // 2   # gate and up quantized separately, as checkpoints hold them
        (qg, sg), (qu, su), (q2, s2) = (fp8_block_quantize(w, g, exact) for w in (w13[:, :inter], w13[:, inter:], w2))
        parts = dict(w13=torch.cat([qg, qu], 1).contiguous(), w13_scale=torch.cat([sg, su], 1).contiguous(),
                     w2=q2, w2_scale=s2)
        fp8.append(parts)
        deq13.append(reference.dequantize_fp8_w13(parts["w13"], parts["w13_scale"], w13.dtype))
        deq2.append(reference.dequantize_fp8_weight(parts["w2"], parts["w2_scale"], w2.dtype))
    return fp8, deq13, deq2


def layer_inputs(world: int, tokens: list[int], experts_per_rank: int, hidden: int, inter: int, topk: int,
                 seed: int, exact: bool, routing: str = "random", dtype=torch.bfloat16, fp8: bool = False):
    """(xs, idxs, ws, w13s, w2s) (a ``LayerInputs``): tokens per rank ``tokens``; routing "random" (distinct
    experts, about one slot in eight -1), "one_expert" (every routed slot to expert 0, the others -1) or
    "none"; with ``fp8``, fp8 weights with block scales (``fp8_weights``)."""
    from moe_cases import make_inputs
    E = experts_per_rank * world
    xs, idxs, ws = make_inputs(world, tokens, E, topk, hidden, seed, dtype)
    if routing == "one_expert":
        for idx in idxs:
            idx[:, 1:] = -1
            idx[:, :1] = 0
    elif routing == "none":
        for idx in idxs:
            idx.fill_(-1)
    xs = make_tokens(xs, seed, exact)
    weights = make_weights(world, experts_per_rank, hidden, inter, seed, exact, dtype)
    w13s, w2s = [w[0] for w in weights], [w[1] for w in weights]
    quantized = None
    if fp8:
        quantized, w13s, w2s = fp8_weights(w13s, w2s, seed, exact)
    out = LayerInputs((xs, idxs, ws, w13s, w2s))
    out.fp8 = quantized
    return out


def layer_weights(inputs, rank: int) -> dict:
    """Rank ``rank``'s weights as MoELayer and set_weights take them (keywords)."""
    if inputs.fp8 is not None:
        return inputs.fp8[rank]
    return dict(w13=inputs[3][rank], w2=inputs[4][rank])


# ---- running the layer ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LayerConfig:
    """One MoELayer's static sizes (num_experts = experts_per_rank * world)."""

    experts_per_rank: int
    hidden: int
    inter: int
    topk: int
    max_tokens: int
    dtype: torch.dtype = torch.bfloat16
    fp8: bool = False         # fp8 e4m3 weights with 128x128 block scales (the reference: dequantized)


# Experts per rank 1, 3, 4 (3: not a power of two), hidden 64/128/192 (192: not a power of two), I 16..96,
# topk 1..4, capacities 1..6.
CONFIGS = (
    LayerConfig(4, 128, 64, 2, 5),
    LayerConfig(3, 64, 32, 3, 4),
    LayerConfig(1, 192, 48, 1, 6, torch.float16),
    LayerConfig(4, 64, 96, 4, 1),
)
# fp8 weights with block scales: hidden 192 (one and a half scale blocks), I 80 (gate's and up's 80 rows: one
# short block each; w2's K is one short block); hidden 136 and I 40 in float16.
FP8_CONFIGS = (
    LayerConfig(2, 192, 80, 2, 5, fp8=True),
    LayerConfig(3, 136, 40, 3, 4, torch.float16, fp8=True),
)
# random: distinct experts, about one slot in eight -1; one_expert: every token's slot 0 to expert 0, the
# others -1; none: nothing routed.
ROUTINGS = ("random", "one_expert", "none")


def token_counts(cfg: LayerConfig, world: int, seed: int) -> list[int]:
    """Tokens per rank: T = 0, 1, max and odd values all occur across cases and ranks."""
    m = cfg.max_tokens
    pool = [m, 0, 1, max(0, m - 1), 3 % (m + 1)]
    return [pool[(seed + r) % len(pool)] for r in range(world)]


def case_list(world: int, configs=None, routings=ROUTINGS, pairs=None, table=None):
    """(config index, config, routing, exact, seed): every config of ``table`` (default CONFIGS) with every
    routing (or only the (config index, routing) ``pairs``), exact and random inputs alternating."""
    seed = 1000 * world
    for ci, cfg in enumerate(CONFIGS if table is None else table):
        if configs is not None and ci not in configs:
            continue
        for routing in routings:
            seed += 17
            if pairs is None or (ci, routing) in pairs:
                yield ci, cfg, routing, seed % 2 == 0, seed


# make test's representatives: each config once, each routing at least once, exact and random inputs
PAIRS = ((0, "random"), (1, "one_expert"), (2, "none"), (3, "random"))


def case_inputs(cfg: LayerConfig, world: int, routing: str, exact: bool, seed: int):
    return layer_inputs(world, token_counts(cfg, world, seed), cfg.experts_per_rank, cfg.hidden, cfg.inter,
                        cfg.topk, seed, exact, routing, cfg.dtype, cfg.fp8)


def make_layer(group, cfg: LayerConfig, w13, w2, **scales):
    from moe_comm import MoELayer
    return MoELayer(group, cfg.experts_per_rank * group.world_size, cfg.hidden, cfg.inter, cfg.max_tokens, cfg.topk,
                    w13, w2, dtype=cfg.dtype, **scales)


def check_ranks(ys: dict, inputs, cfg: LayerConfig, exact: bool, tag: str, excluded=()) -> list[str]:
    """The y of each rank in ``ys`` ({rank: y}) against reference.moe_layer (computed once for them all):
    equal on exact inputs, else within ``layer_bound``."""
    xs, idxs, ws, w13s, w2s = inputs
    E = cfg.experts_per_rank * len(xs)
    wants = reference.moe_layer(xs, idxs, ws, w13s, w2s, E, cfg.max_tokens, excluded=excluded)
    if exact and not exact_inputs_hold(xs, w13s, w2s):
        return [f"{tag}: the exact inputs are not exact"]
    bounds = None if exact else layer_bound(xs, idxs, ws, w13s, w2s, E, cfg.max_tokens)
    errs = []
    for rank, y in ys.items():
        want, where = wants[rank], f"{tag} rank{rank}"
        if y.dtype != want.dtype or y.shape != want.shape:
            errs.append(f"{where}: y {y.dtype} {tuple(y.shape)} != {want.dtype} {tuple(want.shape)}")
        elif exact and not torch.equal(y, want):
            errs.append(f"{where}: y differs from the reference by {(y.double() - want.double()).abs().max()}")
        elif not exact and (bool(((y.double() - want.double()).abs() > bounds[rank]).any()) or bool(y.isnan().any())):
            errs.append(f"{where}: y outside the derived bound")
    return errs


def run_loopback_layers(layers, xs, idxs, ws, outs=None) -> list[torch.Tensor]:
    """One call of every rank's layer on a loopback world, phase by phase (world 1: phase='both')."""
    if len(layers) == 1:
        return [layers[0](xs[0], idxs[0], ws[0], out=None if outs is None else outs[0])]
    for layer, x, i, w in zip(layers, xs, idxs, ws):
        assert layer(x, i, w, phase="send") is None
    for layer in layers:
        assert layer(phase="experts") is None
    return [layer(phase="recv", out=None if outs is None else outs[r]) for r, layer in enumerate(layers)]


def run_loopback_cases(groups, configs=None, routings=ROUTINGS, pairs=None, table=None) -> list[str]:
    """Every case (of ``case_list``) on a loopback world; returns the mismatches."""
    world, errs, layers = len(groups), [], {}
    for ci, cfg, routing, exact, seed in case_list(world, configs, routings, pairs, table):
        inputs = case_inputs(cfg, world, routing, exact, seed)
        if ci not in layers:
            layers[ci] = [make_layer(g, cfg, **layer_weights(inputs, r)) for r, g in enumerate(groups)]
        else:
            for r, layer in enumerate(layers[ci]):
                layer.set_weights(**layer_weights(inputs, r))
        ys = run_loopback_layers(layers[ci], *inputs[:3])
        errs += check_ranks(dict(enumerate(ys)), inputs, cfg, exact, f"loopback W{world} cfg{ci} {routing} exact={exact}")
    for per_rank in layers.values():
        for layer in per_rank:
            layer.close()
    return errs


def run_shm_cases(group, configs=None, routings=ROUTINGS, pairs=None, table=None) -> list[str]:
    """Every case (of ``case_list``) on one rank of a launched group (phase='both', or split on every third)."""
    world, rank, errs, layers = group.world_size, group.rank, [], {}
    for ci, cfg, routing, exact, seed in case_list(world, configs, routings, pairs, table):
        inputs = case_inputs(cfg, world, routing, exact, seed)
        xs, idxs, ws, w13s, w2s = inputs
        if ci not in layers:
            layers[ci] = make_layer(group, cfg, **layer_weights(inputs, rank))
        else:
            layers[ci].set_weights(**layer_weights(inputs, rank))
        layer = layers[ci]
        out = torch.full_like(xs[rank], float("nan"))
        if seed % 3 == 0:
            layer(xs[rank], idxs[rank], ws[rank], phase="send")
            layer(phase="experts")
            y = layer(phase="recv", out=out)
        else:
            y = layer(xs[rank], idxs[rank], ws[rank], out=out)
        if y is not out:
            errs.append(f"rank{rank} cfg{ci}: out= not written in place")
        errs += check_ranks({rank: y}, inputs, cfg, exact, f"shm W{world} cfg{ci} {routing} exact={exact}")
    for layer in layers.values():
        layer.close()
    return errs
