"""A GPU loan in one command: every open claim measured in priority order, each step within its own budget.

    make gpu-quick OUT=dir              (= python3 scripts/gpu_quick.py dir)
    GPU_QUICK_BUDGET_S=360 make gpu-quick OUT=dir      the whole run in 6 minutes: every budget scaled
    BASELINE=/path/to/other/checkout make gpu-quick OUT=dir   also time that tree's kernels (before/after)

On a GPU machine (offline, its own Python, from the source tree: ``../shared/gpu.md``) the steps run in
this order, each in its own process group, killed when its budget runs out (recorded as ``cut``; the run
goes on with the next step):

   1 gpu-tests          a representative subset of tests/gpu (every op compiled, worlds 2-8, graphs, faults)
   2 concurrent-ranks   8 ranks on one GPU, one stream each, 1000 steps of every op, exact every step
   3 faults             bench/timeout_repeats.py: a skipped send, timeouts of 2 and 50 ms, 200 repeats
   4 sanitizers         compute-sanitizer racecheck and synccheck (two processes at once) on the smallest
                        world-2 case
   5 kernels            bench/kernels.py: floor, AllToAllvDynamic, dispatch bf16/fp8, combine (T 1, 128,
                        world 1) and 8 emulated ranks (in turn, one stream each), tracing off
   6 kernels-baseline   the same from $BASELINE (another checkout), rows labelled with its commit
   7 kernels-trace      world-1 kernels with MOE_COMM_TRACE=1 (the flight recorder's cost)
   8 ep-rank            one real rank of EP8, the other 7 emulated (bench/ep_rank.py), T 1 and 128
   9 prefill            PrefillBuffer, 8 emulated ranks, T = 4096: link-side GB/s and % of the floor
  10 decode             DeepSeek-V3 decode step, batch 1 and 64: fused against sync-graphed
  11 hf-door            the transformers door on the GPU (bench/hf_door.py): world-1 generation on nvshmem
                        and loopback checked against transformers' eager run there; a Qwen3-30B-A3B-shaped
                        decode step (batch 1, 8, 64), the door unfused and fused (layer_path), against
                        transformers' grouped_mm and eager experts
  12 moe-layer          bench/moe_layer.py: the fused MoE layer (bf16 weights, and fp8 with block scales)
                        against our unfused path and against
                        dispatch + torch._grouped_mm + combine, DeepSeek-V3 and V4-Flash-like shapes, world
                        8 (emulated, a stream each) then 1, T = 1, 8, 64, 128, 512 (the fused/unfused
                        crossover: moe_layer.FUSED_MAX_TOKENS)
  13 cold-start         process start to the first dispatch + combine (DeepSeek-V3, EP8): empty Triton
                        cache, warm cache, and after ``moe_comm warmup`` (bench/cold_start.py)

Under OUT: ``NN-step/`` per step (its log, JSON lines, and ``verdict.json``: one line, written when the
step ends), ``verdicts.jsonl`` (every verdict so far), ``environment.json``, and ``summary.md`` /
``summary.json`` (scripts/gpu_summary.py), rebuilt from whatever is in OUT after every step: a run cut
short keeps everything finished. Every JSON row carries device, versions and commit.

Without a GPU the same steps run as a dry run: tiny shapes in Triton's interpreter, the
GPU tests collected and skipped, the sanitizer case run without compute-sanitizer; every number is
labelled as not a GPU measurement (tests/test_gpu_quick.py runs it in CI so that it cannot rot).

Budgets: the default total is TOTAL_S (under 8 minutes with the machine's start outside it); each step
has its own budget (STEPS). ``--budget-s`` / ``GPU_QUICK_BUDGET_S`` sets the total and scales every
step's budget with it; a step never gets more than what is left of the total, and none starts with less
than MIN_STEP_S left. ``--steps`` / ``GPU_QUICK_STEPS`` runs a subset, whose share of TOTAL_S is the
share of its budgets: a short loan that picks steps keeps their budgets whole (``scale_for``).

Env: PYTHON (default this interpreter), BASELINE (+ BASELINE_COMMIT when that tree has no git metadata),
MOE_COMM_COMMIT (the measured commit, when this copy's git metadata is not it: every row is labelled
with it). nvshmem4py is installed from ``.whl/*.whl`` into /tmp/site when present (gpu.md); transformers
and its dependencies (the hf-door step) from ``.whl/hf/*.whl`` into /tmp/site-hf, which the step puts after
the machine's own packages (docs/benchmarks.md says how to download them).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # gpu_summary, beside this script
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOTAL_S = 450.0          # default whole-run budget: 8 minutes of an H100 loan, less a margin for the summary
MIN_STEP_S = 10.0        # a step is not started with less than this left of the total
KILL_GRACE_S = 5.0       # SIGTERM, then SIGKILL this much later
DRY_LABEL = "dry run, CPU interpreter, not a GPU measurement"
SITE = "/tmp/site"       # where the carried nvshmem4py wheel is installed (gpu.md)
HF_SITE = "/tmp/site-hf" # where the carried transformers wheels are installed: searched after site-packages

# Step 1: fast and representative (the whole "gpu and not slow" selection needed more than 300 s on an
# H200; these took about 45 s on an H100 at cea8d5d, plus the graphs fault test): every op compiled on the
# loopback heap at world 2 (DeepSeek-V3 rows) and an odd world (world 8 is step 2's), misaligned inputs,
# CUDA-graph replay with new routing and counts, the graphs fault/recover/exclude test; the nvshmem ones
# run when the nvshmem4py wheel is carried, else they skip.
GPU_TESTS = (
    "tests/gpu/test_gpu_heap.py",
    "tests/gpu/test_gpu_ep.py::test_world1_nvshmem[small-bf16]",
    "tests/gpu/test_gpu_ep.py::test_world1_nvshmem[small-fp8]",
    "tests/gpu/test_gpu_ep.py::test_loopback_compiled[2-7168-bf16]",
    "tests/gpu/test_gpu_ep.py::test_loopback_compiled[2-7168-fp8]",
    "tests/gpu/test_gpu_ep.py::test_inputs_not_16_byte_aligned_compiled[2-bf16]",
    "tests/gpu/test_gpu_ep.py::test_cuda_graph_replay_with_new_routing[2-bf16]",
    "tests/gpu/test_gpu_ep.py::test_cuda_graph_replay_with_new_routing[2-fp8]",
    "tests/gpu/test_gpu_alltoallv.py::test_loopback_compiled[row_shape1-3]",
    "tests/gpu/test_gpu_alltoallv.py::test_loopback_compiled[row_shape2-2]",
    "tests/gpu/test_gpu_alltoallv.py::test_cuda_graph_replay_with_new_counts",
    "tests/gpu/test_gpu_faults.py::test_graphs_recover_with_reset_and_survive_an_exclude",
    "tests/gpu/test_gpu_formats.py::test_prefill_moe_with_local_experts_on_the_device[e4m3-ue8m0]",
    "tests/gpu/test_gpu_formats.py::test_nvfp4_global_scales_that_differ_raise_compiled",
    "tests/gpu/test_gpu_moe_layer.py::test_layer_compiled_equals_the_reference_and_the_unfused_path[True-2]",
    "tests/gpu/test_gpu_moe_layer.py::test_fp8_weights_compiled_equal_the_layer_on_dequantized_weights[False]",
)
FAULT_SCRIPT = "bench/timeout_repeats.py"
SANITIZER = "compute-sanitizer"
SANITIZER_TOOLS = ("racecheck", "synccheck")
# The smallest world-2 case (compiled in step 2 first, so the sanitizer steps find it in the cache).
SANITIZER_CASE = ("tests/gpu/concurrent_ranks.py", "--world", "2", "--steps", "1", "--in-turn")
KERNEL_ARGS = ("--tokens", "1,128", "--a2a-rows", "1,128", "--emulated-tokens", "1,128", "--iters", "20",
               "--warmup", "5")
KERNEL_DRY_ARGS = ("--dry", "--tokens", "1", "--a2a-rows", "1", "--emulated-tokens", "1", "--iters", "1",
                   "--warmup", "0")


@dataclass
class Context:
    """What a step's command depends on."""

    out: str                 # the run's OUT
    dry: bool                # no GPU: tiny shapes, interpreter
    python: str
    env: dict                # environment of every step
    baseline: str | None     # another checkout to time (BASELINE)
    baseline_commit: str | None
    nvshmem: bool            # nvshmem4py importable in the steps
    env_record: dict = field(default_factory=dict)   # device, versions, commit (bench.common.environment)
    transformers: bool = True   # transformers importable (the machine's, else HF_SITE's): the hf-door step


@dataclass
class NotRun:
    """A step that cannot run here: ``status`` missing (something it needs is absent) or skipped (not asked)."""

    status: str
    why: str


@dataclass
class Step:
    """One step: its commands (run in order, within one budget), or why it cannot run here."""

    name: str
    budget_s: float                      # at the default total (TOTAL_S)
    what: str                            # one line: what it measures
    commands: object                     # (ctx, step_dir) -> list of (argv, extra env, cwd), or NotRun
    judge: object = None                 # (step_dir, log text, rc, dry) -> (ok, verdict words); default: exit status
    parallel: bool = False               # start every command at once (each to its own log), same deadline


@dataclass
class Verdict:
    """One line per step (``NN-step/verdict.json`` and ``verdicts.jsonl``)."""

    step: str
    index: int
    status: str              # pass | fail | cut | missing | skipped | not-run
    verdict: str             # one line
    budget_s: float
    wall_s: float = 0.0
    rc: int | None = None
    commands: list = field(default_factory=list)
    dry: bool = False
    env: dict = field(default_factory=dict)


# ---- the steps -------------------------------------------------------------------------------------

def _py(ctx, *args, env=None, cwd=None):
    return ([ctx.python, *args], env or {}, cwd)


def gpu_tests(ctx: Context, d: str):
    return [_py(ctx, "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider", "-m", "gpu",
                f"--junitxml={d}/pytest-gpu.xml", *GPU_TESTS)]


def judge_pytest(d, log, rc, dry):
    from gpu_summary import junit  # noqa: PLC0415
    xml = os.path.join(d, "pytest-gpu.xml")
    if not os.path.exists(xml):
        return False, f"no junit XML (exit {rc})"
    t = junit([xml])
    words = f"{t['passed']} passed, {t['failures'] + t['errors']} failed, {t['skipped']} skipped in {t['time']:.0f} s"
    if t["failed"]:
        words += "; FAILED " + ", ".join(n.split("::")[-1] for n in t["failed"][:3])
    return rc == 0 and not t["failed"], words


def concurrent_ranks(ctx: Context, d: str):
    out = f"--json={d}/concurrent_ranks.jsonl"
    if ctx.dry:
        return [_py(ctx, "tests/gpu/concurrent_ranks.py", "--world", "2", "--steps", "2", "--progress", "1", out)]
    return [_py(ctx, *SANITIZER_CASE, out),
            _py(ctx, "tests/gpu/concurrent_ranks.py", "--world", "8", "--steps", "1000", out)]


def judge_concurrent(d, log, rc, dry):
    rows = _jsonl(os.path.join(d, "concurrent_ranks.jsonl"))
    res = [r for r in rows if r.get("kind") == "result"]
    if not res:
        prog = [r for r in rows if r.get("kind") == "progress"]
        return False, f"no result line (exit {rc})" + (f"; {prog[-1]['steps_done']} steps done" if prog else "")
    words = "; ".join(f"world {r['world']} {r['streams']}: {r['steps_done']}/{r['steps_target']} steps "
                      + ("exact" if r["ok"] else f"FAILED ({(r['errors'] or [r['group_error']])[0]})")
                      for r in res)
    return rc == 0 and all(r["ok"] for r in res), words


def faults(ctx: Context, d: str):
    if not os.path.exists(os.path.join(REPO, FAULT_SCRIPT)):
        return NotRun("missing", f"{FAULT_SCRIPT} is not in this tree")
    out = f"{d}/faults.jsonl"
    if ctx.dry:   # the same interface: one repeat, the timeout its CPU test uses (small shapes there)
        return [_py(ctx, FAULT_SCRIPT, "--ops", "dispatch,combine,alltoallv,prefill", "--repeats", "1",
                    "--timeouts-ms", "20", "--json", out)]
    return [_py(ctx, FAULT_SCRIPT, "--ops", "dispatch,combine,alltoallv,prefill", "--repeats", "200",
                "--timeouts-ms", "2,50", "--json", out)]


def judge_faults(d, log, rc, dry):
    """bench/timeout_repeats.py's lines: one per (op, timeout) case, with ok / wrong / repeats / exact_rounds
    / hang / pass (its exit status is 1 on any wrong outcome, hang or crash)."""
    rows = _jsonl(os.path.join(d, "faults.jsonl"))
    total = lambda k: sum(int(r.get(k) or 0) for r in rows)  # noqa: E731
    bad = [f"{r.get('op')} {r.get('timeout_ms')} ms" for r in rows if not r.get("pass")]
    words = (f"{len(rows)} cases: {total('ok')}/{total('repeats')} timed-out receives named the peer, "
             f"{total('wrong')} wrong, {sum(1 for r in rows if r.get('hang'))} hung; rounds after reset exact "
             f"{total('exact_rounds')}" + (f"; FAILED {', '.join(bad)}" if bad else "") + f"; exit {rc}")
    return rc == 0 and bool(rows) and not bad, words


def sanitizers(ctx: Context, d: str):
    """One process per tool, at once (two contexts on the one GPU): each under compute-sanitizer, each
    writing its own case JSON lines."""
    if ctx.dry:   # no compute-sanitizer without a GPU: the case alone, so that it cannot rot
        return [_py(ctx, *SANITIZER_CASE, f"--json={d}/case-{SANITIZER_TOOLS[0]}.jsonl")]
    if shutil.which(SANITIZER) is None:
        return NotRun("missing", f"{SANITIZER} not on PATH")
    return [([SANITIZER, "--tool", tool, "--error-exitcode", "1", "--target-processes", "all", ctx.python,
              *SANITIZER_CASE, f"--json={d}/case-{tool}.jsonl"], {}, None) for tool in SANITIZER_TOOLS]


def judge_sanitizers(d, log, rc, dry):
    summary = [line.strip().strip("= ") for line in log.splitlines() if "ERROR SUMMARY" in line]
    words, ok = [], rc == 0
    for tool in (SANITIZER_TOOLS[:1] if dry else SANITIZER_TOOLS):
        case = [r for r in _jsonl(os.path.join(d, f"case-{tool}.jsonl")) if r.get("kind") == "result"]
        exact = bool(case) and all(r["ok"] for r in case)
        ok = ok and exact
        words.append(f"{tool if not dry else 'the case without compute-sanitizer (no GPU)'}: "
                     + ("exact" if exact else "NOT exact"))
    if not dry:
        ok = ok and len(summary) == len(SANITIZER_TOOLS) and all(" 0 errors" in x for x in summary)
        words.append("; ".join(summary) or "no sanitizer summary")
    return ok, "; ".join(words)


def kernels(trace: bool = False, baseline: bool = False):
    def commands(ctx: Context, d: str):
        sections = "floor,a2a,ep" if trace else "floor,a2a,ep,ep_emulated"
        args = KERNEL_DRY_ARGS if ctx.dry else KERNEL_ARGS
        tag = "trace=on" if trace else "baseline" if baseline else "trace=off"
        env = {"MOE_COMM_TRACE": "1" if trace else "0"}
        if not baseline:
            return [_py(ctx, "bench/kernels.py", "--sections", sections, *args, "--out-dir", d, "--tag", tag, env=env)]
        if not ctx.baseline:
            return NotRun("skipped", "no BASELINE checkout given")
        script = os.path.join(ctx.baseline, "bench", "kernels.py")
        if not os.path.exists(script):
            return NotRun("missing", f"{script} does not exist")
        with open(script) as f:   # the sections that tree has (an older kernels.py may lack some)
            src = f.read()
        sections = ",".join(s for s in sections.split(",") if f'"{s}"' in src)
        args = [a for a in args if a != "--emulated-tokens" or "--emulated-tokens" in src]
        args = _drop_unknown_options(args, src)
        env.update(PYTHONPATH=os.pathsep.join([SITE, ctx.baseline]), MOE_COMM_COMMIT=ctx.baseline_commit or "unknown",
                   PYTHONDONTWRITEBYTECODE="1")   # nothing written into the other checkout
        return [([ctx.python, script, "--sections", sections, *args, "--out-dir", d, "--tag", tag], env, ctx.baseline)]
    return commands


def _drop_unknown_options(args, src: str) -> list:
    """``args`` without the options (and their values) that a script's source does not define."""
    out, i = [], 0
    while i < len(args):
        a = args[i]
        takes_value = a.startswith("--") and a != "--dry" and i + 1 < len(args) and not args[i + 1].startswith("--")
        if a.startswith("--") and f'"{a}"' not in src:
            i += 2 if takes_value else 1
            continue
        out += args[i:i + (2 if takes_value else 1)]
        i += 2 if takes_value else 1
    return out


def judge_kernels(d, log, rc, dry):
    rows = _jsonl_glob(d, "kernels-*.jsonl")
    res = [r for r in rows if r.get("kind") == "result"]
    errs = [r for r in rows if r.get("kind") == "error"]
    pick = next((r for r in res if r["op"] == "dispatch" and r["impl"] == "moe_comm" and r["dtype"] == "bf16"
                 and r.get("tokens") == max(x.get("tokens", 0) for x in res if x["op"] == "dispatch")), None)
    words = f"{len(res)} results, {len(errs)} sections failed"
    if pick:
        words += f"; dispatch bf16 T={pick['tokens']} world 1: {pick['p50_us']:.1f} us, {pick['x_floor']:.2f}x floor"
    pre = [r for r in res if r["op"] == "prefill_dispatch" and r["dtype"] == "bf16"]
    if pre:
        words = f"{len(res)} results; " + "; ".join(
            f"prefill dispatch bf16 {r['streams']}: {r['p50_us']:.0f} us, {r['GBps']:.0f} GB/s link-side, "
            f"{r['pct_of_floor']:.0f} % of the floor" for r in pre)
    return rc == 0 and not errs and bool(res), words


def ep_rank(ctx: Context, d: str):
    if ctx.dry:
        args = ("--dry", "--rank-worlds", "2", "--rank-tokens", "1", "--iters", "1", "--warmup", "0")
    else:
        args = ("--rank-worlds", "8", "--rank-tokens", "1,128", "--iters", "20", "--warmup", "3")
    return [_py(ctx, "bench/kernels.py", "--sections", "floor,ep_rank", "--rank-routings", "uniform", *args,
                "--out-dir", d, "--tag", "trace=off")]


def prefill(ctx: Context, d: str):
    args = (("--dry", "--prefill-tokens", "3", "--iters", "1", "--warmup", "0") if ctx.dry else
            ("--prefill-tokens", "4096", "--iters", "20", "--warmup", "3"))
    return [_py(ctx, "bench/kernels.py", "--sections", "floor,prefill", *args, "--out-dir", d, "--tag", "trace=off")]


def decode(ctx: Context, d: str):
    common = ("--config", "deepseek-v3", "--backends", "sync-graphed,fused", "--out-dir", d)
    if ctx.dry:
        return [_py(ctx, "bench/decode_latency.py", *common, "--device", "cpu", "--world", "1", "--heap", "loopback",
                    "--batches", "1", "--steps", "1", "--warmup", "0", "--check-steps", "1")]
    heap = () if ctx.nvshmem else ("--heap", "loopback")   # world 1 either way
    return [_py(ctx, "bench/decode_latency.py", *common, "--world", "1", *heap, "--batches", "1,64",
                "--steps", "30", "--warmup", "5", "--check-steps", "2")]


def judge_decode(d, log, rc, dry):
    rows = _jsonl_glob(d, "decode_latency*.jsonl")
    p50 = {(r["backend"], r["batch_per_rank"]): r["us_p50"] for r in rows}
    parts = [f"batch {b}: fused {p50[('fused', b)]:.0f} us vs sync-graphed {p50[('sync-graphed', b)]:.0f} us "
             f"({100 * (1 - p50[('fused', b)] / p50[('sync-graphed', b)]):+.1f} %)"
             for b in sorted({k[1] for k in p50}) if ("fused", b) in p50 and ("sync-graphed", b) in p50]
    return rc == 0 and bool(parts), "; ".join(parts) or f"no decode results (exit {rc})"


def hf_door(ctx: Context, d: str):
    if not ctx.transformers:
        return NotRun("missing", f"transformers is not importable here: carry its wheels in .whl/hf "
                                 f"(docs/benchmarks.md), installed into {HF_SITE}")
    return [_py(ctx, "bench/hf_door.py", *(("--dry",) if ctx.dry else ()), "--out-dir", d, "--site-after", HF_SITE)]


def judge_hf_door(d, log, rc, dry):
    rows = _jsonl(os.path.join(d, "hf_door.jsonl"))
    gen = [r for r in rows if r.get("kind") == "generate"]
    refused = [r for r in rows if r.get("kind") == "refused"]
    errors = [r for r in rows if r.get("kind") == "error"]
    p50 = {(r["impl"], r["batch"]): r for r in rows if r.get("kind") == "result" and r.get("what") == "step"}
    kernels = sorted({f"{r['family']} {r['expert_kernel']}" for r in gen if r["ok"]})
    words = [f"generation: {sum(r['ok'] for r in gen)}/{len(gen)} equal to transformers' eager ("
             + ", ".join(sorted({r["heap"] for r in gen})) + "; experts: " + ", ".join(kernels) + ")",
             "loopback world 2 " + ("refused (one process per rank)" if refused and refused[0]["ok"] else "NOT refused")]
    for b in sorted({k[1] for k in p50}):
        if ("moe_comm", b) in p50 and ("grouped_mm", b) in p50:
            door, gmm = p50[("moe_comm", b)], p50[("grouped_mm", b)]
            fused = p50.get(("moe_comm-fused", b))
            words.append(f"B={b} step: door {door['p50_us']:.0f} us ({door['x_floor']:.1f}x floor)"
                         + (f", fused {fused['p50_us']:.0f} us" if fused else "") + f" vs grouped_mm "
                         f"{gmm['p50_us']:.0f} us")
    if errors:
        words.append(f"{len(errors)} error(s): {errors[0]['error'][:120]}")
    ok = (rc == 0 and bool(gen) and all(r["ok"] for r in gen) and bool(refused) and refused[0]["ok"]
          and not errors and bool(p50) and all(r["agrees"] for r in p50.values()))
    return ok, "; ".join(words)


def moe_layer(ctx: Context, d: str):
    if ctx.dry:   # one shape, worlds 1 and 2, one token: the script's logic, not its numbers
        return [_py(ctx, "bench/moe_layer.py", "--dry", "--shapes", "dsv3", "--worlds", "1,2", "--tokens", "1",
                    "--iters", "1", "--warmup", "0", "--out-dir", d)]
    return [_py(ctx, "bench/moe_layer.py", "--iters", "10", "--warmup", "3", "--out-dir", d)]


def fused_max_tokens() -> int:
    """``moe_layer.FUSED_MAX_TOKENS`` as the measured tree has it (read from the source: no import here)."""
    with open(os.path.join(REPO, "moe_comm", "moe_layer.py")) as f:
        for line in f:
            if line.startswith("FUSED_MAX_TOKENS = "):
                return int(line.split("=")[1].split("#")[0])
    raise ValueError("moe_comm/moe_layer.py has no FUSED_MAX_TOKENS")


def moe_layer_crossover(speed: dict) -> str:
    """Words for the fused/unfused crossover from {T: fused speedup over unfused} (the T measured): the
    largest T where fused is faster below the smallest where it is slower, against FUSED_MAX_TOKENS."""
    ts = sorted(speed)
    slower = [t for t in ts if speed[t] < 1.0]
    faster_below = [t for t in ts if speed[t] >= 1.0 and (not slower or t < slower[0])]
    limit = fused_max_tokens()
    if not slower:
        return (f"fused faster at every T measured (up to {ts[-1]}): crossover above {ts[-1]}; FUSED_MAX_TOKENS "
                f"= {limit}" + (" is below it (auto picks unfused where fused was faster)" if limit < ts[-1] else ""))
    if not faster_below:
        return f"unfused faster from the smallest T measured ({slower[0]}); FUSED_MAX_TOKENS = {limit}"
    lo, hi = faster_below[-1], slower[0]
    fits = lo <= limit < hi
    words = (f"crossover between T={lo} (fused faster) and T={hi} (unfused faster): FUSED_MAX_TOKENS = {limit} "
             + ("fits it" if fits else f"does not (set it in [{lo}, {hi}))"))
    if any(speed[t] >= 1.0 for t in ts if t > hi):
        words += "; not monotone (fused faster again above it)"
    return words


def judge_moe_layer(d, log, rc, dry):
    """Per (shape, world): the fused layer's speedup over the unfused path at each T and the crossover
    (``moe_layer_crossover``), grouped_mm's speedup over unfused, the fp8-weight layer's time against the
    bf16 fused layer's and whether it gave the fused layer's bits (it must); the T not measured (a cut run)
    and the points skipped for memory. Passes on a full run whose fp8 layer equals the fused one."""
    all_rows = _jsonl(os.path.join(d, "moe_layer.jsonl"))
    rows = [r for r in all_rows if r.get("kind") == "result"]
    by = {(r["shape"], r["world"], r["tokens"], r["impl"]): r for r in rows}
    parts = []
    for shape, world in sorted({(r["shape"], r["world"]) for r in rows}):
        ts = sorted({r["tokens"] for r in rows if (r["shape"], r["world"]) == (shape, world)})
        speed = {t: by[(shape, world, t, "fused")]["speedup_vs_unfused"] for t in ts
                 if by.get((shape, world, t, "fused"), {}).get("speedup_vs_unfused") is not None}
        words = [f"fused vs unfused " + ", ".join(f"T{t} x{speed[t]:.2f}" for t in sorted(speed))] if speed else []
        if speed:
            words.append(moe_layer_crossover(speed))
        gmm = {t: by[(shape, world, t, "grouped_mm")].get("speedup_vs_unfused") for t in ts
               if (shape, world, t, "grouped_mm") in by}
        if any(v is not None for v in gmm.values()):
            words.append("grouped_mm vs unfused " + ", ".join(f"T{t} x{v:.2f}" for t, v in gmm.items() if v is not None))
        f8 = [(t, by[(shape, world, t, "fused")]["p50_us"] / by[(shape, world, t, "fused_fp8")]["p50_us"],
               by[(shape, world, t, "fused_fp8")]["x_floor"]) for t in ts
              if (shape, world, t, "fused") in by and (shape, world, t, "fused_fp8") in by]
        if f8:
            words.append("fp8 weights vs bf16 fused " + ", ".join(f"T{t} x{x:.2f} ({fl:.2f}x floor)" for t, x, fl in f8))
        missing = [t for t in (1, 8, 64, 128, 512) if t not in ts]
        if missing and not dry:
            words.append("not measured: T " + ",".join(map(str, missing)))
        parts.append(f"{shape} W{world}: " + "; ".join(words))
    fp8_bits = [r for r in rows if r["impl"] == "fused_fp8" and r.get("max_abs_diff_vs_fused") not in (None, 0.0)]
    if fp8_bits:
        parts.append(f"fused_fp8 differs from fused at {len(fp8_bits)} point(s) (it must not: same tiles, same "
                     "dequantized operands)")
    if any(r.get("max_abs_diff_vs_unfused") not in (None, 0.0) for r in rows if r["impl"] == "fused"):
        parts.append("fused differs from unfused in the last bits somewhere (16-row against 64-row GEMM tiles)")
    skips = [r for r in all_rows if r.get("kind") == "skip"]
    if skips:
        parts.append("skipped: " + ", ".join(f"{r['shape']} W{r['world']} T{r['tokens']} {r['impl']}" for r in skips)
                     + f" ({skips[0]['why'][:80]})")
    return rc == 0 and bool(rows) and not fp8_bits, "; ".join(parts) or f"no results (exit {rc})"


def cold_start(ctx: Context, d: str):
    args = ("--dry",) if ctx.dry else ()
    # the cache directories stay out of OUT (tens of MB of binaries): a new temporary directory
    return [_py(ctx, "bench/cold_start.py", *args, "--json", f"{d}/cold_start.jsonl")]


def judge_cold_start(d, log, rc, dry):
    rows = [r for r in _jsonl(os.path.join(d, "cold_start.jsonl")) if r.get("kind") == "run"]
    words = "; ".join(f"{r['case']}: first call {r['to_first_call_s']:.1f} s after process start, "
                      f"{r['compiled']} compiled" for r in rows)
    return rc == 0 and bool(rows), words or f"no cold-start rows (exit {rc})"


STEPS = (
    Step("gpu-tests", 75, "tests/gpu subset: every op compiled, worlds 2/3/8, graphs, faults", gpu_tests, judge_pytest),
    Step("concurrent-ranks", 75, "8 ranks, one stream each, 1000 steps of every op, exact", concurrent_ranks,
         judge_concurrent),
    Step("faults", 150, "skipped send, timeouts 2/50 ms, 200 repeats: CommTimeoutError naming the peer", faults,
         judge_faults),
    Step("sanitizers", 45, "compute-sanitizer racecheck and synccheck at once, world-2 case", sanitizers,
         judge_sanitizers, parallel=True),
    Step("kernels", 70, "floor; a2a, dispatch bf16/fp8, combine T 1/128 world 1 and 8 emulated ranks",
         kernels(), judge_kernels),
    Step("kernels-baseline", 60, "the same sections from $BASELINE (before/after on one device)",
         kernels(baseline=True), judge_kernels),
    Step("kernels-trace", 30, "world-1 kernels with the flight recorder on", kernels(trace=True), judge_kernels),
    Step("ep-rank", 30, "one real rank of EP8, 7 emulated peers, T 1/128", ep_rank, judge_kernels),
    Step("prefill", 35, "PrefillBuffer T=4096, 8 emulated ranks: link GB/s, % of floor", prefill, judge_kernels),
    Step("decode", 50, "DeepSeek-V3 decode step, batch 1/64: fused vs sync-graphed", decode, judge_decode),
    Step("hf-door", 110, "transformers door: world-1 generation vs eager; decode step (unfused, fused) vs grouped_mm",
         hf_door, judge_hf_door),
    Step("moe-layer", 150, "fused MoE layer (bf16, fp8 weights) vs unfused vs grouped_mm, DSV3/V4-Flash, W 8/1, "
         "T 1-512", moe_layer,
         judge_moe_layer),
    Step("cold-start", 80, "process start to first dispatch+combine: cold, warm, after warmup", cold_start,
         judge_cold_start),
)


# ---- running -------------------------------------------------------------------------------------

def _jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue   # a line cut by a kill
    return out


def _jsonl_glob(d: str, pattern: str) -> list[dict]:
    return [r for p in sorted(glob.glob(os.path.join(d, pattern))) for r in _jsonl(p)]


def start_command(argv, env, cwd, log) -> subprocess.Popen:
    """``argv`` started in its own process group, output appended to ``log``."""
    with open(log, "a") as f:
        f.write(f"$ {' '.join(argv)}\n")
        f.flush()
        return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd or REPO,
                                start_new_session=True)


def finish_command(proc: subprocess.Popen, deadline: float) -> tuple[int | None, bool]:
    """(exit status, cut) of a started command, waited for until ``deadline`` (monotonic clock): at the
    deadline its process group gets SIGTERM, then SIGKILL."""
    try:
        return proc.wait(timeout=max(0.0, deadline - time.monotonic())), False
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return None, True


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_step(step: Step, index: int, ctx: Context, budget_s: float) -> Verdict:
    d = os.path.join(ctx.out, f"{index:02d}-{step.name}")
    os.makedirs(d, exist_ok=True)
    v = Verdict(step.name, index, "skipped", "", round(budget_s, 1), dry=ctx.dry, env=ctx.env_record)
    cmds = step.commands(ctx, d)
    if isinstance(cmds, NotRun):
        v.status, v.verdict = cmds.status, cmds.why
        return v
    t0 = time.monotonic()
    deadline = t0 + budget_s
    rc, cut = 0, False
    if step.parallel:   # every command at once, each with its own log, each until the deadline
        logs = [os.path.join(d, f"step-{i}.log") for i in range(1, len(cmds) + 1)]
        procs = [start_command(argv, dict(ctx.env, **extra), cwd, log) for (argv, extra, cwd), log in zip(cmds, logs)]
        done = [finish_command(proc, deadline) for proc in procs]
        cut = any(c for _, c in done)
        rc = next((r for r, _ in done if r), 0) if not cut else None
    else:               # one after another, until one fails or the deadline
        logs = [os.path.join(d, "step.log")]
        for argv, extra, cwd in cmds:
            rc, cut = finish_command(start_command(argv, dict(ctx.env, **extra), cwd, logs[0]), deadline)
            if cut or rc != 0:
                break
    v.commands = [" ".join(argv) for argv, _, _ in cmds]
    v.wall_s, v.rc = round(time.monotonic() - t0, 1), rc
    text = ""
    for log in logs:
        if os.path.exists(log):
            with open(log) as f:
                text += f.read()
    ok, words = (step.judge or (lambda d_, t_, r_, y_: (r_ == 0, f"exit {r_}")))(d, text, rc, ctx.dry)
    if cut:
        v.status, v.verdict = "cut", f"cut at its budget of {budget_s:.0f} s; so far: {words}"
    else:
        v.status, v.verdict = ("pass" if ok else "fail"), words
    return v


def write_verdict(ctx: Context, v: Verdict) -> None:
    line = json.dumps(dataclasses.asdict(v) | ({"label": DRY_LABEL} if v.dry else {}))
    d = os.path.join(ctx.out, f"{v.index:02d}-{v.step}")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "verdict.json"), "w") as f:
        f.write(line + "\n")
    with open(os.path.join(ctx.out, "verdicts.jsonl"), "a") as f:
        f.write(line + "\n")


def rebuild_summary(out: str) -> None:
    """summary.md / summary.json from what is in OUT now (``gpu_summary.quick``)."""
    from gpu_summary import write_quick_summary  # noqa: PLC0415
    try:
        write_quick_summary(out)
    except Exception as e:  # noqa: BLE001  (a summary bug must not stop the run)
        with open(os.path.join(out, "summary.md"), "a") as f:
            f.write(f"\n(summary failed: {type(e).__name__}: {e})\n")


def run(steps, ctx: Context, total_s: float, scale: float) -> list[Verdict]:
    """Every step in order, each within min(its budget x scale, what is left of ``total_s``)."""
    start = time.monotonic()
    plan = [dict(index=i, step=s.name, budget_s=round(s.budget_s * scale, 1), what=s.what)
            for i, s in enumerate(steps, 1)]
    with open(os.path.join(ctx.out, "plan.json"), "w") as f:
        json.dump(dict(total_s=total_s, scale=scale, dry=ctx.dry, steps=plan, env=ctx.env_record), f)
    rebuild_summary(ctx.out)
    verdicts = []
    for i, step in enumerate(steps, 1):
        left = total_s - (time.monotonic() - start)
        budget = min(step.budget_s * scale, left)
        if left < MIN_STEP_S:
            v = Verdict(step.name, i, "not-run", f"not run: {left:.0f} s of the total {total_s:.0f} s left",
                        round(step.budget_s * scale, 1), dry=ctx.dry, env=ctx.env_record)
        else:
            print(f"== {i:02d} {step.name} (budget {budget:.0f} s): {step.what}", flush=True)
            v = run_step(step, i, ctx, budget)
        print(f"   {v.status}: {v.verdict}" + (f" ({v.wall_s:.0f} s)" if v.wall_s else ""), flush=True)
        write_verdict(ctx, v)
        verdicts.append(v)
        rebuild_summary(ctx.out)
    return verdicts


# ---- the environment -------------------------------------------------------------------------------

def install_carried_wheel(python: str, log) -> None:
    """nvshmem4py is not installed on the GPU machine: the carried wheel (``.whl/``) into SITE (gpu.md);
    nor is transformers: its carried wheels (``.whl/hf/``) into HF_SITE."""
    for wheels, site, marker in ((sorted(glob.glob(os.path.join(REPO, ".whl", "*.whl"))), SITE, "nvshmem"),
                                 (sorted(glob.glob(os.path.join(REPO, ".whl", "hf", "*.whl"))), HF_SITE, "transformers")):
        if wheels and not os.path.isdir(os.path.join(site, marker)):
            subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                            "--no-cache-dir", "--target", site, *wheels], stdout=log, stderr=subprocess.STDOUT)


def make_context(out: str, python: str) -> Context:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([SITE, REPO] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo")
    env.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")
    env.pop("TRITON_INTERPRET", None)
    probe = ("import json, sys, torch; from bench.common import environment; "
             "d = torch.device('cuda') if torch.cuda.is_available() else torch.device('cpu'); "
             f"import importlib.util as u; nv = u.find_spec('nvshmem') is not None; sys.path.append({HF_SITE!r}); "
             "print(json.dumps(dict(environment(d), nvshmem_importable=nv, "
             "transformers_importable=u.find_spec('transformers') is not None)))")
    if not env.get("MOE_COMM_COMMIT"):
        sys.path.insert(0, REPO)
        from moe_comm.serving.bench_report import git_commit  # noqa: PLC0415
        env["MOE_COMM_COMMIT"] = git_commit()
    rec = json.loads(subprocess.run([python, "-c", probe], env=env, cwd=REPO, capture_output=True, text=True,
                                    check=True).stdout.strip().splitlines()[-1])
    gpu = rec["device"] != "" and not rec["device"].startswith("CPU")
    baseline = os.environ.get("BASELINE") or None
    commit = os.environ.get("BASELINE_COMMIT")
    if baseline and not commit:
        got = subprocess.run(["git", "-C", baseline, "rev-parse", "HEAD"], capture_output=True, text=True)
        commit = got.stdout.strip() if got.returncode == 0 else None
    nvshmem, transformers = rec.pop("nvshmem_importable"), rec.pop("transformers_importable")
    return Context(out=out, dry=not gpu, python=python, env=env, baseline=baseline, baseline_commit=commit,
                   nvshmem=nvshmem, env_record=rec, transformers=transformers)


def scale_for(total_s: float, chosen=STEPS) -> float:
    """The factor on the chosen steps' budgets: ``total_s`` against their share of TOTAL_S (the budgets of
    all steps, which sum to more than TOTAL_S since most steps end before their budget, take TOTAL_S;
    a subset takes its part of it)."""
    every, these = sum(s.budget_s for s in STEPS), sum(s.budget_s for s in chosen)
    return total_s / (TOTAL_S * these / every)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="results folder (created)")
    p.add_argument("--budget-s", type=float, default=float(os.environ.get("GPU_QUICK_BUDGET_S", TOTAL_S)),
                   help=f"the whole run's budget in seconds; every step's scales with it (default {TOTAL_S:.0f})")
    p.add_argument("--steps", default=os.environ.get("GPU_QUICK_STEPS") or None,
                   help="comma separated subset of the steps, run in the listed order (env GPU_QUICK_STEPS)")
    a = p.parse_args(argv)
    names = [s.name for s in STEPS]
    chosen = a.steps.split(",") if a.steps else names
    if not set(chosen) <= set(names):
        p.error(f"--steps must name some of {', '.join(names)}")
    os.makedirs(a.out, exist_ok=True)
    out = os.path.abspath(a.out)
    python = os.environ.get("PYTHON") or sys.executable
    with open(os.path.join(out, "setup.log"), "a") as log:
        install_carried_wheel(python, log)
    ctx = make_context(out, python)
    with open(os.path.join(out, "environment.json"), "w") as f:
        json.dump(dict(ctx.env_record, dry=ctx.dry, baseline=ctx.baseline, baseline_commit=ctx.baseline_commit,
                       nvshmem=ctx.nvshmem, budget_s=a.budget_s), f)
    if ctx.dry:
        print(f"*** {DRY_LABEL} ***")
    print(f"gpu-quick: {ctx.env_record['device']}, torch {ctx.env_record['torch']}, triton "
          f"{ctx.env_record['triton']}, commit {ctx.env_record['commit']}; budget {a.budget_s:.0f} s")
    steps = [s for s in STEPS if s.name in chosen]
    verdicts = run(steps, ctx, a.budget_s, scale_for(a.budget_s, steps))
    print(f"summary: {os.path.join(out, 'summary.md')}")
    return 0 if all(v.status in ("pass", "skipped", "missing") for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
