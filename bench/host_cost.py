"""Host cost of an eager call: the Python between an op call and its kernel launches (``kernels.py --host``).

Stubbed: Triton's launch. ``JITFunction.run`` and ``InterpretedFunction.run`` (what ``kernel[grid](...)``
calls: Triton's argument binding, its compilation-cache lookup and the launch itself, or on a CPU the
interpreter's execution of the grid) return at once without doing anything.

Measured: everything else of a call, as an eager caller makes it: the phase state machine, the input
checks, the handle, the launch arguments (kernel choice, grid, argument dicts), output allocation, the
views of the inputs, and the end-of-call error check (on a CPU it reads the error word; on a GPU it
records an event and waits for the previous call's). Every op: EPBuffer dispatch / combine,
AllToAllvDynamic forward / combine, PrefillBuffer dispatch / combine.

Per call of one rank: at world 1 one ``phase="both"`` call; on a loopback world of W ranks (one process
holds every rank) every rank's ``phase="send"``, then every rank's ``phase="recv"``, each phase timed on
its own and a rank's two phases added (one sample per rank and call). Dispatch and combine alternate (a
PrefillBuffer dispatch must be answered by a combine before the next one). ``time.perf_counter_ns``;
the garbage collector is off during the timed calls. p10 / p50 / p90 of the per-call times, the machine's
load average, and the p50 of a fixed reference workload timed in the same loop (``_reference_work``): a
shared VM's speed drifts, and every figure with it; ``p50/ref`` does not (compare runs by it, or count
instructions with ``bench/host_instructions.py``).

Since the kernels never run, outputs hold garbage and no device value changes: the figures say nothing
about the kernels, only about the host. The inputs of every call are the same tensors (an eager engine
passes tensors of the same shapes every step; buffers may cache what those determine).
"""

from __future__ import annotations

import gc
import os
import time

import torch

import moe_comm
from bench import peers
from bench.ptx_profile import launches_stubbed

STUBBED = ("Triton's launch (JITFunction.run / InterpretedFunction.run: argument binding, compilation cache "
           "lookup and the launch, or the interpreter's run of the grid) is a no-op")
MEASURED = ("everything else of an eager call: phase state machine, input checks, handle, launch arguments, "
            "output allocation, input views, end-of-call error check")
TARGET_US = 15.0   # issue 25: host time per eager call with launches stubbed, at world 1 and loopback world 8
WORLDS = (1, 8)
PERCENTILES = (0.1, 0.5, 0.9)
REFERENCE_LOOPS = 40   # iterations of _reference_work: ~5-8 µs on the development machine, like an op call


def _calls(world: int, drive_send, drive_recv):
    """A function that makes one call of an op on every rank (``phase="both"`` at world 1, else every
    rank's send phase, then every rank's receive phase) and returns the ns each rank spent in it."""
    clock = time.perf_counter_ns
    if world == 1:
        def both():
            t0 = clock()
            drive_send(0, "both")
            return [clock() - t0]
        return both

    def all_ranks():
        ns = [0] * world
        for r in range(world):
            t0 = clock()
            drive_send(r, "send")
            ns[r] = clock() - t0
        for r in range(world):
            t0 = clock()
            drive_recv(r)
            ns[r] += clock() - t0
        return ns
    return all_ranks


def _ops(groups, o, t: int):
    """(op name, [(dispatch name, dispatch call), (combine name, combine call)]) for every op, inputs built."""
    world, dev, h, e, k = len(groups), o.device, o.hidden, o.experts, o.topk
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(t, h, generator=gen).to(torch.bfloat16).to(dev) for _ in groups]
    idxs = [peers.random_topk(t, e, k, gen).to(dev) for _ in groups]
    ws = [torch.rand(t, k, generator=gen).to(dev) for _ in groups]
    built = []

    # EPBuffer
    eps = [moe_comm.EPBuffer(g, e, h, t, k, dtype=torch.bfloat16) for g in groups]
    ep_res = [None] * world
    ep_out = [torch.zeros(eps[0].num_local_experts, world * t, h, dtype=torch.bfloat16, device=dev) for _ in groups]

    def ep_dispatch(r, phase):
        got = eps[r].dispatch(xs[r], idxs[r], phase=phase)
        if got is not None:
            ep_res[r] = got

    def ep_dispatch_recv(r):
        ep_res[r] = eps[r].dispatch(phase="recv")

    def ep_combine(r, phase):
        eps[r].combine(ep_out[r], ws[r], ep_res[r].handle, phase=phase)

    built.append(("EPBuffer", eps, [("dispatch", _calls(world, ep_dispatch, ep_dispatch_recv)),
                                    ("combine", _calls(world, ep_combine, lambda r: eps[r].combine(phase="recv")))]))

    # AllToAllvDynamic: rows of hidden bf16, t rows per call split as evenly as possible over the ranks
    a2as = [moe_comm.AllToAllvDynamic(g, max(1, t), (h,), torch.bfloat16) for g in groups]
    counts = torch.tensor([t // world + (j < t % world) for j in range(world)], dtype=torch.int32, device=dev)
    a2a_res = [None] * world
    rows = [torch.zeros(world, max(1, t), h, dtype=torch.bfloat16, device=dev) for _ in groups]

    def a2a_forward(r, phase):
        got = a2as[r](xs[r], counts, phase=phase)
        if got is not None:
            a2a_res[r] = got

    def a2a_forward_recv(r):
        a2a_res[r] = a2as[r](phase="recv")

    def a2a_combine(r, phase):
        a2as[r].combine(rows[r], a2a_res[r].handle, phase=phase)

    built.append(("AllToAllvDynamic", a2as,
                  [("forward", _calls(world, a2a_forward, a2a_forward_recv)),
                   ("combine", _calls(world, a2a_combine, lambda r: a2as[r].combine(phase="recv")))]))

    # PrefillBuffer
    pres = [moe_comm.PrefillBuffer(g, e, h, t, k, dtype=torch.bfloat16) for g in groups]
    pre_res = [None] * world
    pre_out = [torch.zeros(world * t, h, dtype=torch.bfloat16, device=dev) for _ in groups]

    def pre_dispatch(r, phase):
        got = pres[r].dispatch(xs[r], idxs[r], ws[r], phase=phase)
        if got is not None:
            pre_res[r] = got

    def pre_dispatch_recv(r):
        pre_res[r] = pres[r].dispatch(phase="recv")

    def pre_combine(r, phase):
        pres[r].combine(pre_out[r], pre_res[r].handle, phase=phase)

    built.append(("PrefillBuffer", pres,
                  [("dispatch", _calls(world, pre_dispatch, pre_dispatch_recv)),
                   ("combine", _calls(world, pre_combine, lambda r: pres[r].combine(phase="recv")))]))
    return built


def _percentiles(samples_ns: list[int]) -> dict:
    us = torch.tensor(samples_ns, dtype=torch.float64) / 1e3
    q = torch.quantile(us, torch.tensor(PERCENTILES, dtype=torch.float64)).tolist()
    return dict(p10_us=q[0], p50_us=q[1], p90_us=q[2], samples=len(samples_ns))


def _reference_work(t: torch.Tensor) -> None:
    """A fixed piece of host work like an op call's (Python calls, attribute reads, tensor metadata): timed
    beside the ops, it says how fast the machine ran while they were measured. A shared VM's speed drifts
    (on the 2-core development machine this work takes 1.0-1.5x its fastest time, in phases of 0.1-10 s),
    and every op's figure drifts with it."""
    for _ in range(REFERENCE_LOOPS):
        if t.shape[0] < 0 or t.dtype is None or not t.is_contiguous():
            raise AssertionError


def measure(o, out) -> list[dict]:
    """Every op's dispatch and combine at every world of ``WORLDS``: p50 / p90 µs per call of one rank.
    Writes one JSON line per (op, call, world, T) to ``out`` and returns them.

    Each op is timed in its own loop (its calls back to back, as the figures before this column was added);
    each iteration of that loop also times ``_reference_work``, whose p50 is printed beside the op's and
    divides it (``p50/ref``: a figure that does not drift with the machine's speed, comparable between runs)."""
    lines = []
    print(f"host cost per eager call, µs per call of one rank (stubbed: {STUBBED}; measured: {MEASURED})")
    print(f"load average before: {os.getloadavg()[0]:.1f} ({os.cpu_count()} CPUs); ref = a fixed piece of host "
          f"work timed in the same loop as the op (the machine's speed meanwhile)")
    print(f"{'op':<18} {'call':<9} {'world':>5} {'T':>5} {'p10 µs':>8} {'p50 µs':>8} {'p90 µs':>8} {'ref µs':>8} "
          f"{'p50/ref':>8}  p50 <= {TARGET_US:g} µs")
    clock = time.perf_counter_ns
    for world in WORLDS:
        for t in o.tokens:
            groups = moe_comm.init(backend="loopback", world_size=world, device=o.device, timeout_s=30.0)
            probe = torch.empty(t, 1)
            with launches_stubbed():
                for op, objs, calls in _ops(groups, o, t):
                    samples, reference = {name: [] for name, _ in calls}, []
                    gc.collect()
                    for i in range(o.warmup + o.iters):
                        if i == o.warmup:
                            gc.disable()
                        for name, call in calls:
                            ns = call()
                            if i >= o.warmup:
                                samples[name].extend(ns)
                        t0 = clock()
                        _reference_work(probe)
                        if i >= o.warmup:
                            reference.append(clock() - t0)
                    gc.enable()
                    for obj in objs:
                        obj.close()
                    ref = _percentiles(reference)["p50_us"]
                    for name, _ in calls:
                        q = _percentiles(samples[name])
                        q["p50_ref"] = q["p50_us"] / ref
                        lines.append(out.write(kind="host", op=op, call=name, world=world, tokens=t, hidden=o.hidden,
                                               experts=o.experts, topk=o.topk, dtype="bf16", heap="loopback",
                                               stubbed=STUBBED, measured=MEASURED, target_us=TARGET_US,
                                               reference_p50_us=ref, loadavg=os.getloadavg()[0], **q))
                        print(f"{op:<18} {name:<9} {world:>5} {t:>5} {q['p10_us']:>8.1f} {q['p50_us']:>8.1f} "
                              f"{q['p90_us']:>8.1f} {ref:>8.1f} {q['p50_ref']:>8.2f}  "
                              f"{'ok' if q['p50_us'] <= TARGET_US else 'over'}")
            for g in groups:
                g.close()
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    return lines
