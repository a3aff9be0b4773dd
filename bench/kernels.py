"""Kernel benchmarks: the floor first, then every op against the floor and against its peers (world 1).

    python bench/kernels.py [--out-dir bench/results]      # a GPU: full sizes
    python bench/kernels.py --dry [--out-dir DIR]          # no GPU: tiny sizes in Triton's interpreter
    python bench/kernels.py --host                         # host cost of an eager call, launches stubbed
                                                           # (CPU or GPU; bench/host_cost.py says what)

1. Floor: device-to-device copy bandwidth (bytes read + written, one large buffer) and the time of an
   empty Triton kernel (one launch). An op that must move B bytes cannot beat B / bandwidth + 1 launch.
2. AllToAllvDynamic (world 1, rows of ``hidden`` bf16) vs torch.ops.symm_mem.all_to_all_vdev (separate
   process: torch brings its own NVSHMEM) and NCCL all_to_all_single with host-read splits.
3. EPBuffer dispatch / combine (bf16, fp8 and, when hidden % 512 == 0, fp8 with packed UE8M0 scales
   (dtype "fp8-ue8m0"); EP=1) vs a pure-torch permute / unpermute. Each op is one call (phase="both") on
   whichever heap; the dispatch split into its phases is timed on a line of its own (impl
   ``moe_comm_split_phases``: at world 1 its send copies x and topk_idx, NOTES 20).
4. ep_emulated: the multi-rank path (send kernel + receive kernel per rank) on one GPU: a loopback world
   of --emulated-world ranks (GPU 8), every rank's phases run one after another on this GPU (replayed
   from a CUDA graph). It times the kernels of the EP>1 path at DeepSeek-V3 shapes, not a network: the
   floor is every rank's payload bytes at copy bandwidth plus two launches per rank. A concurrent
   variant (impl ``..._concurrent``) runs each rank's phases on its own CUDA stream (in turn on a CPU).
5. prefill: PrefillBuffer (high-throughput, rank-major) per-rank emulation, as ep_emulated: a loopback
   world of --prefill-world ranks (GPU 8) with --prefill-tokens per rank (GPU 4096) on one device, every
   rank's dispatch (bf16, fp8) and combine (bf16; in place after the bf16 dispatch) phases; GB/s of the
   link-side bytes (what crosses to other ranks: ``PrefillPlan.dispatch_link_bytes`` /
   ``combine_link_bytes``); the floor is the HBM bytes the emulation reads and writes on the one device
   at copy bandwidth plus the launches.
7. formats (only when named in --sections): the low-precision formats (docs/formats.md) against bf16 at
   --format-tokens (GPU 1,128,4096): EPBuffer at world 1 (dispatch bf16 / e4m3 / nvfp4, combine bf16 /
   e4m3), and PrefillBuffer's emulated world (--prefill-world ranks) at the largest of them. Bytes are
   each format's payload (``format_bytes``).
6. ep_rank (only when named in --sections): one real rank of EP-N (--rank-worlds, GPU 8,16,32,64) at
   full size; the other N-1 ranks' contributions are staged once and signalled per call by a small
   peer-emulator kernel (bench/ep_rank.py). Per-rank µs (the emulator's own time subtracted, and
   reported on its own line), this rank's HBM bytes, x (bytes / copy bandwidth + one launch), uniform
   and skewed routing.

Every line (JSON) carries op, impl, sizes, p20/p50/p80 µs, GB/s (floor bytes / p50), the floor in µs
and p50 / floor, plus device, versions and commit. A PNG and a table are written next to the lines.
A --dry run only proves the script's logic; its numbers are labelled and mean nothing about a GPU.
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import tempfile
import time
import traceback

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch

import moe_comm
import triton
from moe_comm.interpreter import kernel_for
from bench import peers
from bench.common import DRY_LABEL, JsonLines, environment, l2_bytes, percentiles, read_jsonl, time_us

GPU_SIZES = [1, 8, 64, 128, 512, 2048]
SECTIONS = ("floor", "a2a", "ep", "ep_emulated", "prefill", "ep_rank", "permute", "nccl", "vdev", "formats")
# ep_rank runs when named: its GPU sweep compiles ~120 kernel variants (scripts/gpu_check.sh runs it as a
# step of its own, so that its length cannot cut the other sections short).
DEFAULT_SECTIONS = tuple(s for s in SECTIONS if s not in ("ep_rank", "formats"))
DRY_SIZES = [1, 5]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry", action="store_true", help="CPU: tiny shapes, interpreter, a few iterations")
    p.add_argument("--host", action="store_true",
                   help="only the host cost of an eager call of every op, Triton's launch stubbed (bench/host_cost.py; "
                        "CPU or GPU; sizes DeepSeek-V3, T 16, world 1 and loopback 8; --iters 1000, --warmup 20)")
    p.add_argument("--metrics", action="store_true",
                   help="with --host: moe_comm.metrics' exporter serving (not scraped) while the calls are timed")
    p.add_argument("--out-dir", help="where the .jsonl and .png go (default bench/results; --dry: a temp dir)")
    p.add_argument("--sections", default=",".join(DEFAULT_SECTIONS),
                   help=f"comma separated subset of {','.join(SECTIONS)} (default: all but ep_rank)")
    p.add_argument("--emulated-world", type=int, help="ranks of the ep_emulated section (GPU 8; dry 2)")
    p.add_argument("--emulated-tokens", type=lambda s: [int(x) for x in s.split(",")],
                   help="tokens per rank in the ep_emulated section (GPU 1,128; dry 3)")
    sizes = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--prefill-world", type=int, help="ranks of the prefill section (GPU 8; dry 2)")
    p.add_argument("--prefill-tokens", type=sizes, help="tokens per rank in the prefill section (GPU 4096; dry 3)")
    p.add_argument("--rank-worlds", type=sizes, help="EP sizes of the ep_rank section (GPU 8,16,32,64; dry 2,4)")
    p.add_argument("--rank-tokens", type=sizes, help="T per rank in the ep_rank section (GPU 1,8,32,128,512; dry 1,3)")
    p.add_argument("--rank-routings", default="uniform,skewed", help="routings of the ep_rank section")
    p.add_argument("--a2a-rows", type=sizes, help=f"rows per call (GPU {GPU_SIZES})")
    p.add_argument("--format-tokens", type=sizes, help="T of the formats section (GPU 1,128,4096; dry 1,3)")
    p.add_argument("--tokens", type=sizes, help=f"T for dispatch/combine (GPU {GPU_SIZES})")
    p.add_argument("--hidden", type=int, help="row width (GPU 7168; dry 256)")
    p.add_argument("--experts", type=int, help="experts (GPU 256; dry 16)")
    p.add_argument("--topk", type=int, help="top-k (GPU 8; dry 4)")
    p.add_argument("--max-tokens", type=int, default=0,
                   help="EPBuffer max_tokens_per_rank (0: equal to each T, the smallest buffer)")
    p.add_argument("--iters", type=int, help="timed calls per point (GPU 200; dry 3)")
    p.add_argument("--warmup", type=int, help="untimed calls first (GPU 20; dry 1)")
    p.add_argument("--tag", default="", help="label stored in every line (e.g. the change being measured)")
    p.add_argument("--child-vdev", metavar="JSONL", help=argparse.SUPPRESS)  # internal: the vdev process
    p.add_argument("--floor", type=float, nargs=2, metavar=("GBPS", "LAUNCH_US"), help=argparse.SUPPRESS)
    o = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not o.dry
    if o.dry and torch.cuda.is_available():
        p.error("--dry is for machines without a GPU (it labels its numbers as not GPU measurements)")
    if o.dry and o.host:
        p.error("--host measures the host on any machine: run it without --dry")
    if not cuda and not o.dry and not o.host:
        p.error("no GPU here: use --dry (CPU interpreter, tiny shapes, labelled dry run)")
    host = dict(tokens=[16], hidden=7168, experts=256, topk=8, iters=1000, warmup=20)
    gpu = dict(a2a_rows=GPU_SIZES, tokens=GPU_SIZES, hidden=7168, experts=256, topk=8, iters=200, warmup=20,
               emulated_world=8, emulated_tokens=[1, 128], prefill_world=8, prefill_tokens=[4096],
               rank_worlds=[8, 16, 32, 64], format_tokens=[1, 128, 4096],
               rank_tokens=[1, 8, 32, 128, 512])
    dry = dict(a2a_rows=DRY_SIZES, tokens=DRY_SIZES, hidden=256, experts=16, topk=4, iters=3, warmup=1,
               emulated_world=2, emulated_tokens=[3], prefill_world=2, prefill_tokens=[3], rank_worlds=[2, 4],
               format_tokens=[1, 3],
               rank_tokens=[1, 3])
    for k, v in (host if o.host else {}).items():
        if getattr(o, k) is None:
            setattr(o, k, v)
    for k, v in (gpu if cuda else dry).items():
        if getattr(o, k) is None:
            setattr(o, k, v)
    o.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if o.dry or (o.host and not cuda):
        torch.set_num_threads(1)  # tiny CPU ops: a 2-thread pool only adds wake-up latency (index_add_: 0.1 s)
    o.sections = o.sections.split(",")
    o.rank_routings = o.rank_routings.split(",")
    if o.hidden % 128:
        p.error("--hidden must be a multiple of 128 (fp8 dispatch scales 128 columns each)")
    return o


# ---- floor ---------------------------------------------------------------------------------------

@triton.jit
def empty_kernel(x_ptr):
    pass


def measure_floor(o, out: JsonLines) -> tuple[float, float]:
    """(copy GB/s counting read + write, empty-kernel µs); both p50."""
    n = (1 << 30) if o.device.type == "cuda" else (8 << 20)
    src = torch.randint(-2**31, 2**31 - 1, (n // 4,), dtype=torch.int32, device=o.device)
    dst = torch.empty_like(src)
    copy = time_us(lambda i: dst.copy_(src), o.device, o.iters, o.warmup)
    gbps = 2 * n / (copy["p50_us"] * 1e3)
    out.write(kind="floor", op="copy", impl="torch.copy_", bytes=2 * n, GBps=gbps, **copy)
    kernel = kernel_for(empty_kernel, src.device)
    launch = time_us(lambda i: kernel[(1,)](src), o.device, o.iters, o.warmup)
    out.write(kind="floor", op="empty_kernel", impl="triton", bytes=0, **launch)
    print(f"floor: copy {gbps:.0f} GB/s (read + write), empty kernel {launch['p50_us']:.2f} µs")
    return gbps, launch["p50_us"]


def result(out: JsonLines, floor, op, impl, bytes_moved, timing, launches: int = 1, **sizes) -> dict:
    gbps, launch_us = floor
    floor_us = bytes_moved / (gbps * 1e3) + launches * launch_us
    return out.write(kind="result", op=op, impl=impl, bytes=bytes_moved, GBps=bytes_moved / (timing["p50_us"] * 1e3),
                     floor_us=floor_us, x_floor=timing["p50_us"] / floor_us,
                     pct_of_floor=100.0 * floor_us / timing["p50_us"], **sizes, **timing)


# ---- moe-comm ops at world 1 ---------------------------------------------------------------------

def world1_group(device: torch.device):
    """nvshmem heap on a GPU (as a user would run world 1); loopback otherwise (CPU, or no nvshmem4py)."""
    if device.type == "cuda":
        try:
            return moe_comm.init(backend="nvshmem", timeout_s=30.0)
        except ImportError as e:
            print(f"nvshmem heap unavailable ({e}); using the loopback heap at world 1")
    return moe_comm.init(backend="loopback", world_size=1, device=device, timeout_s=30.0)[0]


def drive(call, group, *args, **kw):
    """Call an op as its users do: ``phase="both"`` wherever the group allows it (every heap at world 1),
    else phase by phase (a loopback world of several ranks: send, then recv with no tensors). A world-1
    dispatch split into phases is another call: its send copies x and topk_idx (two more kernels, see
    ``bench_ep``), so world 1 is never split here, whichever heap the machine has."""
    if group.backend != "loopback" or group.world_size == 1:
        return call(*args, **kw)
    call(*args, phase="send", **kw)
    return call(*([None] * len(args)), phase="recv", **kw)


def bench_a2a(o, out, floor, group):
    dtype, h = torch.bfloat16, o.hidden
    for n in o.a2a_rows:
        op = moe_comm.AllToAllvDynamic(group, n, (h,), dtype)
        send = torch.randn(n, h, device=o.device).to(dtype)
        counts = torch.tensor([n], dtype=torch.int32, device=o.device)
        res = drive(op, group, send, counts)
        group.check()
        assert torch.equal(res.recv[0, :n], send), "AllToAllvDynamic returned wrong rows"
        t = time_us(lambda i: drive(op, group, send, counts), o.device, o.iters, o.warmup)
        group.check()
        result(out, floor, "alltoallv", "moe_comm", 2 * n * h * 2, t, rows=n, hidden=h, dtype="bf16",
               heap=group.backend)
        op.close()


# Dispatch formats of the EP=1 section: (dispatch_format, the lines' dtype, scale bytes per 128 columns).
EP_FORMATS = ((None, "bf16", 0), ("e4m3", "fp8", 4), ("e4m3-ue8m0", "fp8-ue8m0", 1))


def ep_bytes(op: str, t: int, h: int, k: int, fp8, scale_bytes: int = 4) -> int:
    """Least bytes an EP=1 op must move (payload only): dispatch reads x [T, H] and writes T*K rows
    (fp8: H bytes + H/128 scales of ``scale_bytes`` each: 4 float32, 1 packed UE8M0); combine reads T*K
    expert rows and writes y [T, H]."""
    if op == "dispatch":
        return t * h * 2 + t * k * ((h + scale_bytes * (h // 128)) if fp8 else 2 * h)
    return t * k * h * 2 + t * h * 2


def ep_class():
    try:
        from moe_comm.ep import EPBuffer  # noqa: PLC0415
    except ImportError:
        return None
    return EPBuffer


def bench_ep(o, out, floor, group):
    EPBuffer = ep_class()
    if EPBuffer is None:
        out.write(kind="skip", op="dispatch/combine", impl="moe_comm", reason="moe_comm.ep.EPBuffer not available")
        print("skip dispatch/combine: moe_comm.ep.EPBuffer not available in this checkout")
        return
    h, e, k = o.hidden, o.experts, o.topk
    gen = torch.Generator().manual_seed(0)
    for fp8, dtype, scale_bytes in EP_FORMATS:
        if fp8 == "e4m3-ue8m0" and h % 512:
            continue   # packed UE8M0 takes whole words of four 128-column groups
        for t in o.tokens:
            cap = o.max_tokens or max(1, t)
            ep = EPBuffer(group, e, h, cap, k, dtype=torch.bfloat16, dispatch_format=fp8)
            x = torch.randn(t, h, generator=gen).to(torch.bfloat16).to(o.device)
            idx = peers.random_topk(t, e, k, gen).to(o.device)
            w = torch.rand(t, k, generator=gen).to(o.device)
            d = drive(ep.dispatch, group, x, idx)
            group.check()
            want = torch.bincount(idx.reshape(-1).cpu(), minlength=e).to(torch.int32)
            assert torch.equal(d.counts.cpu(), want), "dispatch counts differ from the routing"
            sizes = dict(tokens=t, hidden=h, experts=e, topk=k, max_tokens=cap, dtype=dtype, heap=group.backend)
            td = time_us(lambda i: drive(ep.dispatch, group, x, idx), o.device, o.iters, o.warmup)
            dbytes = ep_bytes("dispatch", t, h, k, fp8, scale_bytes)
            result(out, floor, "dispatch", "moe_comm", dbytes, td, phases="both", **sizes)
            # The same dispatch split into phases (what a loopback world is driven with): at world 1 its
            # send copies x and topk_idx so that the caller may reuse them, 3 launches instead of 1.
            tsplit = time_us(lambda i: ep.dispatch(x, idx, phase="send") or ep.dispatch(phase="recv"), o.device,
                             o.iters, o.warmup)
            result(out, floor, "dispatch", "moe_comm_split_phases", dbytes, tsplit, phases="split", **sizes)
            d = drive(ep.dispatch, group, x, idx)
            expert_out = d.x.to(torch.bfloat16)  # rows past the counts are never read
            tc = time_us(lambda i: drive(ep.combine, group, expert_out, w, d.handle), o.device, o.iters, o.warmup)
            group.check()
            result(out, floor, "combine", "moe_comm", ep_bytes("combine", t, h, k, fp8), tc, phases="both", **sizes)
            del d, expert_out
            if hasattr(ep, "close"):
                ep.close()
            del ep
            if o.device.type == "cuda":
                torch.cuda.empty_cache()


def graphed(fn, device: torch.device):
    """On a GPU, ``fn`` captured once in a CUDA graph and replayed: the emulated world launches 2 kernels
    per rank, and timing them eagerly would time Python launching them."""
    if device.type != "cuda":
        return fn
    fn(0)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()   # the eager call's cached temporaries: the capture's private pool needs its own
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(0)
    return lambda i: graph.replay()


def rank_streams(device: torch.device, world: int):
    """One CUDA stream per rank of a loopback world (``concurrent``); None on a CPU, where the ranks'
    phases run in turn (the interpreter runs one program at a time: a receive would wait forever)."""
    return [torch.cuda.Stream(device) for _ in range(world)] if device.type == "cuda" else None


def run_phases(streams, sends, recvs) -> list:
    """Every rank's send phase ``sends[i]()``, then every rank's receive phase ``recvs[i]()``; returns the
    receives' results in rank order.

    streams None: in turn, on the current stream. Else rank i's phases run on ``streams[i]``: the sends
    of all ranks concurrently, then the receives concurrently, each receive after an event of every
    rank's send. The flags alone would order a receive after its peers' sends, but a receive spinning
    on them may hold the SMs a peer's send needs (nothing guarantees the sends are scheduled first), so
    the events keep every wait short. Forks from and joins into the current stream (graph capture).
    """
    if streams is None:
        for send in sends:
            send()
        return [recv() for recv in recvs]
    main = torch.cuda.current_stream()
    fork = torch.cuda.Event()
    fork.record(main)
    sent = []
    for stream, send in zip(streams, sends):
        stream.wait_event(fork)
        with torch.cuda.stream(stream):
            send()
            sent.append(torch.cuda.Event())
            sent[-1].record(stream)
    results = []
    for stream, recv in zip(streams, recvs):
        with torch.cuda.stream(stream):
            for event in sent:
                stream.wait_event(event)
            results.append(recv())
            joined = torch.cuda.Event()
            joined.record(stream)
        main.wait_event(joined)
    return results


def bench_ep_emulated(o, out, floor):
    """Every rank's send phase, then every rank's receive phase, on one device (loopback world): in turn,
    and concurrently (each rank on its own stream, ``run_phases``)."""
    EPBuffer = ep_class()
    world = o.emulated_world
    groups = moe_comm.init(backend="loopback", world_size=world, device=o.device, timeout_s=30.0)
    gen = torch.Generator().manual_seed(2)
    for concurrent in (False, True):
        impl = f"moe_comm_emulated_w{world}" + ("_concurrent" if concurrent else "")
        streams = rank_streams(o.device, world) if concurrent else None
        how = "one per rank" if streams else "one (no CUDA: ranks in turn)" if concurrent else "one"
        for fp8 in (False, True):
            for t in o.emulated_tokens:
                bench_emulated_point(o, out, floor, EPBuffer, groups, gen, impl, streams, how, fp8, t)


def bench_emulated_point(o, out, floor, EPBuffer, groups, gen, impl, streams, how, fp8, t):
    """One (dtype, T) point of ep_emulated: check the counts, time dispatch and combine of every rank."""
    world, h, e, k = len(groups), o.hidden, o.experts, o.topk
    eps = [EPBuffer(g, e, h, t, k, dtype=torch.bfloat16, fp8_dispatch=fp8) for g in groups]
    xs = [torch.randn(t, h, generator=gen).to(torch.bfloat16).to(o.device) for _ in groups]
    idxs = [peers.random_topk(t, e, k, gen).to(o.device) for _ in groups]
    ws = [torch.rand(t, k, generator=gen).to(o.device) for _ in groups]

    def dispatch_all(i):
        return run_phases(streams, [lambda ep=ep, x=x, idx=idx: ep.dispatch(x, idx, phase="send")
                                    for ep, x, idx in zip(eps, xs, idxs)],
                          [lambda ep=ep: ep.dispatch(phase="recv") for ep in eps])

    ds = dispatch_all(0)
    got = torch.stack([d.counts.cpu() for d in ds]).reshape(-1)
    want = torch.bincount(torch.cat(idxs).reshape(-1).cpu(), minlength=e).to(torch.int32)
    assert torch.equal(got, want), "emulated dispatch counts differ from the routing"
    sizes = dict(tokens=t, world=world, hidden=h, experts=e, topk=k, max_tokens=t,
                 dtype="fp8" if fp8 else "bf16", heap="loopback (emulated on one device)",
                 streams=how)
    td = time_us(graphed(dispatch_all, o.device), o.device, o.iters, o.warmup)
    result(out, floor, "dispatch", impl, world * ep_bytes("dispatch", t, h, k, fp8), td,
           launches=2 * world, **sizes)
    ds = dispatch_all(0)
    outs = [d.x.to(torch.bfloat16) for d in ds]  # rows past the counts are never read

    def combine_all(i):
        return run_phases(streams, [lambda ep=ep, eo=eo, w=w, d=d: ep.combine(eo, w, d.handle, phase="send")
                                    for ep, eo, w, d in zip(eps, outs, ws, ds)],
                          [lambda ep=ep: ep.combine(phase="recv") for ep in eps])

    tc = time_us(graphed(combine_all, o.device), o.device, o.iters, o.warmup)
    for g in groups:
        g.check()
    result(out, floor, "combine", impl, world * ep_bytes("combine", t, h, k, fp8), tc,
           launches=2 * world, **sizes)
    for ep in reversed(eps):
        ep.close()
    del ds, outs, eps
    if o.device.type == "cuda":
        torch.cuda.empty_cache()


# ---- prefill: PrefillBuffer, per-rank emulation ---------------------------------------------------------

PREFILL_SPIN_CYCLES = 20_000_000   # ~10 ms GPU spin before each timed round: the host enqueues every rank's
                                   # phases meanwhile (4 launches per rank), so its Python is not timed


def time_round(first, second, device: torch.device, iters: int, warmup: int) -> tuple[dict, dict]:
    """Device time of ``first(i)`` and of ``second(i)`` run back to back (a dispatch must be answered by its
    combine before the next one, so they are timed in one loop): two dicts as ``time_us`` gives. GPU:
    three CUDA events per round, after an L2 flush and a spin outside them; CPU: ``time.perf_counter``."""
    for i in range(warmup):
        first(i)
        second(i)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        flush = torch.empty(max(2 * l2_bytes(device), 256 << 20) // 4, dtype=torch.int32, device=device)
    a, b, events = [], [], []
    for i in range(iters):
        if cuda:
            flush.fill_(i)
            torch.cuda._sleep(PREFILL_SPIN_CYCLES)
            events.append([torch.cuda.Event(enable_timing=True) for _ in range(3)])
            events[-1][0].record()
            first(warmup + i)
            events[-1][1].record()
            second(warmup + i)
            events[-1][2].record()
        else:
            t0 = time.perf_counter()
            first(warmup + i)
            t1 = time.perf_counter()
            second(warmup + i)
            a.append((t1 - t0) * 1e6)
            b.append((time.perf_counter() - t1) * 1e6)
    if cuda:
        torch.cuda.synchronize(device)
        a = [e[0].elapsed_time(e[1]) * 1e3 for e in events]
        b = [e[1].elapsed_time(e[2]) * 1e3 for e in events]
    return percentiles(a), percentiles(b)


def prefill_destinations(idx: torch.Tensor, num_experts: int, world: int) -> torch.Tensor:
    """bool [T, world]: the ranks holding one of each token's experts (ids in [0, E); -1 not routed)."""
    owner = torch.where(idx >= 0, idx // (num_experts // world), world)
    hit = torch.zeros(idx.shape[0], world + 1, dtype=torch.bool, device=idx.device)
    hit.scatter_(1, owner, True)
    return hit[:, :world]


def prefill_bytes(plan, idxs, num_experts: int, fp8: bool) -> dict:
    """Bytes of one round of an emulated world (sums over ranks). link_*: what crosses to other ranks
    (the plan's count: payload once per (token, remote destination rank), plus ids, weights and control
    words; floor_pairs: those pairs alone). hbm_*: what the one device reads and writes for it: the
    dispatch reads each routed token once and writes its row at every destination, itself included,
    plus ids and weights to every rank; the combine reads one partial row per (token, destination)
    and writes y, and with an fp8 dispatch (``expert_out`` is not ``recv_x``) its send first copies
    those rows into the zone."""
    world, ep = plan.world, plan.ep
    row_in, row_out = ep.hidden * 2, 4 * (ep.x_words + ep.scale_words)
    meta = 8 * ep.topk
    b = dict(link_dispatch=0, link_combine=0, floor_pairs=0, hbm_dispatch=0, hbm_combine=0)
    for r, idx in enumerate(idxs):
        dest = prefill_destinations(idx, num_experts, world)
        pairs_all, remote = int(dest.sum()), int(dest.sum() - dest[:, r].sum())
        t, routed = idx.shape[0], int(dest.any(dim=1).sum())
        b["floor_pairs"] += remote
        b["link_dispatch"] += plan.dispatch_link_bytes(remote, t, world - 1)
        b["link_combine"] += plan.combine_link_bytes(remote)
        b["hbm_dispatch"] += routed * row_in + pairs_all * row_out + t * world * meta
        copies = 3 if fp8 else 1   # the send's read and write of each partial row, then the receive's read
        b["hbm_combine"] += copies * pairs_all * 4 * ep.out_words + t * row_in
    return b


def prefill_result(out: JsonLines, floor, op, impl, link_bytes: int, hbm_bytes: int, timing, launches: int,
                   **sizes) -> dict:
    """A result line whose GB/s is link-side bytes / p50 and whose floor is the HBM bytes at copy bandwidth
    plus the launches (``result``'s fields, and link_bytes / hbm_bytes)."""
    gbps, launch_us = floor
    floor_us = hbm_bytes / (gbps * 1e3) + launches * launch_us
    return out.write(kind="result", op=op, impl=impl, bytes=link_bytes, hbm_bytes=hbm_bytes,
                     GBps=link_bytes / (timing["p50_us"] * 1e3), floor_us=floor_us,
                     x_floor=timing["p50_us"] / floor_us, pct_of_floor=100.0 * floor_us / timing["p50_us"],
                     **sizes, **timing)


def bench_prefill(o, out, floor):
    """PrefillBuffer dispatch (bf16, fp8) and in-place combine of every rank of a loopback world on one
    device: in turn, and on CUDA concurrently (one stream per rank, ``run_phases``). The first round of
    each point is checked: expert counts against the routing, y against (number of destination ranks)
    x, exact (the experts are the identity: every partial row is the token itself)."""
    world, h, e, k = o.prefill_world, o.hidden, o.experts, o.topk
    groups = moe_comm.init(backend="loopback", world_size=world, device=o.device, timeout_s=30.0)
    gen = torch.Generator().manual_seed(3)
    variants = [(f"moe_comm_emulated_w{world}", None, "one")]
    if o.device.type == "cuda":
        variants.append((f"moe_comm_emulated_w{world}_concurrent", rank_streams(o.device, world), "one per rank"))
    for t in o.prefill_tokens:
        xs = [torch.randn(t, h, generator=gen).to(torch.bfloat16).to(o.device) for _ in groups]
        idxs = [peers.random_topk(t, e, k, gen).to(o.device) for _ in groups]
        ws = [torch.rand(t, k, generator=gen).to(o.device) for _ in groups]
        for impl, streams, how in variants:
            for fp8 in (False, True):
                bufs = [moe_comm.PrefillBuffer(g, e, h, t, k, dtype=torch.bfloat16, fp8_dispatch=fp8) for g in groups]
                bench_prefill_point(o, out, floor, bufs, xs, idxs, ws, impl, streams, how, fp8)
                for b in reversed(bufs):
                    b.close()
                if o.device.type == "cuda":
                    torch.cuda.empty_cache()


def bench_prefill_point(o, out, floor, bufs, xs, idxs, ws, impl, streams, how, fp8):
    world, e, t = len(bufs), o.experts, xs[0].shape[0]
    ds = []

    def dispatch_all(i):
        ds[:] = run_phases(streams, [lambda b=b, x=x, idx=idx, w=w: b.dispatch(x, idx, w, phase="send")
                                     for b, x, idx, w in zip(bufs, xs, idxs, ws)],
                           [lambda b=b: b.dispatch(phase="recv") for b in bufs])

    def combine_all(i):
        # fp8: the partial rows are bf16 anyway (the experts' output), the zone's recv_x is not: a copy
        eos = [d.recv_x if not fp8 else expert_outs[r] for r, d in enumerate(ds)]
        return run_phases(streams, [lambda b=b, eo=eo, d=d: b.combine(eo, d.handle, phase="send")
                                    for b, eo, d in zip(bufs, eos, ds)],
                          [lambda b=b: b.combine(phase="recv") for b in bufs])

    expert_outs = [torch.zeros(bufs[0].plan.rows, o.hidden, dtype=torch.bfloat16, device=o.device)
                   for _ in bufs] if fp8 else None
    dispatch_all(0)
    got = torch.stack([d.expert_counts.cpu() for d in ds]).reshape(-1)
    want = torch.bincount(torch.cat(idxs).reshape(-1).cpu(), minlength=e).to(torch.int32)
    assert torch.equal(got, want), "emulated prefill dispatch counts differ from the routing"
    ys = combine_all(0)
    if not fp8:
        for x, idx, y in zip(xs, idxs, ys):
            n = prefill_destinations(idx, e, world).sum(dim=1, keepdim=True)
            assert torch.equal(y, (x.float() * n).to(torch.bfloat16)), "emulated prefill combine differs"
    for buf in bufs:
        buf.group.check()
    nb = prefill_bytes(bufs[0].plan, idxs, e, fp8)
    sizes = dict(tokens=t, world=world, hidden=o.hidden, experts=e, topk=o.topk, max_tokens=t,
                 dtype="fp8" if fp8 else "bf16", heap="loopback (emulated on one device)", streams=how,
                 floor_pairs=nb["floor_pairs"])
    td, tc = time_round(dispatch_all, combine_all, o.device, o.iters, o.warmup)
    for buf in bufs:
        buf.group.check()
    prefill_result(out, floor, "prefill_dispatch", impl, nb["link_dispatch"], nb["hbm_dispatch"], td, 2 * world,
                   **sizes)
    prefill_result(out, floor, "prefill_combine", impl, nb["link_combine"], nb["hbm_combine"], tc, 2 * world,
                   **dict(sizes, dtype="bf16", dispatch_dtype=sizes["dtype"]))


# ---- formats: nvfp4 / e4m3 dispatch and e4m3 combine against bf16 ------------------------------------------

FORMAT_POINTS = ((None, None), ("e4m3", None), ("nvfp4", None), (None, "e4m3"))   # (dispatch, combine) formats


def format_bytes(fmt: str | None, h: int) -> int:
    """Payload bytes of one row in a format (formats.py): bf16 2H; e4m3 H + H/32; nvfp4 H/2 + H/16."""
    return {None: 2 * h, "e4m3": h + 4 * (h // 128), "nvfp4": h // 2 + h // 16}[fmt]


def bench_formats(o, out, floor):
    """EPBuffer (world 1: the send and receive of one rank in one kernel) and PrefillBuffer (emulated world)
    with every point of FORMAT_POINTS: dispatch and combine timed as in the ep and prefill sections. Each
    point is checked first: dispatch counts against the routing; with a quantized format the rows of one
    token against ``moe_comm.reference``'s quantizer, bit for bit."""
    from moe_comm import reference  # noqa: PLC0415
    h, e, k = o.hidden, o.experts, o.topk
    group = moe_comm.init(backend="loopback", world_size=1, device=o.device, timeout_s=30.0)[0]
    gen = torch.Generator().manual_seed(4)
    for dfmt, cfmt in FORMAT_POINTS:
        for t in o.format_tokens:
            cap = o.max_tokens or max(1, t)
            ep = moe_comm.EPBuffer(group, e, h, cap, k, dispatch_format=dfmt, combine_format=cfmt)
            x = torch.randn(t, h, generator=gen).to(torch.bfloat16).to(o.device)
            idx = peers.random_topk(t, e, k, gen).to(o.device)
            w = torch.rand(t, k, generator=gen).to(o.device)
            gs = reference.nvfp4_global_scale(x) if dfmt == "nvfp4" else None
            d = drive(ep.dispatch, group, x, idx, global_scale=gs)
            group.check()
            want = torch.bincount(idx.reshape(-1).cpu(), minlength=e).to(torch.int32)
            assert torch.equal(d.counts.cpu(), want), "dispatch counts differ from the routing"
            if dfmt is not None and t:
                e0 = int(idx[0, 0])
                q = (reference.quantize_nvfp4(x[:1].cpu(), gs.cpu()) if dfmt == "nvfp4"
                     else reference.quantize_fp8(x[:1].cpu()))
                assert torch.equal(d.x[e0, 0].cpu().view(torch.uint8), q[0][0].view(torch.uint8)), "codes"
            sizes = dict(tokens=t, hidden=h, experts=e, topk=k, max_tokens=cap, heap=group.backend,
                         dtype=dfmt or "bf16")
            td = time_us(lambda i: drive(ep.dispatch, group, x, idx, global_scale=gs), o.device, o.iters, o.warmup)
            result(out, floor, "dispatch", "moe_comm_formats", t * h * 2 + t * k * format_bytes(dfmt, h), td,
                   **sizes)
            d = drive(ep.dispatch, group, x, idx, global_scale=gs)
            expert_out = torch.ones((ep.num_local_experts, cap, h), dtype=torch.bfloat16, device=o.device)
            tc = time_us(lambda i: drive(ep.combine, group, expert_out, w, d.handle), o.device, o.iters, o.warmup)
            group.check()
            # bytes: the expert rows as they travel (at world 1 read in place, in bf16), and y
            result(out, floor, "combine", "moe_comm_formats", t * k * h * 2 + t * h * 2, tc,
                   **dict(sizes, dtype=cfmt or "bf16", dispatch_dtype=dfmt or "bf16"))
            ep.close()
            del d, expert_out, ep
            if o.device.type == "cuda":
                torch.cuda.empty_cache()
    group.close()
    bench_prefill_formats(o, out, floor, max(o.format_tokens))


def bench_prefill_formats(o, out, floor, t: int):
    """PrefillBuffer's emulated world at T tokens per rank, every point of FORMAT_POINTS (ranks in turn)."""
    from moe_comm import reference  # noqa: PLC0415
    world, h, e, k = o.prefill_world, o.hidden, o.experts, o.topk
    groups = moe_comm.init(backend="loopback", world_size=world, device=o.device, timeout_s=30.0)
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(t, h, generator=gen).to(torch.bfloat16).to(o.device) for _ in groups]
    idxs = [peers.random_topk(t, e, k, gen).to(o.device) for _ in groups]
    ws = [torch.rand(t, k, generator=gen).to(o.device) for _ in groups]
    gs = reference.nvfp4_global_scale(torch.cat(xs))
    for dfmt, cfmt in FORMAT_POINTS:
        bufs = [moe_comm.PrefillBuffer(g, e, h, t, k, dispatch_format=dfmt, combine_format=cfmt) for g in groups]
        scale = gs if dfmt == "nvfp4" else None
        ds = []
        eos = [torch.ones(bufs[0].plan.rows, h, dtype=torch.bfloat16, device=o.device) for _ in groups]

        def dispatch_all(i):
            ds[:] = run_phases(None, [lambda b=b, x=x, idx=idx, w=w: b.dispatch(x, idx, w, phase="send",
                                                                               global_scale=scale)
                                      for b, x, idx, w in zip(bufs, xs, idxs, ws)],
                               [lambda b=b: b.dispatch(phase="recv") for b in bufs])

        def combine_all(i):
            return run_phases(None, [lambda b=b, eo=eo, d=d: b.combine(eo, d.handle, phase="send")
                                     for b, eo, d in zip(bufs, eos, ds)],
                              [lambda b=b: b.combine(phase="recv") for b in bufs])

        dispatch_all(0)
        got = torch.stack([d.expert_counts.cpu() for d in ds]).reshape(-1)
        want = torch.bincount(torch.cat(idxs).reshape(-1).cpu(), minlength=e).to(torch.int32)
        assert torch.equal(got, want), "prefill dispatch counts differ from the routing"
        combine_all(0)
        td, tc = time_round(dispatch_all, combine_all, o.device, o.iters, o.warmup)
        for b in bufs:
            b.group.check()
        pairs = sum(int(prefill_destinations(idx, e, world).sum()) for idx in idxs)
        sizes = dict(tokens=t, world=world, hidden=h, experts=e, topk=k, max_tokens=t, dtype=dfmt or "bf16",
                     heap="loopback (emulated on one device)", streams="one")
        result(out, floor, "prefill_dispatch", "moe_comm_formats", pairs * format_bytes(dfmt, h), td,
               launches=2 * world, **sizes)
        result(out, floor, "prefill_combine", "moe_comm_formats", pairs * format_bytes(cfmt, h), tc,
               launches=2 * world, **dict(sizes, dtype=cfmt or "bf16", dispatch_dtype=dfmt or "bf16"))
        for b in reversed(bufs):
            b.close()
        if o.device.type == "cuda":
            torch.cuda.empty_cache()
    for g in groups:
        g.close()


def bench_ep_rank(o, out, floor):
    """One real rank of EP-N for every N in --rank-worlds (bench/ep_rank.py): per point a line for the
    peer emulator alone and one for the rank (total minus the emulator's p50)."""
    from bench import ep_rank  # noqa: PLC0415
    h, e, k = o.hidden, o.experts, o.topk
    gen = torch.Generator().manual_seed(3)
    for world in o.rank_worlds:
        rank = world // 2
        for kind in o.rank_routings:
            for t in o.rank_tokens:
                xs = [torch.randn(t, h, generator=gen).to(torch.bfloat16) for _ in range(world)]
                idxs = ep_rank.routing(kind, world, rank, t, e, k, gen)
                for fp8 in (False, True):
                    sizes = dict(tokens=t, world=world, rank=rank, routing=kind, hidden=h, experts=e, topk=k,
                                 max_tokens=t, dtype="fp8" if fp8 else "bf16",
                                 heap=f"loopback: rank {rank} real, {world - 1} ranks emulated")
                    need = ep_rank.rank_bytes(world, e, h, t, k, fp8)
                    if o.device.type == "cuda" and need > 0.8 * torch.cuda.mem_get_info(o.device)[0]:
                        why = f"needs {need / 2**30:.1f} GiB (every rank's symmetric buffers on this device)"
                        out.write(kind="skip", op="dispatch/combine", impl=f"moe_comm_rank_w{world}_{kind}",
                                  reason=why, **sizes)
                        print(f"skip ep_rank EP{world} T={t} {sizes['dtype']}: {why}")
                        continue
                    em = ep_rank.EmulatedRank(world, rank, e, h, k, fp8, xs, idxs, o.device, gen)
                    try:
                        bench_rank_point(o, out, floor, em, sizes, combine=not fp8)
                    finally:
                        em.close()
                        del em  # the world's memory goes with it (see EmulatedRank.close)
                        gc.collect()
                        if o.device.type == "cuda":
                            torch.cuda.empty_cache()


def bench_rank_point(o, out, floor, em, sizes, combine: bool):
    """Check one emulated rank (all of it where the reference is cheap, world*T*K <= 4096, bit for bit
    on a CPU; counts only above), then time dispatch (and the combine) with and without the rank's
    kernels."""
    d = em.dispatch()
    y = em.combine()
    em.group.check()
    world, t, k = sizes["world"], sizes["tokens"], sizes["topk"]
    if world * t * k <= 4096:
        em.check(d, y, exact=o.device.type != "cuda")
    else:
        assert torch.equal(d.counts.cpu(), em.expected_counts()), "dispatch counts differ from the routing"
    ops = [("dispatch", em.dispatch)] + ([("combine", em.combine)] if combine else [])
    for op, call in ops:
        emu = time_us(graphed(lambda i, op=op: em.signal(op), o.device), o.device, o.iters, o.warmup)
        total = time_us(graphed(call, o.device), o.device, o.iters, o.warmup)
        em.group.check()
        ctrl = 8 * (world - 1) * (em.p.dispatch_ctrl_words if op == "dispatch" else em.combine_ch.ctrl_words)
        result(out, floor, op, f"peer_emulator_w{world}_{sizes['routing']}", ctrl, emu, **sizes)
        rank_t = dict(total, **{q: total[q] - emu["p50_us"] for q in ("p20_us", "p50_us", "p80_us")})
        line = result(out, floor, op, f"moe_comm_rank_w{world}_{sizes['routing']}", em.floor_bytes(op), rank_t,
                      total_p50_us=total["p50_us"], emulator_p50_us=emu["p50_us"], **sizes)
        print(f"ep_rank EP{world} {sizes['routing']} T={t} {op} {sizes['dtype']}: {line['p50_us']:.1f} µs "
              f"(+ emulator {emu['p50_us']:.1f}), {line['x_floor']:.2f}x floor")


# ---- peers ---------------------------------------------------------------------------------------

def bench_permute(o, out, floor):
    h, e, k = o.hidden, o.experts, o.topk
    gen = torch.Generator().manual_seed(1)
    for fp8 in (False, True):
        for t in o.tokens:
            x = torch.randn(t, h, generator=gen).to(torch.bfloat16).to(o.device)
            idx = peers.random_topk(t, e, k, gen).to(o.device)
            w = torch.rand(t, k, generator=gen).to(o.device)
            sizes = dict(tokens=t, hidden=h, experts=e, topk=k, dtype="fp8" if fp8 else "bf16")
            tp = time_us(lambda i: peers.torch_permute(x, idx, e, fp8), o.device, o.iters, o.warmup)
            result(out, floor, "dispatch", "torch_permute", ep_bytes("dispatch", t, h, k, fp8), tp, **sizes)
            if fp8:
                continue  # combine works on dtype rows either way: timed once, with the bf16 case
            rows, _, _, order = peers.torch_permute(x, idx, e, False)
            tu = time_us(lambda i: peers.torch_unpermute(rows, w, order), o.device, o.iters, o.warmup)
            result(out, floor, "combine", "torch_unpermute", ep_bytes("combine", t, h, k, fp8), tu, **sizes)


def bench_nccl(o, out, floor):
    peers.init_world1(o.device)
    impl = "nccl_host_splits" if o.device.type == "cuda" else "gloo_host_splits"
    h = o.hidden
    try:
        for n in o.a2a_rows:
            send = torch.randn(n, h, device=o.device).to(torch.bfloat16)
            recv = torch.empty_like(send)
            counts = torch.tensor([n], dtype=torch.int64, device=o.device)
            scratch = torch.empty_like(counts)
            assert torch.equal(peers.nccl_alltoallv(send, recv, counts, scratch), send)
            t = time_us(lambda i: peers.nccl_alltoallv(send, recv, counts, scratch), o.device, o.iters, o.warmup)
            result(out, floor, "alltoallv", impl, 2 * n * h * 2, t, rows=n, hidden=h, dtype="bf16")
    finally:
        torch.distributed.destroy_process_group()


def bench_vdev_child(o, out, floor):
    """Runs in its own process (torch's NVSHMEM must not meet nvshmem4py's in one process)."""
    peers.init_world1(o.device)
    h = o.hidden
    try:
        for n in o.a2a_rows:
            try:
                op = peers.SymmMemAllToAllv(n, h, torch.bfloat16, o.device)
            except RuntimeError as e:
                if "global_ranks.size() > 1" not in str(e):
                    raise
                # torch's symmetric memory refuses a one-rank group, and one GPU cannot host two NVSHMEM
                # ranks (several processes per GPU run in NVSHMEM's limited mode): no comparison here.
                out.write(kind="skip", op="alltoallv", impl="torch_symm_mem_vdev",
                          reason=f"torch {torch.__version__} symm_mem needs world > 1 (rendezvous: {e})"[:300])
                print("skip torch all_to_all_vdev: torch symmetric memory needs world > 1")
                return
            op.input.copy_(torch.randn(n, h, device=o.device).to(torch.bfloat16))
            op.set_counts(torch.tensor([n], dtype=torch.int64, device=o.device))
            op()
            torch.cuda.synchronize()
            assert torch.equal(op.out[:n], op.input) and int(op.recv_counts()[0]) == n, "all_to_all_vdev wrong"
            t = time_us(lambda i: op(), o.device, o.iters, o.warmup)
            result(out, floor, "alltoallv", "torch_symm_mem_vdev", 2 * n * h * 2, t, rows=n, hidden=h, dtype="bf16")
    finally:
        torch.distributed.destroy_process_group()


def run_vdev(o, out, floor, argv):
    if o.device.type != "cuda" or not peers.has_all_to_all_vdev():
        why = "needs CUDA" if o.device.type != "cuda" else f"torch {torch.__version__} has no all_to_all_vdev"
        out.write(kind="skip", op="alltoallv", impl="torch_symm_mem_vdev", reason=why)
        print(f"skip torch all_to_all_vdev: {why}")
        return
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--child-vdev", out.path, "--floor", *map(str, floor)]
    try:
        proc = subprocess.run(cmd, timeout=600)
        ok = proc.returncode == 0
        why = f"child process exited with {proc.returncode}"
    except subprocess.TimeoutExpired:
        ok, why = False, "child process timed out (600 s)"
    if not ok:
        out.write(kind="skip", op="alltoallv", impl="torch_symm_mem_vdev", reason=why)
        print(f"torch all_to_all_vdev failed: {why}")


def compile_report(out: JsonLines) -> None:
    """Registers, spills, warps and shared memory of every moe_comm kernel compiled in this process."""
    import importlib  # noqa: PLC0415
    import pkgutil  # noqa: PLC0415

    import moe_comm.triton_kernels as tk  # noqa: PLC0415
    for info in pkgutil.iter_modules(tk.__path__):
        mod = importlib.import_module(f"{tk.__name__}.{info.name}")
        for name, fn in vars(mod).items():
            if not isinstance(fn, triton.runtime.JITFunction) or not name.endswith("_kernel"):
                continue
            for caches in fn.device_caches.values():
                for kernel in caches[0].values():
                    try:
                        kernel._init_handles()
                    except Exception:  # noqa: BLE001  (interpreter, or no binary: nothing to report)
                        continue
                    md = kernel.metadata
                    out.write(kind="compile", op=f"{info.name}.{name}", n_regs=kernel.n_regs,
                              n_spills=kernel.n_spills, num_warps=md.num_warps, num_stages=md.num_stages,
                              shared_bytes=md.shared)
                    print(f"compiled {info.name}.{name}: {kernel.n_regs} registers, {kernel.n_spills} spills, "
                          f"{md.num_warps} warps, {md.shared} B shared")


# ---- report --------------------------------------------------------------------------------------

def table(lines: list[dict]) -> str:
    rows = [f"{'op':<10} {'impl':<32} {'dtype':<5} {'size':>6} {'p50 µs':>10} {'GB/s':>8} "
            f"{'floor µs':>9} {'x floor':>8}"]
    for r in lines:
        if r["kind"] == "result":
            size = r.get("rows", r.get("tokens"))
            rows.append(f"{r['op']:<10} {r['impl']:<32} {r['dtype']:<5} {size:>6} {r['p50_us']:>10.1f} "
                        f"{r['GBps']:>8.1f} {r['floor_us']:>9.1f} {r['x_floor']:>8.2f}")
        elif r["kind"] in ("skip", "error"):
            what = "skipped" if r["kind"] == "skip" else "FAILED"
            rows.append(f"{r['op']:<10} {r['impl']:<32} {what}: {r['reason'][:200]}")
    return "\n".join(rows)


def plot(lines: list[dict], path: str, title: str) -> None:
    """Top: device time p50 per op (solid) with the floor (dotted, labelled) and the host wall time per
    call of back-to-back eager calls (hollow markers, what an eager caller waits); bottom: x floor.
    x axes carry the measured sizes."""
    try:
        import matplotlib  # noqa: PLC0415
    except ImportError:
        print("matplotlib not installed (pip install 'moe-comm[bench]'): no PNG")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    res = [r for r in lines if r["kind"] == "result"]
    fig, axes = plt.subplots(2, 2, figsize=(14, 9), sharex="col", gridspec_kw=dict(height_ratios=[3, 2]))
    panels = [("alltoallv (world 1)", "rows", lambda r: r["op"] == "alltoallv"),
              ("dispatch / combine (EP=1; _emulated_w8: 8 ranks in turn)", "tokens",
               lambda r: r["op"] != "alltoallv")]
    colors = plt.get_cmap("tab20").colors  # more series than the default cycle's 10 colours
    for col, (name, size_key, pick) in enumerate(panels):
        ax, axf = axes[0][col], axes[1][col]
        series: dict = {}
        for r in filter(pick, res):
            key = r["impl"] if r["op"] == "alltoallv" else f"{r['op']} {r['impl']} {r['dtype']}"
            series.setdefault(key, []).append((r[size_key], r["p50_us"], r["floor_us"], r.get("wall_us"),
                                               r["x_floor"]))
        floor_labelled = False
        for i, (key, pts) in enumerate(sorted(series.items())):
            pts.sort()
            c = colors[i % 20]
            ls = "-" if " moe_comm " in f" {key} " else ("-." if "emulated" in key else "--")
            xs = [p[0] for p in pts]
            ax.plot(xs, [p[1] for p in pts], marker="o", ls=ls, color=c, label=f"{key} (device)")
            walls = [(p[0], p[3]) for p in pts if p[3] is not None]
            if walls:
                ax.plot([w[0] for w in walls], [w[1] for w in walls], marker="o", mfc="none", ls="none", color=c)
            if key.endswith("moe_comm") or " moe_comm " in key:
                ax.plot(xs, [p[2] for p in pts], ls=":", color="gray",
                        label=None if floor_labelled else "floor: bytes / copy rate + one launch")
                floor_labelled = True
                axf.plot(xs, [p[4] for p in pts], marker="o", ls=ls, color=c, label=key)
        sizes = sorted({r[size_key] for r in filter(pick, res)})
        for a in (ax, axf):
            a.set_xscale("log", base=2)
            a.grid(True, which="both", alpha=0.3)
            if sizes:
                a.set_xticks(sizes, [str(x) for x in sizes])
                a.minorticks_off()
        ax.set(yscale="log", ylabel="µs: p50 device (filled), host wall per eager call (hollow)",
               title=f"{name}")
        axf.axhline(1.0, color="gray", lw=0.8)
        axf.set(xlabel=f"{size_key} (measured sizes)", ylabel="x floor (device p50 / floor)")
        if series:
            ax.legend(fontsize=7)
            axf.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _progress(total: int):
    """A tqdm bar over the sections on stderr (the ``bench`` extra), or a silent stand-in."""
    from moe_comm.serving.latency_bench import progress_bar  # noqa: PLC0415
    return progress_bar(total=total, disable=False, desc="kernel bench")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    o = parse_args(argv)
    env = environment(o.device)
    if o.child_vdev:
        bench_vdev_child(o, JsonLines(o.child_vdev, dict(env, tag=o.tag), o.dry), tuple(o.floor))
        return 0
    out_dir = o.out_dir or (tempfile.mkdtemp(prefix="moe-comm-bench-dry-") if o.dry else
                            os.path.join("bench", "results"))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    slug = "dry" if o.dry else env["device"].replace(" ", "-")
    base = os.path.join(out_dir, f"kernels-{slug}-{stamp}")
    if o.host:
        from bench.host_cost import measure  # noqa: PLC0415
        out = JsonLines(os.path.join(out_dir, f"kernels-host-{slug}-{stamp}.jsonl"), dict(env, tag=o.tag), False)
        print(f"device {env['device']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}")
        measure(o, out)
        print(f"wrote {out.path}")
        return 0
    out = JsonLines(base + ".jsonl", dict(env, tag=o.tag), o.dry)
    if o.dry:
        print(f"*** {DRY_LABEL} ***")
    print(f"device {env['device']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}")
    failed = []

    def section(name, fn, *args):
        """Run one section; a failure is recorded (JSON line + exit status) and the others still run."""
        if name not in o.sections:
            return
        bar.set_postfix_str(name)
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001
            failed.append(name)
            out.write(kind="error", op=name, impl="-", reason=f"{type(e).__name__}: {str(e)[:2000]}")
            traceback.print_exc()
            print(f"section {name} FAILED: {type(e).__name__}: {str(e)[:300]}")
        bar.update()

    steps = [n for n in SECTIONS if n in o.sections]
    bar = _progress(len(steps))
    floor = measure_floor(o, out) if "floor" in o.sections else (1.0, 0.0)
    if "floor" in o.sections:
        bar.update()
    if {"a2a", "ep"} & set(o.sections):
        group = world1_group(o.device)
        try:
            section("a2a", bench_a2a, o, out, floor, group)
            section("ep", bench_ep, o, out, floor, group)
            if o.device.type == "cuda":
                compile_report(out)
        finally:
            group.close()
    section("ep_emulated", bench_ep_emulated, o, out, floor)
    section("prefill", bench_prefill, o, out, floor)
    section("ep_rank", bench_ep_rank, o, out, floor)
    section("formats", bench_formats, o, out, floor)
    section("permute", bench_permute, o, out, floor)
    section("nccl", bench_nccl, o, out, floor)
    section("vdev", run_vdev, o, out, floor, argv)
    bar.close()
    lines = read_jsonl(out.path)
    title = f"{env['device']}  torch {env['torch']}  triton {env['triton']}  {env['commit'][:12]}"
    plot(lines, base + ".png", (f"{DRY_LABEL}\n" if o.dry else "") + title)
    print(table(lines))
    print(f"wrote {out.path} and {base}.png")
    if o.dry:
        print(f"*** {DRY_LABEL} ***")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
