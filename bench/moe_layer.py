"""The fused MoE layer against our unfused path and against dispatch + torch._grouped_mm + combine.

    python bench/moe_layer.py [--out-dir DIR]     # a GPU: the issue's grid (below)
    python bench/moe_layer.py --dry               # no GPU: tiny shapes in Triton's interpreter

Per (shape, world, T), one MoE layer call of every rank (a loopback world on one device; on a GPU each rank
on its own stream, the whole round replayed from a CUDA graph), three implementations on the same inputs
and weights:

  fused       moe_comm.MoELayer(path="fused"): gate/up reading rows where they landed, down + combine send
  fused_fp8   the same with the weights as fp8 e4m3 + 128x128 block scales (DeepSeek-V3's checkpoint
              format), dequantized per tile in the kernels
  unfused     moe_comm.MoELayer(path="unfused"): EPBuffer.dispatch, the masked batched experts
              (serving/experts.py), EPBuffer.combine
  grouped_mm  EPBuffer.dispatch, the valid rows packed by expert, torch._grouped_mm for gate/up, SiLU * up,
              torch._grouped_mm for down, the rows unpacked, EPBuffer.combine

Shapes: DeepSeek-V3 (hidden 7168, intermediate 2048, 256 experts, top-8) and a DeepSeek-V4-Flash-like one
(hidden 4096, intermediate 2048, 256 experts, top-6); worlds 1 and 8 (8 emulated ranks on one GPU);
T = 1, 8, 64, 128, 512 tokens per rank; bf16 tokens. Routing is uniform (random top-k). The weights are
drawn as fp8 codes and block scales; every implementation but fused_fp8 takes their dequantized bf16
values (``reference.dequantize_fp8_weight``), so all four compute the same math on the same weights and
fused_fp8 must equal fused bit for bit.

The floor of a point: the bytes the layer must move on the one device (every rank's active experts'
weights read once: ``MoELayer.weight_bytes`` per active expert, 3 * I * H * 2 bytes in bf16, half of that
plus the scales for fused_fp8; the tokens read and the outputs written; every
row that crosses ranks written by its sender and read by its receiver, dispatch and combine) at the
measured copy bandwidth (bench/kernels.py's floor: read + write), plus the fused layer's launches (5 per
rank at world > 1, 4 at world 1, on the critical path: with a stream per rank the ranks' launches overlap,
so a round's floor counts one rank's, and W times that only where the ranks run in turn) at the measured
empty-kernel time. Each line carries p20/p50/p80 µs, the floor, p50 / floor, the speedup over
``unfused``, and the largest |difference| from ``unfused`` (the four compute the same math; the fused
kernels use 16-row GEMM tiles on a GPU, the masked experts 64-row ones once an expert's capacity exceeds
16 rows, EP8 T >= 8, so there the last bits may differ) and, for fused_fp8, from ``fused`` (the same tiles
on the same dequantized operands: 0 expected).

Order (a step cut by its time budget keeps what it finished): world 8 first, T = 128 and 512 first (the
crossover of ``path="auto"``, ``moe_layer.FUSED_MAX_TOKENS`` = 128, lies between them or not), then the
decode sizes; per point ``unfused`` first, and each implementation's line written as soon as it is timed.
Compiling dominates a first run: a point at world 8 launches about 30 kernel variants not compiled before
(each kernel per rank class: rank 0, 1, other; every T is another specialization), one at world 1 about 10,
so the whole grid is ~200 compiles per shape (counted by recording the launches on the CPU), minutes on a
GPU machine; the gpu-quick step's 150 s holds the first two or three points.
An implementation that runs out of GPU memory is recorded as a ``skip`` line (what it needed) and the run
goes on.

A --dry run proves the script's logic on tiny shapes; its numbers mean nothing about a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch

import moe_comm
from bench import peers
from moe_comm import reference
from moe_comm.planner import FP8_WEIGHT_BLOCK
from bench.common import JsonLines, environment, time_us
from bench.kernels import graphed, measure_floor, rank_streams, run_phases

# name -> (hidden, intermediate, experts, topk)
SHAPES = {"dsv3": (7168, 2048, 256, 8), "v4flash": (4096, 2048, 256, 6)}
DRY_SHAPE = (128, 64, 8, 2)
GPU_TOKENS, GPU_WORLDS = (128, 512, 1, 64, 8), (8, 1)   # EP8 and the crossover's bracket first: a cut run keeps them
# unfused first: every later line carries its speedup; grouped_mm compiles nothing new (unfused's EPBuffer
# kernels), fused_fp8 its own gate/up and down variants: last
IMPLS = ("unfused", "fused", "grouped_mm", "fused_fp8")
FUSED_LAUNCHES = {1: 4, "multi": 5}   # per rank: world 1 / world > 1


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry", action="store_true", help="no GPU: tiny shapes in the interpreter")
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--shapes", default="dsv3,v4flash")
    p.add_argument("--worlds", default=None, help="comma separated (default 8,1; dry 1,2)")
    p.add_argument("--tokens", default=None,
                   help="comma separated tokens per rank, timed in this order (default 128,512,1,64,8; dry 1,3)")
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    o = p.parse_args(argv)
    o.device = torch.device("cpu" if o.dry or not torch.cuda.is_available() else "cuda")
    o.worlds = [int(v) for v in (o.worlds or ("1,2" if o.dry else ",".join(map(str, GPU_WORLDS)))).split(",")]
    o.tokens = [int(v) for v in (o.tokens or ("1,3" if o.dry else ",".join(map(str, GPU_TOKENS)))).split(",")]
    o.shapes = o.shapes.split(",")
    o.impls = o.impls.split(",")
    return o


class GroupedMM:
    """dispatch + torch._grouped_mm + combine on one rank: the composition a user of our ops would write with
    torch's grouped GEMM (valid rows packed by expert so that each group is contiguous, then unpacked)."""

    def __init__(self, group, experts, hidden, inter, tokens, topk, w13, w2):
        self.ep = moe_comm.EPBuffer(group, experts, hidden, tokens, topk)
        self.gate_up = w13.transpose(1, 2)   # [L, H, 2I]
        self.down = w2.transpose(1, 2)       # [L, I, H]
        self.inter, self.cap = inter, self.ep.plan.capacity
        self.rows = min(self.ep.num_local_experts * self.cap, group.world_size * tokens * topk)   # packed rows
        self._d = self._w = None

    def send(self, x, idx, w):
        self._w = w
        self.ep.dispatch(x, idx, phase="send")

    def experts(self):
        d = self.ep.dispatch(phase="recv")
        L, H = d.x.shape[0], d.x.shape[2]
        ends = d.counts.cumsum(0)
        j = torch.arange(self.rows, device=d.x.device)
        e = torch.searchsorted(ends, j, right=True).clamp(max=L - 1)
        row = (e * self.cap + j - (ends - d.counts)[e]).clamp(max=L * self.cap - 1)
        packed = d.x.view(L * self.cap, H).index_select(0, row)
        offs = ends.to(torch.int32)
        h = torch._grouped_mm(packed, self.gate_up, offs=offs).float()
        a = (torch.nn.functional.silu(h[:, :self.inter]) * h[:, self.inter:]).to(d.x.dtype)
        o = torch._grouped_mm(a, self.down, offs=offs)
        out = torch.empty(L * self.cap + 1, H, dtype=d.x.dtype, device=d.x.device)
        out.index_copy_(0, torch.where(j < ends[-1], row, L * self.cap), o)   # rows past the counts: a dump row
        self.ep.combine(out[:-1].view(L, self.cap, H), self._w, d.handle, phase="send")

    def recv(self):
        return self.ep.combine(phase="recv")

    def both(self, x, idx, w):   # world 1: every op in one call (a split world-1 dispatch copies its inputs)
        d = self.ep.dispatch(x, idx)
        self.ep.dispatch = lambda *a, **k: d   # experts() takes this call's result
        try:
            self._w = w
            self.experts()
        finally:
            del self.ep.dispatch
        return self.ep.combine(phase="recv")

    def close(self):
        self.ep.close()


class Layer:
    """MoELayer driven in the same three phases."""

    def __init__(self, group, experts, hidden, inter, tokens, topk, weights, path):
        fp8 = path == "fused_fp8"
        w13, w2 = (weights["w13"], weights["w2"]) if fp8 else (weights["w13_bf16"], weights["w2_bf16"])
        scales = dict(w13_scale=weights["w13_scale"], w2_scale=weights["w2_scale"]) if fp8 else {}
        self.layer = moe_comm.MoELayer(group, experts, hidden, inter, tokens, topk, w13, w2,
                                       path="fused" if fp8 else path, **scales)

    def send(self, x, idx, w):
        self.layer(x, idx, w, phase="send")

    def experts(self):
        self.layer(phase="experts")

    def recv(self):
        return self.layer(phase="recv")

    def both(self, x, idx, w):
        return self.layer(x, idx, w)

    def close(self):
        self.layer.close()


def call_all(ranks, streams, xs, idxs, ws) -> list:
    """One layer call of every rank: every send, then every experts phase, then every receive (on a GPU each
    rank on its stream, each phase after every rank's previous one: ``run_phases``). World 1: one call."""
    if len(ranks) == 1:
        return [ranks[0].both(xs[0], idxs[0], ws[0])]
    run_phases(streams, [lambda r=r, i=i: r.send(xs[i], idxs[i], ws[i]) for i, r in enumerate(ranks)],
               [r.experts for r in ranks])
    return run_phases(streams, [lambda: None for _ in ranks], [r.recv for r in ranks])


def floor_bytes(idxs, experts: int, hidden: int, inter: int, world: int, fp8: bool = False) -> int:
    """Bytes the layer must move on the one device (module docstring)."""
    local = experts // world
    ids = torch.cat([i.reshape(-1) for i in idxs])
    active = int(torch.unique(ids[ids >= 0]).numel())   # each read once, by its rank
    total = moe_comm.MoELayer.weight_bytes(active, hidden, inter, fp8=fp8)
    for r, idx in enumerate(idxs):
        owner = torch.where(idx >= 0, idx // local, -1)
        remote_slots = int(((owner >= 0) & (owner != r)).sum())
        remote_tokens = sum(len({int(o) for o in row if o >= 0 and o != r}) for row in owner.tolist())
        total += 2 * (remote_tokens + remote_slots) * hidden * 2 + 2 * idx.shape[0] * hidden * 2
    return total


def bench_point(o, out, floor, name, shape, world, tokens, groups, weights, gen):
    hidden, inter, experts, topk = shape
    xs = [torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).to(o.device) for _ in groups]
    idxs = [peers.random_topk(tokens, experts, topk, gen).to(o.device) for _ in groups]
    ws = [torch.rand(tokens, topk, generator=gen).to(o.device) for _ in groups]
    streams = rank_streams(o.device, world)
    launches = FUSED_LAUNCHES[1 if world == 1 else "multi"] * (1 if streams else world)   # on the critical path
    floors = {fp8: floor_bytes([i.cpu() for i in idxs], experts, hidden, inter, world, fp8) / (floor[0] * 1e3)
              + launches * floor[1] for fp8 in (False, True)}
    sizes = dict(op="moe_layer", shape=name, hidden=hidden, intermediate=inter, experts=experts, topk=topk,
                 world=world, tokens=tokens)
    results, ys = {}, {}
    for impl in o.impls:
        ranks = []
        try:
            if impl == "grouped_mm":
                ranks = [GroupedMM(g, experts, hidden, inter, tokens, topk, weights[r]["w13_bf16"],
                                   weights[r]["w2_bf16"]) for r, g in enumerate(groups)]
            else:
                ranks = [Layer(g, experts, hidden, inter, tokens, topk, weights[r], impl) for r, g in enumerate(groups)]
            ys[impl] = [y.float().cpu() for y in call_all(ranks, streams, xs, idxs, ws)]
            results[impl] = time_us(graphed(lambda i: call_all(ranks, streams, xs, idxs, ws), o.device), o.device,
                                    o.iters, o.warmup)
        except torch.OutOfMemoryError as e:   # this point does not fit beside the weights: the run goes on
            held = f"{torch.cuda.memory_allocated(o.device) / 2**30:.1f} GiB held" if o.device.type == "cuda" else ""
            out.write(kind="skip", impl=impl, why=f"out of GPU memory ({held}): {str(e)[:300]}", **sizes)
            print(f"{name} W{world} T{tokens} {impl}: skipped, out of GPU memory ({held})", flush=True)
            ys.pop(impl, None)
        finally:
            for r in reversed(ranks):
                r.close()
            if o.device.type == "cuda":
                torch.cuda.empty_cache()
        if impl not in results:
            continue
        for g in groups:
            g.check()
        _write_result(out, impl, results, ys, floors[impl == "fused_fp8"], streams, sizes)


def _max_diff(ys, a, b):
    """Largest |y_a - y_b| over every rank's rows (None when either was not run)."""
    if a not in ys or b not in ys:
        return None
    return max((float((p - q).abs().max()) if p.numel() else 0.0 for p, q in zip(ys[a], ys[b])), default=0.0)


def _write_result(out, impl, results, ys, floor_us, streams, sizes):
    timing, base = results[impl], results.get("unfused")
    diff = _max_diff(ys, impl, "unfused")
    fp8_diff = _max_diff(ys, impl, "fused") if impl == "fused_fp8" else None
    out.write(kind="result", impl=impl, floor_us=floor_us, x_floor=timing["p50_us"] / floor_us,
              speedup_vs_unfused=None if base is None else base["p50_us"] / timing["p50_us"],
              max_abs_diff_vs_unfused=diff, max_abs_diff_vs_fused=fp8_diff,
              streams="one per rank" if streams else "one (ranks in turn)",
              heap="loopback (emulated on one device)" if sizes["world"] > 1 else "loopback", **sizes, **timing)
    print(f"{sizes['shape']} W{sizes['world']} T{sizes['tokens']} {impl}: {timing['p50_us']:.1f} us, floor "
          f"{floor_us:.1f} us" + ("" if base is None else f", x{base['p50_us'] / timing['p50_us']:.2f} vs unfused")
          + ("" if diff is None else f", max |diff| vs unfused {diff:.3g}")
          + ("" if fp8_diff is None else f", vs fused {fp8_diff:.3g}"), flush=True)


def fp8_weights(local: int, hidden: int, inter: int, device) -> dict:
    """One rank's experts: w13 [L, 2I, H] and w2 [L, H, I] as fp8 e4m3 codes (normal draws) with float32
    128x128 block scales (1/sqrt(K) times a uniform draw in [1/2, 3/2) per block), and their dequantized
    bf16 values w13_bf16, w2_bf16 (``reference.dequantize_fp8_weight``, one expert at a time: its float32
    temporary of the whole tensor would not fit beside them)."""
    out = {}
    for name, (n, k) in (("w13", (2 * inter, hidden)), ("w2", (hidden, inter))):
        halves = 2 if name == "w13" else 1   # w13: gate's block rows, then up's (MoELayer's w13_scale)
        grid = (local, halves * -(-(n // halves) // FP8_WEIGHT_BLOCK), -(-k // FP8_WEIGHT_BLOCK))
        q = torch.empty(local, n, k, device=device, dtype=torch.float8_e4m3fn)
        deq = torch.empty(local, n, k, device=device, dtype=torch.bfloat16)
        scale = (0.5 + torch.rand(grid, device=device)) / k ** 0.5
        for e in range(local):
            q[e] = torch.randn(n, k, device=device, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
            deq[e] = (reference.dequantize_fp8_w13 if name == "w13" else reference.dequantize_fp8_weight)(
                q[e], scale[e], torch.bfloat16)
        out.update({name: q, f"{name}_scale": scale, f"{name}_bf16": deq})
    return out


def main(argv=None) -> int:
    o = parse_args(argv)
    env = environment(o.device)
    out = JsonLines(os.path.join(o.out_dir, "moe_layer.jsonl"), env, o.dry)
    floor = measure_floor(o, out)
    gen = torch.Generator().manual_seed(4)
    for name in o.shapes:
        shape = DRY_SHAPE if o.dry else SHAPES[name]
        hidden, inter, experts, topk = shape
        for world in o.worlds:
            groups = moe_comm.init(backend="loopback", world_size=world, device=o.device, timeout_s=60.0)
            local = experts // world
            torch.manual_seed(5)   # weights drawn on the device (22 GB of DeepSeek-V3 experts in bf16, 11 in fp8)
            weights = [fp8_weights(local, hidden, inter, o.device) for _ in groups]
            for tokens in o.tokens:
                bench_point(o, out, floor, name, shape, world, tokens, groups, weights, gen)
            for g in groups:
                g.close()
            del weights
    print(f"wrote {out.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
