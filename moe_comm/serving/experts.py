"""Expert MLPs on the batched-experts layout, skipping the experts and row tiles that received nothing.

x_e [E_local, R, H] holds rows x_e[e, :counts[e]] for local expert e (counts int32 on the device, never
read on the host). A dense ``torch.bmm`` over every expert reads every expert's weights, which is what
decode time is made of: at batch 1 with top-1 routing over 16 experts, 15/16 of those reads are for
experts with no row. The masked kernel below reads ``counts[e]`` on the device and computes only the
row tiles holding valid rows, so an idle expert's weights are never read, as grouped-GEMM MoE kernels
of serving engines do. Capturable: no host read, fixed grid (column tiles x active-expert slots, where
the caller may bound the active experts, e.g. by tokens * top-k at world 1; independent of R).

Rows past ``counts[e]`` of the output are left unwritten (unspecified), as the layout allows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..interpreter import kernel_for
from ..planner import EXPERT_BLOCK_K, FP8_WEIGHT_BLOCK
from ..triton_kernels.quant import cast_rne
from ..triton_kernels.sync import INTERPRET

# Triton's interpreter multiplies bfloat16 tiles as raw 16-bit integers: there, tiles are widened to
# float32 first (the products are exact in float32 either way; only the compiled path uses bf16 MMA).
DOT_IN_FLOAT32 = tl.constexpr(INTERPRET)
W_BLOCK = tl.constexpr(FP8_WEIGHT_BLOCK)   # rows and columns of an fp8 weight's scale block


@triton.jit
def _b_tile(ptrs, mask, bs_base, s_off, k0, col_live, W_FP8: tl.constexpr, DTYPE: tl.constexpr):
    """A [BK, BN] weight tile at ``ptrs`` as tl.dot takes it: W_FP8, fp8 dequantized to DTYPE (float32 times
    each column's block scale ``bs_base + s_off + k0 // 128``, rounded once); widened to float32 in the
    interpreter (``DOT_IN_FLOAT32``)."""
    b = tl.load(ptrs, mask=mask, other=0.0)
    if W_FP8:
        scale = tl.load(bs_base + s_off + k0 // W_BLOCK, mask=col_live, other=0.0)
        b = cast_rne(b.to(tl.float32) * scale[None, :], DTYPE)
    if DOT_IN_FLOAT32:
        b = b.to(tl.float32)
    return b


@triton.jit
def expert_tile(a_base, a_rows, row_live, b_base, b2_base, n0, K, N, s_ak, s_bk, s_bn, GATED: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
                W_FP8: tl.constexpr = False, bs_base=None, b_block0=0, b2_block0=0):
    """float32 [BM, BN]: the rows of A that start at ``a_base + a_rows`` ([BM] element offsets; elements s_ak
    apart; rows where ``row_live``, the others read as zeros) times columns [n0, n0 + BN) of B [K, N] (at ``b_base``,
    strides s_bk, s_bn), accumulated over K in steps of BK by tl.dot; with GATED, SiLU(A @ B) * (A @ B2)
    (B2 at ``b2_base``, B's strides), in float32. The one GEMM tile of the expert kernels: the masked
    batched experts here and the fused MoE layer (``moe_comm/triton_kernels/moe_gate_up.py``,
    ``moe_down_combine.py``), so a row's result is the same bits whichever kernel computes it.

    W_FP8: B (and B2) are float8_e4m3fn with block scales: B[k, n] is column k of row n of a weight [N, K]
    whose float32 scales start at block row ``b_block0`` (B2: ``b2_block0``) of ``bs_base`` [block rows,
    ceil(K / 128)] (row major; w13's up half has its own blocks after gate's), blocks of FP8_WEIGHT_BLOCK x
    FP8_WEIGHT_BLOCK. Each tile is dequantized in registers to A's
    dtype before tl.dot, as ``reference.dequantize_fp8_weight``: fp8 -> float32, times its block's scale,
    rounded once. BK divides the block, so a K step reads one scale per output column."""
    rn = n0 + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    s_off = rn    # W_FP8: each column's row of block scales, for B and B2 (unused otherwise)
    s2_off = rn
    if W_FP8:
        tl.static_assert(W_BLOCK % BK == 0, "the K step must lie in one fp8 scale block")
        s_cols = (K + W_BLOCK - 1) // W_BLOCK                # scale blocks per weight row
        s_off = (b_block0 + rn // W_BLOCK) * s_cols           # [BN] each column's row of scales
        s2_off = (b2_block0 + rn // W_BLOCK) * s_cols
    # Scalar int64 bases and int32 tile offsets advanced by BK per step (Triton 3.9 has no block
    # pointers; per-element int64 pointer tiles for gate and up spilled on sm_90).
    a_off = a_rows[:, None] + rk[None, :] * s_ak
    b_off = rk[:, None] * s_bk + rn[None, :] * s_bn
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    acc2 = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_live = k0 + rk < K
        # Rows past the count are not read: whatever they hold gives rows that are never stored.
        a = tl.load(a_base + a_off, mask=row_live[:, None] & k_live[None, :], other=0.0)
        b_mask = k_live[:, None] & (rn < N)[None, :]
        DTYPE: tl.constexpr = a_base.dtype.element_ty
        b = _b_tile(b_base + b_off, b_mask, bs_base, s_off, k0, rn < N, W_FP8, DTYPE)
        if DOT_IN_FLOAT32:
            a = a.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if GATED:
            b2 = _b_tile(b2_base + b_off, b_mask, bs_base, s2_off, k0, rn < N, W_FP8, DTYPE)
            acc2 = tl.dot(a, b2, acc2, input_precision=PRECISION)
        a_off += BK * s_ak
        b_off += BK * s_bk
    if GATED:  # SiLU(x @ gate) * (x @ up), in float32
        acc = acc * tl.sigmoid(acc) * acc2
    return acc


@triton.jit
def masked_bmm_kernel(
    a_ptr,        # [E, R, K] activations
    b_ptr,        # [E, K, N] weights (gate with GATED)
    b2_ptr,       # [E, K, N] up weights with GATED, else unused
    c_ptr,        # out [E, R, N]: rows < counts[e] written
    counts_ptr,   # int32 [E]: valid rows per expert (clamped to [0, R])
    R, K, N, E,
    s_ae, s_ar, s_ak, s_be, s_bk, s_bn, s_ce, s_cr, s_cn,
    GATED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, E_P2: tl.constexpr,
    PRECISION: tl.constexpr,  # tl.dot input precision: "ieee" for float32 inputs (no TF32), else "tf32"
):
    # grid = (column tiles, active-expert slots <= E). Slot j takes the j-th expert with rows (in expert
    # order), found from the counts; slots past the number of such experts return at once. The grid
    # does not grow with R, and with a bound on the active experts (few tokens) not with E either.
    j = tl.program_id(1)
    ee = tl.arange(0, E_P2)
    active = (tl.load(counts_ptr + ee, mask=ee < E, other=0) > 0).to(tl.int32)
    pick = (active != 0) & (tl.cumsum(active, 0) - 1 == j)
    e = tl.sum(tl.where(pick, ee, 0))
    n0 = tl.program_id(0) * BN
    rows = tl.minimum(tl.maximum(tl.load(counts_ptr + e), 0), R)
    rows = tl.where(tl.sum(pick.to(tl.int32)) > 0, rows, 0)
    rn = n0 + tl.arange(0, BN)
    a_base = a_ptr + e.to(tl.int64) * s_ae
    b_base = b_ptr + e.to(tl.int64) * s_be
    b2_base = b2_ptr + e.to(tl.int64) * s_be
    c_base = c_ptr + e.to(tl.int64) * s_ce
    for m0 in range(0, rows, BM):
        rm = m0 + tl.arange(0, BM)
        row_live = rm < rows
        acc = expert_tile(a_base, rm * s_ar, row_live, b_base, b2_base, n0, K, N, s_ak, s_bk, s_bn, GATED, BM, BN,
                          BK, PRECISION)
        tl.store(c_base + rm[:, None] * s_cr + rn[None, :] * s_cn, cast_rne(acc, c_ptr.dtype.element_ty),
                 mask=row_live[:, None] & (rn < N)[None, :])


def _tiles(rows: int, expected_rows: int | None):
    """(BM, BN, BK): the row tile follows the rows an expert is expected to get (decode: few)."""
    per_expert = expected_rows if expected_rows is not None else rows
    bm = 16 if per_expert <= 16 else 64  # gate+up with 32-row tiles spills on sm_90 (compile_report)
    return bm, 64, EXPERT_BLOCK_K


def masked_bmm(a: torch.Tensor, b: torch.Tensor, counts: torch.Tensor, b2: torch.Tensor | None = None,
               expected_rows: int | None = None, max_active: int | None = None) -> torch.Tensor:
    """c[e, :counts[e]] = a[e, :counts[e]] @ b[e] (or SiLU(a @ b) * (a @ b2) with ``b2``); a [E, R, K],
    b/b2 [E, K, N], counts int32 [E] on the device. Returns c [E, R, N] in a's dtype; other rows unspecified.
    ``expected_rows``: rows an expert is expected to hold (picks the row tile; never a bound).
    ``max_active``: a bound on the experts with rows (e.g. tokens * top-k), a promise: experts past the
    bound (in expert order) would not be computed. None = E."""
    E, R, K = a.shape
    N = b.shape[2]
    if b.shape[:2] != (E, K) or counts.shape != (E,) or (b2 is not None and (
            b2.shape != b.shape or b2.stride() != b.stride())):
        raise ValueError(f"masked_bmm: a {tuple(a.shape)}, b {tuple(b.shape)}, counts {tuple(counts.shape)}"
                         + ("" if b2 is None else f", b2 {tuple(b2.shape)} strides {b2.stride()} vs {b.stride()}")
                         + ": need a [E, R, K], b and b2 [E, K, N] with the same strides, counts [E]")
    c = torch.empty((E, R, N), dtype=a.dtype, device=a.device)
    slots = E if max_active is None else max(0, min(E, int(max_active)))
    if slots == 0 or R == 0 or N == 0:
        return c
    bm, bn, bk = _tiles(R, expected_rows)
    b2_ = b if b2 is None else b2
    grid = (triton.cdiv(N, bn), slots)
    kernel_for(masked_bmm_kernel, a.device)[grid](a, b, b2_, c, counts, R, K, N, E, *a.stride(), *b.stride(), *c.stride(),
                            GATED=b2 is not None, BM=bm, BN=bn, BK=bk, E_P2=triton.next_power_of_2(E),
                            PRECISION="ieee" if a.dtype == torch.float32 else "tf32")
    return c


def masked_expert_mlp(x_e: torch.Tensor, counts: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                      down: torch.Tensor, expected_rows: int | None = None,
                      max_active: int | None = None) -> torch.Tensor:
    """SiLU-gated expert MLPs on rows x_e[e, :counts[e]] only: x_e [E, R, H], gate/up [E, H, I],
    down [E, I, H] -> [E, R, H] (rows past a count unspecified). Two launches, no host read."""
    h = masked_bmm(x_e, gate, counts, b2=up, expected_rows=expected_rows, max_active=max_active)
    return masked_bmm(h, down, counts, expected_rows=expected_rows, max_active=max_active)


def gated_views(gate_up: torch.Tensor, down: torch.Tensor, transposed: bool = False):
    """(gate, up, down) as ``masked_expert_mlp`` takes them ([E, H, I], [E, H, I], [E, I, H]): views, no copy, of
    expert weights held as transformers holds them, gate_up [E, 2I, H] (the gate's I rows first) and down
    [E, H, I], or with ``transposed`` gate_up [E, H, 2I] and down [E, I, H]."""
    if transposed:
        i = gate_up.shape[2] // 2
        return gate_up[:, :, :i], gate_up[:, :, i:], down
    i = gate_up.shape[1] // 2
    return gate_up[:, :i, :].transpose(1, 2), gate_up[:, i:, :].transpose(1, 2), down.transpose(1, 2)


def dense_expert_mlp(x_e: torch.Tensor, counts: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                     down: torch.Tensor, expected_rows: int | None = None,
                     max_active: int | None = None) -> torch.Tensor:
    """The same with ``torch.bmm`` over every row of every expert (reads every expert's weights)."""
    del counts, expected_rows, max_active
    return torch.bmm(F.silu(torch.bmm(x_e, gate)) * torch.bmm(x_e, up), down)


EXPERT_IMPLS = {"masked": masked_expert_mlp, "dense": dense_expert_mlp}


def _compile_configs() -> list[dict]:
    """Llama-4-Scout (hidden 5120, expert width 8192) and DeepSeek-V3 (7168, 2048) expert GEMMs in bf16 at
    decode row tiles: what ``compile_report`` compiles for sm_90 without a GPU."""
    types = dict(a_ptr="*bf16", b_ptr="*bf16", b2_ptr="*bf16", c_ptr="*bf16", counts_ptr="*i32", R="i32", K="i32",
                 N="i32", E="i32", s_ae="i64", s_ar="i32", s_ak="i32", s_be="i64", s_bk="i32", s_bn="i32", s_ce="i64",
                 s_cr="i32", s_cn="i32")
    out = []
    for gated in (True, False):
        for bm in (16, 64):
            out.append(dict(kernel="masked_bmm_kernel", label=f"{'gate+up' if gated else 'down'} bf16 BM={bm}",
                            types=types, constexprs=dict(GATED=gated, BM=bm, BN=64, BK=64, E_P2=256,
                                                         PRECISION="tf32")))
    return out + _door_configs()


# (dtype, experts, hidden, expert width, EPBuffer rows per expert, row tiles) of the door's configs below
DOOR_SHAPES = (("bf16", 256, 7168, 2048, 64, (16, 64)),   # DeepSeek-V3 at world 1, decode_tokens 64
               ("fp32", 8, 64, 32, 4, (16,)))             # the tiny model of the GPU generation check


def _door_configs() -> list[dict]:
    """The kernel as the transformers door launches it (``serving/hf/experts.decode_experts``): its weights are
    ``gated_views`` of transformers' gate_up_proj [E, 2I, H] and down_proj [E, H, I] (contiguous along K), and
    every integer argument is specialized from the value the launch passes (``compile_report.launch_ints``:
    strides of 1 become constexprs, multiples of 16 are known divisible)."""
    from ..triton_kernels.compile_report import launch_ints  # noqa: PLC0415
    out = []
    for dtype, E, H, I, R, tiles in DOOR_SHAPES:
        def meta(*shape):
            return torch.empty(*shape, device="meta")
        gate, _, down = gated_views(meta(E, 2 * I, H), meta(E, H, I))
        x, h, y = meta(E, R, H), meta(E, R, I), meta(E, R, H)
        for gated, a, b, c in ((True, x, gate, h), (False, h, down, y)):
            ints = dict(R=R, K=a.shape[2], N=b.shape[2], E=E)
            for names, t in ((("s_ae", "s_ar", "s_ak"), a), (("s_be", "s_bk", "s_bn"), b), (("s_ce", "s_cr", "s_cn"), c)):
                ints.update(zip(names, t.stride()))
            types, constexprs, divisible = launch_ints(ints)
            ptr = "*" + dtype
            types.update(a_ptr=ptr, b_ptr=ptr, b2_ptr=ptr, c_ptr=ptr, counts_ptr="*i32")
            for bm in tiles:
                out.append(dict(kernel="masked_bmm_kernel", label=f"door {'gate+up' if gated else 'down'} {dtype} "
                                f"BM={bm}", types=types, divisible=divisible,
                                constexprs=dict(constexprs, GATED=gated, BM=bm, BN=64, BK=64,
                                                E_P2=triton.next_power_of_2(E),
                                                PRECISION="tf32" if dtype == "bf16" else "ieee")))
    return out


COMPILE_CONFIGS = _compile_configs()
