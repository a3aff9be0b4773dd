"""Compile a deployment's kernel variants into Triton's cache before serving (``python -m moe_comm warmup``).

A serving process compiles each Triton kernel variant the first time it launches it: for DeepSeek-V3 at
EP8 that is tens of variants of a few seconds each, on the first decode step of every rank (and on the
first fault, for the abort kernels), while its peers wait in their bounded receives. ``warmup`` does that
work ahead of time, in parallel processes, into Triton's on-disk cache (``TRITON_CACHE_DIR``, default
``~/.triton/cache``), so that the serving process finds every variant there and loads it instead.

What a variant is. Triton compiles one binary per kernel and *specialization*: the constexprs (launch
shapes, world size, ...), the dtype of every pointer argument and whether it is 16-byte aligned, and the
class of every integer argument (== 1, a multiple of 16, or neither; 32- or 64-bit). So one op at one
configuration launches several variants: ``rank`` is 0 (a multiple of 16), 1, or neither on the ranks of
a node that share the cache, and a call's token count T falls into one of three classes.

How they are found: every op of the configuration is built on a loopback world of ``world`` ranks on the
CPU with the CUDA launch plans (``planner.plan_ep`` and friends for ``torch.device("cuda")``) and called
with representative inputs (T = 1, a multiple of 16, and neither; every rank; an aborted call, which
launches the fault path's abort and drain kernels); each launch is *recorded* instead of run (its
arguments: dtypes, alignment, integers, constexprs, launch options). Nothing is computed: the ops' host
logic only needs the launch arguments. Distinct variants (Triton's own specialization key) are then
compiled with ``JITFunction.run(..., warmup=True)``, the call a launch makes minus the launch, so the
cache key is the one a launch computes.

Target: with CUDA, the current device's (what this machine's serving processes will look up). Without a
GPU, ``arch`` (default sm_90): the compile for a GPU target works on the CPU (``compile_report`` does the
same), but only a process with the same Triton version, ptxas and moe-comm source finds the result (all
three are in the cache key): run it where the servers run, or ship ``TRITON_CACHE_DIR`` with the image.

What it cannot cover (the serving process still compiles these at first use): the put transport's
variants (groups with peers on other nodes: recording needs an NVSHMEM group), the host barrier's
``fail_group_kernel`` (its arguments name the peer that timed out), the ``moe_comm.ops`` custom-op path
and the serving model's own kernels (attention, expert GEMMs); and any call with an input the
configuration does not describe (another index or weight dtype, a misaligned view). The figures (compile
time on the CPU, and whether a serving process on a GPU then compiles nothing) are in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import sys
import time
from dataclasses import dataclass

import torch

DEFAULT_ARCH = 90
DEFAULT_TIMEOUT_S = 30.0          # moe_comm.init's default (the timeout does not enter any kernel's key)
OPS = ("ep", "prefill", "a2a")    # EPBuffer (decode), PrefillBuffer, AllToAllvDynamic
SIXTEEN = 16                      # Triton marks an integer argument that is a multiple of 16


@dataclass(frozen=True)
class WarmupConfig:
    """One deployment's ops and sizes, as its serving processes build them (sizes are per rank)."""

    world: int                        # ranks of the deployment (every rank's variants: a node shares the cache)
    num_experts: int
    hidden: int
    topk: int
    max_tokens: int                   # EPBuffer max_tokens_per_rank (decode)
    dtype: torch.dtype = torch.bfloat16
    fp8_dispatch: bool = False        # EPBuffer / PrefillBuffer fp8_dispatch
    ops: tuple = ("ep",)              # subset of OPS
    prefill_tokens: int = 4096        # PrefillBuffer max_tokens_per_rank
    a2a_rows: int = 0                 # AllToAllvDynamic max_rows_per_peer (0: max_tokens * topk), rows of hidden
    index_dtype: torch.dtype = torch.int64   # topk_idx as the router returns it (torch.topk: int64)
    trace: int = 0                    # flight-recorder records per channel (MOE_COMM_TRACE of the servers)
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self):
        bad = [op for op in self.ops if op not in OPS]
        if bad or not self.ops:
            raise ValueError(f"ops must be a non-empty subset of {OPS}, got {self.ops!r}")


@dataclass(frozen=True)
class TensorArg:
    """A tensor argument as a launch specializes it: its dtype and whether its address is 16-byte aligned."""

    dtype: str        # torch dtype name, e.g. "bfloat16"
    aligned: bool

    def make(self) -> torch.Tensor:
        """A small CPU tensor with that dtype and alignment class (CPU allocations are 64-byte aligned)."""
        dtype = getattr(torch, self.dtype)
        size = torch.empty((), dtype=dtype).element_size()
        base = torch.empty(8 * SIXTEEN, dtype=torch.uint8)
        offset = 0 if self.aligned else size if size % SIXTEEN else 4 * size
        t = base[offset:offset + 4 * SIXTEEN].view(dtype)
        assert (t.data_ptr() % SIXTEEN == 0) == self.aligned, "CPU allocation not 16-byte aligned"
        return t


@dataclass(frozen=True)
class Variant:
    """One kernel variant: a launch's arguments reduced to what its specialization depends on."""

    module: str       # module of the @triton.jit kernel
    kernel: str       # its name
    args: tuple       # positional arguments: TensorArg for tensors, the value otherwise
    options: tuple    # launch options (num_warps, ...) as sorted (name, value) pairs
    key: str          # module.kernel:Triton's specialization key (the same for the same variant)
    label: str        # the first call that launched it (op, phase, rank, T)

    def compile(self) -> float:
        """Compile into Triton's cache under the active driver; returns the CPU seconds it took, this
        process's and its children's (ptxas): unlike wall time, not inflated by a busy machine (a
        cache hit takes milliseconds)."""
        from .jit_keys import settle_for  # noqa: PLC0415
        fn = getattr(importlib.import_module(self.module), self.kernel)
        settle_for(fn)   # the key every process computes (jit_keys)
        args = [a.make() if isinstance(a, TensorArg) else a for a in self.args]
        t0 = _cpu_s()
        fn.run(*args, grid=(1,), warmup=True, **dict(self.options))
        return _cpu_s() - t0


def _cpu_s() -> float:
    """CPU seconds of this process and of its finished children (ptxas runs as one)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


# ---- the driver a compile asks for its target ------------------------------------------------------

class _TargetDriver:
    """Triton's active driver as far as ``JITFunction.run(..., warmup=True)`` asks (device 0, no stream, a
    fixed target): what lets a CPU process compile for a GPU."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget  # noqa: PLC0415
        self.target = GPUTarget("cuda", int(arch), 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def default_arch() -> int:
    """The current GPU's compute capability (major * 10 + minor), else DEFAULT_ARCH."""
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return 10 * major + minor
    return DEFAULT_ARCH


@contextlib.contextmanager
def target_driver(arch: int):
    """Compile for ``arch`` through ``_TargetDriver``, also on a GPU machine: its target is what the CUDA
    driver reports for that GPU (GPUTarget("cuda", capability, 32)), and unlike the CUDA driver it does
    not create a CUDA context in every compiling process."""
    from triton.runtime.driver import driver  # noqa: PLC0415
    previous = driver._active   # noqa: SLF001  (reset_active() would probe for a GPU driver, absent on a CPU)
    driver.set_active(_TargetDriver(arch))
    try:
        yield
    finally:
        driver._active = previous   # noqa: SLF001


# ---- recording the launches of a configuration ---------------------------------------------------

_KERNEL_FOR_USERS = ("moe_comm.launches", "moe_comm.channel", "moe_comm.prefill")   # modules that bound kernel_for


class _Recorder:
    """Stands in for ``interpreter.kernel_for``: what a launch calls records the variant (and with
    ``compile_now`` compiles it at once, with the call's own arguments) instead of running it."""

    def __init__(self, compile_now: bool):
        self.variants: dict[str, Variant] = {}
        self.compile_s: dict[str, float] = {}   # key -> CPU seconds of its compile (compile_now)
        self.compile_now = compile_now
        self.label = ""

    def kernel_for(self, fn, device):
        recorder = self

        class Recorded:   # what a Launch calls (run) and what a direct launch calls (kernel[grid](...))
            def run(self, *args, grid, warmup, **options):
                recorder.record(fn, args, options)

            def __getitem__(self, grid):
                return lambda *args, **options: self.run(*args, grid=grid, warmup=False, **options)
        return Recorded()

    def record(self, fn, args, options) -> None:
        from triton.runtime.driver import driver  # noqa: PLC0415
        from triton.runtime.jit import compute_cache_key  # noqa: PLC0415
        _, kernel_key_cache, _, _, binder = fn.device_caches[driver.active.get_current_device()]
        _, specialization, opts = binder(*args, **options)
        key = f"{fn.fn.__module__}.{fn.fn.__name__}:{compute_cache_key(kernel_key_cache, specialization, opts)}"
        if key in self.variants:
            return
        spec = tuple(TensorArg(str(a.dtype).replace("torch.", ""), a.data_ptr() % SIXTEEN == 0)
                     if isinstance(a, torch.Tensor) else a for a in args)
        v = Variant(fn.fn.__module__, fn.fn.__name__, spec, tuple(sorted(options.items())), key, self.label)
        self.variants[key] = v
        if self.compile_now:
            from .jit_keys import settle_for  # noqa: PLC0415
            settle_for(fn)
            t0 = _cpu_s()
            fn.run(*args, grid=(1,), warmup=True, **options)
            self.compile_s[key] = _cpu_s() - t0


@contextlib.contextmanager
def _recording(recorder: _Recorder):
    from . import interpreter  # noqa: PLC0415
    saved = [(interpreter, interpreter.kernel_for)]
    for name in _KERNEL_FOR_USERS:
        mod = importlib.import_module(name)
        saved.append((mod, mod.kernel_for))
    for mod, _ in saved:
        mod.kernel_for = recorder.kernel_for
    try:
        yield
    finally:
        for mod, original in saved:
            mod.kernel_for = original


def token_classes(max_tokens: int) -> list[int]:
    """One token count per class Triton specializes T into, within [0, max_tokens]: 1, a multiple of 16
    (0 when max_tokens < 16), and one that is neither (when there is one)."""
    out = [1, max_tokens - max_tokens % SIXTEEN]
    other = next((t for t in range(2, max_tokens + 1) if t % SIXTEEN), None)
    return out + ([other] if other is not None else [])


def _inputs(cfg: WarmupConfig, T: int, idx_rows: int = 0):
    """x [T, hidden], topk_idx [T, topk] (distinct experts, on every rank), weights [T, topk] float32;
    their values never reach a kernel (nothing runs) but the host checks them."""
    x = torch.zeros(T, cfg.hidden, dtype=cfg.dtype)
    idx = (torch.arange(T * cfg.topk, dtype=torch.int64).view(T, cfg.topk) * 7 + idx_rows) % cfg.num_experts
    return x, idx.to(cfg.index_dtype), torch.zeros(T, cfg.topk, dtype=torch.float32)


def _bad_x(cfg: WarmupConfig) -> torch.Tensor:
    """An x every rank's dispatch refuses (wrong dtype): a multi-rank call is aborted (abort kernel), the
    next one drains it (drain kernel) — the fault path's launches."""
    return torch.zeros(1, cfg.hidden, dtype=torch.float32 if cfg.dtype != torch.float32 else torch.float16)


def _record_ep(recorder: _Recorder, groups, cfg: WarmupConfig) -> None:
    from .ep import EPBuffer  # noqa: PLC0415
    from .planner import plan_ep  # noqa: PLC0415
    world = len(groups)
    eps = [EPBuffer(g, cfg.num_experts, cfg.hidden, cfg.max_tokens, cfg.topk, dtype=cfg.dtype,
                    fp8_dispatch=cfg.fp8_dispatch) for g in groups]
    for ep in eps:
        ep.plan = plan_ep(world, cfg.num_experts, cfg.hidden, cfg.max_tokens, cfg.topk, cfg.dtype, cfg.fp8_dispatch,
                          torch.device("cuda"))
    try:
        for T in token_classes(cfg.max_tokens):
            recorder.label = f"ep T={T}"
            ins = [_inputs(cfg, T, r) for r in range(world)]
            ds = _drive(groups, lambda r, ph: eps[r].dispatch(ins[r][0], ins[r][1], phase=ph),
                        lambda r, ph: eps[r].dispatch(phase=ph))
            # expert_out as the experts write it: dtype rows of d.x's shape (never touched: nothing runs)
            outs = [torch.empty(d.x.shape, dtype=cfg.dtype) for d in ds]
            _drive(groups, lambda r, ph: eps[r].combine(outs[r], ins[r][2], ds[r].handle, phase=ph),
                   lambda r, ph: eps[r].combine(phase=ph))
        if world > 1:
            recorder.label = "ep abort"
            _abort(groups, lambda r: eps[r].dispatch(_bad_x(cfg), _inputs(cfg, 1)[1], phase="send"))
            recorder.label = "ep drain"
            ins = [_inputs(cfg, 1, r) for r in range(world)]
            _drive(groups, lambda r, ph: eps[r].dispatch(ins[r][0], ins[r][1], phase=ph),
                   lambda r, ph: eps[r].dispatch(phase=ph))
    finally:
        for ep in reversed(eps):
            ep.close()


def _record_prefill(recorder: _Recorder, groups, cfg: WarmupConfig) -> None:
    from .prefill import PrefillBuffer  # noqa: PLC0415
    world, m = len(groups), cfg.prefill_tokens
    bufs = [PrefillBuffer(g, cfg.num_experts, cfg.hidden, m, cfg.topk, dtype=cfg.dtype,
                          fp8_dispatch=cfg.fp8_dispatch) for g in groups]
    for b in bufs:
        b.plan = PrefillBuffer._plan(world, cfg.num_experts, cfg.hidden, m, cfg.topk, cfg.dtype, cfg.fp8_dispatch,
                                     torch.device("cuda"))
    try:
        for T in token_classes(m):
            recorder.label = f"prefill T={T}"
            ins = [_inputs(cfg, T, r) for r in range(world)]
            ds = _drive(groups, lambda r, ph: bufs[r].dispatch(*ins[r], phase=ph),
                        lambda r, ph: bufs[r].dispatch(phase=ph))
            _prefill_combine(groups, bufs, ds, cfg)
        if world > 1:
            recorder.label = "prefill abort"
            x, idx, w = _inputs(cfg, 1)
            _abort(groups, lambda r: bufs[r].dispatch(_bad_x(cfg), idx, w, phase="send"))
            recorder.label = "prefill drain"
            ins = [_inputs(cfg, 1, r) for r in range(world)]
            ds = _drive(groups, lambda r, ph: bufs[r].dispatch(*ins[r], phase=ph),
                        lambda r, ph: bufs[r].dispatch(phase=ph))
            _prefill_combine(groups, bufs, ds, cfg)
    finally:
        for b in reversed(bufs):
            b.close()


def _prefill_combine(groups, bufs, ds, cfg: WarmupConfig) -> None:
    """Every rank's combine of dispatch results ``ds``: expert_out is the landing zone itself (in place), or
    with fp8 rows a dtype tensor of its shape."""
    outs = [d.recv_x if not cfg.fp8_dispatch else torch.empty(d.recv_x.shape, dtype=cfg.dtype) for d in ds]
    _drive(groups, lambda r, ph: bufs[r].combine(outs[r], ds[r].handle, phase=ph),
           lambda r, ph: bufs[r].combine(phase=ph))


def _record_a2a(recorder: _Recorder, groups, cfg: WarmupConfig) -> None:
    from .alltoallv import AllToAllvDynamic  # noqa: PLC0415
    from .planner import plan_alltoallv  # noqa: PLC0415
    world, cap = len(groups), cfg.a2a_rows or cfg.max_tokens * cfg.topk
    ops = [AllToAllvDynamic(g, cap, (cfg.hidden,), cfg.dtype) for g in groups]
    for op in ops:
        op.plan = plan_alltoallv(world, cap, (cfg.hidden,), cfg.dtype, torch.device("cuda"))
    def round_trip(n):
        counts = torch.zeros(world, dtype=torch.int32)
        counts[0] = min(n, cap)
        sends = [torch.zeros(n, cfg.hidden, dtype=cfg.dtype) for _ in groups]
        res = _drive(groups, lambda r, ph: ops[r](sends[r], counts, phase=ph), lambda r, ph: ops[r](phase=ph))
        _drive(groups, lambda r, ph: ops[r].combine(res[r].recv, res[r].handle, phase=ph),
               lambda r, ph: ops[r].combine(phase=ph))

    try:
        for n in token_classes(cap):   # N: rows of a call's send (the kernels take it as an integer)
            recorder.label = f"a2a N={n}"
            round_trip(n)
        if world > 1:
            recorder.label = "a2a abort"
            _abort(groups, lambda r: ops[r](torch.zeros(1, cfg.hidden + 1, dtype=cfg.dtype),
                                            torch.zeros(world, dtype=torch.int32), phase="send"))
            recorder.label = "a2a drain"
            round_trip(1)
    finally:
        for op in reversed(ops):
            op.close()


def _drive(groups, send, recv) -> list:
    """Every rank's send phase, then every rank's receive phase (a loopback world); the receives' results."""
    for r in range(len(groups)):
        send(r, "send")
    return [recv(r, "recv") for r in range(len(groups))]


def _abort(groups, bad_send) -> None:
    """Every rank refuses its input: each aborts the call (nobody waits, the group stays usable)."""
    for r in range(len(groups)):
        try:
            bad_send(r)
        except (TypeError, ValueError):
            continue
        raise AssertionError("a refused input was accepted")


RECORDERS = dict(ep=_record_ep, prefill=_record_prefill, a2a=_record_a2a)


def record(cfg: WarmupConfig, arch: int | None = None, compile_now: bool = False) -> _Recorder:
    """The variants ``cfg``'s ops launch (``_Recorder.variants``, by Triton's key), recorded on a CPU
    loopback world. ``compile_now``: also compile each one as it is met, with the launch's own arguments
    (what the first steps of a serving process compile; ``_Recorder.compile_s``)."""
    from .group import init  # noqa: PLC0415
    _check_compilable()
    recorder = _Recorder(compile_now)
    with target_driver(arch or default_arch()), _recording(recorder):
        for op in cfg.ops:
            groups = init(backend="loopback", world_size=cfg.world, device="cpu", timeout_s=cfg.timeout_s,
                          trace=cfg.trace)
            try:
                RECORDERS[op](recorder, groups, cfg)
            finally:
                for g in groups:
                    g.close()
    return recorder


def _check_compilable() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("TRITON_INTERPRET=1 makes every kernel interpreted, so nothing can be compiled: unset "
                           "it (or set 0) to warm the cache")


# ---- compiling -----------------------------------------------------------------------------------

def _compile_in_worker(variant: Variant, arch: int, cache_dir: str | None) -> tuple[str, float]:
    if cache_dir:
        os.environ["TRITON_CACHE_DIR"] = cache_dir
    with target_driver(arch):
        return variant.key, variant.compile()


def compile_variants(variants: list[Variant], arch: int, jobs: int, cache_dir: str | None = None) -> dict[str, float]:
    """Compile every variant into the cache, ``jobs`` processes at a time; CPU seconds per variant key."""
    if jobs <= 1 or len(variants) <= 1:
        return dict(_compile_in_worker(v, arch, cache_dir) for v in variants)
    import multiprocessing  # noqa: PLC0415
    from concurrent.futures import ProcessPoolExecutor  # noqa: PLC0415
    # Spawned workers: a forked one would inherit this process's Triton and torch state (threads, locks).
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(_compile_in_worker, v, arch, cache_dir) for v in variants]
        return dict(f.result() for f in futures)


def cache_dir() -> str:
    """Triton's cache directory for this process (TRITON_CACHE_DIR, else its default)."""
    import triton  # noqa: PLC0415
    return triton.knobs.cache.dir


def cached_kernels(path: str) -> int:
    """Compiled kernels in a Triton cache directory (one ``__grp__*.json`` file each)."""
    if not os.path.isdir(path):
        return 0
    return sum(1 for entry in os.scandir(path) if entry.is_dir()
               for f in os.listdir(entry.path) if f.startswith("__grp__"))


@dataclass
class WarmupReport:
    """What ``warmup`` did."""

    config: dict               # the WarmupConfig, as plain values
    arch: int                  # the target's compute capability
    cache_dir: str
    variants: int              # distinct kernel variants the configuration launches
    kernels: dict              # kernel name -> its variants
    compiled: int              # new entries in the cache (0: everything was there already)
    record_s: float            # finding the variants (the ops driven on the CPU, nothing launched), wall
    compile_s: float           # wall time of the parallel compile
    compile_cpu_s: float       # CPU seconds of the compiles summed (one process on an idle core takes about this)
    slowest: list              # the five slowest variants: (kernel, label, CPU seconds)
    jobs: int
    load_avg: float            # the machine's 1-minute load average when the compile ended (wall times stretch
    #                            with it on a shared machine; CPU seconds do not)


def warmup(cfg: WarmupConfig, arch: int | None = None, jobs: int | None = None,
           cache: str | None = None) -> WarmupReport:
    """Compile every kernel variant ``cfg`` launches (module docstring) into Triton's cache (``cache``, else
    TRITON_CACHE_DIR / Triton's default), ``jobs`` processes in parallel (default: the CPUs), for ``arch``
    (default: this machine's GPU, else sm_90). Returns a WarmupReport; raises if a compile fails."""
    arch = arch or default_arch()
    jobs = jobs or os.cpu_count() or 1
    if cache:
        os.environ["TRITON_CACHE_DIR"] = cache
    where = cache_dir()
    before = cached_kernels(where)
    t0 = time.perf_counter()
    variants = list(record(cfg, arch).variants.values())
    t1 = time.perf_counter()
    seconds = compile_variants(variants, arch, jobs, cache)
    t2 = time.perf_counter()
    kernels: dict[str, int] = {}
    for v in variants:
        kernels[v.kernel] = kernels.get(v.kernel, 0) + 1
    slow = sorted(variants, key=lambda v: -seconds[v.key])[:5]
    return WarmupReport(config=config_dict(cfg), arch=arch, cache_dir=where, variants=len(variants), kernels=kernels,
                        compiled=cached_kernels(where) - before, record_s=t1 - t0, compile_s=t2 - t1,
                        compile_cpu_s=sum(seconds.values()),
                        slowest=[(v.kernel, v.label, round(seconds[v.key], 2)) for v in slow], jobs=jobs,
                        load_avg=os.getloadavg()[0])


def config_dict(cfg: WarmupConfig) -> dict:
    """``cfg`` as plain JSON values (dtypes by name)."""
    return {k: (str(v).replace("torch.", "") if isinstance(v, torch.dtype) else v)
            for k, v in dataclasses.asdict(cfg).items()}


# ---- command line ----------------------------------------------------------------------------------

def config_from_args(a: argparse.Namespace) -> WarmupConfig:
    """A WarmupConfig from the options below (``--model`` fills the widths it is not given)."""
    from .serving.configs import model_config  # noqa: PLC0415
    m = model_config(a.model, "cuda")   # the real widths
    return WarmupConfig(
        world=a.world, num_experts=a.experts or m.num_experts, hidden=a.hidden or m.hidden, topk=a.topk or m.topk,
        max_tokens=a.max_tokens, dtype=getattr(torch, a.dtype), fp8_dispatch=a.fp8_dispatch, ops=tuple(a.ops.split(",")),
        prefill_tokens=a.prefill_tokens, a2a_rows=a.a2a_rows, index_dtype=getattr(torch, a.index_dtype),
        trace=_trace_calls(a.trace), timeout_s=a.timeout_s)


def _trace_calls(option) -> int:
    from .trace.recorder import trace_calls  # noqa: PLC0415
    return trace_calls(option)


def add_config_args(p: argparse.ArgumentParser) -> None:
    """The configuration options (shared with bench/cold_start.py)."""
    from .serving.configs import CONFIG_NAMES  # noqa: PLC0415
    p.add_argument("--model", default="deepseek-v3", choices=CONFIG_NAMES,
                   help="widths (experts, hidden, top-k) of this model at its real size (default deepseek-v3)")
    p.add_argument("--world", type=int, default=8, help="ranks of the deployment (default 8)")
    p.add_argument("--experts", type=int, help="number of experts (default: the model's)")
    p.add_argument("--hidden", type=int, help="hidden size (default: the model's)")
    p.add_argument("--topk", type=int, help="experts per token (default: the model's)")
    p.add_argument("--max-tokens", type=int, default=128, help="EPBuffer max_tokens_per_rank (default 128)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--fp8-dispatch", action="store_true", help="the buffers use fp8_dispatch=True")
    p.add_argument("--ops", default="ep", help=f"comma separated subset of {','.join(OPS)} (default ep)")
    p.add_argument("--prefill-tokens", type=int, default=4096, help="PrefillBuffer max_tokens_per_rank")
    p.add_argument("--a2a-rows", type=int, default=0, help="AllToAllvDynamic max_rows_per_peer (0: max_tokens*topk)")
    p.add_argument("--index-dtype", default="int64", choices=("int64", "int32"), help="dtype of topk_idx")
    p.add_argument("--trace", default=None,
                   help="flight recorder as the servers run it (default: MOE_COMM_TRACE of this process)")
    p.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="moe-comm warmup", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p)
    p.add_argument("--arch", type=int, help="compute capability to compile for (default: this GPU's, else 90)")
    p.add_argument("--jobs", type=int, help="compiling processes (default: the CPUs)")
    p.add_argument("--cache-dir", help="Triton cache directory to fill (default: TRITON_CACHE_DIR or Triton's)")
    p.add_argument("--list", action="store_true", help="only list the variants (nothing is compiled)")
    p.add_argument("--json", action="store_true", help="the report as one JSON object")
    a = p.parse_args(argv)
    try:
        cfg = config_from_args(a)
    except ValueError as e:
        p.error(str(e))
    if a.list:
        variants = list(record(cfg, a.arch).variants.values())
        for v in variants:
            print(json.dumps(dict(kernel=v.kernel, module=v.module, label=v.label, key=v.key)) if a.json
                  else f"{v.kernel:<32} {v.label}")
        if not a.json:
            print(f"{len(variants)} variants")
        return 0
    rep = warmup(cfg, a.arch, a.jobs, a.cache_dir)
    if a.json:
        print(json.dumps(dataclasses.asdict(rep)))
        return 0
    print(f"warmup: {rep.variants} kernel variants of {', '.join(cfg.ops)} at world {cfg.world} for sm_{rep.arch}: "
          f"{rep.compiled} compiled into {rep.cache_dir} (the rest were cached) in {rep.compile_s:.1f} s with "
          f"{rep.jobs} processes ({rep.compile_cpu_s:.1f} CPU s of compiling; finding them {rep.record_s:.1f} s; "
          f"load average {rep.load_avg:.1f})")
    for kernel, n in sorted(rep.kernels.items()):
        print(f"  {kernel:<32} {n} variants")
    return 0


if __name__ == "__main__":
    sys.exit(main())
