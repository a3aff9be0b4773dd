"""Host side of the flight recorder: the option that turns it on, the rings, and one rank's dump.

On: ``MOE_COMM_TRACE`` (``1``/``on``: DEFAULT_CALLS records per channel; an integer N > 1: N records)
or ``init(..., trace=N)``. Off (the default): the kernels are compiled without the recorder's code, so
they make no extra store. ``MOE_COMM_TRACE_DIR``: every ``GroupError`` a rank raises also dumps its
rings there (``group.dump_trace``), once per epoch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np
import torch

from . import layout

ENV_TRACE = "MOE_COMM_TRACE"
ENV_TRACE_DIR = "MOE_COMM_TRACE_DIR"
FORMAT = "moe-comm-trace/1"
_ON, _OFF = ("1", "on", "true", "yes"), ("", "0", "off", "false", "no")


def trace_calls(option=None) -> int:
    """Records per channel: ``option`` (None: the environment); 0 = off."""
    raw = os.environ.get(ENV_TRACE, "") if option is None else option
    if isinstance(raw, bool):
        return layout.DEFAULT_CALLS if raw else 0
    text = str(raw).strip().lower()
    if text in _OFF:
        return 0
    if text in _ON:
        return layout.DEFAULT_CALLS
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"{ENV_TRACE} / trace= must be on/off or a number of calls to keep per channel "
                         f"(e.g. 64), got {raw!r}")
    return n


def status() -> dict:
    """What the environment asks of the flight recorder (``python -m moe_comm info``): on, records per
    channel, the dump directory, and in words (an invalid value says the fix instead of raising)."""
    where = os.environ.get(ENV_TRACE_DIR) or None
    try:
        n = trace_calls()
    except ValueError as e:
        return dict(on=False, calls=0, dump_dir=where, detail=str(e))
    detail = (f"on: the last {n} calls per channel ({ENV_TRACE}={os.environ[ENV_TRACE]})" if n else
              f"off (set {ENV_TRACE}=1, or init(trace=True), to record every channel's last calls)")
    if where:
        detail += f"; GroupError dumps to {where}"
    return dict(on=n > 0, calls=n, dump_dir=where, detail=detail)


def new_ring(world: int, calls: int, device: torch.device) -> torch.Tensor:
    """int64 [calls + 1, record_words(world)], zeros: pinned host memory on CUDA (the host reads it
    without a device sync), a plain tensor on the CPU. The extra row is the one prepared for the next
    call (``layout``), so the ring holds the last ``calls`` calls. One unused row when tracing is off."""
    pin = device.type == "cuda"
    return torch.zeros((calls + 1 if calls else 1, layout.record_words(world)), dtype=torch.int64, pin_memory=pin)


def prepare_first_row(ring: torch.Tensor) -> None:
    """``reset()`` (the device idle): the row of call 1, the new epoch's first call, cleared (no record,
    per-peer words 0), as a phase's end prepares the next call's row (``layout``), so that call's record
    is complete, not STALE. The older record in that row is given up, as every call gives up the row
    after its own."""
    ring[1 % ring.shape[0]].zero_()


READ_TRIES = 8          # reads of a row whose tags change meanwhile before its halves are given up
TAG_WORDS = (layout.T_SEND_TAG, layout.T_RECV_TAG)


def consistent_row(ring: torch.Tensor, i: int, tries: int = READ_TRIES) -> list[int]:
    """Row ``i`` of a ring that kernels may be writing (a seqlock per half, ``layout``): each half's tag,
    its words, its tag again, until both tags read alike; a half whose tag kept changing comes back
    with tag 0 (no record). The reads are in program order, which x86 keeps for loads; a weaker host
    (Arm) would need a load fence between them, which Python cannot issue."""
    row = ring[i]
    for _ in range(tries):
        before = [int(row[t]) for t in TAG_WORDS]
        words = row.tolist()
        after = [int(row[t]) for t in TAG_WORDS]
        if before == after:
            break
    for t, a, b in zip(TAG_WORDS, before, after):
        words[t] = a if a == b == words[t] else 0
    return words


def consistent_rows(ring: torch.Tensor) -> np.ndarray:
    """Every row of a ring that kernels may be writing, as one int64 NumPy snapshot: each half's tag, the
    words, the tags again (``consistent_row``'s seqlock, for the whole ring at once and without retries:
    ``moe_comm.metrics`` reads a half that moved at its next refresh); a half whose tag changed comes back
    with tag 0 (no record)."""
    words = ring.numpy()
    before = words[:, TAG_WORDS].copy()
    rows = words.copy()
    after = words[:, TAG_WORDS]
    for i, t in enumerate(TAG_WORDS):
        moved = (before[:, i] != after[:, i]) | (rows[:, t] != before[:, i])
        rows[moved, t] = 0
    return rows


def channel_records(ch) -> list[layout.TraceRecord]:
    """Every call a channel's ring holds, oldest first (each half of a row read consistently)."""
    world = ch.group.world_size
    recs = [r for i in range(ch.trace.shape[0])
            for r in layout.decode_row(consistent_row(ch.trace, i), world, ch.row_bytes)]
    return sorted(recs, key=lambda r: (r.epoch, r.call))


def _wait_stats(ch):
    """(ns, count) per source, or None when reading them would wait for a busy CUDA stream (a hang)."""
    if ch.wait_stats.device.type == "cuda" and not torch.cuda.current_stream(ch.wait_stats.device).query():
        return None
    ns, count = ch.wait_stats.tolist()
    return ns, count


def rank_dump(group, error: BaseException | None = None) -> dict:
    """One rank's dump (JSON-able): group facts, then every traced channel's records and wait statistics."""
    channels = []
    for ch in group.traced_channels():
        stats = _wait_stats(ch)
        channels.append(dict(
            name=ch.name, row_bytes=ch.row_bytes,
            wait_ns=None if stats is None else stats[0], wait_count=None if stats is None else stats[1],
            records=[dataclasses.asdict(r) for r in channel_records(ch)]))
    return dict(format=FORMAT, rank=group.rank, world_size=group.world_size, epoch=group.epoch,
                recorder_calls=group.trace_calls,   # records kept per channel; 0: the recorder was off
                backend=group.backend, device=str(group.device), live=group.live_ranks,
                clock="globaltimer" if group.device.type == "cuda" else "monotonic",
                host_monotonic_ns=time.monotonic_ns(), error=None if error is None else str(error),
                channels=channels)


def dump_path(path, rank: int) -> str:
    """``path`` itself if it names a .json file, else ``path/trace-rank<rank>.json`` (directory made)."""
    path = os.fspath(path)
    if path.endswith(".json"):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        return path
    os.makedirs(path, exist_ok=True)
    return os.path.join(path, f"trace-rank{rank}.json")


def write_dump(group, path, error: BaseException | None = None) -> str:
    """Write ``rank_dump`` to ``dump_path(path, rank)`` (atomically: a reader never sees half a file)."""
    out = dump_path(path, group.rank)
    tmp = f"{out}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(rank_dump(group, error), f)
    os.replace(tmp, out)
    return out
