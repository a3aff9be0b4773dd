"""``python -m moe_comm selftest``: a short correctness run of every op on what this machine has.

Runs AllToAllvDynamic (forward and reverse), EPBuffer dispatch + combine in bf16 and with fp8 dispatch,
and the DeepEP-compatible Buffer, on a loopback group of 2 ranks on the CPU (Triton's interpreter) and,
where CUDA is available, on loopback groups of 1 and 2 ranks on the GPU (compiled kernels). Results are
compared with ``moe_comm.reference``: exactly on the CPU; on a GPU, fp8 codes may differ by one step
where a rounding tie is decided differently, and combine sums by float32 rounding (fused multiply-adds).
Exit status 0 when every check passes, 1 otherwise. Takes a few seconds on a CPU.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from dataclasses import dataclass

import torch

from . import reference
from .group import init

# Small odd shapes: 8 experts of hidden 256 (two fp8 scale groups), top-3, up to 6 tokens per rank.
NUM_EXPERTS, HIDDEN, TOPK, MAX_TOKENS = 8, 256, 3, 6
A2A_ROWS, A2A_ROW = 4, (64,)
GPU_COMBINE_TOL = 1e-2   # relative and absolute, bf16 outputs of float32 sums of bf16 rows


@dataclass
class Result:
    check: str
    target: str
    ok: bool
    seconds: float
    detail: str = ""


def targets() -> list[tuple[str, int]]:
    """(device, world) pairs this machine can run on a loopback group."""
    out = [("cpu", 2)]
    if torch.cuda.is_available():
        out += [("cuda", 1), ("cuda", 2)]
    return out


def _inputs(world: int, seed: int, device):
    g = torch.Generator().manual_seed(seed)
    xs, idxs, ws = [], [], []
    for r in range(world):
        T = (MAX_TOKENS, 3)[r % 2]
        xs.append((torch.randn(T, HIDDEN, generator=g) * 2).to(torch.bfloat16))
        idx = torch.stack([torch.randperm(NUM_EXPERTS, generator=g)[:TOPK] for _ in range(T)])
        idx[torch.rand(T, TOPK, generator=g) < 0.2] = -1
        idxs.append(idx)
        ws.append(torch.rand(T, TOPK, generator=g))
    return xs, idxs, ws, [[t.to(device) for t in trio] for trio in zip(xs, idxs, ws)]


def _experts(x: torch.Tensor, scales, first_expert: int) -> torch.Tensor:
    """The 'experts': expert e scales its rows by 1 + (e % 3) / 2 (fp8 rows dequantized first)."""
    xf = reference.dequantize_fp8(x, scales) if scales is not None else x.float()
    f = 1 + ((first_expert + torch.arange(x.shape[0], device=x.device)) % 3).float() / 2
    return (xf * f.view(-1, 1, 1)).to(torch.bfloat16)


def check_ep(device: str, world: int, fp8: bool) -> str:
    """EPBuffer dispatch + combine on a loopback group; '' when it matches the reference."""
    from .ep import EPBuffer  # noqa: PLC0415
    exact = device == "cpu"
    groups = init(backend="loopback", world_size=world, device=device)
    eps = [EPBuffer(g, NUM_EXPERTS, HIDDEN, MAX_TOKENS, TOPK, fp8_dispatch=fp8) for g in groups]
    xs, idxs, ws, dev_in = _inputs(world, 7 + world, device)
    for ep, (x, i, _) in zip(eps, dev_in):
        ep.dispatch(x, i, phase="send")
    ds = [ep.dispatch(phase="recv") for ep in eps]
    want = reference.dispatch(xs, idxs, NUM_EXPERTS, MAX_TOKENS, fp8=fp8)
    L = NUM_EXPERTS // world
    for r, (d, w) in enumerate(zip(ds, want)):
        counts = d.counts.cpu()
        if not torch.equal(counts, w["counts"]):
            return f"rank {r}: counts {counts.tolist()} != {w['counts'].tolist()}"
        for e, n in enumerate(counts.tolist()):
            if not torch.equal(d.src[e, :n].cpu(), w["src"][e, :n]):
                return f"rank {r} expert {e}: token order differs"
            if fp8:
                if not (reference.fp8_codes_match(d.x[e, :n].cpu(), w["x"][e, :n], exact)
                        and torch.equal(d.scales[e, :n].cpu(), w["scales"][e, :n])):
                    return f"rank {r} expert {e}: fp8 rows or scales differ"
            elif not torch.equal(d.x[e, :n].cpu(), w["x"][e, :n]):
                return f"rank {r} expert {e}: rows differ"
    eos = [_experts(d.x, d.scales, r * L) for r, d in enumerate(ds)]
    for ep, eo, (_, _, w), d in zip(eps, eos, dev_in, ds):
        ep.combine(eo, w, d.handle, phase="send")
    ys = [ep.combine(phase="recv").cpu() for ep in eps]
    ref_eos = [_experts(w["x"], w["scales"], r * L) for r, w in enumerate(want)]
    for r, (y, yw) in enumerate(zip(ys, reference.combine(ref_eos, ws, idxs, NUM_EXPERTS, MAX_TOKENS))):
        if exact and not torch.equal(y, yw):
            return f"rank {r}: combine differs from the reference"
        if not exact and not torch.allclose(y.float(), yw.float(), rtol=GPU_COMBINE_TOL, atol=GPU_COMBINE_TOL):
            return f"rank {r}: combine differs from the reference by {(y.float() - yw.float()).abs().max():.3g}"
    return ""


def check_alltoallv(device: str, world: int) -> str:
    from .alltoallv import AllToAllvDynamic  # noqa: PLC0415
    groups = init(backend="loopback", world_size=world, device=device)
    ops = [AllToAllvDynamic(g, A2A_ROWS, A2A_ROW, torch.bfloat16) for g in groups]
    g = torch.Generator().manual_seed(world)
    counts = [torch.randint(0, A2A_ROWS + 1, (world,), generator=g, dtype=torch.int32) for _ in range(world)]
    sends = [torch.randn(int(c.sum()) + 1, *A2A_ROW, generator=g).to(torch.bfloat16) for c in counts]
    for op, s, c in zip(ops, sends, counts):
        op(s.to(device), c.to(device), phase="send")
    res = [op(phase="recv") for op in ops]
    for r, (got, (recv, rc)) in enumerate(zip(res, reference.alltoallv(sends, counts, A2A_ROWS))):
        if not torch.equal(got.recv_counts.cpu(), rc):
            return f"rank {r}: recv_counts {got.recv_counts.tolist()} != {rc.tolist()}"
        for j, n in enumerate(rc.tolist()):
            if not torch.equal(got.recv[j, :n].cpu(), recv[j, :n]):
                return f"rank {r}: rows from rank {j} differ"
    rows = [(x.recv.float() * 2).to(torch.bfloat16) for x in res]   # an elementwise 'expert'
    for op, x, rw in zip(ops, res, rows):
        op.combine(rw, x.handle, phase="send")
    backs = [op.combine(phase="recv").cpu() for op in ops]
    want = reference.alltoallv_combine([x.cpu() for x in rows], counts, [len(s) for s in sends], A2A_ROWS)
    for r, (b, w) in enumerate(zip(backs, want)):
        n = int(counts[r].sum())   # rows past the sum were not sent: unspecified
        if not torch.equal(b[:n], w[:n]):
            return f"rank {r}: reverse differs from the reference"
    return ""


def check_deep_ep(device: str, world: int) -> str:
    """The DeepEP-compatible Buffer (hooks: every rank's call, then every rank's hook)."""
    from .compat import deep_ep  # noqa: PLC0415
    groups = init(backend="loopback", world_size=world, device=device)
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, HIDDEN, world, NUM_EXPERTS)
    bufs = [deep_ep.Buffer(g, num_rdma_bytes=hint) for g in groups]
    xs, idxs, ws, dev_in = _inputs(world, 3 + world, device)
    outs = [b.low_latency_dispatch(x, i, MAX_TOKENS, NUM_EXPERTS, use_fp8=False, return_recv_hook=True)
            for b, (x, i, _) in zip(bufs, dev_in)]
    for o in outs:
        o[4]()
    want = reference.dispatch(xs, idxs, NUM_EXPERTS, MAX_TOKENS)
    for r, (o, w) in enumerate(zip(outs, want)):
        if not torch.equal(o[1].cpu(), w["counts"]):
            return f"rank {r}: recv_count {o[1].tolist()} != {w['counts'].tolist()}"
    combs = [b.low_latency_combine(o[0].clone(), i, w, o[2], return_recv_hook=True)
             for b, o, (_, i, w) in zip(bufs, outs, dev_in)]
    for c in combs:
        c[2]()
    for r, (c, yw) in enumerate(zip(combs, reference.combine([w["x"] for w in want], ws, idxs, NUM_EXPERTS,
                                                              MAX_TOKENS))):
        if not torch.allclose(c[0].cpu().float(), yw.float(), rtol=0 if device == "cpu" else GPU_COMBINE_TOL,
                              atol=0 if device == "cpu" else GPU_COMBINE_TOL):
            return f"rank {r}: combine differs from the reference"
    return ""


CHECKS = (
    ("AllToAllvDynamic forward + reverse", check_alltoallv),
    ("EPBuffer dispatch + combine, bf16", lambda d, w: check_ep(d, w, False)),
    ("EPBuffer dispatch + combine, fp8 dispatch", lambda d, w: check_ep(d, w, True)),
    ("DeepEP-compatible Buffer (moe_comm.compat.deep_ep)", check_deep_ep),
)


def run(devices=None, report=print) -> list[Result]:
    """Run every check on every target (optionally only those on ``devices``); ``report`` gets a line each."""
    results = []
    for device, world in targets():
        if devices is not None and device not in devices:
            continue
        target = f"{device}, loopback world {world}"
        for name, fn in CHECKS:
            t0 = time.perf_counter()
            try:
                detail = fn(device, world)
            except Exception as e:  # noqa: BLE001  (a self-test reports every failure and goes on)
                detail = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}"
            res = Result(name, target, detail == "", time.perf_counter() - t0, detail)
            results.append(res)
            if report is not None:
                report(f"{'PASS' if res.ok else 'FAIL'}  {target:<24} {name:<52} {res.seconds:6.2f} s"
                       + ("" if res.ok else "\n      " + res.detail.replace("\n", "\n      ")))
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="moe-comm selftest", description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), action="append",
                    help="only this device (repeatable); default: every device this machine has")
    args = ap.parse_args(argv)
    if args.device and "cuda" in args.device and not torch.cuda.is_available():
        print("selftest: --device cuda, but no CUDA device is available (python -m moe_comm info says why)")
        return 1
    results = run(args.device)
    failed = [r for r in results if not r.ok]
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed or not results else 0


if __name__ == "__main__":
    sys.exit(main())
