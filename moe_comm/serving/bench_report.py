"""Reporting of the decode-latency benchmark: percentiles, the console table, JSON lines and the plot."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap

import numpy as np
import torch


def percentiles(step_us: list[float]) -> dict:
    """Per-step latencies (µs) -> p20 / p50 / p80 and the step count."""
    a = np.asarray(step_us, dtype=np.float64)
    p20, p50, p80 = np.percentile(a, [20, 50, 80])
    return dict(us_p20=float(p20), us_p50=float(p50), us_p80=float(p80), steps=int(a.size))


def slowest_rank_per_step(step_us_per_rank: list[list[float]]) -> list[float]:
    """Ranks step in lockstep; a step is as slow as its slowest rank."""
    return [max(col) for col in zip(*step_us_per_rank)]


def git_commit() -> str:
    """HEAD's hash, with "+dirty" when tracked files differ from it (what was measured is then not HEAD).
    MOE_COMM_COMMIT overrides it, for copies of the tree whose git metadata is not the measured commit
    (a GPU machine)."""
    if os.environ.get("MOE_COMM_COMMIT"):
        return os.environ["MOE_COMM_COMMIT"]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def git(*args):
        return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=10)
    try:
        head = git("rev-parse", "--verify", "-q", "HEAD").stdout.strip()
        if len(head) != 40:
            return "unknown"
        dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment(device: torch.device) -> dict:
    import triton  # noqa: PLC0415
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)"
    return dict(device=name, torch=torch.__version__, triton=triton.__version__, commit=git_commit())


def improvement(base: float, ours: float) -> float:
    """Percent of the baseline's latency saved (positive = ours is faster)."""
    return 100.0 * (base - ours) / base


def format_table(records: list[dict], backends: list[str], batches: list[int]) -> str:
    """One row per batch: p50 µs of every backend, then each of ours vs sync and vs padded."""
    by = {(r["backend"], r["batch_per_rank"]): r for r in records}
    ours = [b for b in backends if b in ("dynamic", "fused")]
    bases = [b for b in backends if b in ("sync", "padded")]
    head = ["batch"] + [f"{b} p50 µs" for b in backends] + [f"{o} vs {s}" for o in ours for s in bases]
    rows = []
    for n in batches:
        row = [str(n)]
        for b in backends:
            r = by.get((b, n))
            row.append("-" if r is None else f"{r['us_p50']:.0f} [{r['us_p20']:.0f}-{r['us_p80']:.0f}]")
        for o in ours:
            for s in bases:
                if (o, n) in by and (s, n) in by:
                    row.append(f"{improvement(by[(s, n)]['us_p50'], by[(o, n)]['us_p50']):+.1f}%")
                else:
                    row.append("-")
        rows.append(row)
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])


def write_jsonl(path: str, records: list[dict]) -> None:
    with open(path, "a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def plot(path: str, records: list[dict], backends: list[str], title: str) -> None:
    """Latency (p50, whiskers p20-p80) against batch size per backend, log-log."""
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for b in backends:
        rs = sorted((r for r in records if r["backend"] == b), key=lambda r: r["batch_per_rank"])
        if not rs:
            continue
        x = [r["batch_per_rank"] for r in rs]
        y = [r["us_p50"] for r in rs]
        err = [[r["us_p50"] - r["us_p20"] for r in rs], [r["us_p80"] - r["us_p50"] for r in rs]]
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=b)
    ax.set_xscale("log", base=2)
    batches = sorted({r["batch_per_rank"] for r in records})
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_yscale("log")
    ax.set_xlabel("decode batch per rank (tokens per step)")
    ax.set_ylabel("decode step latency, µs (p50; bars p20-p80)")
    ax.set_title("\n".join(textwrap.fill(line, 100) for line in title.split("\n")), fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
