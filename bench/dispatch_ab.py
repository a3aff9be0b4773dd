"""World-1 dispatch of several checkouts, timed on one device in one run (before / after a change).

    python bench/dispatch_ab.py --checkout 214d5ce=/tmp/ab/214d5ce --checkout 779df73=/tmp/ab/779df73 \\
                                --checkout . [--tokens 1,128] [--iters 200] [--warmup 20] [--out-dir DIR]
    python bench/dispatch_ab.py --dry --checkout ... --out-dir DIR      # no GPU: the script's logic only

A checkout is a source tree, or only its ``moe_comm`` package (``git archive <commit> moe_comm | tar -x
-C DIR``), as ``PATH`` or ``LABEL=PATH`` (``bench/ptx_profile.py``). Each runs in a process of its own
that imports that tree's ``moe_comm``; everything else is this tree's: the timing (``bench/common.py``
``time_us``: CUDA events after an L2 flush and a spin, p20/p50/p80), the seeded inputs, the sizes, the
floor (measured once, first) and the bytes it counts (``bench/kernels.py``). So the rows differ in the
library only. Per checkout, dtype (bf16, fp8) and T, at world 1 on the loopback heap with DeepSeek-V3
sizes (256 experts, hidden 7168, top-8, ``max_tokens_per_rank`` = T):

- ``phases both``: one ``dispatch(x, topk_idx)`` call, what a world-1 user runs (one kernel);
- ``phases split``: ``phase="send"`` then ``phase="recv"``, what a loopback world is driven with (at
  world 1 its send copies x and topk_idx, so that the caller may reuse them: three launches).

Before timing, each point's counts are checked against the routing. JSON lines (with the checkout's
label in ``checkout`` and ``impl``) and the table go to --out-dir (default bench/results).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":
    sys.path.insert(0, HERE)   # this tree's bench package (the parent only: a child imports its checkout)

GPU = dict(hidden=7168, experts=256, topk=8, tokens=[1, 128], iters=200, warmup=20)
DRY = dict(hidden=256, experts=16, topk=4, tokens=[1, 3], iters=3, warmup=1)


def child(o) -> None:
    """Time the checkout on PYTHONPATH (this process's moe_comm); one JSON line per point on stdout."""
    import torch  # noqa: PLC0415

    import moe_comm  # noqa: PLC0415
    from moe_comm.ep import EPBuffer  # noqa: PLC0415
    spec = importlib.util.spec_from_file_location("ab_common", os.path.join(HERE, "bench", "common.py"))
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)   # this tree's timing, whichever moe_comm is imported
    dev = torch.device("cpu" if o.dry else "cuda")
    if o.dry:
        torch.set_num_threads(1)
    group = moe_comm.init(backend="loopback", world_size=1, device=dev)[0]
    h, e, k = o.hidden, o.experts, o.topk
    for fp8 in (False, True):
        for t in o.tokens:
            gen = torch.Generator().manual_seed(t)
            x = torch.randn(t, h, generator=gen).to(torch.bfloat16).to(dev)
            idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(dev)
            ep = EPBuffer(group, e, h, t, k, dtype=torch.bfloat16, fp8_dispatch=fp8)
            calls = dict(both=lambda i: ep.dispatch(x, idx),
                         split=lambda i: ep.dispatch(x, idx, phase="send") or ep.dispatch(phase="recv"))
            for phases, call in calls.items():
                d = call(0)
                group.check()
                want = torch.bincount(idx.reshape(-1).cpu(), minlength=e).to(torch.int32)
                assert torch.equal(d.counts.cpu(), want), f"{o.label}: dispatch counts differ from the routing"
                timing = common.time_us(call, dev, o.iters, o.warmup)
                print(json.dumps(dict(checkout=o.label, dtype="fp8" if fp8 else "bf16", tokens=t, phases=phases,
                                      **timing)), flush=True)
            del d
            if hasattr(ep, "close"):
                ep.close()
    group.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkout", action="append", help="PATH or LABEL=PATH (repeatable; at least one)")
    ap.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--iters", type=int)
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--dry", action="store_true", help="CPU: tiny shapes in the interpreter (numbers mean nothing)")
    ap.add_argument("--out-dir", help="where the .jsonl goes (default bench/results)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--label", default="", help=argparse.SUPPRESS)
    ap.add_argument("--hidden", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--experts", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--topk", type=int, help=argparse.SUPPRESS)
    o = ap.parse_args(argv)
    for key, v in (DRY if o.dry else GPU).items():
        if getattr(o, key) is None:
            setattr(o, key, v)
    if o.child:
        child(o)
        return 0
    if not o.checkout:
        ap.error("give at least one --checkout")

    import torch  # noqa: PLC0415

    from bench.common import DRY_LABEL, JsonLines, environment  # noqa: PLC0415
    from bench.kernels import ep_bytes, measure_floor, result, table  # noqa: PLC0415
    from bench.ptx_profile import checkout, checkout_env  # noqa: PLC0415
    if not o.dry and not torch.cuda.is_available():
        ap.error("no GPU here: use --dry (CPU interpreter, tiny shapes, labelled dry run)")
    o.device = torch.device("cpu" if o.dry else "cuda")
    trees = [checkout(a) for a in o.checkout]
    env = environment(o.device)
    out_dir = o.out_dir or os.path.join(HERE, "bench", "results")
    slug = "dry" if o.dry else env["device"].replace(" ", "-")
    out = JsonLines(os.path.join(out_dir, f"dispatch-ab-{slug}-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"),
                    dict(env, tag="dispatch_ab"), o.dry)
    if o.dry:
        print(f"*** {DRY_LABEL} ***")
    floor = measure_floor(o, out)   # once, by this tree, for every checkout's rows
    lines, failed = [], []
    for label, path in trees:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--label", label,
               "--tokens", ",".join(map(str, o.tokens)), "--iters", str(o.iters), "--warmup", str(o.warmup),
               "--hidden", str(o.hidden), "--experts", str(o.experts), "--topk", str(o.topk)] + (
               ["--dry"] if o.dry else [])
        proc = subprocess.run(cmd, env=checkout_env(path), cwd=path, capture_output=True, text=True)
        for s in proc.stdout.splitlines():
            if not s.startswith("{"):
                continue
            p = json.loads(s)
            impl = f"{label}" + (" split" if p["phases"] == "split" else "")
            lines.append(result(out, floor, "dispatch", impl, ep_bytes("dispatch", p["tokens"], o.hidden, o.topk,
                                                                        p["dtype"] == "fp8"),
                                {k: p[k] for k in ("p20_us", "p50_us", "p80_us", "samples", "wall_us")},
                                checkout=label, path=path, phases=p["phases"], tokens=p["tokens"], hidden=o.hidden,
                                experts=o.experts, topk=o.topk, max_tokens=p["tokens"], dtype=p["dtype"],
                                heap="loopback"))
        if proc.returncode:
            failed.append(label)
            out.write(kind="error", op="dispatch", impl=label, reason=proc.stderr[-2000:])
            sys.stderr.write(proc.stderr[-4000:])
    lines.sort(key=lambda r: (r["dtype"], r["tokens"], r["phases"], r["impl"]))
    print(table(lines))
    print(f"wrote {out.path}" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
