"""Cold start: wall time from process start to the first dispatch + combine, with Triton's cache empty,
warm, and filled beforehand by ``python -m moe_comm warmup``.

    python3 bench/cold_start.py [--json PATH] [--work-dir DIR] [warmup's configuration options]
    python3 bench/cold_start.py --dry ...          # no GPU: the script's logic only (see below)

Three serving-like processes are started, one after another, each with TRITON_CACHE_DIR set (the
configuration's defaults: DeepSeek-V3, EP8 on one GPU as a loopback world, 128 tokens per rank):

  cold            an empty cache directory: every kernel variant of the first call is compiled
  warm            the same directory again: every variant is loaded from it
  after-warmup    a second empty directory, filled by ``python -m moe_comm warmup`` (timed on its own)
                  just before: if warmup covers what the first call launches, this one compiles nothing

A process imports torch and moe_comm, builds every rank's EPBuffer, runs one dispatch and one combine on
every rank (all ranks' send phases, then all receive phases), synchronizes, then runs a second one
(steady state). Reported per process: seconds from its start (the parent's clock just before it is
started) to the end of the first call, the import, the setup and both calls, and how many kernels it
added to the cache directory (counted before and after: ``compiled``; 0 = everything was cached).

``--dry`` (a CPU): the processes run the ops in Triton's interpreter on tiny shapes (nothing is
compiled: ``compiled`` is 0) and warmup only lists the variants; the figures are labelled as not GPU
measurements. The compile time on the CPU for a GPU target is ``python -m moe_comm warmup``'s report.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

T0_ENV = "MOE_COMM_COLD_START_T0"   # the parent's time.time() just before it started the process
DRY_CONFIG = ["--world", "1", "--experts", "8", "--hidden", "128", "--topk", "2", "--max-tokens", "3"]
CASES = ("cold", "warm", "after-warmup")


def child(cfg) -> dict:
    """One serving-like process (module docstring): its timings, as a dict."""
    t0 = float(os.environ[T0_ENV])
    import torch  # noqa: PLC0415
    import moe_comm  # noqa: PLC0415
    t_import = time.time()
    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    groups = moe_comm.init(backend="loopback", world_size=cfg.world, device=dev, timeout_s=cfg.timeout_s)
    eps = [moe_comm.EPBuffer(g, cfg.num_experts, cfg.hidden, cfg.max_tokens, cfg.topk, dtype=cfg.dtype,
                             fp8_dispatch=cfg.fp8_dispatch) for g in groups]
    gen = torch.Generator().manual_seed(0)
    T = cfg.max_tokens
    xs = [torch.randn(T, cfg.hidden, generator=gen).to(cfg.dtype).to(dev) for _ in groups]
    idxs = [torch.rand(T, cfg.num_experts, generator=gen).topk(cfg.topk, dim=1).indices.to(dev) for _ in groups]
    ws = [torch.rand(T, cfg.topk, generator=gen).to(dev) for _ in groups]
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t_setup = time.time()

    def step():
        for ep, x, i in zip(eps, xs, idxs):
            ep.dispatch(x, i, phase="send")
        ds = [ep.dispatch(phase="recv") for ep in eps]
        for ep, d, w in zip(eps, ds, ws):
            ep.combine(d.x.to(cfg.dtype), w, d.handle, phase="send")
        ys = [ep.combine(phase="recv") for ep in eps]
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        for g in groups:
            g.check()
        return ys

    step()
    t_first = time.time()
    step()
    t_second = time.time()
    for ep in reversed(eps):
        ep.close()
    return dict(to_first_call_s=t_first - t0, import_s=t_import - t0, setup_s=t_setup - t_import,
                first_call_s=t_first - t_setup, second_call_s=t_second - t_first)


def run_case(case: str, cache: str, config_args: list[str], env: dict) -> dict:
    from moe_comm.warmup import cached_kernels  # noqa: PLC0415
    before = cached_kernels(cache)
    e = dict(env, TRITON_CACHE_DIR=cache)
    e[T0_ENV] = repr(time.time())
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", *config_args], env=e,
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{case}: the process failed:\n{out.stdout[-2000:]}{out.stderr[-4000:]}")
    rec = json.loads(out.stdout.strip().splitlines()[-1])
    return dict(rec, case=case, cache_dir=cache, compiled=cached_kernels(cache) - before)


def run_warmup(cache: str, config_args: list[str], env: dict, dry: bool) -> dict:
    t0 = time.time()
    args = ["--list", "--json"] if dry else ["--json", "--cache-dir", cache]
    out = subprocess.run([sys.executable, "-m", "moe_comm", "warmup", *config_args, *args],
                         env=dict(env, TRITON_CACHE_DIR=cache), capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"warmup failed:\n{out.stdout[-2000:]}{out.stderr[-4000:]}")
    lines = [json.loads(s) for s in out.stdout.splitlines() if s.startswith("{")]
    rep = dict(variants=len(lines), compiled=0) if dry else lines[-1]
    return dict(rep, wall_s=time.time() - t0)


def main(argv=None) -> int:
    from moe_comm.warmup import add_config_args, config_dict, config_from_args  # noqa: PLC0415
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p)
    p.add_argument("--dry", action="store_true", help="CPU: tiny shapes, interpreter, warmup only listed")
    p.add_argument("--json", help="append the JSON lines here too")
    p.add_argument("--work-dir", help="where the cache directories go (default: a new temporary directory)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else list(argv)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(config_from_args(a))))
        return 0
    import tempfile  # noqa: PLC0415

    import torch  # noqa: PLC0415
    from bench.common import DRY_LABEL, environment, printed_lines  # noqa: PLC0415
    if a.dry and torch.cuda.is_available():
        p.error("--dry is for machines without a GPU")
    if not a.dry and not torch.cuda.is_available():
        p.error("no GPU here: use --dry")
    config_args = [x for x in argv if x not in ("--dry", "--child")]
    config_args = _without(config_args, ("--json", "--work-dir"))
    if a.dry:
        config_args = DRY_CONFIG + config_args
    cfg = config_from_args(p.parse_args(config_args))
    env_rec = environment(torch.device("cuda" if not a.dry else "cpu"))
    work = a.work_dir or tempfile.mkdtemp(prefix="moe-comm-cold-start-")
    for sub in ("cold", "warmup"):
        shutil.rmtree(os.path.join(work, sub), ignore_errors=True)
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    emit = printed_lines(a.json, dict(bench="cold_start", config=config_dict(cfg), dry=a.dry, env=env_rec,
                                      **({"label": DRY_LABEL} if a.dry else {})))

    cold = os.path.join(work, "cold")
    emit(kind="run", **run_case("cold", cold, config_args, env))
    emit(kind="run", **run_case("warm", cold, config_args, env))
    pre = os.path.join(work, "warmup")
    emit(kind="warmup", **run_warmup(pre, config_args, env, a.dry))
    emit(kind="run", **run_case("after-warmup", pre, config_args, env))
    return 0


def _without(args: list[str], options) -> list[str]:
    """``args`` without ``options`` and their values."""
    out, skip = [], False
    for x in args:
        if skip:
            skip = False
            continue
        if x in options:
            skip = True
            continue
        if any(x.startswith(o + "=") for o in options):
            continue
        out.append(x)
    return out


if __name__ == "__main__":
    sys.exit(main())
