"""Shared benchmark plumbing: environment record, percentile timing, JSON lines.

Timing rules (../shared/gpu.md): warm up first; on a GPU every call is bracketed by CUDA events and
preceded by an L2 flush, so no call reads what the previous one left in cache (the flush does what
rotating inputs larger than the L2 would); report p20 / p50 / p80.
On a CPU (dry runs only) calls are synchronous and timed with ``time.perf_counter``.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import time

import torch

from moe_comm.serving.bench_report import git_commit

DRY_LABEL = "dry run, CPU interpreter, not a GPU measurement"


def _version(dist_name: str) -> str | None:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device: torch.device) -> dict:
    """What a result line needs to be reproducible: device, versions, commit, time."""
    from moe_comm.interpreter import use_interpreter  # noqa: PLC0415
    cuda = device.type == "cuda"
    nvshmem = _version("nvshmem4py-cu13") or _version("nvshmem4py-cu12")
    try:
        import triton  # noqa: PLC0415
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return dict(
        device=torch.cuda.get_device_name(device) if cuda else f"CPU ({platform.processor() or platform.machine()})",
        torch=torch.__version__, triton=triton_version, nvshmem4py=nvshmem,
        cuda=torch.version.cuda if cuda else None, python=platform.python_version(),
        commit=git_commit(), time=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        triton_interpret=use_interpreter(device),   # our kernels ran in Triton's interpreter
    )


def l2_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20))


def percentiles(samples_us: list[float]) -> dict:
    t = torch.tensor(samples_us, dtype=torch.float64)
    q = torch.quantile(t, torch.tensor([0.2, 0.5, 0.8], dtype=torch.float64)).tolist()
    return dict(p20_us=q[0], p50_us=q[1], p80_us=q[2], samples=len(samples_us))


def time_us(fn, device: torch.device, iters: int, warmup: int) -> dict:
    """Per-call time of ``fn(i)`` (i = call number, for rotating inputs): p20 / p50 / p80 in µs, and
    ``wall_us``: host wall time per call of ``iters`` back-to-back calls (launch cost included).

    GPU: each call sits between two CUDA events, after an L2 flush and a ~0.5 ms spin kernel that are
    outside the events: while the GPU works on those, the host enqueues the call, so its Python and
    launch cost is hidden unless the call synchronizes (then it is counted, as it should be).
    """
    for i in range(warmup):
        fn(i)
    if device.type != "cuda":
        samples = []
        for i in range(iters):
            t0 = time.perf_counter()
            fn(i)
            samples.append((time.perf_counter() - t0) * 1e6)
        return dict(percentiles(samples), wall_us=sum(samples) / len(samples))
    torch.cuda.synchronize(device)
    flush = torch.empty(max(2 * l2_bytes(device), 256 << 20) // 4, dtype=torch.int32, device=device)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        flush.fill_(i)
        torch.cuda._sleep(1_000_000)  # ~0.5 ms at 2 GHz: time for the host to enqueue the timed call
        starts[i].record()
        fn(warmup + i)
        ends[i].record()
    torch.cuda.synchronize(device)
    gpu = percentiles([s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)])
    t0 = time.perf_counter()
    for i in range(iters):
        fn(warmup + iters + i)
    torch.cuda.synchronize(device)
    return dict(gpu, wall_us=(time.perf_counter() - t0) * 1e6 / iters)


class JsonLines:
    """Appends one JSON object per line; every line carries the environment and, in dry runs, the label."""

    def __init__(self, path: str, env: dict, dry: bool):
        self.path, self.env, self.dry = path, env, dry
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def write(self, **fields) -> dict:
        line = dict(fields, dry=self.dry, **({"label": DRY_LABEL} if self.dry else {}), env=self.env)
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")
        return line


def printed_lines(path: str | None, head: dict):
    """``emit(**fields)``: one JSON line, ``head`` then ``fields``, printed and (if ``path``) appended to
    ``path`` at once (a run killed later keeps it)."""
    def emit(**fields) -> None:
        line = json.dumps(dict(head, **fields))
        print(line, flush=True)
        if path:
            with open(path, "a") as f:
                f.write(line + "\n")
    return emit


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(s) for s in f if s.strip()]
