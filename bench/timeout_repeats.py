"""Timed-out receives, repeated: does every one become CommTimeoutError naming the missing peer (never a
hang, a lost CUDA context or another error), and is the round after ``reset()`` exact?

Loopback world 2 on one device (a GPU; on a CPU the interpreter at small shapes). In each repeat rank 1
skips its send phase of the op, rank 0 runs its send and receive phases, so rank 0's receive waits for a
flag that never comes and must time out naming peer 1; then ``reset()`` on both ranks and a round of the
op on both ranks that must equal the reference (the same inputs every round, the reference computed once).

    python bench/timeout_repeats.py [--ops dispatch,combine,alltoallv,prefill] [--repeats 200]
        [--timeouts-ms 2,50] [--shape dsv3|small] [--warps W] [--exact-every 1] [--json FILE]
        [--jobs J] [--case-timeout-s S]

Each (op, timeout) case runs in its own process (a lost CUDA context ends only that case) under a
wall-clock watchdog (a case past ``--case-timeout-s`` is killed and recorded as a hang). One JSON line per
case (to ``--json`` as each case ends, and to stdout); a summary line per case last; exit status 1 if any
case had a wrong outcome, a hang or a crash. ``--warps W`` launches every kernel of the ops with W warps
(more warps: more chances for the threads of one program to disagree).

Shapes: ``dsv3`` = hidden 7168, 128 tokens per rank, 256 experts, top-8 (DeepSeek-V3 decode; prefill and
AllToAllvDynamic the same rows); ``small`` = hidden 256, 8 tokens, 16 experts, top-4.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SHAPES = {"dsv3": (7168, 128, 256, 8), "small": (256, 8, 16, 4)}   # hidden, tokens per rank, experts, top-k
OPS = ("dispatch", "combine", "alltoallv", "prefill")
SKIPPER, WAITER = 1, 0   # rank 1 skips its send; rank 0's receive must name it


def _force_warps(warps: int) -> None:
    """Every Launch built from now on passes ``num_warps=warps`` (a launch option, moe_comm/launches.py)."""
    from moe_comm import launches  # noqa: PLC0415
    init = launches.Launch.__init__

    def patched(self, kernel, device, grid, aligned=True, **static):
        static["num_warps"] = warps
        init(self, kernel, device, grid, aligned, **static)
    launches.Launch.__init__ = patched


class Case:
    """One op on a loopback world of 2: ``fault()`` runs the call with rank 1 silent; ``exact()`` a full call
    on both ranks, True when it equals the reference."""

    def __init__(self, op, groups, shape, dev):
        import torch  # noqa: PLC0415

        import moe_comm  # noqa: PLC0415
        from moe_comm import reference  # noqa: PLC0415
        self.op, self.groups, self.dev, self.torch, self.ref = op, groups, dev, torch, reference
        H, M, E, K = shape
        self.H, self.M, self.E, self.K = H, M, E, K
        g = torch.Generator().manual_seed(1)
        self.xs = [torch.randn(M, H, generator=g).bfloat16() for _ in groups]
        self.idxs = [torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(M)]) for _ in groups]
        self.ws = [torch.rand(M, K, generator=g) for _ in groups]
        if op in ("dispatch", "combine"):
            self.bufs = [moe_comm.EPBuffer(gr, E, H, M, K) for gr in groups]
            self.want_d = reference.dispatch(self.xs, self.idxs, E, M)
            outs = [2 * w["x"] for w in self.want_d]           # the stand-in experts: y = 2 x, exact in bf16
            self.want_y = reference.combine(outs, self.ws, self.idxs, E, M)
        elif op == "prefill":
            self.bufs = [moe_comm.PrefillBuffer(gr, E, H, M, K) for gr in groups]
            self.want_d = reference.prefill_dispatch(self.xs, self.idxs, self.ws, E, M)
            self.want_y = reference.prefill_combine([2 * w["x"] for w in self.want_d], self.idxs, E, M)
        elif op == "alltoallv":
            world = len(groups)
            self.cap = M
            self.counts = [torch.full((world,), M // world, dtype=torch.int32) for _ in groups]
            self.sends = [x[:M // world * world].clone() for x in self.xs]
            self.bufs = [moe_comm.AllToAllvDynamic(gr, self.cap, (H,), torch.bfloat16) for gr in groups]
            self.want_a = reference.alltoallv(self.sends, self.counts, self.cap)
        else:
            raise ValueError(f"unknown op {op!r}: one of {OPS}")

    def _on(self, t):
        return t.to(self.dev)

    def fault(self) -> None:
        """Rank 1 skips the op's send (for combine: after an exact dispatch on both ranks); rank 0 runs both
        phases. The error is read after a device sync."""
        b, r = self.bufs, WAITER
        if self.op == "dispatch":
            b[r].dispatch(self._on(self.xs[r]), self._on(self.idxs[r]), phase="send")
            b[r].dispatch(phase="recv")
        elif self.op == "combine":
            ds = self._dispatch_all()
            b[r].combine(2 * ds[r].x, self._on(self.ws[r]), ds[r].handle, phase="send")
            b[r].combine(phase="recv")
        elif self.op == "prefill":
            b[r].dispatch(self._on(self.xs[r]), self._on(self.idxs[r]), self._on(self.ws[r]), phase="send")
            b[r].dispatch(phase="recv")
        else:
            b[r](self._on(self.sends[r]), self._on(self.counts[r]), phase="send")
            b[r](phase="recv")
        self.sync()
        self.groups[r].check()

    def sync(self) -> None:
        if self.dev != "cpu":
            self.torch.cuda.synchronize()

    def _dispatch_all(self):
        for b, x, i in zip(self.bufs, self.xs, self.idxs):
            b.dispatch(self._on(x), self._on(i), phase="send")
        return [b.dispatch(phase="recv") for b in self.bufs]

    def exact(self) -> bool:
        """A full call of the op on both ranks (dispatch and combine for EP and prefill) equals the reference,
        compared on the device: every valid row, count and id bit for bit; the combine's sums bit for bit on
        a CPU, within one bf16 ulp on a GPU (the kernel's float32 multiply-adds may be fused there, the
        reference's are not: tests/gpu/test_gpu_ep.py says the same)."""
        torch = self.torch
        eq = torch.equal
        if self.op in ("dispatch", "combine"):
            ds = self._dispatch_all()
            ok = True
            for d, w in zip(ds, self.want_d):
                counts = self._dev(w, "counts")
                valid = torch.arange(d.x.shape[1], device=d.x.device)[None, :] < counts[:, None]
                ok &= eq(d.counts, counts) and eq(d.x[valid], self._dev(w, "x")[valid])
            for b, d, w in zip(self.bufs, ds, self.ws):
                b.combine(2 * d.x, self._on(w), d.handle, phase="send")
            ys = [b.combine(phase="recv") for b in self.bufs]
        elif self.op == "prefill":
            for b, x, i, w in zip(self.bufs, self.xs, self.idxs, self.ws):
                b.dispatch(self._on(x), self._on(i), self._on(w), phase="send")
            ds = [b.dispatch(phase="recv") for b in self.bufs]
            ok = all(eq(d.recv_x[self._dev(w, "valid")], self._dev(w, "x")[self._dev(w, "valid")])
                     and eq(d.recv_topk_idx, self._dev(w, "topk_idx")) for d, w in zip(ds, self.want_d))
            for b, d in zip(self.bufs, ds):
                b.combine(2 * d.recv_x, d.handle, phase="send")
            ys = [b.combine(phase="recv") for b in self.bufs]
        else:
            for b, s, c in zip(self.bufs, self.sends, self.counts):
                b(self._on(s), self._on(c), phase="send")
            rs = [b(phase="recv") for b in self.bufs]
            ok = True
            for r, (recv, rc) in zip(rs, self.want_a):
                rc = self._on(rc)
                valid = torch.arange(recv.shape[1], device=rc.device)[None, :] < rc[:, None]
                ok &= eq(r.recv_counts, rc) and eq(r.recv[valid], self._on(recv)[valid])
            self.sync()
            return bool(ok)
        self.sync()
        for g in self.groups:
            g.check()
        return bool(ok) and all(self._same_sum(y, self._on(w)) for y, w in zip(ys, self.want_y))

    def _dev(self, want: dict, key: str):
        """The reference's tensor ``key`` on the device (copied once)."""
        cache = want.setdefault("_on_device", {})
        if key not in cache:
            cache[key] = self._on(want[key])
        return cache[key]

    def _same_sum(self, y, want) -> bool:
        if self.dev == "cpu":
            return self.torch.equal(y, want)
        y, want = y.float(), want.float()
        return bool(((y - want).abs() <= want.abs() * 2.0 ** -7 + 1e-30).all())   # one bf16 ulp


def run_case(op: str, timeout_ms: float, repeats: int, shape: str, warps: int, exact_every: int) -> dict:
    """One case in this process: ``repeats`` timed-out receives, each followed by reset(), and an exact
    round after every ``exact_every``-th (and after the last)."""
    import torch  # noqa: PLC0415

    import moe_comm  # noqa: PLC0415
    from moe_comm import CommTimeoutError, MoECommError  # noqa: PLC0415
    if warps:
        _force_warps(warps)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    groups = moe_comm.init(backend="loopback", world_size=2, device=dev, timeout_s=timeout_ms / 1000)
    case = Case(op, groups, SHAPES[shape], dev)
    res = dict(op=op, timeout_ms=timeout_ms, shape=shape, hidden=case.H, tokens=case.M, experts=case.E,
               topk=case.K, warps=warps or "default", repeats=repeats, ok=0, wrong=0, slow=0, exact_rounds=0,
               inexact_rounds=0, other=[], device=torch.cuda.get_device_name() if dev == "cuda" else "cpu")
    t_all = time.time()
    res["exact_before"] = case.exact()
    times = []
    for rep in range(repeats):
        t0 = time.time()
        try:
            case.fault()
            res["wrong"] += 1
            res["other"].append(f"rep {rep}: no error")
        except CommTimeoutError as e:
            dt = time.time() - t0
            times.append(dt)
            if getattr(e, "peer", None) == SKIPPER and f"peer rank {SKIPPER}" in str(e):
                res["ok"] += 1
            else:
                res["wrong"] += 1
                res["other"].append(f"rep {rep}: {str(e)[:160]}")
            if dt > 3 * timeout_ms / 1000 + 1.0:
                res["slow"] += 1
        except MoECommError as e:
            res["wrong"] += 1
            res["other"].append(f"rep {rep}: {type(e).__name__}: {str(e)[:160]}")
        for g in groups:
            g.reset()
        print(f"rep {rep}: ok {res['ok']} wrong {res['wrong']}", file=sys.stderr, flush=True)   # where a crash hit
        if (rep + 1) % exact_every == 0 or rep == repeats - 1:
            if case.exact():
                res["exact_rounds"] += 1
            else:
                res["inexact_rounds"] += 1
                res["other"].append(f"rep {rep}: the round after reset() was not exact")
    times.sort()
    res.update(raise_s_p50=round(times[len(times) // 2], 4) if times else None,
               raise_s_max=round(times[-1], 4) if times else None, wall_s=round(time.time() - t_all, 1))
    res["other"] = res["other"][:10]
    return res


def _versions() -> dict:
    out = {}
    try:
        import torch  # noqa: PLC0415
        import triton  # noqa: PLC0415
        out.update(torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda)
    except ImportError:
        pass
    out["commit"] = os.environ.get("MOE_COMM_COMMIT")   # the measured commit, where a copy's git metadata is not
    if not out["commit"]:
        try:
            out["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                           cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        except OSError:
            out["commit"] = None
    return out


def verdict(r: dict) -> bool:
    return (r.get("ok") == r.get("repeats") and r.get("wrong") == 0 and not r.get("inexact_rounds")
            and r.get("exact_before") is True and "status" not in r)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--timeouts-ms", default="2,50")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default: dsv3 on a GPU, small on a CPU")
    ap.add_argument("--warps", type=int, default=0, help="num_warps of every launch (0: the planner's)")
    ap.add_argument("--exact-every", type=int, default=1)
    ap.add_argument("--json", default=None, help="append one JSON line per case to this file")
    ap.add_argument("--jobs", type=int, default=1, help="cases run at once (processes)")
    ap.add_argument("--case-timeout-s", type=float, default=300.0)
    ap.add_argument("--one", nargs=2, metavar=("OP", "TIMEOUT_MS"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one:
        shape = a.shape or "small"
        print(json.dumps(run_case(a.one[0], float(a.one[1]), a.repeats, shape, a.warps, a.exact_every)))
        return 0
    ops = [o for o in a.ops.split(",") if o]
    bad = [o for o in ops if o not in OPS]
    if bad:
        ap.error(f"unknown op(s) {bad}: choose from {','.join(OPS)}")
    if a.shape is None:
        import torch  # noqa: PLC0415
        a.shape = "dsv3" if torch.cuda.is_available() else "small"
    common = dict(**_versions(), shape=a.shape)
    todo = [(op, float(t)) for t in a.timeouts_ms.split(",") for op in ops]
    running, results = [], []
    env = dict(os.environ, PYTHONUNBUFFERED="1")

    def start(op, t):
        cmd = [sys.executable, os.path.abspath(__file__), "--one", op, str(t), "--repeats", str(a.repeats),
               "--shape", a.shape, "--warps", str(a.warps), "--exact-every", str(a.exact_every)]
        return (op, t, time.time(), subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                      text=True, env=env))

    def finish(op, t, t0, p, killed):
        out, err = p.communicate()
        rows = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
        if rows:
            r = rows[-1]
        else:
            r = dict(op=op, timeout_ms=t, repeats=a.repeats, ok=0, wrong=0, warps=a.warps or "default",
                     status="hang (killed by the watchdog)" if killed else f"crashed (exit {p.returncode})",
                     stderr_tail=err[-1500:], wall_s=round(time.time() - t0, 1))
        r.update(common)
        r["pass"] = verdict(r)
        results.append(r)
        line = json.dumps(r)
        print(line, flush=True)
        if a.json:
            with open(a.json, "a") as f:
                f.write(line + "\n")

    while todo or running:
        while todo and len(running) < a.jobs:
            running.append(start(*todo.pop(0)))
        time.sleep(0.2)
        for item in list(running):
            op, t, t0, p = item
            killed = False
            if p.poll() is None and time.time() - t0 > a.case_timeout_s:
                p.kill()
                killed = True
            if p.poll() is not None:
                running.remove(item)
                finish(op, t, t0, p, killed)
    for r in results:
        state = r.get("status") or f"{r['ok']}/{r['repeats']} CommTimeoutError naming peer {SKIPPER}, wrong " \
                                    f"{r['wrong']}, slow {r['slow']}, exact rounds {r['exact_rounds']}/" \
                                    f"{r['exact_rounds'] + r['inexact_rounds']}"
        print(f"timeout repeats {r['op']:<9} {r['timeout_ms']:>5g} ms warps {r['warps']}: {state}: "
              f"{'PASS' if r['pass'] else 'FAIL'}")
    return 0 if results and all(r["pass"] for r in results) else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    raise SystemExit(main())
