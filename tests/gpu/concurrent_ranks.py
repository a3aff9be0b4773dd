"""Concurrent ranks on one GPU, every op, every step exact against ``moe_comm.reference``.

    python3 tests/gpu/concurrent_ranks.py [--world 8] [--steps 1000] [--ops ep,a2a,prefill] [--in-turn]
                                          [--json PATH] [--progress 100]

A loopback world of ``--world`` ranks on one device; each step runs, on every rank, EPBuffer dispatch and
combine, AllToAllvDynamic forward and reverse and PrefillBuffer dispatch and combine, with fresh inputs:
token counts 0, 1, odd and the capacity across ranks, routings cycling through random ids with -1 slots,
every token's first slot on expert 0, all of a token's experts on one rank, an expert listed twice and
nothing routed (``tests/ep_cases.py``); AllToAllvDynamic counts random, zero, all to one rank and full
(``tests/a2a_cases.py``). Outputs are poisoned before each call. After each step every rank's outputs
are compared with the reference: dispatch rows, counts and order exactly; combine sums exactly too,
since the weights are powers of two (each product is exact, so a fused multiply-add rounds as a
multiply then an add would) and the expert outputs fed to the reference are the ones the ranks used.

On CUDA each rank runs on its own stream (default): the host enqueues every rank's send phase, then
every rank's receive phase, and nothing else orders them, so the receive of one rank spins on the device
while the sends of others run: the flags, sequence numbers and the alternation of buffer sets under
real concurrency, which the CPU interpreter (one program at a time) cannot show. ``--in-turn`` runs
the ranks' phases one after another on one stream (compute-sanitizer's case: it serializes kernels, and
a receive waiting for a send it holds back would time out). On a CPU (dry run) the ranks always run in
turn, interpreted.

Exit status 0 when every step matched; 1 at the first step that did not (its mismatches and the group's
error are in the last JSON line). JSON lines: one per ``--progress`` steps and one result line, each
with device, versions and commit.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)
for p in (TESTS, ROOT):
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402

import moe_comm  # noqa: E402
from moe_comm import MoECommError, reference  # noqa: E402

import a2a_cases  # noqa: E402
import ep_cases  # noqa: E402
import prefill_cases  # noqa: E402

CFG = ep_cases.Config(experts_per_rank=4, hidden=256, max_tokens=8, topk=4)   # EP and prefill sizes
A2A_CAP, A2A_ROW = 5, (256,)
OPS = ("ep", "a2a", "prefill")
A2A_PATTERNS = ("random", "zeros", "one_destination", "full")
TIMEOUT_S = 10.0


def power_of_two_weights(ws):
    """Weights 1, 1/2, 1/4 or 1/8 (float32): a product with a bf16 row is exact, so the combine's sums
    are bitwise the reference's however the compiler contracts them."""
    return [torch.exp2(-torch.floor(w * 4)) for w in ws]


def experts(d, rank: int, dev) -> torch.Tensor:
    """The 'experts' of ``rank``: global expert e scales its rows by 1 + (e % 5) / 4 (bf16, on the device)."""
    L = d.x.shape[0]
    mult = 1 + ((rank * L + torch.arange(L, device=dev)) % 5).float().view(L, 1, 1) * 0.25
    return (d.x.float() * mult).to(torch.bfloat16)


class World:
    """The ranks, their ops and how their phases run (``streams``: one CUDA stream per rank, or None)."""

    def __init__(self, world: int, device: torch.device, ops, streams: bool):
        self.world, self.dev, self.ops = world, device, ops
        self.groups = moe_comm.init(backend="loopback", world_size=world, device=device, timeout_s=TIMEOUT_S)
        E = CFG.experts_per_rank * world
        self.eps = [moe_comm.EPBuffer(g, E, CFG.hidden, CFG.max_tokens, CFG.topk) for g in self.groups]
        self.a2as = [moe_comm.AllToAllvDynamic(g, A2A_CAP, A2A_ROW, torch.bfloat16) for g in self.groups]
        self.pfs = [prefill_cases.make_buffer(g, CFG) for g in self.groups]
        self.streams = [torch.cuda.Stream(device) for _ in range(world)] if streams else None

    def phases(self, send, recv) -> list:
        """``send(r)`` on every rank, then ``recv(r)`` on every rank (each rank on its stream, after what the
        main stream made: inputs, poison); the receives' results. No event orders one rank's receive after
        another's send: only the device flags do."""
        self.follow_main()
        if self.streams is None:
            for r in range(self.world):
                send(r)
            return [recv(r) for r in range(self.world)]
        for r, s in enumerate(self.streams):
            with torch.cuda.stream(s):
                send(r)
        out = []
        for r, s in enumerate(self.streams):
            with torch.cuda.stream(s):
                out.append(recv(r))
        return out

    def on_rank(self, fn) -> list:
        """``fn(r)`` for every rank on its stream (the 'experts' between a dispatch and its combine)."""
        self.follow_main()
        if self.streams is None:
            return [fn(r) for r in range(self.world)]
        out = []
        for r, s in enumerate(self.streams):
            with torch.cuda.stream(s):
                out.append(fn(r))
        return out

    def follow_main(self) -> None:
        """Every rank's stream waits for what the main stream has enqueued so far."""
        if self.streams is not None:
            main = torch.cuda.current_stream(self.dev)
            for s in self.streams:
                s.wait_stream(main)

    def end(self) -> None:
        """The main stream joins every rank's, then the host waits for the device and checks every group."""
        if self.streams is not None:
            main = torch.cuda.current_stream(self.dev)
            for s in self.streams:
                main.wait_stream(s)
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
        for g in self.groups:
            g.check()

    def close(self) -> None:
        for op in reversed(self.eps + self.pfs + self.a2as):
            op.close()


def ep_step(w: World, step: int) -> list[str]:
    W, E, dev = w.world, CFG.experts_per_rank * w.world, w.dev
    routing = ep_cases.ROUTINGS[step % len(ep_cases.ROUTINGS)]
    xs, idxs, ws = ep_cases.make_inputs(CFG, W, routing, 10_000 + step)
    ws = power_of_two_weights(ws)
    dx, di, dw = ([t.to(dev) for t in ts] for ts in (xs, idxs, ws))
    for ep in w.eps:
        ep_cases.poison(ep)
    ds = w.phases(lambda r: w.eps[r].dispatch(dx[r], di[r], phase="send"), lambda r: w.eps[r].dispatch(phase="recv"))
    snaps = w.on_rank(lambda r: ep_cases.snapshot(ds[r]))   # d.x is rewritten by the next dispatch
    eos = w.on_rank(lambda r: experts(ds[r], r, dev))
    outs = [torch.full((len(x), CFG.hidden), float("nan"), dtype=torch.bfloat16, device=dev) for x in xs]
    ys = w.phases(lambda r: w.eps[r].combine(eos[r], dw[r], ds[r].handle, out=outs[r], phase="send"),
                  lambda r: w.eps[r].combine(phase="recv"))
    w.end()
    tag = f"step {step} ep {routing}"
    exp = reference.dispatch(xs, idxs, E, CFG.max_tokens)
    errs = [e for r in range(W) for e in ep_cases.check_dispatch(r, snaps[r], exp[r], xs, CFG, f"{tag} rank {r}")]
    want = reference.combine([eo.cpu() for eo in eos], ws, idxs, E, CFG.max_tokens)
    errs += [f"{tag} rank {r}: combine differs from the reference" for r in range(W)
             if not torch.equal(ys[r].cpu(), want[r])]
    return errs


def a2a_step(w: World, step: int) -> list[str]:
    W, dev = w.world, w.dev
    pattern = A2A_PATTERNS[step % len(A2A_PATTERNS)]
    counts = a2a_cases.make_counts(pattern, W, A2A_CAP, 20_000 + step)
    sends = a2a_cases.make_sends(counts, A2A_ROW, torch.bfloat16, 20_000 + step)
    dc, ds_ = [c.to(dev) for c in counts], [s.to(dev) for s in sends]
    for op in w.a2as:
        a2a_cases.poison(op)
    res = w.phases(lambda r: w.a2as[r](ds_[r], dc[r], phase="send"), lambda r: w.a2as[r](phase="recv"))
    rows = w.on_rank(lambda r: a2a_cases.transform(res[r].recv))
    back = w.phases(lambda r: w.a2as[r].combine(rows[r], res[r].handle, phase="send"),
                    lambda r: w.a2as[r].combine(phase="recv"))
    w.end()
    tag = f"step {step} a2a {pattern}"
    rows_cpu = [t.cpu() for t in rows]
    errs = [e for r in range(W) for e in a2a_cases.check_forward(r, res[r], sends, counts, A2A_CAP, f"{tag} rank {r}")]
    errs += [e for r in range(W) for e in a2a_cases.check_reverse(r, back[r], rows_cpu, sends, counts, f"{tag} rank {r}")]
    return errs


def prefill_step(w: World, step: int) -> list[str]:
    W, E, dev = w.world, CFG.experts_per_rank * w.world, w.dev
    routing = ep_cases.ROUTINGS[(step + 2) % len(ep_cases.ROUTINGS)]
    xs, idxs, ws = ep_cases.make_inputs(CFG, W, routing, 30_000 + step)
    dx, di, dw = ([t.to(dev) for t in ts] for ts in (xs, idxs, ws))
    for b in w.pfs:
        prefill_cases.poison(b)
    ds = w.phases(lambda r: w.pfs[r].dispatch(dx[r], di[r], dw[r], phase="send"),
                  lambda r: w.pfs[r].dispatch(phase="recv"))
    exp = reference.prefill_dispatch(xs, idxs, ws, E, CFG.max_tokens)
    # what each rank received (the combine's send overwrites the zone) and its partial rows, NaN where no
    # local expert is (the combine must not read them)
    got = w.on_rank(lambda r: dict(src_tokens=ds[r].src_tokens.clone(), expert_counts=ds[r].expert_counts.clone(),
                                   recv_topk_idx=ds[r].recv_topk_idx.clone(), recv_x=ds[r].recv_x.clone(),
                                   recv_topk_weights=ds[r].recv_topk_weights.clone(), recv_scales=None))
    valid = [e["valid"].to(dev) for e in exp]
    parts = w.on_rank(lambda r: torch.where(valid[r][:, None], prefill_cases.partial_rows(
        ds[r].recv_x, ds[r].recv_scales, r, CFG.dtype), float("nan")).to(CFG.dtype))
    ys = w.phases(lambda r: w.pfs[r].combine(parts[r], ds[r].handle, phase="send"),
                  lambda r: w.pfs[r].combine(phase="recv"))
    w.end()
    tag = f"step {step} prefill {routing}"
    errs = [e for r in range(W) for e in prefill_cases.check_dispatch(argparse.Namespace(
        **{k: v.cpu() if v is not None else None for k, v in got[r].items()}), exp[r], CFG, f"{tag} rank {r}")]
    want = reference.prefill_combine([p.cpu() for p in parts], idxs, E, CFG.max_tokens)
    errs += [f"{tag} rank {r}: combine differs from the reference" for r in range(W)
             if not torch.equal(ys[r].cpu(), want[r])]
    return errs


STEPS = dict(ep=ep_step, a2a=a2a_step, prefill=prefill_step)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--ops", default=",".join(OPS), help=f"comma separated subset of {','.join(OPS)}")
    p.add_argument("--in-turn", action="store_true", help="every rank's phases in turn on one stream")
    p.add_argument("--json", help="append JSON lines here (progress and the result)")
    p.add_argument("--progress", type=int, default=100, help="a progress line every this many steps")
    a = p.parse_args(argv)
    ops = a.ops.split(",")
    if not set(ops) <= set(OPS) or a.world < 2:
        p.error(f"--ops must be a subset of {OPS} and --world >= 2")
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    concurrent = dev.type == "cuda" and not a.in_turn
    from bench.common import DRY_LABEL, environment, printed_lines  # noqa: PLC0415
    dry = dev.type != "cuda"
    emit = printed_lines(a.json, dict(
        check="concurrent_ranks", world=a.world, ops=ops, steps_target=a.steps, dry=dry,
        streams="one per rank" if concurrent else "one (ranks in turn)",
        config=dict(experts=CFG.experts_per_rank * a.world, hidden=CFG.hidden, max_tokens=CFG.max_tokens,
                    topk=CFG.topk, a2a_rows=A2A_CAP), env=environment(dev), **({"label": DRY_LABEL} if dry else {})))

    w = World(a.world, dev, ops, concurrent)
    t0, done, errs, failure = time.time(), 0, [], None
    try:
        for step in range(a.steps):
            for op in ops:
                errs += STEPS[op](w, step)
            if errs:
                break
            done = step + 1
            if done % a.progress == 0 and done < a.steps:
                emit(kind="progress", steps_done=done, wall_s=round(time.time() - t0, 1))
    except MoECommError as e:   # a group error (timeout, ...): the step did not complete
        failure = f"{type(e).__name__}: {e}"
    finally:
        w.close()
    ok = not errs and failure is None and done == a.steps
    emit(kind="result", ok=ok, steps_done=done, errors=errs[:10], group_error=failure,
         wall_s=round(time.time() - t0, 1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
