"""Pure-torch references of every op, given every rank's inputs at once.

Tests compare the kernels against these (exactly for counts, order and moved bytes); docs use them to
say what each op computes. They are written for clarity, not speed, and read counts on the host.
"""

from __future__ import annotations

import torch

from . import formats
from .planner import FP8_WEIGHT_BLOCK


# ---- AllToAllvDynamic ----------------------------------------------------------------------------

def sent_rows(counts: list[int], max_rows_per_peer: int, num_rows: int, excluded=()) -> list[tuple[int, int]]:
    """(first row, rows sent) to each rank, as the op clamps device counts: rank j's rows start at the
    prefix sum of the counts as given (negative ones taken as 0); min(count, capacity, rows that exist)
    of them are sent, none to an excluded rank."""
    out, off = [], 0
    for j, c in enumerate(counts):
        c = max(int(c), 0)
        n = 0 if j in excluded else max(0, min(c, max_rows_per_peer, num_rows - off))
        out.append((off, n))
        off += c
    return out


def alltoallv(sends: list[torch.Tensor], send_counts: list[torch.Tensor], max_rows_per_peer: int, excluded=()):
    """Forward all-to-all-v. sends[r] [N_r, *row_shape]; send_counts[r] [world]. Counts are clamped as
    the op clamps them (``sent_rows``); ranks in ``excluded`` send and receive nothing. Returns per
    receiving rank i: (recv [world, max_rows_per_peer, *row_shape] with rows past a count zero,
    recv_counts int32 [world])."""
    world = len(sends)
    split = [sent_rows(sc.tolist(), max_rows_per_peer, sends[j].shape[0], excluded) for j, sc in enumerate(send_counts)]
    out = []
    for i in range(world):
        row_shape = sends[i].shape[1:]
        recv = torch.zeros((world, max_rows_per_peer, *row_shape), dtype=sends[i].dtype)
        rc = torch.zeros(world, dtype=torch.int32)
        for j in range(world):
            if i in excluded or j in excluded:
                continue
            off, n = split[j][i]
            recv[j, :n] = sends[j][off:off + n].cpu()
            rc[j] = n
        out.append((recv, rc))
    return out


def alltoallv_combine(rows: list[torch.Tensor], send_counts: list[torch.Tensor], num_rows: list[int],
                      max_rows_per_peer: int | None = None, excluded=()):
    """Reverse of ``alltoallv``. rows[i] [world, max_rows_per_peer, *row_shape] on rank i; rows[i][j, :n]
    (n = rows rank j sent to i) go back to rank j at the offsets its forward rows had. Returns per rank
    j: [num_rows[j], *row_shape], rows not covered by the forward zero."""
    world = len(rows)
    cap = rows[0].shape[1] if max_rows_per_peer is None else max_rows_per_peer
    out = []
    for j in range(world):
        res = torch.zeros((num_rows[j], *rows[j].shape[2:]), dtype=rows[j].dtype)
        for i, (off, n) in enumerate(sent_rows(send_counts[j].tolist(), cap, num_rows[j], excluded)):
            if i not in excluded and j not in excluded:
                res[off:off + n] = rows[i][j, :n].cpu()
        out.append(res)
    return out


# ---- EPBuffer dispatch / combine ---------------------------------------------------------------

FP8_E4M3_MAX = 448.0
FP8_AMAX_MIN = 1e-4  # DeepEP's kFP8Margin: a group's amax is at least this (as float32)
F32_MANTISSA_BITS = 23


def quantize_fp8(x: torch.Tensor, group: int = 128, fmt: str | bool = formats.E4M3):
    """float8_e4m3fn quantization with one scale per ``group`` columns, as the fp8 dispatch does in format
    ``fmt`` (``moe_comm.formats``; DeepEP's low-latency formats, bit for bit; the kernels' twin is
    triton_kernels/quant.py).

    x [..., H] floating, finite, H % group == 0 (H % (4 * group) with "e4m3-ue8m0"). Per group, in float32,
    every operation rounded to nearest even (no float64): amax = max(max |x|, 1e-4); then

    - "e4m3" (or True): inv = 448 / amax (correctly rounded division); q = e4m3(x * inv) (ties to even;
      |x * inv| <= 448 + 2**-15, which rounds to 448, so nothing saturates); scale = amax * float32(1/448).
      An all-zero group gets q = 0 and scale = float32(1e-4) * float32(1/448).
    - "e4m3-pow2": t = amax * float32(1/448); e = ceil(log2(t)) (t's exponent, +1 unless t is a power of
      two); q = e4m3(x * 2**-e) (the product is exact); scale = 2**e.
    - "e4m3-ue8m0": the same q; scales int32 [..., H / (4 * group)], byte j of word i = e + 127 of group
      4i + j (``unpack_ue8m0`` turns them back into the 2**e of "e4m3-pow2").

    So dequantize_fp8(q, scales) = q * scale ~= x. Returns (q [..., H] float8_e4m3fn, scales).
    """
    fmt = formats.fp8_name(fmt)
    xf = x.float().unflatten(-1, (-1, group))
    amax = xf.abs().amax(dim=-1).clamp(min=FP8_AMAX_MIN)
    amax_inv = torch.tensor(1.0 / FP8_E4M3_MAX, dtype=torch.float32, device=x.device)
    if fmt == formats.E4M3:
        # torch.div, not 448 / amax: a scalar divided by a tensor is computed as reciprocal() * 448 (two roundings).
        inverse = torch.div(torch.full_like(amax, FP8_E4M3_MAX), amax)
        scales = amax * amax_inv
    else:
        bits = (amax * amax_inv).view(torch.int32)
        biased = (bits >> F32_MANTISSA_BITS) + ((bits & ((1 << F32_MANTISSA_BITS) - 1)) != 0).int()   # e + 127
        inverse = ((2 * formats.UE8M0_BIAS - biased) << F32_MANTISSA_BITS).view(torch.float32)            # 2**-e
        scales = (biased << F32_MANTISSA_BITS).view(torch.float32) if fmt == formats.E4M3_POW2 else pack_ue8m0(biased)
    q = (xf * inverse.unsqueeze(-1)).to(torch.float8_e4m3fn)
    return q.flatten(-2), scales


def pack_ue8m0(biased: torch.Tensor) -> torch.Tensor:
    """int [..., G] exponent bytes (e + 127, G % 4 == 0) -> int32 [..., G / 4], byte j of word i = group 4i + j."""
    b = biased.to(torch.int64).unflatten(-1, (-1, formats.UE8M0_PER_WORD))
    word = (b << (8 * torch.arange(formats.UE8M0_PER_WORD, device=b.device))).sum(-1)
    return torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)


def unpack_ue8m0(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] packed UE8M0 scales -> float32 [..., 4 * W] the scales 2**e they stand for."""
    shifts = 8 * torch.arange(formats.UE8M0_PER_WORD, device=words.device)
    b = (words.to(torch.int64).unsqueeze(-1) >> shifts) & 0xFF
    return (b.flatten(-2).to(torch.int32) << F32_MANTISSA_BITS).view(torch.float32)


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, group: int = 128) -> torch.Tensor:
    """Inverse of ``quantize_fp8`` (any format: int32 scales are packed UE8M0): float32 [..., H] = q * the
    scale of its group, one float32 product per element. Group j is columns [j * group, (j + 1) * group):
    scales [..., ceil(H / group)] (H need not be a multiple of group: the last group is then shorter)."""
    if scales.dtype == torch.int32:
        scales = unpack_ue8m0(scales)
    return q.float() * scales.repeat_interleave(group, dim=-1)[..., :q.shape[-1]]


def dequantize_fp8_weight(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                          block: int = FP8_WEIGHT_BLOCK) -> torch.Tensor:
    """An fp8 weight with block scales as DeepSeek-V3's checkpoints hold it (``weight_scale_inv``), in the
    layer's dtype: w [..., N, K] float8_e4m3fn, scale float32 [..., ceil(N / block), ceil(K / block)] (block
    (i, j) covers rows [i * block, (i + 1) * block) and columns [j * block, (j + 1) * block), the last ones
    shorter). Returns [..., N, K] dtype = (w.float() * scale of its block).to(dtype): one float32 product,
    one rounding. What ``MoELayer`` computes with fp8 weights (its kernels dequantize each tile so)."""
    rows = scale.repeat_interleave(block, dim=-2)[..., :w.shape[-2], :]   # [..., N, ceil(K / block)]
    return dequantize_fp8(w, rows, block).to(dtype)


def dequantize_fp8_w13(w13: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                       block: int = FP8_WEIGHT_BLOCK) -> torch.Tensor:
    """``dequantize_fp8_weight`` of a gate/up pair as checkpoints hold it (gate_proj and up_proj quantized
    separately) and engines fuse it (vLLM's and SGLang's ``w13_weight_scale_inv``): w13 [..., 2I, K]
    float8_e4m3fn (gate rows, then up rows), scale float32 [..., 2 * ceil(I / block), ceil(K / block)]
    (gate's block rows, then up's: no block spans both halves). Returns [..., 2I, K] dtype."""
    inter, nb = w13.shape[-2] // 2, scale.shape[-2] // 2
    return torch.cat([dequantize_fp8_weight(w13[..., :inter, :], scale[..., :nb, :], dtype, block),
                      dequantize_fp8_weight(w13[..., inter:, :], scale[..., nb:, :], dtype, block)], dim=-2)


NVFP4_GROUP = 16          # elements per e4m3 block scale
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)           # magnitude code 0..7
E2M1_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True),
                   (5.0, False))   # (t, inclusive): |v| passes t when |v| > t (|v| >= t if inclusive); ties to even


def nvfp4_global_scale(x: torch.Tensor) -> torch.Tensor:
    """TensorRT-LLM's NVFP4 global scale for ``x``: float32 [1] = 448 * 6 / max |x| (the calibrated value a
    checkpoint's input scale holds; 448 * 6 for an all-zero or empty x)."""
    amax = x.float().abs().amax() if x.numel() else torch.zeros((), device=x.device)
    amax = torch.where(amax > 0, amax, torch.ones_like(amax))
    return torch.div(torch.full_like(amax, FP8_E4M3_MAX * E2M1_MAX), amax).reshape(1)


def quantize_nvfp4(x: torch.Tensor, global_scale: torch.Tensor):
    """NVFP4 quantization as the nvfp4 dispatch does (TensorRT-LLM's formula with correctly rounded
    reciprocals; the kernels' twin and the formula: triton_kernels/quant.py ``quantize_nvfp4_groups``).

    x [..., H] floating, finite, H % 16 == 0; global_scale float32 with one element, finite, > 0. Per block
    of 16 elements, in float32: sf = e4m3(min(gs * (vmax * f32(1/6)), 448)); inverse = 1 / (sf * (1 / gs))
    (0 if sf == 0); q = e2m1(x * inverse), ties to even, saturated at 6, sign kept (-0 is code 8).
    Returns (values uint8 [..., H / 2]: element 2j in the low nibble of byte j; scales float8_e4m3fn
    [..., H / 16], one per block, linear layout). dequantize_nvfp4(values, scales, gs) ~= x."""
    gs = global_scale.float().reshape(()).to(x.device)
    xf = x.float().unflatten(-1, (-1, NVFP4_GROUP))
    vmax = xf.abs().amax(dim=-1)
    rcp6 = torch.tensor(1.0 / E2M1_MAX, dtype=torch.float32, device=x.device)
    sf = (gs * (vmax * rcp6)).clamp(max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)   # exact below 448: one rounding
    sff = sf.float()
    one = torch.ones((), dtype=torch.float32, device=x.device)
    inverse = torch.where(sff != 0, torch.div(one, torch.where(sff != 0, sff, one) * torch.div(one, gs)), 0.0)
    v = xf * inverse.unsqueeze(-1)
    a = v.abs()
    mag = torch.zeros(v.shape, dtype=torch.int32, device=x.device)
    for t, inclusive in E2M1_THRESHOLDS:
        mag += (a >= t if inclusive else a > t).int()
    sign = (v.view(torch.int32) >> 31) & 1
    codes = (mag | (sign << 3)).flatten(-2)
    values = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return values, sf


def dequantize_nvfp4(values: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Inverse of ``quantize_nvfp4``: float32 [..., H] = e2m1 value * scale / global_scale, in float32."""
    v = values.view(torch.uint8).int()
    codes = torch.stack([v & 0xF, v >> 4], dim=-1).flatten(-2)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=values.device)
    e2m1 = torch.where(codes >= 8, -table[codes & 7], table[codes & 7])
    gs = global_scale.float().reshape(()).to(values.device)
    return ((e2m1.unflatten(-1, (-1, NVFP4_GROUP)) * scales.float().unsqueeze(-1)) / gs).flatten(-2)


def fp8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """What the fp8 combine makes of a row: ``dequantize_fp8(*quantize_fp8(x))``, float32."""
    return dequantize_fp8(*quantize_fp8(x))


def fp8_codes_match(got: torch.Tensor, want: torch.Tensor, exact: bool = True, max_fraction: float = 1.0) -> bool:
    """float8 tensors with equal codes; with ``exact=False`` (compiled kernels, whose conversion may break a
    rounding tie the other way) a code may also be the next one of the same sign, for at most
    ``max_fraction`` of the elements."""
    a, b = got.view(torch.uint8).int(), want.view(torch.uint8).int()
    diff = a != b
    if not diff.any():
        return True
    if exact:
        return False
    adjacent = ((a - b).abs() == 1) & ((a ^ b) & 0x80 == 0)
    return bool(adjacent[diff].all() and diff.float().mean() <= max_fraction)


def routed(e: int, num_experts: int, world: int, excluded=()) -> bool:
    """Is a slot naming expert ``e`` routed: a valid id whose rank is not excluded."""
    return 0 <= e < num_experts and e // (num_experts // world) not in excluded


def ep_rows(topk_idxs: list[torch.Tensor], num_experts: int, max_tokens_per_rank: int, excluded=()):
    """Where every routed slot lands. Returns ``rows[r][e]`` = list of (source rank s, token t, k) that
    rank r's local expert e receives, in order (by s, then t, then k), truncated to the capacity
    world * max_tokens_per_rank. Ids outside [0, num_experts), and ids of experts on an excluded rank,
    are not routed; an excluded rank sends nothing."""
    world = len(topk_idxs)
    local = num_experts // world
    cap = world * max_tokens_per_rank
    rows = [[[] for _ in range(local)] for _ in range(world)]
    for s, idx in enumerate(topk_idxs):
        if s in excluded:
            continue
        for t, ids in enumerate(idx.tolist()):
            for k, e in enumerate(ids):
                if routed(e, num_experts, world, excluded):
                    rows[e // local][e % local].append((s, t, k))
    return [[lst[:cap] for lst in per_rank] for per_rank in rows]


def dispatch(xs: list[torch.Tensor], topk_idxs: list[torch.Tensor], num_experts: int,
             max_tokens_per_rank: int, fp8: bool | str = False, excluded=(), nvfp4_scale: torch.Tensor | None = None):
    """EPBuffer.dispatch of every rank at once. xs[r] [T_r, H]; topk_idxs[r] [T_r, K] (-1 = not routed).
    fp8: the EPBuffer's fp8 dispatch format (False, True = "e4m3", or an fp8 format of ``moe_comm.formats``).

    Returns per receiving rank a dict: x [E_local, R, H] (dtype, or float8_e4m3fn with fp8; with
    ``nvfp4_scale``, the global scale every rank passed, uint8 [E_local, R, H/2] of ``quantize_nvfp4``) and
    scales [E_local, R, H/128] float32 (fp8; int32 [E_local, R, H/512] with "e4m3-ue8m0"), float8_e4m3fn
    [E_local, R, H/16] (nvfp4) or None, rows past a count zero; counts int32 [E_local]; src int32 [E_local,
    R] = s * max_tokens_per_rank + t per valid row, -1 past a count (R = world * M).
    """
    world = len(xs)
    local, cap, m = num_experts // world, world * max_tokens_per_rank, max_tokens_per_rank
    rows = ep_rows(topk_idxs, num_experts, max_tokens_per_rank, excluded)
    out = []
    for r in range(world):
        H, dt = xs[r].shape[1], xs[r].dtype
        x = torch.zeros((local, cap, H), dtype=dt)
        src = torch.full((local, cap), -1, dtype=torch.int32)
        counts = torch.zeros(local, dtype=torch.int32)
        for e in range(local):
            for i, (s, t, _k) in enumerate(rows[r][e]):
                x[e, i] = xs[s][t].cpu()
                src[e, i] = s * m + t
            counts[e] = len(rows[r][e])
        x, scales = _quantize(x, fp8, nvfp4_scale)
        out.append(dict(x=x, scales=scales, counts=counts, src=src))
    return out


def combine(expert_outs: list[torch.Tensor], topk_weights: list[torch.Tensor], topk_idxs: list[torch.Tensor],
            num_experts: int, max_tokens_per_rank: int, excluded=(), fp8: bool = False):
    """EPBuffer.combine of every rank at once. expert_outs[r] [E_local, R, H] on rank r (row i of expert e
    answers dispatch row i); topk_weights[r], topk_idxs[r] [T_r, K]. Returns per rank y [T_r, H]:
    y[t] = sum over k ascending of routed slots of w[t, k] * row, in float32, cast to expert_outs' dtype.
    A slot dropped for capacity contributes a zero row; a slot whose expert's rank is excluded is not
    routed (no weight). With ``fp8`` (combine_format="e4m3") each row is first quantized and dequantized
    (``fp8_round_trip``: what crosses the link, every slot's row alike, the token rank's own included)."""
    world = len(expert_outs)
    local = num_experts // world
    rows = ep_rows(topk_idxs, num_experts, max_tokens_per_rank, excluded)
    where = {}
    for r in range(world):
        for e in range(local):
            for i, key in enumerate(rows[r][e]):
                where[key] = (r, e, i)
    out = []
    for s in range(world):
        idx, w = topk_idxs[s].tolist(), topk_weights[s].float().cpu()
        T, K = len(idx), topk_weights[s].shape[1]
        H, dt = expert_outs[0].shape[-1], expert_outs[0].dtype
        y = torch.zeros((T, H), dtype=torch.float32)
        for t in range(T):
            acc = torch.zeros(H, dtype=torch.float32)
            for k in range(K):
                if not routed(idx[t][k], num_experts, world, excluded):
                    continue
                hit = where.get((s, t, k))
                row = expert_outs[hit[0]][hit[1], hit[2]].float().cpu() if hit else torch.zeros(H)
                if fp8:
                    row = fp8_round_trip(row)
                acc = acc + w[t, k] * row
            y[t] = acc
        out.append(y.to(dt))
    return out


# ---- The MoE layer: dispatch -> per-expert SiLU-gated MLP -> weighted combine ---------------------

def expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert's SiLU-gated MLP on its rows, as ``moe_comm.MoELayer`` computes it. x [N, H]; w13 [2I, H]
    (gate = rows [0, I), up = rows [I, 2I), the layout of a Linear's weight); w2 [H, I]. Returns [N, H] in
    x's dtype.

    Roundings, stated: gate = x @ w13[:I].T and up = x @ w13[I:].T accumulate in float32 (each a dot
    product over H of float32 products of the dtype inputs, which are exact); a = SiLU(gate) * up in
    float32, rounded once to the dtype; y = a @ w2.T accumulated in float32 over I, rounded once to the
    dtype. The order of the terms inside each dot product is not fixed here (torch's CPU GEMM's): a kernel's
    tl.dot sums in its own order, and tests bound that difference (tests/moe_layer_cases.py derives the
    bound). With inputs whose every product and partial sum is exact in float32 the order cannot matter,
    and the fused layer equals this reference bit for bit (``moe_layer``: the combine's order is fixed)."""
    inter = w13.shape[0] // 2
    h = x.float() @ w13.float().T
    gate, up = h[:, :inter], h[:, inter:]
    a = (gate * torch.sigmoid(gate) * up).to(x.dtype)
    return (a.float() @ w2.float().T).to(x.dtype)


def moe_layer(xs: list[torch.Tensor], topk_idxs: list[torch.Tensor], topk_weights: list[torch.Tensor],
              w13s: list[torch.Tensor], w2s: list[torch.Tensor], num_experts: int, max_tokens_per_rank: int,
              excluded=()) -> list[torch.Tensor]:
    """``MoELayer`` of every rank at once: ``dispatch`` (xs[r] [T_r, H], topk_idxs[r] [T_r, K], -1 = not
    routed), then on rank r each local expert e's rows ``expert_mlp(rows, w13s[r][e], w2s[r][e])`` (w13s[r]
    [E_local, 2I, H], w2s[r] [E_local, H, I]), then ``combine`` with topk_weights[r] [T_r, K]: y[t] = sum
    over k ascending of routed slots of w[t, k] * expert row, in float32, rounded once to the dtype. A slot
    dropped for capacity contributes a zero row; excluded ranks as in ``dispatch``. Returns per rank y
    [T_r, H] in xs' dtype."""
    world = len(xs)
    d = dispatch(xs, topk_idxs, num_experts, max_tokens_per_rank, excluded=excluded)
    outs = []
    for r in range(world):
        eo = torch.zeros_like(d[r]["x"])
        for e, n in enumerate(d[r]["counts"].tolist()):
            if n:
                eo[e, :n] = expert_mlp(d[r]["x"][e, :n], w13s[r][e].cpu(), w2s[r][e].cpu())
        outs.append(eo)
    return combine(outs, topk_weights, topk_idxs, num_experts, max_tokens_per_rank, excluded)


# ---- PrefillBuffer dispatch / combine ------------------------------------------------------------

def prefill_dispatch(xs: list, topk_idxs: list[torch.Tensor], topk_weights: list[torch.Tensor],
                     num_experts: int, max_tokens_per_rank: int, fp8: bool | str = False, excluded=(),
                     nvfp4_scale: torch.Tensor | None = None):
    """PrefillBuffer.dispatch of every rank at once. xs[r] [T_r, H], or pre-quantized (codes [T_r, H]
    float8_e4m3fn, scales [T_r, S]): their rows land as they are, ``fp8`` unused; topk_idxs[r],
    topk_weights[r] [T_r, K]. ``fp8`` and ``nvfp4_scale`` as for ``dispatch``.

    Returns per receiving rank a dict (R = world * M): valid bool [R] (row s*M + t holds token t of source s,
    which has an expert here); x [R, H] (dtype, or float8_e4m3fn with fp8 or pre-quantized xs, or uint8
    [R, H/2] with ``nvfp4_scale``: ``quantize_nvfp4``; zero rows where not valid) and scales ([R, ...]:
    ``quantize_fp8``'s or ``quantize_nvfp4``'s, or the given ones) or None; topk_idx int32 [R, K] (local
    ids, -1 elsewhere and past a source's tokens); topk_weights float32 [R, K] (0 where topk_idx is -1);
    src_tokens int32 [world]; expert_counts int32 [L]. Ids outside [0, num_experts) and experts of excluded
    ranks are not routed; an excluded rank sends and receives nothing."""
    world, m = len(xs), max_tokens_per_rank
    local, R = num_experts // world, world * m
    given = isinstance(xs[0], tuple)   # pre-quantized: (codes, scales) per rank
    data = [x[0] if given else x for x in xs]
    out = []
    for r in range(world):
        H, K, dt = data[r].shape[1], topk_idxs[r].shape[1], data[r].dtype
        x = torch.zeros((R, H), dtype=dt)
        scales = torch.zeros((R, xs[r][1].shape[1]), dtype=xs[r][1].dtype) if given else None
        idx = torch.full((R, K), -1, dtype=torch.int32)
        w = torch.zeros((R, K), dtype=torch.float32)
        valid = torch.zeros(R, dtype=torch.bool)
        src_tokens = torch.zeros(world, dtype=torch.int32)
        counts = torch.zeros(local, dtype=torch.int32)
        for s in range(world):
            if s in excluded or r in excluded:
                continue
            src_tokens[s] = data[s].shape[0]
            for t, ids in enumerate(topk_idxs[s].tolist()):
                for k, e in enumerate(ids):
                    if routed(e, num_experts, world, excluded) and e // local == r:
                        idx[s * m + t, k] = e % local
                        w[s * m + t, k] = float(topk_weights[s][t, k])
                        counts[e % local] += 1
                        valid[s * m + t] = True
                if valid[s * m + t]:
                    x[s * m + t] = data[s][t].cpu()
                    if given:
                        scales[s * m + t] = xs[s][1][t].cpu()
        if not given:
            x, scales = _quantize(x, fp8, nvfp4_scale)
        out.append(dict(valid=valid, x=x, scales=scales, topk_idx=idx, topk_weights=w, src_tokens=src_tokens,
                        expert_counts=counts))
    return out


def _quantize(x: torch.Tensor, fp8: bool | str, nvfp4_scale):
    """(payload, scales) of the dispatch formats: x as it is (None), fp8 in format ``fp8`` (True: "e4m3"), or
    nvfp4 with that global scale."""
    if fp8:
        return quantize_fp8(x, fmt=fp8)
    if nvfp4_scale is not None:
        return quantize_nvfp4(x, nvfp4_scale)
    return x, None


def prefill_owners(ids: list[int], num_experts: int, world: int, excluded=()) -> list[int]:
    """The ranks a token with expert ids ``ids`` is sent to, ascending: each once."""
    local = num_experts // world
    return sorted({e // local for e in ids if routed(e, num_experts, world, excluded)})


def prefill_combine(partials: list[torch.Tensor], topk_idxs: list[torch.Tensor], num_experts: int,
                    max_tokens_per_rank: int, excluded=(), ranks_per_node: int | None = None, fp8: bool = False):
    """PrefillBuffer.combine of every rank at once. partials[d] [R, H] on rank d (row s*M + t: rank d's
    partial output for token t of source s). Returns per source rank s y [T_s, H]: the sum over the ranks
    d holding one of t's experts, ascending d, of partials[d][s*M + t] in float32, cast to their dtype;
    with ``fp8`` (combine_format="e4m3") each partial row quantized and dequantized first (``fp8_round_trip``).

    ``ranks_per_node`` = G (nodes of G consecutive ranks reached by puts, docs/prefill.md "Across
    nodes"): the sum runs node by node in ascending node order, each node's term the float32 sum of its
    ranks' rows (ascending d), rounded to the dtype for every node but s's own (its rail put it as one
    row), left to right in float32, then cast. With one node, or nodes of one rank, the same bits as
    without."""
    world, m = len(partials), max_tokens_per_rank
    g = world if ranks_per_node is None else int(ranks_per_node)
    dt = partials[0].dtype
    out = []
    for s in range(world):
        T, H = topk_idxs[s].shape[0], partials[0].shape[1]
        y = torch.zeros((T, H), dtype=torch.float32)
        if s not in excluded:
            for t, ids in enumerate(topk_idxs[s].tolist()):
                owners = prefill_owners(ids, num_experts, world, excluded)
                for node in range(world // g):
                    part = torch.zeros(H, dtype=torch.float32)
                    mine = [d for d in owners if d // g == node]
                    for d in mine:
                        row = partials[d][s * m + t].float().cpu()
                        part = part + (fp8_round_trip(row) if fp8 else row)
                    if node != s // g and mine:
                        part = part.to(dt).float()
                    y[t] = y[t] + part
        out.append(y.to(dt))
    return out


def prefill_pairs(topk_idx: torch.Tensor, num_experts: int, world: int, rank: int, excluded=()) -> int:
    """(token, destination rank other than ``rank``) pairs of one rank's tokens: the payload rows its
    dispatch must move across the link at the least (each routed token once per destination rank)."""
    return sum(len([d for d in prefill_owners(ids, num_experts, world, excluded) if d != rank])
               for ids in topk_idx.tolist())
