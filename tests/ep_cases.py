"""EPBuffer test cases shared by the shm (multi-process) and loopback (one-process) tests.

Every rank can rebuild every rank's inputs from the case seed, so each rank checks its own outputs
against ``moe_comm.reference`` and returns a list of mismatches (empty = pass). Outputs are poisoned
before every call, so rows the kernels should have written but did not stand out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_comm import reference


@dataclass(frozen=True)
class Config:
    """One EPBuffer's static sizes (num_experts = experts_per_rank * world)."""

    experts_per_rank: int
    hidden: int
    max_tokens: int
    topk: int
    dtype: torch.dtype = torch.bfloat16
    fp8: bool | str = False   # the fp8 dispatch format: False, True (= "e4m3") or an fp8 format of moe_comm.formats


# Experts per rank 3..16 (3, 5: not a power of two), hidden 128/256/512, topk 1/2/3/4, odd capacities;
# every fp8 format (moe_comm.formats): float32 amax/448 scales, power-of-two float32, packed UE8M0.
CONFIGS = (
    Config(4, 128, 7, 2),
    Config(8, 256, 5, 4, fp8=True),
    Config(16, 128, 3, 1),
    Config(4, 256, 4, 4, dtype=torch.float16),
    Config(5, 128, 3, 2, dtype=torch.float32),
    Config(4, 512, 3, 3, fp8="e4m3-ue8m0"),
    Config(3, 256, 3, 2, fp8="e4m3-pow2"),
)
FORMAT_CONFIGS = {i for i, c in enumerate(CONFIGS) if c.fp8}   # every fp8 format
# random: distinct experts, some -1; skewed: every token's k=0 goes to expert 0; one_rank: all of a
# token's experts live on one rank; dup: token 0 lists one expert twice (the rows keep k order);
# none: nothing routed.
ROUTINGS = ("random", "skewed", "one_rank", "dup", "none")


def token_counts(cfg: Config, world: int, seed: int) -> list[int]:
    """Tokens per rank: T = 0, 1, max and odd values all occur across cases and ranks."""
    m = cfg.max_tokens
    pool = [m, 0, 1, m - 1 if m % 2 == 0 else m, 3 % (m + 1), m]
    return [pool[(seed + r) % len(pool)] for r in range(world)]


def make_inputs(cfg: Config, world: int, routing: str, seed: int):
    """(xs, topk_idxs, topk_weights), one entry per rank, int64 and int32 ids alternating by rank."""
    g = torch.Generator().manual_seed(seed)
    E, K, L = cfg.experts_per_rank * world, cfg.topk, cfg.experts_per_rank
    xs, idxs, ws = [], [], []
    for r, T in enumerate(token_counts(cfg, world, seed)):
        x = (torch.randn(T, cfg.hidden, generator=g) * 3).to(cfg.dtype)
        idx = torch.full((T, K), -1, dtype=torch.int64)
        for t in range(T):
            if routing == "one_rank" and K <= L:
                rank = int(torch.randint(0, world, (1,), generator=g))
                idx[t] = rank * L + torch.randperm(L, generator=g)[:K]
            elif routing != "none":
                idx[t] = torch.randperm(E, generator=g)[:K]
        if routing == "random" and T:
            idx[torch.rand(T, K, generator=g) < 0.2] = -1
        elif routing == "skewed" and T:
            idx[:, 0] = 0
            idx[:, 1:][idx[:, 1:] == 0] = -1
        elif routing == "dup" and T and K >= 2:
            e = seed % E  # twice in token 0, nowhere else: stays within the capacity
            idx[idx == e] = -1
            idx[0, 1] = idx[0, 0] = e
        xs.append(x)
        idxs.append(idx.to(torch.int32) if (seed + r) % 2 else idx)
        ws.append(torch.rand(T, K, generator=g))
    return xs, idxs, ws


def poison(ep) -> None:
    """Fill the dispatch outputs of ``ep`` (a test-only look inside) with values no kernel writes."""
    if ep._allocated:
        if ep._x.dtype == torch.float8_e4m3fn:
            ep._x.view(torch.uint8).fill_(0x7F)  # NaN
            ep._scales.view(torch.int32).fill_(-1)   # NaN as float32; UE8M0 bytes 0xFF (NaN in UE8M0)
        else:
            ep._x.fill_(float("nan"))
        for s in ep._sets:
            s.src.fill_(-7)
            s.counts.fill_(-7)


def expert_fn(x: torch.Tensor, scales, first_expert: int, dtype: torch.dtype) -> torch.Tensor:
    """The 'experts': a per-global-expert elementwise map of the received rows (deterministic, so a
    token's output depends only on the token and the expert, whatever the world size)."""
    xf = reference.dequantize_fp8(x, scales) if scales is not None else x.float()
    L = x.shape[0]
    mult = 1 + ((first_expert + torch.arange(L)) % 5).float().view(L, 1, 1) * 0.25
    return (xf * mult + 0.5).to(dtype)


def expert_outputs(d, rank: int, cfg: Config) -> torch.Tensor:
    """expert_fn of a DispatchResult, with every row past a count set to NaN: combine must not read it."""
    out = expert_fn(d.x, d.scales, rank * cfg.experts_per_rank, cfg.dtype)
    for e, n in enumerate(d.counts.tolist()):
        out[e, n:] = float("nan")
    return out


def fp8_error_bound(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Largest |dequantized - x| e4m3 rounding allows: half an ulp (2**-4 relative) in the normal
    range, half the subnormal step (2**-10 * scale) below it (packed UE8M0 scales unpacked first)."""
    if scales.dtype == torch.int32:
        scales = reference.unpack_ue8m0(scales)
    s = scales.repeat_interleave(128, dim=-1)
    return x.float().abs() * 2.0 ** -4 + s * 2.0 ** -10


def check_dispatch(rank, d, exp, xs, cfg: Config, tag) -> list[str]:
    counts = d.counts.cpu()
    if counts.dtype != torch.int32 or not torch.equal(counts, exp["counts"]):
        return [f"{tag}: counts {counts.tolist()} != {exp['counts'].tolist()}"]
    errs = []
    m = cfg.max_tokens
    for e, n in enumerate(counts.tolist()):
        if not torch.equal(d.src[e, :n].cpu(), exp["src"][e, :n]):
            errs.append(f"{tag}: src of expert {e}: {d.src[e, :n].tolist()} != {exp['src'][e, :n].tolist()}")
            continue
        if cfg.fp8:
            if not (torch.equal(d.x[e, :n].view(torch.uint8), exp["x"][e, :n].view(torch.uint8))
                    and torch.equal(d.scales[e, :n], exp["scales"][e, :n])):
                errs.append(f"{tag}: fp8 rows or scales of expert {e} differ from the reference")
            src_rows = torch.stack([xs[s // m][s % m] for s in exp["src"][e, :n].tolist()]) if n else None
            if n:
                deq = reference.dequantize_fp8(d.x[e, :n], d.scales[e, :n])
                bound = fp8_error_bound(src_rows, d.scales[e, :n])
                if not bool(((deq - src_rows.float()).abs() <= bound).all()):
                    errs.append(f"{tag}: fp8 dequantization error of expert {e} above the bound")
        elif not torch.equal(d.x[e, :n].cpu(), exp["x"][e, :n]):
            errs.append(f"{tag}: rows of expert {e} differ")
    return errs


def snapshot(d):
    """Copies of what a check needs (d.x is overwritten by the next dispatch)."""
    return type(d)(d.x.clone(), None if d.scales is None else d.scales.clone(), d.counts.clone(),
                   d.src.clone(), d.handle)


def case_list(world: int):
    seed = 100 * world
    for ci, cfg in enumerate(CONFIGS):
        for ri, routing in enumerate(ROUTINGS):
            if (ci + ri + world) % 2:  # half the grid per world size: odd worlds one half, even the other
                continue
            seed += 13
            yield ci, cfg, routing, seed


def make_buffer(group, cfg: Config):
    from moe_comm import EPBuffer, formats
    return EPBuffer(group, cfg.experts_per_rank * group.world_size, cfg.hidden, cfg.max_tokens, cfg.topk,
                    dtype=cfg.dtype, dispatch_format=formats.fp8_name(cfg.fp8))


def run_shm_cases(group, configs=None) -> list[str]:
    """Every case on one rank of a launched group: dispatch, then combine, some split in two phases;
    one case per config also runs twice (phase='both', then split) and must give identical bits.
    ``configs``: indices into CONFIGS to run (default all)."""
    world, rank = group.world_size, group.rank
    errs, bufs = [], {}
    for ci, cfg, routing, seed in case_list(world):
        if configs is not None and ci not in configs:
            continue
        if ci not in bufs:
            bufs[ci] = make_buffer(group, cfg)
        ep = bufs[ci]
        xs, idxs, ws = make_inputs(cfg, world, routing, seed)
        E = cfg.experts_per_rank * world
        exp_d = reference.dispatch(xs, idxs, E, cfg.max_tokens, fp8=cfg.fp8)
        exp_eo = [expert_fn(exp_d[r]["x"], exp_d[r]["scales"], r * cfg.experts_per_rank, cfg.dtype)
                  for r in range(world)]
        exp_y = reference.combine(exp_eo, ws, idxs, E, cfg.max_tokens)[rank]
        results = []
        for split in ((False, True) if routing == "random" else (seed % 3 == 0,)):
            tag = f"rank{rank} cfg{ci} {routing} seed{seed} split={split}"
            poison(ep)
            if split:
                assert ep.dispatch(xs[rank], idxs[rank], phase="send") is None
                d = ep.dispatch(phase="recv")
            else:
                d = ep.dispatch(xs[rank], idxs[rank])
            errs += check_dispatch(rank, d, exp_d[rank], xs, cfg, tag)
            d = snapshot(d)
            eo = expert_outputs(d, rank, cfg)
            out = torch.full_like(xs[rank], float("nan"))
            if split:
                assert ep.combine(eo, ws[rank], d.handle, out=out, phase="send") is None
                y = ep.combine(phase="recv")
            else:
                y = ep.combine(eo, ws[rank], d.handle, out=out)
            if y is not out:
                errs.append(f"{tag}: combine did not write out= in place")
            if not torch.equal(y, exp_y):
                errs.append(f"{tag}: combine differs from the reference by {(y.float() - exp_y.float()).abs().max()}")
            results.append((d, y))
        if len(results) == 2:
            (d1, y1), (d2, y2) = results
            n = d1.counts.tolist()
            same = torch.equal(d1.counts, d2.counts) and torch.equal(y1, y2) and all(
                torch.equal(d1.x[e, :c].view(torch.uint8), d2.x[e, :c].view(torch.uint8)) for e, c in enumerate(n))
            if not same:
                errs.append(f"rank{rank} cfg{ci} seed{seed}: phase='both' and send+recv differ")
    for ep in bufs.values():
        ep.close()
    return errs


def run_loopback_cases(groups, configs=None) -> list[str]:
    """The same cases on a loopback world, driven phase by phase (every rank's send, then every recv);
    ``configs``: indices into CONFIGS to run (default all)."""
    world = len(groups)
    errs, bufs = [], {}
    for ci, cfg, routing, seed in case_list(world):
        if configs is not None and ci not in configs:
            continue
        if ci not in bufs:
            bufs[ci] = [make_buffer(g, cfg) for g in groups]
        errs += loopback_case(bufs[ci], cfg, routing, seed, f"loopback cfg{ci} {routing}")
    return errs


def loopback_case(eps, cfg: Config, routing: str, seed: int, tag: str) -> list[str]:
    """One checked dispatch -> combine of ``cfg``'s inputs on a loopback world's EPBuffers ``eps``."""
    world = len(eps)
    errs = []
    xs, idxs, ws = make_inputs(cfg, world, routing, seed)
    E = cfg.experts_per_rank * world
    exp_d = reference.dispatch(xs, idxs, E, cfg.max_tokens, fp8=cfg.fp8)
    for ep in eps:
        poison(ep)
    for r, ep in enumerate(eps):
        ep.dispatch(xs[r], idxs[r], phase="send")
    ds = [snapshot(ep.dispatch(phase="recv")) for ep in eps]
    for r in range(world):
        errs += check_dispatch(r, ds[r], exp_d[r], xs, cfg, f"{tag} rank{r}")
    eos = [expert_outputs(ds[r], r, cfg) for r in range(world)]
    for r, ep in enumerate(eps):
        ep.combine(eos[r], ws[r], ds[r].handle, phase="send")
    ys = [ep.combine(phase="recv") for ep in eps]
    exp_eo = [expert_fn(exp_d[r]["x"], exp_d[r]["scales"], r * cfg.experts_per_rank, cfg.dtype)
              for r in range(world)]
    exp_y = reference.combine(exp_eo, ws, idxs, E, cfg.max_tokens)
    for r in range(world):
        if not torch.equal(ys[r], exp_y[r]):
            errs.append(f"{tag} rank{r}: combine differs from the reference")
    return errs


def offset_copy(t: torch.Tensor, offset: int = 4) -> torch.Tensor:
    """A contiguous copy of ``t`` that starts ``offset`` bytes past a 16-byte boundary: a view into a larger
    buffer, as a caller slicing a packed tensor would pass (4: word-aligned but not 16-byte aligned; 2, for
    2-byte dtypes: not even on a 4-byte word). An empty ``t`` is cloned (it has no address to offset)."""
    if t.numel() == 0:
        return t.clone()
    flat = torch.empty(t.numel() * t.element_size() + 32, dtype=torch.uint8, device=t.device)
    start = (-flat.data_ptr()) % 16 + offset
    view = flat[start:start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
    view.copy_(t)
    return view


def record_launches(monkeypatch, record) -> list:
    """Make every ``moe_comm.launches.Launch`` built from now on append ``record(fn, args, grid)`` (``fn`` the
    ``@triton.jit`` kernel, ``args`` its positional arguments) to the returned list when it runs, then
    launch as it would have."""
    from moe_comm import launches  # noqa: PLC0415
    launched, kernel_for = [], launches.kernel_for

    def recording(fn, device):
        kernel = kernel_for(fn, device)

        class Recording:   # what a Launch calls: run(*args, grid, warmup, **options)
            def run(self, *args, grid, warmup, **kwargs):
                launched.append(record(fn, args, grid))
                return kernel.run(*args, grid=grid, warmup=warmup, **kwargs)
        return Recording()

    monkeypatch.setattr(launches, "kernel_for", recording)
    return launched
