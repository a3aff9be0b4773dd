"""Host cost of an eager call in CPU instructions, which do not drift with a shared machine's speed.

    python bench/host_instructions.py [--iters 100] [--ops EPBuffer,AllToAllvDynamic,PrefillBuffer]

``kernels.py --host`` times the calls; on a shared VM its figures move 1.0-1.5x with the machine's speed
(its ``ref`` column). This counts instead: each op runs under valgrind's callgrind (needs ``valgrind`` on
PATH; ~1.5 min per op and world on the 2-core development machine), exactly as ``bench/host_cost.py``
drives it (same sizes, Triton's launch stubbed, garbage collector off), and only the instructions executed
inside the timed loop are counted (callgrind collects inside ``functools.reduce``, which runs the loop).
Printed: thousands of instructions per dispatch + combine pair of one rank (world 8: both phases of every
rank, divided by 8). Deterministic to ~0.1 % between runs, so a change's effect on the host path is
visible even when it is smaller than the machine's drift.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OPS = ("EPBuffer", "AllToAllvDynamic", "PrefillBuffer")
WARMUP = 20
SIZES = dict(hidden=7168, experts=256, topk=8, tokens=16)   # as kernels.py --host


def _child(world: int, op: str, iters: int, metrics: bool = False) -> None:
    """Under callgrind: build every op as host_cost does, then run ``iters`` pairs of ``op`` inside reduce
    (``metrics``: with moe_comm.metrics' exporter on, as ``kernels.py --host --metrics``)."""
    import functools  # noqa: PLC0415
    import gc  # noqa: PLC0415
    import types  # noqa: PLC0415

    import torch  # noqa: PLC0415

    import moe_comm  # noqa: PLC0415
    from bench import host_cost  # noqa: PLC0415
    o = types.SimpleNamespace(device=torch.device("cpu"), **{k: v for k, v in SIZES.items() if k != "tokens"})
    groups = moe_comm.init(backend="loopback", world_size=world, device=o.device, timeout_s=30.0)
    with host_cost.launches_stubbed():
        for name, _, calls in host_cost._ops(groups, o, SIZES["tokens"]):
            if name != op:
                continue
            if metrics:
                host_cost.metrics_on()

            def pair(_acc, _i):
                for _, call in calls:
                    call()
            for i in range(WARMUP):
                pair(None, i)
            gc.disable()
            functools.reduce(pair, range(iters), None)   # the only code callgrind counts
            gc.enable()
            return
    raise ValueError(f"unknown op {op!r}: one of {OPS}")


def count(world: int, op: str, iters: int, metrics: bool = False) -> float:
    """Instructions per dispatch + combine pair of one rank."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        cmd = ["valgrind", "--tool=callgrind", "--collect-atstart=no", "--toggle-collect=functools_reduce",
               f"--callgrind-out-file={out}", sys.executable, os.path.abspath(__file__), "--child",
               str(world), op, str(iters), str(int(metrics))]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
        found = re.search(r"I\s+refs:\s*([\d,]+)", proc.stderr)
        if proc.returncode != 0 or not found:
            raise RuntimeError(f"callgrind run failed ({op}, world {world}):\n{proc.stderr[-2000:]}")
        return int(found.group(1).replace(",", "")) / (iters * world)


def main() -> int:
    if len(sys.argv) in (5, 6) and sys.argv[1] == "--child":   # --child WORLD OP ITERS [METRICS]
        sys.path.insert(0, ROOT)
        _child(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5:] == ["1"])
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=100, help="pairs per rank counted (world 8: a fifth of them)")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--metrics", action="store_true", help="moe_comm.metrics' exporter on (serving, not scraped)")
    o = p.parse_args()
    if shutil.which("valgrind") is None:
        p.error("needs valgrind on PATH (apt install valgrind); kernels.py --host times the same calls without it")
    print(f"host instructions per dispatch + combine pair of one rank, thousands (Triton's launch stubbed; "
          f"hidden {SIZES['hidden']}, {SIZES['experts']} experts, top-{SIZES['topk']}, T = {SIZES['tokens']}, bf16)")
    print(f"{'op':<18} {'world 1':>9} {'world 8':>9}")
    for op in o.ops.split(","):
        k = [count(w, op, o.iters if w == 1 else max(1, o.iters // 5), o.metrics) / 1e3 for w in (1, 8)]
        print(f"{op:<18} {k[0]:>9.1f} {k[1]:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
