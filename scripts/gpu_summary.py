"""Summaries of GPU runs, and the tables of README's and docs/benchmarks.md's results, from results folders.

    python scripts/gpu_summary.py OUT_DIR [--markdown OUT_DIR/summary.md]
        one screen for a ``make gpu-check`` folder: tests (pytest junit XML), kernel and decode benchmarks
        (JSON lines) and the issue's targets, PASS / MISS / n/a; for a ``make gpu-quick`` folder (it has
        plan.json) every step's budget, status and verdict and the figures each step measured, also written
        to OUT_DIR/summary.md and summary.json
    python scripts/gpu_summary.py --publish [RUN_DIR ...]
        add RUN_DIRs to bench/results/published.txt, then rewrite README's results table and the generated
        part of docs/benchmarks.md from every folder listed there (device, versions and commit on each
        column or row): the last step of a GPU loan is this command and a commit

Reads every ``*.xml`` (junit), ``kernels-*.jsonl`` and ``decode_latency*.jsonl`` under OUT_DIR.
Targets: dispatch and combine within 1.5x of (HBM floor + one launch) at T=128, EP=1; AllToAllvDynamic
at least 1.5x faster than torch all_to_all_vdev and NCCL with host-read splits at decode sizes (<= 128
rows); the randomized dispatch -> combine soak passes.
A run folder may hold ``run.json`` ({"commit": ..., "note": ...}): the commit the tables name for it when
the machine's copy of the tree carried other git metadata than the commit measured (its JSON lines keep
what they recorded).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import xml.etree.ElementTree as ET

DRY_LABEL = "dry run, CPU interpreter, not a GPU measurement"
DECODE_ROWS = 128      # "decode sizes": calls of at most this many rows
TARGET_T = 128
FLOOR_TARGET = 1.5
SPEEDUP_TARGET = 1.5
DECODE_GAIN_TARGET = 43.0  # % lower decode step than sync at batch <= DECODE_GAIN_BATCH (NCCLX's figure)
DECODE_GAIN_BATCH = 64


def read_jsonl(paths) -> list[dict]:
    out = []
    for p in paths:
        with open(p) as f:
            out += [json.loads(s) for s in f if s.strip()]
    return out


def junit(paths) -> dict:
    """Totals over every junit file, failing test names, and the outcome of each test by name."""
    tot = dict(tests=0, failures=0, errors=0, skipped=0, time=0.0)
    failed, outcome = [], {}
    for p in paths:
        root = ET.parse(p).getroot()
        for suite in ([root] if root.tag == "testsuite" else root.iter("testsuite")):
            for k in ("tests", "failures", "errors", "skipped"):
                tot[k] += int(suite.get(k, 0))
            tot["time"] += float(suite.get("time", 0.0))
            for case in suite.iter("testcase"):
                name = f"{case.get('classname', '')}::{case.get('name', '')}"
                bad = case.find("failure") is not None or case.find("error") is not None
                skip = case.find("skipped") is not None
                outcome[name] = "failed" if bad else "skipped" if skip else "passed"
                if bad:
                    failed.append(name)
    tot["passed"] = tot["tests"] - tot["failures"] - tot["errors"] - tot["skipped"]
    return dict(tot, failed=failed, outcome=outcome)


def verdict(ok: bool | None) -> str:
    return "n/a " if ok is None else ("PASS" if ok else "MISS")


def targets(kern: list[dict], tests: dict | None) -> list[str]:
    res = [r for r in kern if r.get("kind") == "result"]
    lines = []
    for op, dtype in (("dispatch", "bf16"), ("dispatch", "fp8"), ("combine", "bf16"), ("combine", "fp8")):
        r = next((r for r in res if r["op"] == op and r["impl"] == "moe_comm" and r["dtype"] == dtype
                  and r.get("tokens") == TARGET_T), None)
        if r is None:
            lines.append(f"  n/a   {op} {dtype} T={TARGET_T}: no measurement")
            continue
        lines.append(f"  {verdict(r['x_floor'] <= FLOOR_TARGET)}  {op} {dtype} T={TARGET_T}: p50 {r['p50_us']:.1f} µs, "
                     f"floor {r['floor_us']:.1f} µs -> {r['x_floor']:.2f}x (target <= {FLOOR_TARGET}x)")
    ours = {r["rows"]: r["p50_us"] for r in res if r["op"] == "alltoallv" and r["impl"] == "moe_comm"}
    for peer in ("torch_symm_mem_vdev", "host_splits"):  # host_splits: NCCL (gloo in a dry run)
        theirs = {r["rows"]: r["p50_us"] for r in res if r["op"] == "alltoallv" and r["impl"].endswith(peer)}
        peer = next((r["impl"] for r in res if r["op"] == "alltoallv" and r["impl"].endswith(peer)), peer)
        common = sorted(n for n in ours if n in theirs and n <= DECODE_ROWS)
        if not common:
            lines.append(f"  n/a   alltoallv vs {peer}: no common decode-size measurement")
            continue
        speed = {n: theirs[n] / ours[n] for n in common}
        worst = min(speed, key=speed.get)
        lines.append(f"  {verdict(speed[worst] >= SPEEDUP_TARGET)}  alltoallv vs {peer}: speedup "
                     + ", ".join(f"{n}r {speed[n]:.2f}x" for n in common) + f" (target >= {SPEEDUP_TARGET}x each)")
    soak = {n: o for n, o in (tests or {}).get("outcome", {}).items() if "soak" in n}
    if not soak:
        lines.append("  n/a   soak: not run")
    else:
        ok = all(o == "passed" for o in soak.values())
        lines.append(f"  {verdict(ok if 'skipped' not in soak.values() else None)}  soak: "
                     + ", ".join(f"{n.split('::')[-1]} {o}" for n, o in soak.items()))
    return lines


def kernel_table(kern: list[dict]) -> list[str]:
    res = [r for r in kern if r.get("kind") == "result"]
    if not res:
        return ["  (no kernel results)"]
    sizes = sorted({r.get("rows", r.get("tokens")) for r in res})
    keys = []
    for r in res:
        k = (r["op"], r["impl"], r["dtype"])
        if k not in keys:
            keys.append(k)
    cell = {((r["op"], r["impl"], r["dtype"]), r.get("rows", r.get("tokens"))): r for r in res}
    out = ["  p50 µs (x floor for moe_comm) by rows (alltoallv) / tokens T per rank (dispatch, combine)",
           "  " + f"{'op':<9} {'impl':<32} {'dtype':<5}" + "".join(f"{s:>16}" for s in sizes)]
    for k in keys:
        cells = []
        for s in sizes:
            r = cell.get((k, s))
            if r is None:
                cells.append(f"{'-':>16}")
            elif k[1].startswith("moe_comm"):
                cells.append(f" {r['p50_us']:.1f} ({r['x_floor']:.1f}x)".rjust(16))
            else:
                cells.append(f"{r['p50_us']:>16.1f}")
        out.append("  " + f"{k[0]:<9} {k[1]:<32} {k[2]:<5}" + "".join(cells))
    for r in kern:
        if r.get("kind") in ("skip", "error"):
            what = "skipped" if r["kind"] == "skip" else "FAILED"
            out.append(f"  {what} {r['op']} {r['impl']}: {r['reason'][:150]}")
    return out


def where(world, long: bool = False) -> str:
    """'w8' / 'world 8' for a real world; one rank of an emulated EP-N as it is."""
    if isinstance(world, str):
        return f"one rank of {world}" if long else world.replace(" ", "-")
    return f"world {world}" if long else f"w{world}"


def decode_groups(dec: list[dict]) -> dict[tuple, list[dict]]:
    """Decode records by (config, world, heap, expert kernel, attention kernel); records from before a
    kernel was recorded ran torch.bmm experts ("dense") and the torch attention."""
    groups: dict[tuple, list[dict]] = {}
    for r in dec:
        world = f"EP{r['emulate_ep']} emulated" if r.get("emulate_ep") else r.get("world")
        key = (r.get("config"), world, r.get("heap"), r.get("expert_impl", "dense"),
               r.get("attention_impl", "torch"))
        groups.setdefault(key, []).append(r)
    return groups


def decode_targets(dec: list[dict]) -> list[str]:
    """Issue targets per group and backend (dynamic, fused): >= 43 % lower step time than sync at every
    batch <= 64, and never slower than sync or padded at any batch."""
    lines = []
    for (config, world, _, experts, attention), rows in decode_groups(dec).items():
        p50 = {(r["backend"], r["batch_per_rank"]): r["us_p50"] for r in rows}
        for be in ("dynamic", "fused"):
            batches = sorted(b for (name, b) in p50 if name == be and (("sync", b) in p50))
            if not batches:
                continue
            gain = {b: 100.0 * (1 - p50[(be, b)] / p50[("sync", b)]) for b in batches}
            small = [b for b in batches if b <= DECODE_GAIN_BATCH]
            worst = min(small, key=gain.get) if small else None
            tag = f"{config} {where(world)} {experts}" + ("" if attention == "torch" else f" attn-{attention}")
            ok = None if worst is None else gain[worst] >= DECODE_GAIN_TARGET
            lines.append(f"  {verdict(ok)}  decode {be} vs sync "
                         f"({tag}): " + (f"least {gain[worst]:.1f} % at batch {worst}, most {max(gain.values()):.1f} % "
                                         f"(target >= {DECODE_GAIN_TARGET:.0f} % at every batch <= {DECODE_GAIN_BATCH})"
                                         if worst is not None else "no batch <= 64"))
            slower = [f"{b} ({base})" for b in batches for base in ("sync", "padded")
                      if (base, b) in p50 and p50[(be, b)] > p50[(base, b)]]
            lines.append(f"  {verdict(not slower)}  decode {be} never slower than sync/padded ({tag})"
                         + (": slower at batch " + ", ".join(slower) if slower else ""))
    return lines


def decode_table(dec: list[dict]) -> list[str]:
    """One table per (config, world, heap, expert kernel, attention kernel) found."""
    if not dec:
        return ["  (no decode results)"]
    groups = decode_groups(dec)
    out = []
    for (config, world, heap, experts, attention), rows in groups.items():
        backends = list(dict.fromkeys(r["backend"] for r in rows))
        batches = sorted({r["batch_per_rank"] for r in rows})
        by = {(r["backend"], r["batch_per_rank"]): r for r in rows}
        out += [f"  {config} {where(world, long=True)} {heap} heap, {experts} expert GEMMs, {attention} attention; "
                "step p50 µs by batch per rank",
                "  " + f"{'backend':<10}" + "".join(f"{b:>9}" for b in batches)]
        for be in backends:
            out.append("  " + f"{be:<10}" + "".join(
                f"{by[(be, b)]['us_p50']:>9.0f}" if (be, b) in by else f"{'-':>9}" for b in batches))
    return out


def summarize(out_dir: str) -> str:
    find = lambda pat: sorted(glob.glob(os.path.join(out_dir, "**", pat), recursive=True))  # noqa: E731
    kern = read_jsonl(find("kernels-*.jsonl"))
    dec = read_jsonl(find("decode_latency*.jsonl"))
    xmls = find("*.xml")
    tests = junit(xmls) if xmls else None
    dry = any(r.get("dry") for r in kern) or any(str(r.get("device", "")).startswith("cpu") for r in dec)
    env = next((r["env"] for r in kern if "env" in r), None) or (dec[0] if dec else {})
    lines = [f"*** {DRY_LABEL} ***"] if dry else []
    lines.append(f"moe-comm GPU check: {env.get('device', '?')}; torch {env.get('torch', '?')}, triton "
                 f"{env.get('triton', '?')}, nvshmem4py {env.get('nvshmem4py', '?')}; commit {env.get('commit', '?')}")
    if tests is None:
        lines.append("tests: no junit XML found")
    else:
        lines.append(f"tests: {tests['passed']} passed, {tests['failures']} failed, {tests['errors']} errors, "
                     f"{tests['skipped']} skipped in {tests['time']:.0f} s")
        lines += [f"  FAILED {n}" for n in tests["failed"][:6]]
        if len(tests["failed"]) > 6:
            lines.append(f"  ... and {len(tests['failed']) - 6} more")
    floor = {r["op"]: r for r in kern if r.get("kind") == "floor"}
    if floor:
        lines.append(f"floor: copy {floor['copy']['GBps']:.0f} GB/s (read + write), empty kernel "
                     f"{floor['empty_kernel']['p50_us']:.2f} µs" if {"copy", "empty_kernel"} <= floor.keys()
                     else "floor: incomplete")
    lines.append("targets:")
    lines += targets(kern, tests)
    lines += decode_targets(dec)
    lines.append("kernels:")
    lines += kernel_table(kern)
    lines.append("decode:")
    lines += decode_table(dec)
    if dry:
        lines.append(f"*** {DRY_LABEL} ***")
    return "\n".join(lines)


# ---- gpu-quick folders -----------------------------------------------------------------------------

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK_PLAN = "plan.json"


def _rows(pattern_dir: str, pattern: str) -> list[dict]:
    """JSON lines of every file matching ``pattern`` under a folder; lines cut by a kill are skipped."""
    out = []
    for path in sorted(glob.glob(os.path.join(pattern_dir, "**", pattern), recursive=True)):
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
    return out


def env_words(env: dict) -> str:
    """device; torch, triton, CUDA versions; commit: what every summary line is measured with."""
    return (f"{env.get('device', '?')}; torch {env.get('torch', '?')}, triton {env.get('triton', '?')}, "
            f"CUDA {env.get('cuda') or '-'}; commit {str(env.get('commit', '?'))[:12]}")


def _step_dir(out: str, name: str) -> str | None:
    hits = sorted(glob.glob(os.path.join(out, f"[0-9][0-9]-{name}")))
    return hits[0] if hits else None


def _kernel_section(out: str, name: str, title: str) -> list[str]:
    d = _step_dir(out, name)
    kern = _rows(d, "kernels-*.jsonl") if d else []
    if not kern:
        return []
    env = next((r["env"] for r in kern if "env" in r), {})
    return [f"## {title}", "", f"{env_words(env)}; tag {env.get('tag') or '-'}", "", "```"] + kernel_table(kern) + ["```", ""]


def _compare(out: str, a: str, b: str, title: str) -> list[str]:
    """p50 of step ``b`` against step ``a`` for every (op, impl, dtype, size) both measured."""
    da, db = _step_dir(out, a), _step_dir(out, b)
    if not da or not db:
        return []
    key = lambda r: (r["op"], r["impl"], r["dtype"], r.get("rows", r.get("tokens")))  # noqa: E731
    ra = {key(r): r for r in _rows(da, "kernels-*.jsonl") if r.get("kind") == "result"}
    rb = {key(r): r for r in _rows(db, "kernels-*.jsonl") if r.get("kind") == "result"}
    common = [k for k in ra if k in rb]
    if not common:
        return []
    ea, eb = ra[common[0]]["env"], rb[common[0]]["env"]
    lines = [f"## {title}", "", f"{a}: {env_words(ea)}", f"{b}: {env_words(eb)}", "",
             f"| op | impl | dtype | size | {a} p50 µs | {b} p50 µs | {b} / {a} |", "|---|---|---|---|---|---|---|"]
    for k in common:
        x, y = ra[k]["p50_us"], rb[k]["p50_us"]
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {x:.1f} | {y:.1f} | {y / x:.2f} |")
    return lines + [""]


def _prefill_section(out: str) -> list[str]:
    d = _step_dir(out, "prefill")
    rows = [r for r in _rows(d, "kernels-*.jsonl") if r.get("kind") == "result"] if d else []
    if not rows:
        return []
    lines = ["## Prefill, every rank of an emulated world on one device", "", env_words(rows[0]["env"]), "",
             "| op | ranks | dispatch dtype | T per rank | streams | p50 µs | link-side GB/s | floor µs | % of floor |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['op']} | {r['world']} | {r.get('dispatch_dtype', r['dtype'])} | {r['tokens']} | {r['streams']} | "
                     f"{r['p50_us']:.1f} | {r['GBps']:.0f} | {r['floor_us']:.1f} | {r['pct_of_floor']:.0f} |")
    return lines + [""]


def _decode_section(out: str) -> list[str]:
    d = _step_dir(out, "decode")
    dec = _rows(d, "decode_latency*.jsonl") if d else []
    if not dec:
        return []
    return ["## Decode step", "", env_words(dec[0]), "", "```"] + decode_table(dec) + ["```", ""]


def _cold_section(out: str) -> list[str]:
    d = _step_dir(out, "cold-start")
    rows = _rows(d, "cold_start.jsonl") if d else []
    if not rows:
        return []
    lines = ["## Cold start", "", env_words(rows[0]["env"]), "",
             "| process | to first dispatch+combine s | import s | setup s | first call s | second call s | "
             "kernels compiled |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] == "run":
            lines.append(f"| {r['case']} | {r['to_first_call_s']:.1f} | {r['import_s']:.1f} | {r['setup_s']:.1f} | "
                         f"{r['first_call_s']:.2f} | {r['second_call_s']:.3f} | {r['compiled']} |")
        elif r["kind"] == "warmup":
            lines.append(f"| (moe_comm warmup) | {r['wall_s']:.1f} wall | | | | | {r['compiled']} of "
                         f"{r['variants']} variants |")
    return lines + [""]


def quick_summary(out: str) -> tuple[str, dict]:
    """(markdown, JSON object) of a gpu-quick folder as it is now: the plan, every finished step's verdict
    and what the measuring steps recorded."""
    with open(os.path.join(out, QUICK_PLAN)) as f:
        plan = json.load(f)
    verdicts = {}
    for path in sorted(glob.glob(os.path.join(out, "[0-9][0-9]-*", "verdict.json"))):
        with open(path) as f:
            v = json.loads(f.read())
        verdicts[v["step"]] = v
    env = plan.get("env", {})
    lines = [f"*** {DRY_LABEL} ***", ""] if plan.get("dry") else []
    lines += [f"# gpu-quick: {env_words(env)}", "",
              f"Budget {plan['total_s']:.0f} s in all (every step's budget x {plan['scale']:.2f}); a step past its "
              "budget is cut and the run goes on.", "",
              "| # | step | budget s | status | wall s | verdict |", "|---|---|---|---|---|---|"]
    for st in plan["steps"]:
        v = verdicts.get(st["step"])
        if v is None:
            lines.append(f"| {st['index']} | {st['step']} | {st['budget_s']:.0f} | pending | | {st['what']} |")
        else:
            lines.append(f"| {st['index']} | {st['step']} | {v['budget_s']:.0f} | {v['status']} | {v['wall_s']:.0f} | "
                         f"{v['verdict'].replace('|', '/')} |")
    lines.append("")
    lines += _kernel_section(out, "kernels", "Kernels (world 1 and 8 emulated ranks), tracing off")
    lines += _compare(out, "kernels", "kernels-baseline", "Baseline checkout against this one (same device, same run)")
    lines += _compare(out, "kernels", "kernels-trace", "Flight recorder: tracing on against off")
    lines += _kernel_section(out, "ep-rank", "One rank of EP8, the other ranks emulated")
    lines += _prefill_section(out)
    lines += _decode_section(out)
    lines += _cold_section(out)
    if plan.get("dry"):
        lines.append(f"*** {DRY_LABEL} ***")
    data = dict(env=env, dry=plan.get("dry", False), total_s=plan["total_s"], scale=plan["scale"],
                steps=[dict(st, **verdicts.get(st["step"], dict(status="pending"))) for st in plan["steps"]])
    return "\n".join(lines) + "\n", data


def write_quick_summary(out: str) -> str:
    """Write OUT/summary.md and OUT/summary.json (``quick_summary``); returns the markdown."""
    text, data = quick_summary(out)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(data, f, indent=1)
    return text


# ---- README's and docs/benchmarks.md's tables -----------------------------------------------------------

PUBLISHED = os.path.join("bench", "results", "published.txt")
README_MARK, DOCS_MARK = "kernel-results", "all-kernel-results"
MAIN_TAGS = ("", "trace=off")   # rows the tables show (not the flight recorder's, not a baseline's)


def published_runs(root: str = REPO) -> list[str]:
    """The run folders listed in bench/results/published.txt (relative to the repository), in column order."""
    path = os.path.join(root, PUBLISHED)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [s.strip() for s in f if s.strip() and not s.lstrip().startswith("#")]


def run_info(root: str, run: str) -> dict:
    """One run folder: its kernel rows (tracing off, this tree's), the environment they carry, the commit
    the tables name (run.json's, else the rows') and a short column label."""
    meta = {}
    if os.path.exists(os.path.join(root, run, "run.json")):
        with open(os.path.join(root, run, "run.json")) as f:
            meta = json.load(f)
    tags = (meta["tag"],) if "tag" in meta else MAIN_TAGS   # run.json may name the rows shown (a before/after run)
    kern = [r for r in _rows(os.path.join(root, run), "kernels-*.jsonl") if r.get("env", {}).get("tag", "") in tags]
    env = next((r["env"] for r in kern if "env" in r), {})
    commit = str(meta.get("commit") or env.get("commit", "?"))
    device = str(env.get("device", "?")).replace("NVIDIA ", "")
    return dict(run=run, rows=kern, env=env, commit=commit, note=meta.get("note", ""),
                label=f"{device} · {commit[:7]}")


def _cell(r: dict | None, prefill: bool = False) -> str:
    if r is None:
        return "-"
    if prefill:
        return f"{r['p50_us']:.0f} µs, {r['GBps']:.0f} GB/s, {r['pct_of_floor']:.0f} %"
    ours = r["impl"].startswith("moe_comm")   # a peer's time alone: the floor is ours to meet
    return f"{r['p50_us']:.1f} ({r['x_floor']:.2f}x)" if ours and "x_floor" in r else f"{r['p50_us']:.1f}"


# (row label, op, impl, dtype, size key) of the summary table (docs/benchmarks.md), in order; README_ROWS:
# the labels README's shorter copy keeps (README is read in one sitting: the rest is one link away)
SUMMARY_ROWS = (
    ("AllToAllvDynamic, rows", "alltoallv", "moe_comm", "bf16", "rows"),
    ("NCCL all_to_all_single, host-read splits", "alltoallv", "nccl_host_splits", "bf16", "rows"),
    ("dispatch bf16", "dispatch", "moe_comm", "bf16", "tokens"),
    ("dispatch fp8", "dispatch", "moe_comm", "fp8", "tokens"),
    ("combine bf16", "combine", "moe_comm", "bf16", "tokens"),
    ("8 emulated ranks in turn: dispatch bf16", "dispatch", "moe_comm_emulated_w8", "bf16", "tokens"),
    ("8 emulated ranks in turn: combine bf16", "combine", "moe_comm_emulated_w8", "bf16", "tokens"),
    ("8 emulated ranks, a stream each: dispatch bf16", "dispatch", "moe_comm_emulated_w8_concurrent", "bf16", "tokens"),
    ("8 emulated ranks, a stream each: dispatch fp8", "dispatch", "moe_comm_emulated_w8_concurrent", "fp8", "tokens"),
    ("8 emulated ranks, a stream each: combine bf16", "combine", "moe_comm_emulated_w8_concurrent", "bf16", "tokens"),
)
README_ROWS = ("AllToAllvDynamic, rows", "NCCL all_to_all_single, host-read splits", "dispatch bf16", "combine bf16",
               "8 emulated ranks, a stream each: dispatch bf16", "8 emulated ranks, a stream each: combine bf16")
README_SIZES = (1, 128)
PREFILL_ROWS = (("prefill dispatch bf16", "prefill_dispatch", "bf16"), ("prefill dispatch fp8", "prefill_dispatch", "fp8"),
                ("prefill combine (after bf16 dispatch)", "prefill_combine", "bf16"))


def summary_table(runs: list[dict], labels: tuple[str, ...] | None = None, prefill: bool = True) -> list[str]:
    """The kernel summary table: one column per run (device and commit in its head), rows by op and size;
    ``labels``: only those rows of SUMMARY_ROWS (all when None); ``prefill``: the prefill rows too."""
    head = "| DeepSeek-V3 rows (hidden 7168; top-8 of 256 experts) | T or rows | " + " | ".join(
        r["label"] for r in runs) + " |"
    lines = [head, "|---|---|" + "---|" * len(runs)]
    floors = []
    for r in runs:
        fl = {x["op"]: x for x in r["rows"] if x.get("kind") == "floor"}
        floors.append(f"{fl['copy']['GBps']:.0f} GB/s, {fl['empty_kernel']['p50_us']:.2f} µs"
                      if {"copy", "empty_kernel"} <= fl.keys() else "-")
    lines.append("| floor: copy (read + write), empty launch | | " + " | ".join(floors) + " |")
    for label, op, impl, dtype, size_key in SUMMARY_ROWS:
        if labels is not None and label not in labels:
            continue
        for n in README_SIZES:
            cells = [_cell(next((x for x in r["rows"] if x.get("kind") == "result" and x["op"] == op
                                 and x["impl"] == impl and x["dtype"] == dtype and x.get(size_key) == n), None))
                     for r in runs]
            if any(c != "-" for c in cells):
                lines.append(f"| {label} | {n} | " + " | ".join(cells) + " |")
    for label, op, dtype in PREFILL_ROWS if prefill else ():
        for impl, how in (("moe_comm_emulated_w8_concurrent", "a stream each"), ("moe_comm_emulated_w8", "in turn")):
            cells = []
            for r in runs:
                hit = [x for x in r["rows"] if x.get("kind") == "result" and x["op"] == op and x["impl"] == impl
                       and (x.get("dispatch_dtype", x["dtype"]) == dtype)]
                cells.append(_cell(hit[0] if hit else None, prefill=True))
            if any(c != "-" for c in cells):
                n = next(x.get("tokens") for r in runs for x in r["rows"] if x.get("op") == op)
                lines.append(f"| 8 emulated ranks, {how}: {label} (p50, link-side GB/s, % of floor) | {n} | "
                             + " | ".join(cells) + " |")
    return lines


def versions_line(runs: list[dict]) -> str:
    return "; ".join(f"{r['label']}: {env_words(dict(r['env'], commit=r['commit']))}"
                     + (f" ({r['note']})" if r["note"] else "") + f", `{r['run']}`" for r in runs)


def docs_table(runs: list[dict]) -> list[str]:
    """docs/benchmarks.md's long table: every kernel result of every run, device, versions and commit on
    each row."""
    lines = ["| device | torch | triton | CUDA | commit | op | impl | dtype | size | p50 µs | p20-p80 µs | x floor | GB/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        e = r["env"]
        for x in r["rows"]:
            if x.get("kind") != "result":
                continue
            size = x.get("rows", x.get("tokens"))
            lines.append(f"| {e.get('device')} | {e.get('torch')} | {e.get('triton')} | {e.get('cuda') or '-'} | "
                         f"{r['commit'][:7]} | {x['op']} | {x['impl']} | {x.get('dispatch_dtype', x['dtype'])} | {size} | "
                         f"{x['p50_us']:.1f} | {x['p20_us']:.1f}-{x['p80_us']:.1f} | "
                         f"{x.get('x_floor', float('nan')):.2f} | {x.get('GBps', float('nan')):.0f} |")
    return lines


def replace_block(text: str, mark: str, body: list[str]) -> str:
    """``text`` with the lines between ``<!-- mark: begin ... -->`` and ``<!-- mark: end -->`` replaced."""
    begin, end = f"<!-- {mark}: begin", f"<!-- {mark}: end -->"
    i, j = text.find(begin), text.find(end)
    if i < 0 or j < i:
        raise ValueError(f"no '{begin} ... -->' ... '{end}' block to rewrite")
    i = text.index("\n", i) + 1
    return text[:i] + "\n".join(body) + "\n" + text[j:]


def publish(new_runs: list[str], root: str = REPO) -> list[str]:
    """Add ``new_runs`` to published.txt; rewrite the README and docs/benchmarks.md tables; the runs shown."""
    listed = published_runs(root)
    for run in new_runs:
        rel = os.path.relpath(os.path.abspath(run), root)
        if rel not in listed:
            listed.append(rel)
            with open(os.path.join(root, PUBLISHED), "a") as f:
                f.write(rel + "\n")
    runs = [run_info(root, r) for r in listed]
    note = ("Generated by `scripts/gpu_summary.py --publish` from the folders in `bench/results/published.txt`: "
            "edit those, not these lines.")
    readme = summary_table(runs, README_ROWS, prefill=False) + [
        "", "Each column's GPU, versions and run folder, and the prefill and fp8 rows: "
            "[docs/benchmarks.md](docs/benchmarks.md#every-kernel-result)."]
    docs = [note, "", *summary_table(runs), "", "Measured with: " + versions_line(runs) + ".", "", *docs_table(runs)]
    for doc, mark, body in (("README.md", README_MARK, readme), (os.path.join("docs", "benchmarks.md"), DOCS_MARK, docs)):
        path = os.path.join(root, doc)
        with open(path) as f:
            text = f.read()
        with open(path, "w") as f:
            f.write(replace_block(text, mark, body))
    return listed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", nargs="?", help="a results folder to summarize")
    p.add_argument("--markdown", help="also write the summary as a fenced block into this file")
    p.add_argument("--publish", nargs="*", metavar="RUN_DIR",
                   help="add these run folders to bench/results/published.txt and rewrite the README and "
                        "docs/benchmarks.md tables from every folder listed there")
    o = p.parse_args(argv)
    if o.publish is not None:
        for run in publish(o.publish):
            print(f"published: {run}")
        return 0
    if o.out_dir is None:
        p.error("give a results folder, or --publish")
    if os.path.exists(os.path.join(o.out_dir, QUICK_PLAN)):
        print(write_quick_summary(o.out_dir))
        return 0
    text = summarize(o.out_dir)
    print(text)
    if o.markdown:
        with open(o.markdown, "w") as f:
            f.write("```\n" + text + "\n```\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
