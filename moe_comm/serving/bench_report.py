"""Reporting of the decode-latency benchmark: percentiles, the console table, JSON lines and the plot."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap

import numpy as np
import torch

from .backends import BASELINE_NAMES


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
    return dict(device=name, torch=torch.__version__, triton=triton.__version__,
                cuda=torch.version.cuda if device.type == "cuda" else None, commit=git_commit())


def improvement(base: float, ours: float) -> float:
    """Percent of the baseline's latency saved (positive = ours is faster)."""
    return 100.0 * (base - ours) / base


BASELINES = BASELINE_NAMES


def _grid(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])


def format_table(records: list[dict], backends: list[str], batches: list[int]) -> str:
    """One row per batch: p50 µs [p20-p80] of every backend."""
    by = {(r["backend"], r["batch_per_rank"]): r for r in records}
    head = ["batch"] + [f"{b} p50 µs" for b in backends]
    rows = []
    for n in batches:
        row = [str(n)]
        for b in backends:
            r = by.get((b, n))
            row.append("-" if r is None else f"{r['us_p50']:.0f} [{r['us_p20']:.0f}-{r['us_p80']:.0f}]")
        rows.append(row)
    return _grid(head, rows)


def savings(records: list[dict], backends: list[str], batches: list[int]) -> list[dict]:
    """Every backend against every baseline present (other than itself): % of the baseline's p50 saved."""
    by = {(r["backend"], r["batch_per_rank"]): r["us_p50"] for r in records}
    bases = [b for b in BASELINES if b in backends]
    out = []
    for n in batches:
        for b in backends:
            for base in bases:
                if base != b and (b, n) in by and (base, n) in by:
                    out.append(dict(batch=n, backend=b, baseline=base, pct=improvement(by[(base, n)], by[(b, n)])))
    return out


# Baselines in the order a saving is read: graphed like the capturable backends first, the eager model last.
FAIR_FIRST = ("sync-graphed", "padded", "sync")
BASELINE_LABELS = {"sync": "vs sync (eager model)"}


def format_savings(rows: list[dict], backends: list[str], batches: list[int]) -> str:
    """One row per (batch, backend): % saved against each baseline (positive = faster), the fair baseline
    first."""
    bases = [b for b in FAIR_FIRST if b in backends]
    pct = {(r["batch"], r["backend"], r["baseline"]): r["pct"] for r in rows}
    head = ["batch", "backend"] + [BASELINE_LABELS.get(b, f"vs {b}") for b in bases]
    body = []
    for n in batches:
        for b in backends:
            cells = [f"{pct[(n, b, base)]:+.1f}%" if (n, b, base) in pct else "-" for base in bases]
            if any(c != "-" for c in cells):
                body.append([str(n), b] + cells)
    return _grid(head, body)


COMM_PARTS = ("dispatch", "combine")


def latest_profile(records: list[dict]) -> dict:
    """{(backend, batch): {part: µs per step}} from ``decode_profile`` JSON lines (the last line wins)."""
    out: dict = {}
    for r in records:
        if r.get("bench") == "decode_profile":
            out.setdefault((r["backend"], r["batch_per_rank"]), {})[r["part"]] = r["us_per_step"]
    return out


def attribution(records: list[dict], profile: dict, baseline: str = "sync") -> list[dict]:
    """Where each backend's difference from ``baseline`` comes from, per batch.

    saved = baseline p50 - backend p50 (timed steps). communication = the baseline's dispatch + combine
    time minus the backend's, from the step profile (eager steps, device time on a GPU). graphs = the
    rest: what running the step as CUDA graphs (no launch gaps, no host-bound stretches) and without
    host syncs saves outside the two ops. Rows without a profile for both backends are left out.
    """
    by = {(r["backend"], r["batch_per_rank"]): r["us_p50"] for r in records}
    out = []
    for (b, n), us in sorted(by.items()):
        if b == baseline or (baseline, n) not in by:
            continue
        pb, pbase = profile.get((b, n)), profile.get((baseline, n))
        if not pb or not pbase:
            continue
        saved = by[(baseline, n)] - us
        comm = sum(pbase.get(p, 0.0) for p in COMM_PARTS) - sum(pb.get(p, 0.0) for p in COMM_PARTS)
        out.append(dict(batch=n, backend=b, baseline=baseline, saved_us=saved, communication_us=comm,
                        graphs_us=saved - comm))
    return out


def format_attribution(rows: list[dict]) -> str:
    head = ["batch", "backend", "vs", "saved µs", "communication µs", "graphs + host µs"]
    body = [[str(r["batch"]), r["backend"], r["baseline"], f"{r['saved_us']:.0f}", f"{r['communication_us']:.0f}",
             f"{r['graphs_us']:.0f}"] for r in rows]
    return _grid(head, body)


def write_jsonl(path: str, records: list[dict]) -> int:
    """Append ``records`` to ``path``; returns how many runs the file now holds (distinct ``run`` values;
    lines written before runs were labelled count as one)."""
    with open(path, "a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    with open(path) as f:
        return len({json.loads(line).get("run") for line in f if line.strip()})


# The decode target the issue tracker quotes: NCCLX's single-node decode saving (43 %).
TARGET_SAVED_PCT = 43.0


def plot(path: str, records: list[dict], backends: list[str], title: str) -> None:
    """Left: latency (p50, whiskers p20-p80) against batch size per backend, log-log. Right: % of each
    baseline's latency that every other backend saves, with the 43 % target line."""
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for b in backends:
        rs = sorted((r for r in records if r["backend"] == b), key=lambda r: r["batch_per_rank"])
        if not rs:
            continue
        x = [r["batch_per_rank"] for r in rs]
        y = [r["us_p50"] for r in rs]
        err = [[r["us_p50"] - r["us_p20"] for r in rs], [r["us_p80"] - r["us_p50"] for r in rs]]
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=b)
    batches = sorted({r["batch_per_rank"] for r in records})
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        a.set_xticks(batches, [str(b) for b in batches])
        a.set_xlabel("decode batch per rank (tokens per step)")
        a.grid(True, which="both", alpha=0.3)
    ax.set_yscale("log")
    ax.set_ylabel("decode step latency, µs (p50; bars p20-p80)")
    ax.legend()
    rows = savings(records, backends, batches)
    styles = {"sync": "-", "sync-graphed": "--", "padded": ":"}
    for b in backends:
        for base in BASELINES:
            pts = sorted((r["batch"], r["pct"]) for r in rows if r["backend"] == b and r["baseline"] == base)
            if pts and b not in BASELINES[:BASELINES.index(base) + 1]:
                ax2.plot([p[0] for p in pts], [p[1] for p in pts], styles[base], marker=".", label=f"{b} vs {base}")
    ax2.axhline(TARGET_SAVED_PCT, color="red", lw=1)
    ax2.text(batches[0], TARGET_SAVED_PCT, f" {TARGET_SAVED_PCT:.0f} % target", color="red", va="bottom", fontsize=8)
    ax2.axhline(0, color="black", lw=0.6)
    ax2.set_ylabel("% of the baseline's step latency saved")
    ax2.set_title("saved vs each baseline (solid: sync, dashed: sync-graphed, dotted: padded)", fontsize=9)
    ax2.legend(fontsize=7, ncol=2)
    fig.suptitle("\n".join(textwrap.fill(line, 150) for line in title.split("\n")), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_graphs(record: dict) -> str:
    """How a timed run ran its steps (a GRAPH_MODES key); lines written before ``graphs`` was recorded
    carry only ``cuda_graphs``."""
    return record.get("graphs") or ("graph" if record.get("cuda_graphs") else "eager")


COUNTED = (("step_host_reads", "host syncs per step"), ("step_launches", "kernel launches per step"),
           ("step_wire_bytes", "payload bytes to other ranks per step"))


def plot_counters(path: str, records: list[dict], backends: list[str], batches: list[int], title: str,
                  committed: dict | None) -> None:
    """What a CPU run measures truly, per backend and batch: host syncs, kernel launches and bytes to other
    ranks per step (bars; the x labels say how the step runs on a GPU). Last panel: the committed GPU run
    of the same configuration (p50 step latency per backend), titled with its device and commit; no
    interpreter timing is drawn."""
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    from .step_profile import GRAPH_MODES  # noqa: PLC0415
    by = {(r["backend"], r["batch_per_rank"]): r for r in records}
    fig, axes = plt.subplots(1, len(COUNTED) + 1, figsize=(5 * (len(COUNTED) + 1), 5.6))
    width = 0.8 / max(1, len(batches))
    labels = [f"{b}\n{by[(b, batches[0])]['step_gpu_graphs']}" for b in backends]
    legend = "x labels: backend, and how its step runs on a GPU: " + "; ".join(f"{k} = {v}" for k, v in GRAPH_MODES.items())
    for ax, (key, name) in zip(axes, COUNTED):
        for j, n in enumerate(batches):
            xs = [i + (j - (len(batches) - 1) / 2) * width for i in range(len(backends))]
            vals = [by[(b, n)][key] for b in backends]
            bars = ax.bar(xs, vals, width * 0.95, label=f"batch {n}")
            ax.bar_label(bars, [f"{v:,}" for v in vals], fontsize=6, rotation=90, padding=2)
        ax.set_xticks(range(len(backends)), labels, fontsize=7, rotation=30)
        ax.set_title(name, fontsize=9)
        ax.margins(y=0.2)
        ax.legend(fontsize=7)
    ax = axes[-1]
    if committed is None:
        ax.text(0.5, 0.5, "no committed GPU run\nof this configuration", ha="center", va="center")
        ax.set_axis_off()
    else:
        for b in backends:
            rs = sorted((r for r in committed["records"] if r["backend"] == b), key=lambda r: r["batch_per_rank"])
            if rs:
                ax.plot([r["batch_per_rank"] for r in rs], [r["us_p50"] for r in rs], marker="o",
                        label=f"{b} ({GRAPH_MODES[run_graphs(rs[0])]})")
        gpu_batches = sorted({r["batch_per_rank"] for r in committed["records"]})
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(gpu_batches, [str(n) for n in gpu_batches], fontsize=7)
        ax.set_xlabel("decode batch per rank")
        ax.set_ylabel("step latency p50, µs")
        ax.set_title(textwrap.fill(f"committed GPU run, world 1: {committed['device']}, commit {committed['commit']}"
                                   " (not this machine)", 60), fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle("\n".join(textwrap.fill(line, 170) for line in (title + "\n" + legend).split("\n")), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_profile(path: str, profile: dict, backends: list[str], batches: list[int], parts: tuple,
                 title: str, unit: str) -> None:
    """The step profile as stacked bars: one bar per (batch, backend), one segment per part."""
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    fig, ax = plt.subplots(figsize=(max(7, 1.2 * len(batches) * len(backends)), 5))
    width = 0.8 / max(1, len(backends))
    colors = plt.get_cmap("tab10").colors
    for j, b in enumerate(backends):
        bottom = [0.0] * len(batches)
        for k, part in enumerate(parts):
            h = [profile[b][n].get(part, 0.0) for n in batches]
            xs = [i + (j - (len(backends) - 1) / 2) * width for i in range(len(batches))]
            ax.bar(xs, h, width * 0.95, bottom=bottom, color=colors[k % 10], label=part if j == 0 else None,
                   edgecolor="white", lw=0.3)
            bottom = [a + c for a, c in zip(bottom, h)]
        for i, top in enumerate(bottom):
            ax.text(i + (j - (len(backends) - 1) / 2) * width, top, b, rotation=90, fontsize=7, ha="center",
                    va="bottom")
    ax.set_xticks(range(len(batches)), [f"batch {n}" for n in batches])
    ax.set_ylabel(unit)
    ax.set_title("\n".join(textwrap.fill(line, 120) for line in title.split("\n")), fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
