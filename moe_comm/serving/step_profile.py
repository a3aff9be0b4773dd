"""Where a decode step's time goes (``moe-comm-decode-bench --profile``): one rank, eager steps under
``torch.profiler``, time per named part of the model.

The model marks its parts with ``model.span`` ranges (attention, router, dispatch, experts, combine,
shared expert, LM head) when ``model.PROFILE_SPANS`` is on; off, the ranges cost nothing. On the GPU a
part's time is the device time of the kernels that ran inside its range (each range drains the device at
both ends, so they are the kernels it launched), summed over the profiled steps and divided by their
number; on the CPU it is the range's CPU time. "other" is the step's time outside every part (norms,
embedding, residual adds). Steps run eagerly (a CUDA graph replays as one opaque launch), so the
per-step total is the sum of the kernels' device times, not the graphed step's latency.

Inputs: ``batch`` tokens in cache slots 0..batch-1, all at position ``prompt_len + warmup``: the
attention reads the whole cache whatever the position, so no prefill is needed to profile it.
"""

from __future__ import annotations

import os
import time

import torch

from . import model as model_mod
from .bench_report import environment, write_jsonl

PARTS = ("attention", "router", "dispatch", "experts", "combine", "shared_expert", "lm_head")


def _span_times(prof, steps: int, device_time: bool) -> dict:
    """µs per step for every model part and the whole step: on the CPU the ranges' own CPU time, on the
    GPU the device time of the kernels that ran inside them (``device_span_times``)."""
    if device_time:
        return device_span_times(prof.profiler.kineto_results.events(), steps)
    out = dict.fromkeys((*PARTS, "step"), 0.0)
    for ev in prof.events():
        if ev.name.startswith("moe::") and ev.device_type == torch.autograd.DeviceType.CPU:
            key = ev.name[len("moe::"):]
            if key in out:
                out[key] += ev.cpu_time_total / steps
    out["other"] = max(0.0, out["step"] - sum(out[p] for p in PARTS))
    return out


def device_span_times(events, steps: int) -> dict:
    """events: the profiler's kineto events -> µs per step for every part, "step", "other", "outside",
    and "kernels": {part or "other": {kernel name: µs per step}}.

    Every piece of work on the device (kernel, copy, memset) belongs to the innermost ``moe::`` range whose
    CPU interval holds its midpoint: ``model.span`` drains the device at both ends of a range, so the
    kernels launched inside it run inside it. By time, because the profiler does not link Triton's
    launches to their range. "outside": device time in no step at all (anything but 0 means work the
    attribution missed).
    """
    out = dict.fromkeys((*PARTS, "step", "outside"), 0.0)
    ranges, work, kernels = [], [], {}
    for ev in events:
        on_device = ev.device_type() == torch.autograd.DeviceType.CUDA
        if ev.name().startswith("moe::"):
            # A range; on the device, the range's copy that spans the kernels the profiler linked to it,
            # which is not work. (The profiler records no waits unless asked to.)
            key = ev.name()[len("moe::"):]
            if not on_device and key in out:
                ranges.append((ev.start_ns(), ev.end_ns(), key))
        elif on_device:  # kernels, copies, memsets
            work.append((ev.start_ns() + ev.duration_ns() // 2, ev.duration_ns() / 1e3 / steps, ev.name()))
    for mid, us, kernel in work:
        holding = [(hi - lo, key) for lo, hi, key in ranges if lo <= mid <= hi]
        if not holding:
            out["outside"] += us
            continue
        out["step"] += us
        part = min(holding)[1]  # the innermost range: a part, or "step" itself
        if part != "step":
            out[part] += us
        by_name = kernels.setdefault("other" if part == "step" else part, {})
        by_name[kernel] = by_name.get(kernel, 0.0) + us
    out["other"] = max(0.0, out["step"] - sum(out[p] for p in PARTS))
    out["kernels"] = kernels
    return out


def profile_ranks(groups: list, opts) -> dict:
    """{"profile": {backend: {batch: {part: µs per step}}}} for the one rank in ``groups`` (world 1)."""
    from .backends import make_comms  # noqa: PLC0415
    from .configs import model_config  # noqa: PLC0415
    from .model import MoEDecoder, run_to_end  # noqa: PLC0415
    from .weights import build_weights  # noqa: PLC0415

    if len(groups) != 1 or groups[0].world_size != 1:
        raise SystemExit("--profile runs one rank (world 1): the parts of a step are timed on that rank alone")
    device = groups[0].device
    cfg = model_config(opts.config, device)
    emulate = getattr(opts, "emulate_ep", 0)
    # --emulate-ep N: one rank of EP-N holds experts [0, E/N) (see backends.EmulatedPeers)
    weights = build_weights(cfg, device, experts=(0, cfg.experts_per_rank(emulate)) if emulate else None)
    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    position = min(opts.prompt_len + opts.warmup, cfg.max_seq - 1)
    out: dict = {}
    model_mod.PROFILE_SPANS = True
    try:
        for name in opts.backends:
            comm = make_comms(name, groups, cfg, opts.max_batch, emulate_ep=emulate)[0]
            model = MoEDecoder(weights, comm, opts.max_batch, expert_impl=opts.experts,
                               attention_impl=opts.attention)
            out[name] = {}
            for batch in opts.batches:
                g = torch.Generator().manual_seed(batch)
                tokens = torch.randint(0, cfg.vocab, (batch,), generator=g).to(device)
                slots = torch.arange(batch, device=device)
                positions = torch.full((batch,), position, dtype=torch.int64, device=device)
                valid = torch.ones(batch, dtype=torch.bool, device=device)

                def step():
                    with model_mod.span("step"):
                        run_to_end(model.forward(tokens, slots, positions, valid))
                for _ in range(opts.warmup):
                    step()
                if cuda:
                    torch.cuda.synchronize(device)
                with torch.profiler.profile(activities=activities) as prof:
                    for _ in range(opts.steps):
                        step()
                    if cuda:
                        torch.cuda.synchronize(device)
                out[name][batch] = _span_times(prof, opts.steps, cuda)
            comm.close()
            del model
    finally:
        model_mod.PROFILE_SPANS = False
    return dict(profile=out)


def profile_path(opts, cfg) -> str:
    """Where ``--profile`` writes its JSON lines (and the timing report looks for them)."""
    ep = f"_ep{opts.emulate_ep}emu" if getattr(opts, "emulate_ep", 0) else ""
    return os.path.join(opts.out_dir,
                        f"decode_profile_{cfg.name}_{opts.device}{ep}_{opts.experts}_attn-{opts.attention}.jsonl")


def _largest(us_by_kernel: dict, n: int) -> list[tuple[str, float]]:
    return sorted(us_by_kernel.items(), key=lambda kv: -kv[1])[:n]


def report_profile(opts, results: list[dict]) -> dict:
    """Print one table per backend (parts x batches, µs per step) and append JSON lines."""
    from .configs import model_config  # noqa: PLC0415
    cfg = model_config(opts.config, opts.device)
    env = environment(torch.device(opts.device))
    prof = results[0]["profile"]
    unit = "device µs" if opts.device == "cuda" else "CPU µs (interpreted kernels: not a GPU measurement)"
    print(f"\n{cfg.name}: hidden {cfg.hidden}, {cfg.num_layers} layers, {cfg.num_experts} experts, top-{cfg.topk}; "
          f"{opts.experts} expert GEMMs, {opts.attention} attention; world 1, eager steps under torch.profiler")
    print(f"{env['device']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}")
    records = []
    for name, by_batch in prof.items():
        print(f"\n{name}: {unit} per step, mean of {opts.steps} steps after {opts.warmup} warm-up")
        print(f"  {'part':<14}" + "".join(f"{b:>10}" for b in opts.batches))
        for part in (*PARTS, "other", "step", *(("outside",) if opts.device == "cuda" else ())):
            print(f"  {part:<14}" + "".join(f"{by_batch[b][part]:>10.0f}" for b in opts.batches))
            for b in opts.batches:
                top = _largest(by_batch[b].get("kernels", {}).get(part, {}), 5)
                records.append(dict(bench="decode_profile", config=cfg.name, backend=name, batch_per_rank=b,
                                    part=part, us_per_step=by_batch[b][part], device_time=opts.device == "cuda",
                                    top_kernels=[[k[:120], round(us, 2)] for k, us in top],
                                    expert_impl=opts.experts, attention_impl=opts.attention,
                                    steps=opts.steps, **env,
                                    time=time.strftime("%Y-%m-%dT%H:%M:%S")))
        last = by_batch[opts.batches[-1]].get("kernels", {})
        for part in ("dispatch", "combine"):
            top = _largest(last.get(part, {}), 3)
            if top:
                print(f"  largest {part} kernels at batch {opts.batches[-1]}: "
                      + "; ".join(f"{k[:60]} {us:.0f}" for k, us in top))
    os.makedirs(opts.out_dir, exist_ok=True)
    path = profile_path(opts, cfg)
    write_jsonl(path, records)
    print(f"\nJSON lines appended to {path}")
    import importlib.util  # noqa: PLC0415
    png = None
    if importlib.util.find_spec("matplotlib") is not None:
        from .bench_report import plot_profile  # noqa: PLC0415
        png = path[:-len(".jsonl")] + ".png"
        plot_profile(png, prof, list(prof), opts.batches, (*PARTS, "other"),
                     f"{cfg.name}: where a step's time goes ({unit} per step, eager steps)\n"
                     f"{env['device']}, commit {str(env['commit'])[:12]}", unit)
        print(f"plot written to {png}")
    return dict(records=records, jsonl=path, png=png)


# ---- what a CPU measures truly: host reads, launches, bytes, graph mode ----------------------------------

class _Counters(torch.overrides.TorchFunctionMode):
    """Counts host reads of tensor values (``tolist``, ``item``, ``int(t)``, ...): on a GPU each is a
    device->host sync. Paused inside Triton launches (the interpreter's own reads) and moe-comm's
    error-word checks (pinned host memory: no device sync on a GPU)."""

    READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
             torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.numpy}

    def __init__(self):
        super().__init__()
        self.host_reads, self.paused = 0, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.paused and func in self.READS:
            self.host_reads += 1
        return func(*args, **(kwargs or {}))


class _Launches(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts ATen ops that run a kernel (view and metadata ops excluded): one launch each on a GPU."""

    FREE = {"empty", "empty_strided", "new_empty", "new_empty_strided", "detach", "lift_fresh"}

    def __init__(self, counters: _Counters):
        super().__init__()
        self.counters, self.aten = counters, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.counters.paused and not func.is_view and func.overloadpacket.__name__ not in self.FREE:
            self.aten += 1
        return func(*args, **(kwargs or {}))


def comm_wire_bytes(comm, topk_idx: torch.Tensor) -> int:
    """Payload bytes this rank's dispatch + combine put into other ranks' buffers for one call, from
    the call's routing and the backend's message format (rows to this rank itself are not counted):
    sync/sync-graphed/dynamic send each routed (token, expert) pair's row both ways (with an 8-byte /
    4-byte expert id on the dispatch); padded sends every row of every peer's padded block; fused
    sends a token once per destination rank (with its K routing ids) and each pair's row back."""
    world, e_local = comm.world, comm.experts_per_rank
    row = comm.hidden * torch.empty((), dtype=comm.dtype).element_size()
    t, k = topk_idx.shape
    valid = topk_idx >= 0
    dest = torch.where(valid, topk_idx.div(e_local, rounding_mode="floor"), comm.rank)
    remote = valid & (dest != comm.rank)
    pairs = int(remote.sum())
    name = comm.name
    if name in ("sync", "sync-graphed"):
        return pairs * (row + 8) + pairs * row
    if name == "dynamic":
        return 2 * pairs * (row + 4)
    if name == "padded":
        per_token = min(k, e_local)
        inner = getattr(comm, "inner", comm)
        cap = t * per_token if (world == 1 or inner is not comm) else inner.max_tokens * per_token
        return (world - 1) * cap * ((row + 8) + row)
    if name == "fused":
        ranks = torch.zeros(t, world, dtype=torch.bool)
        ranks[remote.nonzero(as_tuple=True)[0], dest[remote]] = True
        return int(ranks.sum()) * (row + 4 * k) + pairs * row
    raise ValueError(f"no message format for backend {name!r}")


# How a decode step runs: the one vocabulary of the benchmark's tables, JSON lines and plots.
GRAPH_MODES = {"graph": "one CUDA graph", "piecewise": "CUDA graphs between eager exchanges",
               "eager": "eager, no CUDA graphs"}


def graph_mode(comm) -> str:
    """How a step with this backend can run on a GPU (a GRAPH_MODES key)."""
    if comm.capturable:
        return "graph"
    if getattr(comm, "piecewise", False):
        return "piecewise"
    return "eager"


def count_step(engine, batch: int, warm: bool = True) -> dict:
    """One decode step of ``batch`` tokens on every local rank of ``engine``, counted: host reads of
    device values, kernel launches (ATen kernels + Triton launches), payload bytes to other ranks (per
    rank, all layers), and how the step can run on a GPU (``gpu_graphs``, a GRAPH_MODES key).
    Collective: every process of the world calls it together. Runs eagerly (on a GPU too): launches are
    counted as the step issues them. warm: one uncounted step first (a backend's first call allocates its
    buffers); False for an engine that has already run."""
    import triton.runtime.interpreter as interp  # noqa: PLC0415
    import triton.runtime.jit as jit  # noqa: PLC0415

    from ..group import CommGroup  # noqa: PLC0415

    models = engine.models
    dev = engine.device
    counters = _Counters()
    launches = _Launches(counters)
    triton_launches = [0]
    routed: list = []

    def paused(fn, count_launch):
        def wrapper(*a, **kw):
            if count_launch and not counters.paused:
                triton_launches[0] += 1
            counters.paused += 1
            try:
                return fn(*a, **kw)
            finally:
                counters.paused -= 1
        return wrapper

    def recording(comm):
        orig = comm.dispatch

        def dispatch(x, topk_idx, phase="both"):
            if phase != "recv":  # a phased model passes the same arguments to both phases
                routed.append((comm, topk_idx.detach().to("cpu", copy=True)))
            return orig(x, topk_idx, phase=phase)
        return orig, dispatch

    saved = [(interp.InterpretedFunction, "run"), (jit.JITFunction, "run"), (CommGroup, "check")]
    originals = [getattr(cls, attr) for cls, attr in saved]
    dispatches = [recording(m.comm) for m in models]
    b = batch
    args = [[torch.zeros(b, dtype=torch.int64, device=dev), torch.arange(b, device=dev),
             torch.full((b,), 1, dtype=torch.int64, device=dev), torch.ones(b, dtype=torch.bool, device=dev)]
            for _ in models]
    if warm:
        with torch.no_grad():  # first calls allocate buffers and compile; not part of a step
            engine._forward(*[list(col) for col in zip(*args)])
    try:
        for (cls, attr), fn in zip(saved, originals):
            setattr(cls, attr, paused(fn, count_launch=attr == "run"))
        for m, (_, rec) in zip(models, dispatches):
            m.comm.dispatch = rec
        with torch.no_grad(), counters, launches:
            engine._forward(*[list(col) for col in zip(*args)])
    finally:
        for (cls, attr), fn in zip(saved, originals):
            setattr(cls, attr, fn)
        for m, (orig, _) in zip(models, dispatches):
            m.comm.dispatch = orig
    # routing recorded on the CPU outside the modes; count per local rank (first one reported)
    comm0 = models[0].comm
    wire = sum(comm_wire_bytes(c, idx) for c, idx in routed if c is comm0)
    n = len(models)
    return dict(host_reads=counters.host_reads // n, launches=(launches.aten + triton_launches[0]) // n,
                aten_launches=launches.aten // n, triton_launches=triton_launches[0] // n,
                wire_bytes=wire, gpu_graphs=graph_mode(comm0), batch=batch)
