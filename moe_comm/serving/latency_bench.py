"""Decode-latency benchmark of the MoE comm backends on a tiny MoE model (``moe-comm-decode-bench``).

For one model config: first every backend's greedy decoding is checked against the single-process reference
model (abort on mismatch), then decode steps are timed per batch size and backend (warm-up, then p20 / p50 /
p80 of the per-step latency, CUDA events on a GPU), then one step per batch is counted (host syncs, kernel
launches, bytes to other ranks, graph mode; ``step_profile.count_step``). Backends: ``sync`` (eager model),
``sync-graphed`` (piecewise graphs around the host-synced exchange), ``padded`` (the bucket's own capacity),
``dynamic``, ``fused`` (backends.py). Appends JSON lines and draws a PNG under ``--out-dir``.

Report: on the CPU the counted properties lead, then the latest committed GPU results of the same config
(device and commit named), and the interpreter timings last as a harness check. On a GPU: the timings, the
% saved against each baseline, and, with a ``--profile`` of the same config in ``--out-dir``, how much of
each difference is communication (dispatch + combine time) and how much graphs and host.

Without the ``bench`` extra (tqdm, matplotlib) it says so and runs without a progress bar and plots.

Where the ranks run:
  CPU                         --world processes (default 4) over the shm heap, Triton interpreted, no graphs
  one GPU                     world 1 over the nvshmem heap, CUDA graphs
  one GPU, --heap loopback    --world ranks (2-8) emulated in one process on one GPU (labelled "emulated")
  several GPUs                torchrun --nproc-per-node N (one rank per GPU, nvshmem heap)
  --emulate-ep N              one rank of EP-N on one device (E/N experts, peers emulated as its mirror;
                              backends.EmulatedPeers), world 1
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

import torch

from .backends import BACKEND_NAMES, BASELINE_NAMES
from .bench_report import (environment, format_savings, format_table, percentiles, plot, plot_counters, savings,
                           slowest_rank_per_step, write_jsonl)
from .configs import CONFIG_NAMES, model_config

CPU_DEFAULTS = dict(batches=[1, 4], world=4, steps=3, warmup=1)
GPU_DEFAULTS = dict(batches=[1, 2, 4, 8, 16, 32, 64], world=1, steps=200, warmup=20)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="moe-comm-decode-bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="llama4-scout", choices=CONFIG_NAMES)
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")],
                   help="decode batch sizes per rank, comma separated (CPU 1,4; GPU 1,2,...,64)")
    p.add_argument("--backends", type=lambda s: s.split(","), default=list(BACKEND_NAMES),
                   help=f"comma separated subset of {','.join(BACKEND_NAMES)}")
    p.add_argument("--world", type=int, help="ranks (CPU default 4; GPU 1; under torchrun: its world)")
    p.add_argument("--heap", default="auto", choices=("auto", "shm", "nvshmem", "loopback"))
    p.add_argument("--steps", type=int, help="timed decode steps per point (CPU 3, GPU 200)")
    p.add_argument("--warmup", type=int, help="untimed decode steps first (CPU 1, GPU 20)")
    p.add_argument("--prompt-len", type=int, default=4)
    p.add_argument("--check-steps", type=int, default=3, help="decode steps compared with the reference")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--out-dir", default=os.path.join("bench", "results"))
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--emulate-ep", type=int, default=0, metavar="N",
                   help="one rank of an EP-N deployment on this device: the model holds E/N experts and one rank's "
                        "batch; every peer is emulated as this rank's mirror (what it sends peer p comes back as "
                        "p's contribution), so the step is one rank's work minus the link (world 1 only)")
    p.add_argument("--profile", action="store_true",
                   help="instead of timing: where each step's time goes (attention, router, dispatch, experts, "
                        "combine, shared expert, LM head), eager steps under torch.profiler, one rank (world 1)")
    p.add_argument("--attention", default="auto", choices=("auto", "torch", "triton"),
                   help="attention kernel, the same for every backend: torch = gather each token's whole cache "
                        "row (max_seq positions), triton = read only the visible positions (auto: triton on "
                        "GPU, torch on CPU)")
    p.add_argument("--experts", default="auto", choices=("auto", "masked", "dense"),
                   help="expert MLP kernel, the same for every backend: masked = Triton grouped GEMM that skips "
                        "experts without rows, dense = torch.bmm over every expert (auto: masked on GPU, dense on CPU)")
    opts = p.parse_args(argv)
    for b in opts.backends:
        if b not in BACKEND_NAMES:
            p.error(f"unknown backend {b!r}; choose from {BACKEND_NAMES}")
    cuda = torch.cuda.is_available() if opts.device == "auto" else opts.device == "cuda"
    opts.device = "cuda" if cuda else "cpu"
    defaults = dict(GPU_DEFAULTS if cuda else CPU_DEFAULTS)
    if opts.emulate_ep:
        defaults["world"] = 1
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if opts.profile and opts.world is None and not torchrun:
        opts.world = 1
    for k, v in defaults.items():
        if getattr(opts, k) is None:
            setattr(opts, k, int(os.environ["WORLD_SIZE"]) if k == "world" and torchrun else v)
    if opts.heap == "auto":
        opts.heap = "shm" if not cuda else ("loopback" if opts.world > 1 and not torchrun else "nvshmem")
    opts.torchrun = torchrun
    if opts.experts == "auto":
        opts.experts = "masked" if cuda else "dense"
    if opts.attention == "auto":
        opts.attention = "triton" if cuda else "torch"
    opts.max_batch = max(max(opts.batches), 3)
    if opts.emulate_ep:
        if opts.emulate_ep < 2 or (opts.world != 1 and not opts.profile):
            p.error("--emulate-ep N needs N >= 2 and --world 1 (it emulates the other ranks)")
        try:
            model_config(opts.config, opts.device).experts_per_rank(opts.emulate_ep)
        except ValueError as e:
            p.error(str(e))
    return opts


# ---- optional packages (the ``bench`` extra) -----------------------------------------------------------

BENCH_EXTRA_HINT = "pip install 'moe-comm[bench]'"


def missing_bench_packages() -> list[str]:
    """The ``bench`` extra's packages that are not installed (tqdm: progress bar, matplotlib: plots)."""
    import importlib.util  # noqa: PLC0415
    return [m for m in ("tqdm", "matplotlib") if importlib.util.find_spec(m) is None]


class _NoBar:
    """Stands in for tqdm when it is missing: no output."""

    def set_postfix_str(self, *_):
        pass

    def update(self, *_):
        pass

    def close(self):
        pass


def progress_bar(total: int, disable: bool, desc: str):
    """A tqdm bar on stderr, or a silent stand-in without the ``bench`` extra."""
    try:
        from tqdm import tqdm  # noqa: PLC0415
    except ImportError:
        return _NoBar()
    return tqdm(total=total, disable=disable, desc=desc, unit="run", file=sys.stderr)


def graphs_label(engine) -> str:
    """How an engine runs a decode step in this run (a ``step_profile.GRAPH_MODES`` key): "graph" (one
    CUDA graph), "piecewise" (graphs between eager exchanges) or "eager"."""
    if getattr(engine, "piecewise_graphs", False):
        return "piecewise"
    return "graph" if engine.use_graphs else "eager"


# ---- work on the ranks ---------------------------------------------------------------------------------

def _check_requests(rank: int, world: int, vocab: int, steps: int, prompt_len: int):
    """A few requests of different lengths; the last rank of a multi-rank world gets none (idle rank)."""
    from .engine import Request  # noqa: PLC0415
    if world > 1 and rank == world - 1:
        return []
    g = torch.Generator().manual_seed(1000 + rank)
    return [Request(torch.randint(0, vocab, (prompt_len + i,), generator=g).tolist(), steps + 1) for i in range(3)]


def _timing_requests(rank: int, batch: int, vocab: int, new_tokens: int, prompt_len: int):
    from .engine import Request  # noqa: PLC0415
    g = torch.Generator().manual_seed(2000 + 97 * rank + batch)
    return [Request(torch.randint(0, vocab, (prompt_len,), generator=g).tolist(), new_tokens) for _ in range(batch)]


def run_ranks(groups: list, opts) -> dict:
    """Check then time every backend on the ranks of ``groups`` (one, or every rank of a loopback world).

    Returns {"timing": {backend: {batch: [step µs of this process]}}, "check": {backend: worst rel error},
    "graphs": {backend: bool}, "emulated": {backend: bool}}.
    """
    from .backends import make_comms, tiled_reference_weights  # noqa: PLC0415
    from .check import ReferenceMismatch, check_generation, default_rtol  # noqa: PLC0415
    from .engine import DecodeEngine, global_max  # noqa: PLC0415
    from .model import MoEDecoder  # noqa: PLC0415
    from .piecewise import PiecewiseEngine  # noqa: PLC0415
    from .reference_model import ReferenceModel  # noqa: PLC0415
    from .step_profile import count_step  # noqa: PLC0415
    from .weights import build_weights  # noqa: PLC0415

    device, world = groups[0].device, groups[0].world_size
    if device.type == "cuda":
        torch.cuda.set_device(device)  # streams, events and graphs use the current device
    if device.type == "cpu":  # one process per rank shares the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // (world if len(groups) == 1 else 1)))
    cfg = model_config(opts.config, device)
    need = opts.prompt_len + max(2 + opts.check_steps, opts.warmup + opts.steps) + 1
    if need > cfg.max_seq:
        raise ValueError(f"prompt + steps need {need} positions > max_seq={cfg.max_seq}; use fewer --steps")
    emulate = opts.emulate_ep
    if emulate:
        # One rank of EP-N: experts [0, E/N) only; its reference computes expert e with local e mod E/N.
        e_local = cfg.experts_per_rank(emulate)
        shares = [build_weights(cfg, device, experts=(0, e_local))]
        full = tiled_reference_weights(shares[0], cfg.num_experts)
    else:
        # Every expert once (the reference needs them; ranks of this process take views) or only this rank's.
        full = build_weights(cfg, device) if len(groups) > 1 or world == 1 else None
        e_local = cfg.experts_per_rank(world)
        shares = ([full.for_rank(g.rank, world) for g in groups] if full is not None else
                  [build_weights(cfg, device, experts=(groups[0].rank * e_local, (groups[0].rank + 1) * e_local))])
    ranks = [g.rank for g in groups]
    out = dict(timing={}, check={}, graphs={}, emulated={}, counters={})
    bar = progress_bar(total=len(opts.backends) * (1 + len(opts.batches)), disable=0 not in ranks,
                       desc="decode bench")

    def engine_for(name):
        comms = make_comms(name, groups, cfg, opts.max_batch, emulate_ep=emulate)
        piecewise = getattr(comms[0], "piecewise", False)
        models = [MoEDecoder(w, c, opts.max_batch, phased=len(groups) > 1 or piecewise, expert_impl=opts.experts,
                             attention_impl=opts.attention) for w, c in zip(shares, comms)]
        return (PiecewiseEngine(models) if piecewise else DecodeEngine(models)), comms

    def release(comms):
        for c in comms:
            c.close()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    # 1. every backend against the reference model, before any timing
    ref = ReferenceModel(full if full is not None else build_weights(cfg, device), opts.attention)
    for name in opts.backends:
        bar.set_postfix_str(f"{name}: check vs reference")
        engine, comms = engine_for(name)
        reqs = [_check_requests(r, world, cfg.vocab, opts.check_steps, opts.prompt_len) for r in ranks]
        gens = engine.generate(reqs, record_logits=True)
        worst, failure = 0.0, None
        try:
            for r, rq, gs in zip(ranks, reqs, gens):
                for i, (q, g) in enumerate(zip(rq, gs)):
                    label = f"{name} rank {r} request {i}"
                    worst = max(worst, check_generation(ref, q, g, default_rtol(cfg.dtype), label))
        except ReferenceMismatch as e:
            failure = e
        if global_max([int(failure is not None)], device)[0]:  # every rank stops, not just the one that saw it
            raise failure or ReferenceMismatch(f"{name}: another rank's outputs differ from the reference")
        out["check"][name] = worst
        del engine
        release(comms)
        bar.update()
    del ref

    # 2. timing
    for name in opts.backends:
        engine, comms = engine_for(name)
        out["graphs"][name] = graphs_label(engine)
        out["emulated"][name] = comms[0].emulated
        out["timing"][name] = {}
        for batch in opts.batches:
            bar.set_postfix_str(f"{name}: batch {batch}")
            reqs = [_timing_requests(r, batch, cfg.vocab, opts.warmup + opts.steps + 1, opts.prompt_len)
                    for r in ranks]
            engine.generate(reqs)
            out["timing"][name][batch] = [engine.step_us[opts.warmup:]]
            bar.update()
        # What every machine measures truly: host reads, launches, bytes, graph mode (engine warm by now).
        out["counters"][name] = {batch: count_step(engine, batch, warm=False) for batch in opts.batches}
        del engine
        release(comms)
    bar.close()
    return out


def _rank_entry(group, opts):
    return _work(opts)([group], opts)


def _work(opts):
    """What the ranks run: the timing (``run_ranks``) or, with --profile, ``step_profile.profile_ranks``."""
    if opts.profile:
        from .step_profile import profile_ranks  # noqa: PLC0415
        return profile_ranks
    return run_ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(opts) -> list[dict] | None:
    """Run the ranks where ``opts`` says; per-process results on the reporting process, None elsewhere."""
    import moe_comm  # noqa: PLC0415  (turns the Triton interpreter on without CUDA)
    if opts.torchrun:
        import torch.distributed as dist  # noqa: PLC0415
        with moe_comm.init(opts.heap, timeout_s=opts.timeout_s) as group:
            res = _work(opts)([group], opts)
            gathered = [None] * group.world_size if group.rank == 0 else None
            dist.gather_object(res, gathered, dst=0)
            # Every rank's part of the gather complete before any rank tears its process group down; the
            # group's close then destroys it, its gloo threads joined before the interpreter finalizes
            # (``moe_comm.group.init_process_group`` says why that needed care: an abort at exit).
            dist.barrier()
        return gathered
    if opts.heap == "loopback":
        device = torch.device("cuda", torch.cuda.current_device()) if opts.device == "cuda" else torch.device("cpu")
        groups = moe_comm.init("loopback", world_size=opts.world, timeout_s=opts.timeout_s, device=device)
        return [_work(opts)(groups, opts)]
    if opts.device == "cuda":
        if opts.world != 1:
            raise SystemExit("several ranks on GPUs: use torchrun (one GPU per rank) or --heap loopback on one GPU")
        import torch.distributed as dist  # noqa: PLC0415
        from moe_comm.group import init_process_group  # noqa: PLC0415  (one that destroy really ends)
        # A one-rank process group so the sync/padded baselines really call NCCL's all_to_all_single.
        init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                           device_id=torch.device("cuda", 0))
        try:
            with moe_comm.init(opts.heap, timeout_s=opts.timeout_s) as group:
                return [_work(opts)([group], opts)]
        finally:
            dist.destroy_process_group()
    return moe_comm.launch(_rank_entry, opts.world, opts, backend=opts.heap, timeout_s=opts.timeout_s)


# ---- report ------------------------------------------------------------------------------------------

def _describe(opts, results) -> str:
    if opts.emulate_ep:
        ep = (f"one rank of EP{opts.emulate_ep} EMULATED on one device (E/{opts.emulate_ep} experts, peers mirror "
              f"this rank, no link); ")
    else:
        ep = ""
    return ep + _describe_world(opts, results)


def _describe_world(opts, results) -> str:
    if opts.device == "cpu":
        where = (f"world {opts.world} emulated in one process (loopback heap)" if opts.heap == "loopback"
                 else f"{opts.world} processes, {opts.heap} heap")
        return f"CPU, {where}, Triton kernels interpreted (on CPU tensors), every step eager (no CUDA graphs on a CPU)"
    from .step_profile import GRAPH_MODES  # noqa: PLC0415
    emulated = opts.heap == "loopback" and opts.world > 1
    graphs = ", ".join(f"{b}: {GRAPH_MODES[g]}" for b, g in results[0]["graphs"].items())
    where = (f"world {opts.world} EMULATED on one GPU (loopback heap: every rank's work runs on this GPU, "
             f"one after another)" if emulated else f"world {opts.world}, {opts.heap} heap")
    return f"GPU, {where}; {graphs}"


def report(opts, results: list[dict]) -> dict:
    cfg = model_config(opts.config, opts.device)
    env = environment(torch.device(opts.device))
    mode = _describe(opts, results)
    run = time.strftime("%Y-%m-%dT%H:%M:%S")   # every line of this run carries it; the file may hold earlier runs
    records = []
    for b in opts.backends:
        for n in opts.batches:
            per_process = [lst for res in results for lst in res["timing"][b][n]]
            rec = dict(bench="decode_latency", op="decode_step", config=cfg.name, hidden=cfg.hidden, layers=cfg.num_layers,
                       experts=cfg.num_experts, topk=cfg.topk, dtype=str(cfg.dtype).replace("torch.", ""),
                       backend=b, batch_per_rank=n, world=opts.world, heap=opts.heap, expert_impl=opts.experts,
                       attention_impl=opts.attention,
                       emulated=bool(results[0]["emulated"][b]), cuda_graphs=results[0]["graphs"][b] != "eager",
                       graphs=results[0]["graphs"][b], emulate_ep=opts.emulate_ep,
                       warmup=opts.warmup, check_rel_err=max(res["check"][b] for res in results),
                       **{f"step_{k}": v for k, v in results[0]["counters"][b][n].items() if k != "batch"},
                       **percentiles(slowest_rank_per_step(per_process)), **env,
                       run=run, time=time.strftime("%Y-%m-%dT%H:%M:%S"))
            records.append(rec)
    os.makedirs(opts.out_dir, exist_ok=True)
    attention = "" if opts.attention == "torch" else f"_attn-{opts.attention}"
    world = f"ep{opts.emulate_ep}emu" if opts.emulate_ep else f"w{opts.world}"
    stem = os.path.join(opts.out_dir,
                        f"decode_latency_{cfg.name}_{opts.device}_{world}_{opts.experts}{attention}")
    runs = write_jsonl(stem + ".jsonl", records)
    title = (f"{cfg.name}: hidden {cfg.hidden}, {cfg.num_layers} layers, {cfg.num_experts} experts, top-{cfg.topk}, "
             f"{rec['dtype']}, {opts.experts} expert GEMMs, {opts.attention} attention")
    measured = f"{env['device']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}"
    which_run = f"run {run}" + (f" (the latest of {runs} runs in {os.path.basename(stem)}.jsonl)" if runs > 1 else "")
    committed = committed_gpu_run(cfg.name) if opts.device == "cpu" else None
    drawn = "matplotlib" not in missing_bench_packages()
    if drawn and opts.device == "cpu":
        plot_counters(stem + ".png", records, opts.backends, opts.batches,
                      f"{title}\n{mode}\nmeasured on {measured}; {which_run}", committed)
    elif drawn:
        plot(stem + ".png", records, opts.backends, f"{title}\n{mode}\nmeasured on {measured}; {which_run}")
    worst = {b: max(res["check"][b] for res in results) for b in opts.backends}
    print(f"\n{title}\n{mode}\n{measured}")
    print("1. reference check passed: " + ", ".join(f"{b} max rel err {e:.1e}" for b, e in worst.items()))
    print("\n2. per decode step and rank, counted on this machine (the same on any device):")
    print(format_counters(results[0]["counters"], opts.backends, opts.batches))
    timing = (f"decode step latency, µs: p50 [p20-p80] over {opts.steps} steps after {opts.warmup} warm-up "
              f"(slowest rank per step)")
    if opts.device == "cpu":
        print("\n3. " + format_committed(committed, cfg.name))
        print(f"\n4. harness check, NOT a comparison of the designs: {timing}. On the CPU the Triton kernels of "
              "dynamic/fused run in Triton's interpreter and the baselines use gloo.\n")
        print(format_table(records, opts.backends, opts.batches))
        print("\nharness check of the savings arithmetic (interpreter vs gloo; meaningless as a comparison):")
        print(format_savings(savings(records, opts.backends, opts.batches), opts.backends, opts.batches))
    else:
        print(f"\n3. {timing}\n")
        print(format_table(records, opts.backends, opts.batches))
        print("\n% of each baseline's latency saved (positive = faster; " + SAVINGS_NOTE + "):")
        print(format_savings(savings(records, opts.backends, opts.batches), opts.backends, opts.batches))
        print_attribution(opts, cfg, records)
    print(f"\nJSON lines of {which_run} appended to {stem}.jsonl" + (f"\nplot of this run written to {stem}.png" if drawn else ""))
    return dict(records=records, jsonl=stem + ".jsonl", png=stem + ".png" if drawn else None)


SAVINGS_NOTE = ("sync-graphed is the fair baseline: it is graphed wherever a host-synced exchange allows; "
                "against sync, an eager model, most of a saving is CUDA graphs")


def format_counters(counters: dict, backends: list[str], batches: list[int]) -> str:
    """counters[backend][batch] (``step_profile.count_step``) as one row per (backend, batch)."""
    from .bench_report import _grid  # noqa: PLC0415
    from .step_profile import GRAPH_MODES  # noqa: PLC0415
    head = ["backend", "batch", "host syncs", "launches (ATen + Triton)", "bytes to other ranks", "on a GPU the step runs"]
    rows = []
    for b in backends:
        for n in batches:
            c = counters[b][n]
            rows.append([b, str(n), str(c["host_reads"]), f"{c['launches']} ({c['aten_launches']} + {c['triton_launches']})",
                         f"{c['wire_bytes']:,}", GRAPH_MODES[c["gpu_graphs"]]])
    return _grid(head, rows)


def committed_gpu_run(config: str, root: str | None = None) -> dict | None:
    """The latest committed GPU decode run (world 1) of ``config`` under bench/results: {path, device,
    commit, records (the latest line per (backend, batch)), profile (the step profile in the same
    directory, ``bench_report.latest_profile``; {} if none)}; None when there is none."""
    import glob  # noqa: PLC0415
    import json  # noqa: PLC0415
    from .bench_report import latest_profile  # noqa: PLC0415
    root = root or RESULTS_ROOT
    best = None
    for path in glob.glob(os.path.join(root, "**", f"decode_latency_{config}_cuda_w1_*.jsonl"), recursive=True):
        with open(path) as f:
            recs = [json.loads(x) for x in f if x.strip()]
        recs = [r for r in recs if r.get("bench") == "decode_latency" and not r.get("emulate_ep")]
        if recs and (best is None or max(r["time"] for r in recs) > max(r["time"] for r in best[1])):
            best = (path, recs)
    if best is None:
        return None
    path, recs = best
    last = {}
    for r in recs:
        last[(r["backend"], r["batch_per_rank"])] = r
    profile = {}
    for prof_path in glob.glob(os.path.join(os.path.dirname(path), f"decode_profile_{config}_cuda_*.jsonl")):
        with open(prof_path) as f:
            profile.update(latest_profile([json.loads(x) for x in f if x.strip()]))
    r0 = next(iter(last.values()))
    return dict(path=path, root=root, device=r0.get("device"), commit=str(r0.get("commit"))[:7],
                records=list(last.values()), profile=profile)


RESULTS_ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                            "bench", "results")


def format_committed(run: dict | None, config: str) -> str:
    """A committed GPU run as a table, every saving with its basis: against a baseline graphed like fused
    (sync-graphed, padded) as measured; against sync (an eager model) only split into communication and
    graphs + host by the run's step profile."""
    from .bench_report import _grid, attribution, improvement, run_graphs  # noqa: PLC0415
    from .step_profile import GRAPH_MODES  # noqa: PLC0415
    if run is None:
        return f"latest committed GPU results for {config}: none under {RESULTS_ROOT}"
    last = {(r["backend"], r["batch_per_rank"]): r for r in run["records"]}
    backends = [b for b in BACKEND_NAMES if any(k[0] == b for k in last)]
    batches = sorted({k[1] for k in last})
    graphed = [b for b in ("sync-graphed", "padded") if b in backends]
    split = {r["batch"]: r for r in attribution(run["records"], run["profile"], "sync") if r["backend"] == "fused"}
    head = (["batch"] + [f"{b} µs" for b in backends] + [f"fused vs {b}" for b in graphed]
            + ["fused vs sync: saved µs = communication + graphs/host"])
    rows = []
    for n in batches:
        row = [str(n)] + [f"{last[(b, n)]['us_p50']:.0f}" if (b, n) in last else "-" for b in backends]
        for b in graphed:
            ok = (b, n) in last and ("fused", n) in last
            row.append(f"{improvement(last[(b, n)]['us_p50'], last[('fused', n)]['us_p50']):+.1f}%" if ok else "-")
        sp = split.get(n)
        row.append("- (no step profile at this batch)" if sp is None else
                   f"{sp['saved_us']:.0f} = {sp['communication_us']:.0f} + {sp['graphs_us']:.0f} "
                   f"({100 * sp['graphs_us'] / sp['saved_us']:.0f}% graphs/host)")
        rows.append(row)
    ran = {b: GRAPH_MODES[run_graphs(next(r for k, r in last.items() if k[0] == b))] for b in backends}
    note = "\n   how each backend ran its steps: " + "; ".join(f"{b}: {m}" for b, m in ran.items())
    if "sync-graphed" not in backends:
        note += ("\n   These runs predate the sync-graphed baseline and per-bucket padded capacity (padded used the "
                 "largest bucket's capacity at every batch).")
    return (f"latest committed GPU results for the same configuration ({config} at its real widths, world 1): "
            f"{run['device']}, commit {run['commit']}, "
            f"{os.path.relpath(run['path'], os.path.dirname(os.path.dirname(run['root'])))}{note}\n"
            + _grid(head, rows))


def committed_gpu_results(config: str, root: str | None = None) -> str:
    """``format_committed`` of ``committed_gpu_run``."""
    return format_committed(committed_gpu_run(config, root), config)


def print_attribution(opts, cfg, records: list[dict]) -> None:
    """Where each backend's difference from sync comes from, if a step profile of this configuration is
    in --out-dir (``--profile`` writes it)."""
    from .bench_report import attribution, format_attribution, latest_profile  # noqa: PLC0415
    from .step_profile import profile_path  # noqa: PLC0415
    path = profile_path(opts, cfg)
    if not os.path.exists(path):
        print(f"\ngraphs vs communication: no step profile at {path} (run with --profile first)")
        return
    with open(path) as f:
        import json  # noqa: PLC0415
        prof = latest_profile([json.loads(x) for x in f if x.strip()])
    rows = [r for base in BASELINE_NAMES for r in attribution(records, prof, base)]
    print(f"\nwhere the difference comes from (communication = dispatch + combine device time from {path}; "
          "graphs + host = the rest):")
    print(format_attribution(rows))


def main(argv=None) -> int:
    opts = parse_args(argv)
    missing = missing_bench_packages()
    if missing:
        print(f"note: {', '.join(missing)} not installed (the 'bench' extra: {BENCH_EXTRA_HINT}): "
              f"running without {' and '.join({'tqdm': 'a progress bar', 'matplotlib': 'plots'}[m] for m in missing)}",
              file=sys.stderr)
    results = _run(opts)
    if results is not None and (not opts.torchrun or int(os.environ["RANK"]) == 0):
        if opts.profile:
            from .step_profile import report_profile  # noqa: PLC0415
            report_profile(opts, results)
        else:
            report(opts, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
