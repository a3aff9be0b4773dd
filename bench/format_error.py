"""Error of the low-precision formats against the exact path, on synthetic MoE activations.

    python bench/format_error.py [--tokens 512] [--hidden 7168] [--topk 8] [--seed 0] [--kernel-tokens 2]

What it measures, per activation model (below):

- combine: y = sum over k of w[t, k] * row(t, k), the rows being expert outputs in bf16. The exact value is
  that sum in float64; the bf16 combine (combine_format=None) is the float32 sum in k order rounded to
  bf16 (``reference.combine``), the fp8 combine (combine_format="e4m3") the same sum of
  ``reference.fp8_round_trip`` of each row (``reference.combine(..., fp8=True)``); LogFMT-10 is an emulation
  of DeepEP's ``use_logfmt`` combine format (below), for comparison only (moe-comm does not implement it).
- dispatch: x ~= dequantize(quantize(x)) per token, fp8 (e4m3, per 128 columns) and nvfp4 (per 16 columns,
  global scale 448 * 6 / max |x| over the batch, ``reference.nvfp4_global_scale``).

Errors are relative, per token t: ||y_t - exact_t||_2 / ||exact_t||_2 (mean, p99 and max over tokens), the
same over the whole batch (||Y - exact||_F / ||exact||_F), and the largest element error relative to the
token's largest magnitude (max |y - exact| / max |exact|). With outlier channels the per-token figures are
dominated by those channels, so the outlier models also report the per-token mean over the other
channels ("bulk"): what the large channels' share of a group scale costs their neighbours. ``--kernel-tokens`` tokens of each model also
go through EPBuffer's kernels (world 1, Triton's interpreter on a CPU) and must equal the reference bit
for bit: the table is the kernels' error, not only the formula's.

Activation models (every row bf16, as an expert's output or a token's hidden state):
  gaussian      N(0, 1) per element, times a per-token scale exp(N(0, 0.5))
  heavy-tail    Student-t with 3 degrees of freedom per element, times the per-token scale
  outliers      heavy-tail plus OUTLIER_CHANNELS fixed channels 100x larger (the "massive activations"
                of LLM hidden states: a few channels orders of magnitude above the rest)
  outliers-1e3  the same with 1000x channels
  sparse-rows   heavy-tail with 90 % of a row's elements zero (ReLU-like sparsity)
Synthetic: no model's real activations are used (none are available here); the outlier models are the
adversarial case for per-group scales, since one large channel sets the scale of its 127 (or 15)
neighbours.

LogFMT-10 (DeepEP csrc/kernels/internode_ll.cu ``logfmt_encode`` / ``decode_and_accumulate``): per
128-column group with amax = max |x| < 1 and amin = min |x| (of the bf16 values) with log2(amin) <
log2(amax), a 9-bit log code between log2(amin) (clipped at log2(amax) - 32) and log2(amax) plus a sign
bit; other groups stay bf16. Emulated here in float32 with torch's log2/exp2 where DeepEP uses the GPU's
approximate lg2/ex2, so its figures are the format's, within those functions' error. Whether a group is
cast depends on its magnitude (amax < 1), unlike e4m3's scaled codes: the LogFMT rows run once on the
model's rows as they are and once scaled by LOGFMT_SMALL (every group then below 1), with the share of
groups cast.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch  # noqa: E402

from moe_comm import reference  # noqa: E402

MODELS = ("gaussian", "heavy-tail", "outliers", "outliers-1e3", "sparse-rows")
OUTLIER_CHANNELS = 4
LOGFMT_BITS = 10
LOGFMT_MIN_CLIP = 32.0   # DeepEP's kMinClip: log2(amin) is clipped at log2(amax) - 32
LOGFMT_SMALL = 2.0 ** -12   # rows scaled by this have every 128-column group below 1: LogFMT casts them all


def activations(model: str, rows: int, hidden: int, g: torch.Generator, channels=None) -> torch.Tensor:
    """bf16 [rows, hidden] of ``model`` (module docstring); ``channels``: the outlier channels (default random)."""
    scale = torch.exp(torch.randn(rows, 1, generator=g) * 0.5)
    if model == "gaussian":
        x = torch.randn(rows, hidden, generator=g)
    else:
        normal = torch.randn(rows, hidden, generator=g)
        chi2 = sum(torch.randn(rows, hidden, generator=g) ** 2 for _ in range(3))
        x = normal / torch.sqrt(chi2 / 3)          # Student-t, 3 degrees of freedom
    if model.startswith("outliers"):
        factor = 1000.0 if model == "outliers-1e3" else 100.0
        channels = torch.randperm(hidden, generator=g)[:OUTLIER_CHANNELS] if channels is None else channels
        x[:, channels] = factor * (1 + torch.rand(rows, OUTLIER_CHANNELS, generator=g))
    if model == "sparse-rows":
        x[torch.rand(rows, hidden, generator=g) < 0.9] = 0.0
    return (x * scale).to(torch.bfloat16)


def logfmt_cast(x: torch.Tensor) -> float:
    """Share of the 128-column groups of bf16 ``x`` that LogFMT-10 casts (the others stay bf16)."""
    a = x.float().unflatten(-1, (-1, 128)).abs()
    amax, amin = a.amax(dim=-1), a.amin(dim=-1)
    log_amax = torch.log2(amax)
    return ((log_amax < 0) & (torch.maximum(torch.log2(amin), log_amax - LOGFMT_MIN_CLIP) < log_amax)).float().mean().item()


def logfmt_round_trip(x: torch.Tensor) -> torch.Tensor:
    """DeepEP's LogFMT-10 encode then decode of bf16 ``x`` [..., H] (H % 128 == 0), float32 (emulation)."""
    n_values = 1 << (LOGFMT_BITS - 1)
    xf = x.float().unflatten(-1, (-1, 128))
    a = xf.abs()
    amax, amin = a.amax(dim=-1, keepdim=True), a.amin(dim=-1, keepdim=True)
    log_amax = torch.log2(amax)
    log_amin = torch.maximum(torch.log2(amin), log_amax - LOGFMT_MIN_CLIP)
    cast = (log_amax < 0) & (log_amin < log_amax)
    step = (log_amax - log_amin) / (n_values - 2)
    rounding = 2.0 - torch.log2((1.0 + torch.exp2(step)) * 0.5) / step
    code = torch.floor(torch.clamp(torch.log2(a) / step + (rounding - log_amin / step), min=0))
    decoded = torch.where(code == 0, 0.0, torch.exp2((code - 1) * step + log_amin))
    return torch.where(cast, torch.copysign(decoded, xf), xf).flatten(-2)


def errors(y: torch.Tensor, exact: torch.Tensor, bulk: torch.Tensor | None = None) -> dict:
    """Relative errors of y [T, H] against exact [T, H] (float64): module docstring; ``bulk``: bool [H], the
    channels of the "bulk" figure (None: no such figure)."""
    d = (y.double() - exact)
    per_token = d.norm(dim=1) / exact.norm(dim=1).clamp_min(1e-300)
    elem = d.abs().amax(dim=1) / exact.abs().amax(dim=1).clamp_min(1e-300)
    out = dict(mean=per_token.mean().item(), p99=torch.quantile(per_token, 0.99).item(),
               max=per_token.max().item(), overall=(d.norm() / exact.norm()).item(), max_elem=elem.max().item())
    if bulk is not None:
        out["bulk_mean"] = (d[:, bulk].norm(dim=1) / exact[:, bulk].norm(dim=1).clamp_min(1e-300)).mean().item()
    return out


def combine_rows(rows: torch.Tensor, w: torch.Tensor, transform=None) -> torch.Tensor:
    """float32 sum over k in ascending order of w[:, k] * transform(rows[:, k]) (rows [T, K, H] bf16)."""
    acc = torch.zeros(rows.shape[0], rows.shape[2])
    for k in range(rows.shape[1]):
        r = rows[:, k].float() if transform is None else transform(rows[:, k])
        acc = acc + w[:, k, None] * r
    return acc


def routing_weights(tokens: int, topk: int, g: torch.Generator) -> torch.Tensor:
    """DeepSeek-V3's: top-k sigmoid scores normalized to sum 1, times its routed scaling factor 2.5."""
    s = torch.sigmoid(torch.randn(tokens, topk, generator=g) * 2)
    return s / s.sum(dim=1, keepdim=True) * 2.5


def kernel_check(rows: torch.Tensor, w: torch.Tensor, x: torch.Tensor, gs: torch.Tensor) -> bool:
    """EPBuffer (world 1, loopback) with combine_format="e4m3" and dispatch_format="nvfp4" on these rows:
    the combine equals reference.combine(..., fp8=True) and the dispatch reference.quantize_nvfp4, bitwise."""
    import moe_comm  # noqa: PLC0415
    T, K, H = rows.shape
    group = moe_comm.init(backend="loopback", device="cpu")[0]
    ep = moe_comm.EPBuffer(group, T * K, H, T, K, dispatch_format="nvfp4", combine_format="e4m3")
    idx = torch.arange(T * K).view(T, K)           # every slot its own expert: row (t, k) is expert t*K + k's
    d = ep.dispatch(x, idx, global_scale=gs)
    q, s = reference.quantize_nvfp4(x, gs)
    same = all(torch.equal(d.x[t * K + k, 0], q[t]) and torch.equal(d.scales[t * K + k, 0].view(torch.uint8),
                                                                     s[t].view(torch.uint8))
               for t in range(T) for k in range(K))
    expert_out = torch.zeros(T * K, T, H, dtype=torch.bfloat16)
    expert_out[:, 0] = rows.reshape(T * K, H)
    y = ep.combine(expert_out, w, d.handle)
    want = reference.combine([expert_out], [w], [idx], T * K, T, fp8=True)[0]
    ep.close()
    return same and torch.equal(y, want)


def measure(args) -> list[dict]:
    g = torch.Generator().manual_seed(args.seed)
    out = []
    for model in MODELS:
        # The same outlier channels in every expert's output and every token (a model's massive activations
        # live in fixed channels).
        channels = torch.randperm(args.hidden, generator=g)[:OUTLIER_CHANNELS]
        bulk = None
        if model.startswith("outliers"):
            bulk = torch.ones(args.hidden, dtype=torch.bool)
            bulk[channels] = False
        rows = activations(model, args.tokens * args.topk, args.hidden, g, channels).view(
            args.tokens, args.topk, args.hidden)
        w = routing_weights(args.tokens, args.topk, g)
        exact = (w.double()[:, :, None] * rows.double()).sum(dim=1)
        res = dict(model=model)

        def combine(name, transform, scale=1.0):
            r = rows if scale == 1.0 else (rows.float() * scale).to(torch.bfloat16)   # exact: a power of two
            res[name] = errors(combine_rows(r, w, transform).to(torch.bfloat16).double() / scale, exact, bulk)
        combine("combine bf16", None)
        combine("combine e4m3", reference.fp8_round_trip)
        combine("combine LogFMT-10 (emulated)", logfmt_round_trip)
        res["combine LogFMT-10 (emulated)"]["cast"] = logfmt_cast(rows)
        combine("combine LogFMT-10 (emulated) rows x 2^-12", logfmt_round_trip, LOGFMT_SMALL)
        res["combine LogFMT-10 (emulated) rows x 2^-12"]["cast"] = logfmt_cast((rows.float() * LOGFMT_SMALL))
        x = activations(model, args.tokens, args.hidden, g, channels)
        gs = reference.nvfp4_global_scale(x)
        res["dispatch e4m3"] = errors(reference.fp8_round_trip(x), x.double(), bulk)
        res["dispatch nvfp4"] = errors(reference.dequantize_nvfp4(*reference.quantize_nvfp4(x, gs), gs), x.double(),
                                       bulk)
        if args.kernel_tokens:
            n = args.kernel_tokens
            res["kernels_bit_exact"] = kernel_check(rows[:n].contiguous(), w[:n].contiguous(), x[:n].contiguous(), gs)
        out.append(res)
    return out


def wire_bytes(hidden: int) -> dict:
    """Payload bytes of one row on the wire per format (routing words aside): formats.py's layouts."""
    from moe_comm.formats import fp8_row_words  # noqa: PLC0415
    return {"bf16": 2 * hidden, "e4m3": 4 * fp8_row_words(hidden), "nvfp4": hidden // 2 + hidden // 16,
            "LogFMT-10 (all groups cast)": hidden * LOGFMT_BITS // 8 + 4 * (hidden // 128)}


def table(results: list[dict]) -> str:
    keys = [k for k in results[0] if k not in ("model", "kernels_bit_exact")]
    lines = ["| model | path | per-token mean | p99 | max | overall | max element / token max | bulk mean |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        for k in keys:
            e = r[k]
            path = k + (f" ({100 * e['cast']:.0f} % of groups cast)" if "cast" in e else "")
            bulk = f"{e['bulk_mean']:.2e}" if "bulk_mean" in e else ""
            lines.append(f"| {r['model']} | {path} | {e['mean']:.2e} | {e['p99']:.2e} | {e['max']:.2e} | "
                         f"{e['overall']:.2e} | {e['max_elem']:.2e} | {bulk} |")
    return "\n".join(lines)


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kernel-tokens", type=int, default=2, help="tokens per model also run through the kernels")
    a = ap.parse_args(argv)
    if a.hidden % 128:
        ap.error("--hidden must be a multiple of 128")
    return a


def main(argv=None) -> int:
    args = parse(argv)
    results = measure(args)
    print(table(results))
    print("bytes per row on the wire:", wire_bytes(args.hidden))
    print("kernels bit-exact against the reference:", {r["model"]: r.get("kernels_bit_exact") for r in results})
    print(json.dumps(dict(op="format_error", args=vars(args), results=results, wire_bytes=wire_bytes(args.hidden))))
    bad = [r["model"] for r in results if r.get("kernels_bit_exact") is False]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
