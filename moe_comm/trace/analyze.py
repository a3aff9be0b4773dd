"""Merge the ranks' flight-recorder dumps (``group.dump_trace``) into a diagnosis in plain words and a
Chrome trace (``python -m moe_comm trace DIR``).

What it says, from whichever ranks' files exist (a dead or hung rank's own file is not needed: its peers'
receives recorded what they saw of it):

- **never published**: a receive that did not end "ok" and never saw source j's flag of call c: rank j
  never published call c (first such call per channel, source and epoch; the waiting ranks named);
- **desync**: a receive that saw a flag of a later call: both call numbers;
- **waits**: for every receive, how long it waited for each source's flag (WAITED: measured by the
  program that waited, until the flag came or it gave up); summed per (waiter, source) pair over the
  recorded window;
- **slowest rank**: the source whose flags kept the others waiting longest in total.

Times come from each rank's own clock; waits are differences on one rank, so they are exact whatever the
clocks. The Chrome trace puts every rank on one timeline: right on one machine's CPU (one monotonic
clock), only roughly on GPUs (each GPU's %globaltimer).
"""

from __future__ import annotations

import glob
import json
import os
from collections import defaultdict
from dataclasses import dataclass, field

from .recorder import FORMAT

TOP_PAIRS = 8       # waiter/source pairs listed, longest total first
NS_PER_MS = 1e6


@dataclass
class Diagnosis:
    """The analyzer's findings (``lines``: the same in plain words)."""

    world: int
    ranks: list[int]                                   # ranks whose dump was read
    missing: list[int]                                 # ranks without a dump
    never_published: list[dict] = field(default_factory=list)  # channel, op, epoch, call, rank, waiters, outcomes
    desyncs: list[dict] = field(default_factory=list)  # channel, op, epoch, rank, peer, expected, got
    waits: dict = field(default_factory=dict)          # (waiter, source) -> dict(total_ns, count, max_ns, max_call)
    caused_ns: dict = field(default_factory=dict)      # source -> total ns others waited for it
    slowest: int | None = None
    unfinished: list[dict] = field(default_factory=list)  # receives that began and never ended
    recorder_off: list[int] = field(default_factory=list)  # ranks whose dump was made with the recorder off
    errors: dict = field(default_factory=dict)         # rank -> the error its dump was made for (recorder off)
    lines: list[str] = field(default_factory=list)


def load_dumps(path) -> dict[int, dict]:
    """rank -> dump, from a directory of ``trace-rank*.json`` files (or one file)."""
    files = [path] if os.path.isfile(path) else sorted(glob.glob(os.path.join(path, "*.json")))
    dumps = {}
    for f in files:
        with open(f) as fh:
            try:
                d = json.load(fh)
            except json.JSONDecodeError:
                continue
        if isinstance(d, dict) and d.get("format") == FORMAT:
            dumps[int(d["rank"])] = d
    return dumps


def _receives(dumps):
    """(rank, channel name, record) for every record with a receive part."""
    for rank, d in sorted(dumps.items()):
        for ch in d["channels"]:
            for rec in ch["records"]:
                if rec["recv_start"] is not None:
                    yield rank, ch["name"], rec


def analyze(dumps: dict[int, dict]) -> Diagnosis:
    if not dumps:
        raise ValueError("no flight-recorder dumps found (files written by group.dump_trace)")
    world = max(d["world_size"] for d in dumps.values())
    diag = Diagnosis(world, sorted(dumps), [r for r in range(world) if r not in dumps])
    diag.recorder_off = [r for r, d in sorted(dumps.items()) if _recorder_off(d)]
    diag.errors = {r: dumps[r]["error"] for r in diag.recorder_off if dumps[r].get("error")}
    missing_flags = defaultdict(lambda: dict(waiters=set(), outcomes=set(), calls=set()))
    for rank, name, rec in _receives(dumps):
        if rec["outcome"] == "desync":
            peer, got, expected = rec["error"]
            diag.desyncs.append(dict(channel=name, op=rec["op"], epoch=rec["epoch"], rank=rank, peer=peer,
                                     expected=expected, got=got))
        if rec["recv_end"] is None:
            diag.unfinished.append(dict(channel=name, op=rec["op"], epoch=rec["epoch"], call=rec["call"], rank=rank))
        if rec["outcome"] != "ok":
            desynced = {x["peer"] for x in diag.desyncs if x["rank"] == rank and x["channel"] == name
                        and x["epoch"] == rec["epoch"]}
            for src, t in enumerate(rec["seen"]):
                if t is None and src not in desynced:
                    m = missing_flags[(name, rec["op"], rec["epoch"], src)]
                    m["waiters"].add(rank)
                    m["outcomes"].add(rec["outcome"] or "still waiting")
                    m["calls"].add(rec["call"])
        for src, waited in enumerate(rec["waited"]):
            if src == rank or (not waited and rec["seen"][src] is None):   # not waited for
                continue
            w = diag.waits.setdefault((rank, src), dict(total_ns=0, count=0, max_ns=0, max_call=None, op=None))
            w["total_ns"] += waited
            w["count"] += 1
            if waited >= w["max_ns"]:
                w.update(max_ns=waited, max_call=rec["call"], op=rec["op"])
    for (name, op, epoch, src), m in sorted(missing_flags.items()):
        diag.never_published.append(dict(channel=name, op=op, epoch=epoch, call=min(m["calls"]), rank=src,
                                         waiters=sorted(m["waiters"]), outcomes=sorted(m["outcomes"])))
    for (_, src), w in diag.waits.items():
        diag.caused_ns[src] = diag.caused_ns.get(src, 0) + w["total_ns"]
    if diag.caused_ns:
        diag.slowest = max(diag.caused_ns, key=lambda r: (diag.caused_ns[r], -r))
    diag.lines = _words(diag)
    return diag


def _recorder_off(dump: dict) -> bool:
    """The dump was made with the flight recorder off: it says so (``recorder_calls`` 0), or, from a
    version that did not write that, no channel holds a record."""
    if "recorder_calls" in dump:
        return dump["recorder_calls"] == 0
    return not any(ch["records"] for ch in dump["channels"])


def _ranks(rs) -> str:
    rs = list(rs)
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))


def _words(diag: Diagnosis) -> list[str]:
    out = [f"{len(diag.ranks)} of {diag.world} ranks dumped"
           + (f"; no dump from {_ranks(diag.missing)} (dead, hung, or not dumping)" if diag.missing else "")]
    if diag.recorder_off:
        out.append(f"RECORDER OFF on {_ranks(diag.recorder_off)}: their dumps hold no calls, so no waits, "
                   f"slowest rank or timeline from them. To record: MOE_COMM_TRACE=1 (or moe_comm.init(..., "
                   f"trace=True)) before the group is made (moe_comm.launch's processes inherit it), then run "
                   f"again. Without the recorder: the error each rank raised (below), and the metrics that need "
                   f"none (moe_comm.metrics: errors by kind and peer, calls, expert load, epochs, excluded "
                   f"ranks; docs/metrics.md)")
    for rank, err in sorted(diag.errors.items()):
        out.append(f"  rank {rank} raised: {err}")
    for x in diag.never_published:
        out.append(f"NEVER PUBLISHED: rank {x['rank']} never published {x['op']} call {x['call']} "
                   f"(channel {x['channel']}, epoch {x['epoch']}): {_ranks(x['waiters'])} waited for it "
                   f"(receive: {', '.join(x['outcomes'])})")
    for x in diag.desyncs:
        out.append(f"DESYNC: rank {x['rank']} expected {x['op']} call {x['expected']} from rank {x['peer']} "
                   f"but saw call {x['got']} (channel {x['channel']}, epoch {x['epoch']}): the two are "
                   f"{x['got'] - x['expected']} calls out of step (one of them skipped a call)")
    for x in diag.unfinished:
        out.append(f"UNFINISHED: rank {x['rank']}'s receive of {x['op']} call {x['call']} (channel "
                   f"{x['channel']}) began and never ended (hung, or dumped while it ran)")
    pairs = sorted(diag.waits.items(), key=lambda kv: -kv[1]["total_ns"])[:TOP_PAIRS]
    if pairs:
        out.append("waits (a receive waiting for a source's flag):")
    for (rank, src), w in pairs:
        out.append(f"  rank {rank} waited {w['total_ns'] / NS_PER_MS:.1f} ms for rank {src} over {w['count']} "
                   f"receives (longest {w['max_ns'] / NS_PER_MS:.1f} ms, {w['op']} call {w['max_call']})")
    if diag.slowest is not None:
        others = sorted(((ns, r) for r, ns in diag.caused_ns.items() if r != diag.slowest), reverse=True)
        runner = f"; next: rank {others[0][1]}, {others[0][0] / NS_PER_MS:.1f} ms" if others else ""
        out.append(f"SLOWEST: rank {diag.slowest} (the others waited {diag.caused_ns[diag.slowest] / NS_PER_MS:.1f} "
                   f"ms in total for its flags over the recorded window{runner})")
    return out


def chrome_trace(dumps: dict[int, dict]) -> dict:
    """Chrome trace / Perfetto JSON: one process per rank, one thread per channel phase, one slice per
    send and receive (args: call, outcome, rows per peer, when each source's flag was seen)."""
    events, t0 = [], None
    for d in dumps.values():
        for ch in d["channels"]:
            for rec in ch["records"]:
                for t in (rec["send_start"], rec["recv_start"]):
                    if t is not None:
                        t0 = t if t0 is None else min(t0, t)
    for rank, d in sorted(dumps.items()):
        events.append(dict(name="process_name", ph="M", pid=rank, args=dict(name=f"rank {rank}")))
        for tid, ch in enumerate(d["channels"]):
            for phase, k in (("send", 2 * tid), ("recv", 2 * tid + 1)):
                events.append(dict(name="thread_name", ph="M", pid=rank, tid=k, args=dict(name=f"{ch['name']} {phase}")))
            for rec in ch["records"]:
                for phase, k in (("send", 2 * tid), ("recv", 2 * tid + 1)):
                    start, end = rec[f"{phase}_start"], rec[f"{phase}_end"]
                    if start is None:
                        continue
                    args = dict(call=rec["call"], epoch=rec["epoch"])
                    if phase == "send":
                        rows = rec["sent_rows"]
                        args.update(rows_to=rows, bytes_to=[r * rec["row_bytes"] for r in rows])
                    else:
                        args.update(outcome=rec["outcome"] or "unfinished", rows_from=rec["recv_rows"],
                                    seen_after_us=[None if s is None else (s - start) / 1e3 for s in rec["seen"]])
                    events.append(dict(name=f"{rec['op']} {phase} #{rec['call']}", ph="X", pid=rank, tid=k,
                                       ts=(start - t0) / 1e3, dur=max(0, (end or start) - start) / 1e3, args=args))
    return dict(traceEvents=events, displayTimeUnit="ms")


def main(argv=None) -> int:
    import argparse  # noqa: PLC0415
    ap = argparse.ArgumentParser(prog="moe-comm trace", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", help="directory of trace-rank*.json files (group.dump_trace, MOE_COMM_TRACE_DIR)")
    ap.add_argument("--chrome", help="where to write the Chrome trace (default DIR/trace.chrome.json)")
    a = ap.parse_args(argv)
    dumps = load_dumps(a.dir)
    if not dumps:
        print(f"moe-comm trace: no flight-recorder dumps in {a.dir} (write them with group.dump_trace(DIR) "
              f"or MOE_COMM_TRACE_DIR)")
        return 1
    for line in analyze(dumps).lines:
        print(line)
    out = a.chrome or os.path.join(a.dir if os.path.isdir(a.dir) else os.path.dirname(a.dir), "trace.chrome.json")
    with open(out, "w") as f:
        json.dump(chrome_trace(dumps), f)
    print(f"timeline: {out} (open in ui.perfetto.dev or chrome://tracing)")
    return 0
