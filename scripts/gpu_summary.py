"""One-screen summary of a GPU check: tests (pytest junit XML), kernel benchmark and decode benchmark
(JSON lines), and the issue's targets, PASS / MISS / n/a.

    python scripts/gpu_summary.py OUT_DIR [--markdown OUT_DIR/summary.md]

Reads every ``*.xml`` (junit), ``kernels-*.jsonl`` and ``decode_latency*.jsonl`` under OUT_DIR.
Targets: dispatch and combine within 1.5x of (HBM floor + one launch) at T=128, EP=1; AllToAllvDynamic
at least 1.5x faster than torch all_to_all_vdev and NCCL with host-read splits at decode sizes (<= 128
rows); the randomized dispatch -> combine soak passes.
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--markdown", help="also write the summary as a fenced block into this file")
    o = p.parse_args(argv)
    text = summarize(o.out_dir)
    print(text)
    if o.markdown:
        with open(o.markdown, "w") as f:
            f.write("```\n" + text + "\n```\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
