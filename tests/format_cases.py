"""Cases of the low-precision formats (``moe_comm.formats``: nvfp4 dispatch, fp8 combine) for EPBuffer and
PrefillBuffer, shared by the shm (multi-process), loopback (one-process) and emulated-node tests.

Every rank rebuilds every rank's inputs from the case seed (``ep_cases.make_inputs``: T = 0, 1, odd and the
capacity across ranks; -1 ids, all tokens to expert 0, all of a token's experts on one rank, a duplicated
expert, nothing routed) and checks its own outputs bit for bit against ``moe_comm.reference``: the dispatch's
codes and scales against ``reference.quantize_nvfp4`` of the rows, the combine against ``reference.combine`` /
``prefill_combine`` with ``fp8=True`` (each row through ``reference.fp8_round_trip``). Outputs are poisoned
before every call; expert rows the combine must not read are NaN. The 'experts' dequantize what they
receive (``reference.dequantize_nvfp4`` with the global scale): the stand-in expert stage that consumes
nvfp4 on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_comm import EPBuffer, PrefillBuffer, reference

from ep_cases import Config, make_inputs

# Every case here has at least one new format; hidden 192 (nvfp4 only: three column blocks of 64) and 384
# (three 128-column groups in a 512-column tile) are the odd sizes; one float16 case.
CONFIGS = (
    (Config(4, 128, 5, 2), "nvfp4", None),
    (Config(5, 384, 3, 4), None, "e4m3"),
    (Config(3, 128, 4, 3), "nvfp4", "e4m3"),
    (Config(4, 192, 3, 1, dtype=torch.float16), "nvfp4", None),
    (Config(2, 128, 3, 2, dtype=torch.float16), "e4m3", "e4m3"),
)
ROUTINGS = ("random", "skewed", "one_rank", "dup", "none")
GS_FACTORS = (1.0, 0.25, 4.0)   # global scale = factor * 448 * 6 / amax: calibrated, coarse, saturating


@dataclass(frozen=True)
class Case:
    ci: int          # index into CONFIGS
    routing: str
    seed: int


def cases(world: int, every: int = 2) -> list[Case]:
    """The cases of a world size: one (config, routing) pair in ``every`` (1 to 4), every config at every
    world size; together the world sizes cover the routings."""
    out, seed = [], 7000 * world
    for ci in range(len(CONFIGS)):
        for ri, routing in enumerate(ROUTINGS):
            if (ci + ri + world) % every == 0:
                seed += 17
                out.append(Case(ci, routing, seed))
    return out


def inputs(case: Case, world: int):
    """(cfg, dispatch_format, combine_format, xs, idxs, ws, global_scale or None), the same on every rank."""
    cfg, fmt, cfmt = CONFIGS[case.ci]
    xs, idxs, ws = make_inputs(cfg, world, case.routing, case.seed)
    gs = None
    if fmt == "nvfp4":
        gs = reference.nvfp4_global_scale(torch.cat(xs)) * GS_FACTORS[case.seed % len(GS_FACTORS)]
    return cfg, fmt, cfmt, xs, idxs, ws, gs


def dequantized(x, scales, gs) -> torch.Tensor:
    """float32 rows of a dispatch output in any format (the stand-in experts' input)."""
    if gs is not None:
        return reference.dequantize_nvfp4(x, scales, gs)
    if scales is not None:
        return reference.dequantize_fp8(x, scales)
    return x.float()


def expert_fn(x, scales, gs, first_expert: int, dtype) -> torch.Tensor:
    """The 'experts' of EPBuffer: dequantize, then a per-global-expert elementwise map (deterministic)."""
    xf = dequantized(x, scales, gs)
    L = xf.shape[0]
    mult = 1 + ((first_expert + torch.arange(L)) % 5).float().view(L, 1, 1) * 0.25
    return (xf * mult + 0.5).to(dtype)


def partial_rows(x, scales, gs, rank: int, dtype) -> torch.Tensor:
    """The 'experts' of PrefillBuffer's rank ``rank``: dequantize, then a per-rank elementwise map."""
    return (dequantized(x, scales, gs) * (1 + 0.25 * rank) + 0.5).to(dtype)


def poison_ep(ep: EPBuffer) -> None:
    """Dispatch outputs filled with what no kernel writes there (e4m3 NaN scales, NaN / 0xFF rows)."""
    if not ep._allocated:
        return
    if ep._x.dtype.is_floating_point and ep._x.dtype != torch.float8_e4m3fn:
        ep._x.fill_(float("nan"))
    else:
        ep._x.view(torch.uint8).fill_(0xFF)   # fp8: NaN; nvfp4: a code pair no all-zero row has
    if ep._scales is not None and ep._scales.dtype == torch.float8_e4m3fn:
        ep._scales.view(torch.uint8).fill_(0x7F)   # e4m3 NaN
    elif ep._scales is not None:
        ep._scales.fill_(float("nan"))
    for s in ep._sets:
        s.src.fill_(-7)
        s.counts.fill_(-7)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def check_ep_dispatch(rank, d, exp, tag) -> list[str]:
    if not torch.equal(d.counts.cpu(), exp["counts"]):
        return [f"{tag}: counts {d.counts.tolist()} != {exp['counts'].tolist()}"]
    errs = []
    for e, n in enumerate(exp["counts"].tolist()):
        if not torch.equal(d.src[e, :n].cpu(), exp["src"][e, :n]):
            errs.append(f"{tag}: src of expert {e}")
        if not same_bytes(d.x[e, :n].cpu(), exp["x"][e, :n]):
            errs.append(f"{tag}: rows of expert {e} differ from the reference")
        if exp["scales"] is not None and not same_bytes(d.scales[e, :n].cpu(), exp["scales"][e, :n]):
            errs.append(f"{tag}: scales of expert {e} differ from the reference")
    return errs


def expected_ep(cfg, fmt, cfmt, xs, idxs, ws, gs, world):
    E = cfg.experts_per_rank * world
    exp_d = reference.dispatch(xs, idxs, E, cfg.max_tokens, fp8=fmt == "e4m3", nvfp4_scale=gs)
    eos = [expert_fn(exp_d[r]["x"], exp_d[r]["scales"], gs, r * cfg.experts_per_rank, cfg.dtype)
           for r in range(world)]
    return exp_d, reference.combine(eos, ws, idxs, E, cfg.max_tokens, fp8=cfmt == "e4m3")


def expert_outputs(d, rank, cfg) -> torch.Tensor:
    out = expert_fn(d.x, d.scales, d.global_scale, rank * cfg.experts_per_rank, cfg.dtype)
    for e, n in enumerate(d.counts.tolist()):
        out[e, n:] = float("nan")   # combine must not read them
    return out


def snapshot(d):
    return type(d)(d.x.clone(), None if d.scales is None else d.scales.clone(), d.counts.clone(), d.src.clone(),
                   d.handle, d.global_scale)


def make_ep(group, ci: int) -> EPBuffer:
    cfg, fmt, cfmt = CONFIGS[ci]
    return EPBuffer(group, cfg.experts_per_rank * group.world_size, cfg.hidden, cfg.max_tokens, cfg.topk,
                    dtype=cfg.dtype, dispatch_format=fmt, combine_format=cfmt)


def run_ep_shm(group, every: int = 2) -> list[str]:
    """Every case on one rank of a launched group (phase='both'; 'random' cases split in two phases too).
    First, every rank gives its nvfp4 dispatch no global scale: every rank raises before sending, and the
    cases after it are exact."""
    world, rank = group.world_size, group.rank
    errs, bufs, refused = [], {}, False
    for case in cases(world, every):
        cfg, fmt, cfmt, xs, idxs, ws, gs = inputs(case, world)
        ep = bufs.setdefault(case.ci, make_ep(group, case.ci))
        if fmt == "nvfp4" and not refused:
            refused = True
            try:
                ep.dispatch(xs[rank], idxs[rank])
                errs.append(f"rank{rank}: an nvfp4 dispatch without global_scale was not refused")
            except TypeError as e:
                if "global_scale" not in str(e):
                    errs.append(f"rank{rank}: refused without naming global_scale: {e}")
        for split in ((False, True) if case.routing == "random" else (False,)):
            errs += ep_call(ep, rank, case, split)
    for ep in bufs.values():
        ep.close()
    return errs


def ep_call(ep, rank: int, case: Case, split: bool = False) -> list[str]:
    """One checked dispatch -> combine of ``case`` on rank ``rank`` of a launched group (phase='both', or
    split in two phases)."""
    world = ep.group.world_size
    cfg, fmt, cfmt, xs, idxs, ws, gs = inputs(case, world)
    exp_d, exp_y = expected_ep(cfg, fmt, cfmt, xs, idxs, ws, gs, world)
    tag = f"rank{rank} cfg{case.ci} {case.routing} seed{case.seed} split={split}"
    poison_ep(ep)
    if split:
        assert ep.dispatch(xs[rank], idxs[rank], phase="send", global_scale=gs) is None
        d = ep.dispatch(phase="recv")
    else:
        d = ep.dispatch(xs[rank], idxs[rank], global_scale=gs)
    errs = check_ep_dispatch(rank, d, exp_d[rank], tag)
    d = snapshot(d)
    out = torch.full_like(xs[rank], float("nan"))
    if split:
        ep.combine(expert_outputs(d, rank, cfg), ws[rank], d.handle, out=out, phase="send")
        y = ep.combine(phase="recv")
    else:
        y = ep.combine(expert_outputs(d, rank, cfg), ws[rank], d.handle, out=out)
    if not torch.equal(y, exp_y[rank]):
        errs.append(f"{tag}: combine differs from the reference by {(y.float() - exp_y[rank].float()).abs().max()}")
    return errs


def ep_round_trip(eps, case: Case) -> list[str]:
    """One checked dispatch -> combine of ``case`` on a loopback world's EPBuffers, phase by phase."""
    world = len(eps)
    cfg, fmt, cfmt, xs, idxs, ws, gs = inputs(case, world)
    exp_d, exp_y = expected_ep(cfg, fmt, cfmt, xs, idxs, ws, gs, world)
    for ep in eps:
        poison_ep(ep)
    for r, ep in enumerate(eps):
        ep.dispatch(xs[r], idxs[r], phase="send", global_scale=gs)
    ds = [snapshot(ep.dispatch(phase="recv")) for ep in eps]
    tag = f"loopback cfg{case.ci} {case.routing} seed{case.seed}"
    errs = [e for r in range(world) for e in check_ep_dispatch(r, ds[r], exp_d[r], f"{tag} rank{r}")]
    for r, ep in enumerate(eps):
        ep.combine(expert_outputs(ds[r], r, cfg), ws[r], ds[r].handle, phase="send")
    ys = [ep.combine(phase="recv") for ep in eps]
    return errs + [f"{tag} rank{r}: combine differs" for r in range(world) if not torch.equal(ys[r], exp_y[r])]


def run_ep_loopback(groups, every: int = 2) -> list[str]:
    bufs = {}
    return [e for case in cases(len(groups), every)
            for e in ep_round_trip(bufs.setdefault(case.ci, [make_ep(g, case.ci) for g in groups]), case)]


# ---- PrefillBuffer ---------------------------------------------------------------------------------------

def make_prefill(group, ci: int) -> PrefillBuffer:
    cfg, fmt, cfmt = CONFIGS[ci]
    return PrefillBuffer(group, cfg.experts_per_rank * group.world_size, cfg.hidden, cfg.max_tokens, cfg.topk,
                         dtype=cfg.dtype, dispatch_format=fmt, combine_format=cfmt)


def poison_prefill(buf: PrefillBuffer) -> None:
    buf._ensure_allocated()
    buf._dispatch_ch.data.local.fill_(-1)   # all ones: NaN in every float format; e4m3 scales NaN
    for zone in buf._zones:
        zone.src_tokens.fill_(-7)
        zone.counts.fill_(-7)


def expected_prefill(cfg, fmt, cfmt, xs, idxs, ws, gs, world):
    E = cfg.experts_per_rank * world
    exp_d = reference.prefill_dispatch(xs, idxs, ws, E, cfg.max_tokens, fp8=fmt == "e4m3", nvfp4_scale=gs)
    parts = [partial_rows(e["x"], e["scales"], gs, r, cfg.dtype) for r, e in enumerate(exp_d)]
    return exp_d, reference.prefill_combine(parts, idxs, E, cfg.max_tokens, fp8=cfmt == "e4m3")


def check_prefill_dispatch(d, exp, tag) -> list[str]:
    errs = []
    if not torch.equal(d.src_tokens.cpu(), exp["src_tokens"]) or not torch.equal(d.expert_counts.cpu(),
                                                                                  exp["expert_counts"]):
        errs.append(f"{tag}: counts differ")
    v = exp["valid"]
    if not same_bytes(d.recv_x[v].cpu(), exp["x"][v]):
        errs.append(f"{tag}: recv_x differs in {int(v.sum())} valid rows")
    if exp["scales"] is not None and not same_bytes(d.recv_scales[v].cpu(), exp["scales"][v]):
        errs.append(f"{tag}: recv_scales differ")
    return errs


def prefill_expert_out(d, exp, rank, cfg) -> torch.Tensor:
    """partial_rows of what this rank received (a tensor of its own), NaN where the combine must not read."""
    out = partial_rows(d.recv_x, d.recv_scales, d.global_scale, rank, cfg.dtype)
    out[~exp["valid"]] = float("nan")
    return out


def run_prefill_shm(group, every: int = 2) -> list[str]:
    world, rank = group.world_size, group.rank
    errs, bufs = [], {}
    for case in cases(world, every):
        cfg, fmt, cfmt, xs, idxs, ws, gs = inputs(case, world)
        buf = bufs.setdefault(case.ci, make_prefill(group, case.ci))
        exp_d, exp_y = expected_prefill(cfg, fmt, cfmt, xs, idxs, ws, gs, world)
        tag = f"rank{rank} cfg{case.ci} {case.routing} seed{case.seed}"
        # The zone is read by the peers' combines of the previous case until they return, and written by
        # their dispatches of this one as soon as every combine released it: poison between two barriers.
        group.barrier()
        poison_prefill(buf)
        group.barrier()
        d = buf.dispatch(xs[rank], idxs[rank], ws[rank], global_scale=gs)
        errs += check_prefill_dispatch(d, exp_d[rank], tag)
        y = buf.combine(prefill_expert_out(d, exp_d[rank], rank, cfg), d.handle)
        if not torch.equal(y, exp_y[rank]):
            errs.append(f"{tag}: combine differs from the reference")
    for buf in bufs.values():
        buf.close()
    return errs


def prefill_round_trip(bufs, case: Case) -> list[str]:
    """One checked dispatch -> combine of ``case`` on a loopback world's PrefillBuffers, phase by phase."""
    world = len(bufs)
    cfg, fmt, cfmt, xs, idxs, ws, gs = inputs(case, world)
    exp_d, exp_y = expected_prefill(cfg, fmt, cfmt, xs, idxs, ws, gs, world)
    for b in bufs:
        poison_prefill(b)
    for r, b in enumerate(bufs):
        b.dispatch(xs[r], idxs[r], ws[r], phase="send", global_scale=gs)
    ds = [b.dispatch(phase="recv") for b in bufs]
    tag = f"loopback cfg{case.ci} {case.routing} seed{case.seed}"
    errs = [e for r, d in enumerate(ds) for e in check_prefill_dispatch(d, exp_d[r], f"{tag} rank{r}")]
    for r, (b, d) in enumerate(zip(bufs, ds)):
        b.combine(prefill_expert_out(d, exp_d[r], r, cfg), d.handle, phase="send")
    ys = [b.combine(phase="recv") for b in bufs]
    return errs + [f"{tag} rank{r}: combine differs" for r in range(world) if not torch.equal(ys[r], exp_y[r])]


def run_prefill_loopback(groups, every: int = 2) -> list[str]:
    bufs = {}
    return [e for case in cases(len(groups), every)
            for e in prefill_round_trip(bufs.setdefault(case.ci, [make_prefill(g, case.ci) for g in groups]), case)]
