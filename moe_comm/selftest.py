"""``python -m moe_comm selftest``: a short correctness run of every op on what this machine has.

Runs AllToAllvDynamic (forward and reverse), EPBuffer dispatch + combine in bf16 and with fp8 dispatch,
and the DeepEP-compatible Buffer, on a loopback group of 2 ranks on the CPU (Triton's interpreter); then
AllToAllvDynamic and EPBuffer in 2 processes over /dev/shm (``moe_comm.launch``, the path of the README's
first example) and, where CUDA is available, on loopback groups of 1 and 2 ranks on the GPU (compiled
kernels). Results are
compared with ``moe_comm.reference``: exactly on the CPU; on a GPU, fp8 codes may differ by one step
where a rounding tie is decided differently, and combine sums by float32 rounding (fused multiply-adds).
Exit status 0 when every check passes, 1 otherwise. Takes a few seconds on a CPU (plus the start of
the two processes).
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


LOOPBACK, PROCESSES = "loopback", "shm"   # how the ranks of a target run: one process, or one each
SHM_WORLD = 2
SHM_TIMEOUT_S = 60.0


def targets() -> list[tuple[str, int, str]]:
    """(device, world, heap) triples this machine can run."""
    out = [("cpu", 2, LOOPBACK), ("cpu", SHM_WORLD, PROCESSES)]
    if torch.cuda.is_available():
        out += [("cuda", 1, LOOPBACK), ("cuda", 2, LOOPBACK)]
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


def _dispatch_differs(r: int, d, w: dict, fp8: bool, exact: bool) -> str:
    """'' when rank r's dispatch result ``d`` matches the reference's ``w``, else what differs."""
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
    return ""


def _combine_differs(r: int, y: torch.Tensor, yw: torch.Tensor, exact: bool) -> str:
    if exact and not torch.equal(y, yw):
        return f"rank {r}: combine differs from the reference"
    if not exact and not torch.allclose(y.float(), yw.float(), rtol=GPU_COMBINE_TOL, atol=GPU_COMBINE_TOL):
        return f"rank {r}: combine differs from the reference by {(y.float() - yw.float()).abs().max():.3g}"
    return ""


def _ep_reference(world: int, seed: int, device, fp8: bool):
    """Inputs of every rank, the reference dispatch, and the reference combine of the 'experts'."""
    xs, idxs, ws, dev_in = _inputs(world, seed, device)
    want = reference.dispatch(xs, idxs, NUM_EXPERTS, MAX_TOKENS, fp8=fp8)
    L = NUM_EXPERTS // world
    ref_eos = [_experts(w["x"], w["scales"], r * L) for r, w in enumerate(want)]
    return dev_in, want, reference.combine(ref_eos, ws, idxs, NUM_EXPERTS, MAX_TOKENS)


def check_ep(device: str, world: int, fp8: bool) -> str:
    """EPBuffer dispatch + combine on a loopback group; '' when it matches the reference."""
    from .ep import EPBuffer  # noqa: PLC0415
    exact = device == "cpu"
    groups = init(backend="loopback", world_size=world, device=device)
    eps = [EPBuffer(g, NUM_EXPERTS, HIDDEN, MAX_TOKENS, TOPK, fp8_dispatch=fp8) for g in groups]
    dev_in, want, want_y = _ep_reference(world, 7 + world, device, fp8)
    for ep, (x, i, _) in zip(eps, dev_in):
        ep.dispatch(x, i, phase="send")
    ds = [ep.dispatch(phase="recv") for ep in eps]
    for r, (d, w) in enumerate(zip(ds, want)):
        if err := _dispatch_differs(r, d, w, fp8, exact):
            return err
    L = NUM_EXPERTS // world
    eos = [_experts(d.x, d.scales, r * L) for r, d in enumerate(ds)]
    for ep, eo, (_, _, w), d in zip(eps, eos, dev_in, ds):
        ep.combine(eo, w, d.handle, phase="send")
    ys = [ep.combine(phase="recv").cpu() for ep in eps]
    for r, (y, yw) in enumerate(zip(ys, want_y)):
        if err := _combine_differs(r, y, yw, exact):
            return err
    return ""


def _a2a_case(world: int, device):
    """Counts and rows of every rank (seeded by the world size) and the reference's answers."""
    g = torch.Generator().manual_seed(world)
    counts = [torch.randint(0, A2A_ROWS + 1, (world,), generator=g, dtype=torch.int32) for _ in range(world)]
    sends = [torch.randn(int(c.sum()) + 1, *A2A_ROW, generator=g).to(torch.bfloat16) for c in counts]
    want = reference.alltoallv(sends, counts, A2A_ROWS)
    rows = [(recv.float() * 2).to(torch.bfloat16) for recv, _ in want]   # an elementwise 'expert'
    back = reference.alltoallv_combine(rows, counts, [len(s) for s in sends], A2A_ROWS)
    return [c.to(device) for c in counts], [s.to(device) for s in sends], want, back


def _a2a_differs(r: int, got, want) -> str:
    recv, rc = want
    if not torch.equal(got.recv_counts.cpu(), rc):
        return f"rank {r}: recv_counts {got.recv_counts.tolist()} != {rc.tolist()}"
    for j, n in enumerate(rc.tolist()):
        if not torch.equal(got.recv[j, :n].cpu(), recv[j, :n]):
            return f"rank {r}: rows from rank {j} differ"
    return ""


def _a2a_reverse_differs(r: int, back: torch.Tensor, want: torch.Tensor, sent: int) -> str:
    # rows past the sum of the counts were not sent: unspecified
    return "" if torch.equal(back[:sent], want[:sent]) else f"rank {r}: reverse differs from the reference"


def check_alltoallv(device: str, world: int) -> str:
    from .alltoallv import AllToAllvDynamic  # noqa: PLC0415
    groups = init(backend="loopback", world_size=world, device=device)
    ops = [AllToAllvDynamic(g, A2A_ROWS, A2A_ROW, torch.bfloat16) for g in groups]
    counts, sends, want, want_back = _a2a_case(world, device)
    for op, s, c in zip(ops, sends, counts):
        op(s, c, phase="send")
    res = [op(phase="recv") for op in ops]
    for r, (got, w) in enumerate(zip(res, want)):
        if err := _a2a_differs(r, got, w):
            return err
    for op, x in zip(ops, res):
        op.combine((x.recv.float() * 2).to(torch.bfloat16), x.handle, phase="send")
    backs = [op.combine(phase="recv").cpu() for op in ops]
    for r, (b, w) in enumerate(zip(backs, want_back)):
        if err := _a2a_reverse_differs(r, b, w, int(counts[r].sum())):
            return err
    return ""


def _processes_rank(group) -> str:
    """One rank of ``check_processes``: both ops on this rank's inputs, its results against the reference.
    Every rank makes every call whatever it found, so a wrong result on one rank cannot hang the others."""
    from .alltoallv import AllToAllvDynamic  # noqa: PLC0415
    from .ep import EPBuffer  # noqa: PLC0415
    r, world, errors = group.rank, group.world_size, []
    op = AllToAllvDynamic(group, A2A_ROWS, A2A_ROW, torch.bfloat16)
    counts, sends, want, want_back = _a2a_case(world, "cpu")
    got = op(sends[r], counts[r])
    errors.append(_a2a_differs(r, got, want[r]))
    back = op.combine((got.recv.float() * 2).to(torch.bfloat16), got.handle)
    errors.append(_a2a_reverse_differs(r, back, want_back[r], int(counts[r].sum())))
    ep = EPBuffer(group, NUM_EXPERTS, HIDDEN, MAX_TOKENS, TOPK)
    dev_in, want_d, want_y = _ep_reference(world, 7 + world, "cpu", False)
    x, idx, w = dev_in[r]
    d = ep.dispatch(x, idx)
    errors.append(_dispatch_differs(r, d, want_d[r], False, True))
    y = ep.combine(_experts(d.x, d.scales, r * (NUM_EXPERTS // world)), w, d.handle)
    errors.append(_combine_differs(r, y, want_y[r], True))
    return "; ".join(e for e in errors if e)


def check_processes(device: str, world: int) -> str:
    """AllToAllvDynamic and EPBuffer (bf16) in ``world`` processes over /dev/shm (moe_comm.launch)."""
    from .group import launch  # noqa: PLC0415
    return "; ".join(e for e in launch(_processes_rank, world, backend="shm", timeout_s=SHM_TIMEOUT_S) if e)


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
PROCESS_CHECKS = (("AllToAllvDynamic and EPBuffer, one process per rank", check_processes),)


def run(devices=None, report=print) -> list[Result]:
    """Run every check on every target (optionally only those on ``devices``); ``report`` gets a line each."""
    results = []
    for device, world, heap in targets():
        if devices is not None and device not in devices:
            continue
        target = f"{device}, {heap} world {world}"
        for name, fn in (CHECKS if heap == LOOPBACK else PROCESS_CHECKS):
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
