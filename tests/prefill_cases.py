"""PrefillBuffer test cases shared by the shm (multi-process) and loopback (one-process) tests.

Inputs come from ``ep_cases.make_inputs`` (T = 0, 1, odd and the capacity across ranks; random ids with
-1, all tokens to expert 0, all of a token's experts on one rank, a duplicated expert, nothing routed).
Every rank rebuilds every rank's inputs from the seed and checks its own outputs against
``moe_comm.reference``; the zone and the counts are poisoned before every call.
"""

from __future__ import annotations

import torch

from moe_comm import PrefillBuffer, formats, reference
from moe_comm.topology import node_layout

from ep_cases import Config, make_inputs

CONFIGS = (
    Config(4, 128, 5, 2),                          # bf16
    Config(5, 256, 4, 4, fp8=True),                # fp8 dispatch, 2 scale groups, L not a power of two
    Config(2, 128, 3, 1, dtype=torch.float16),
    Config(3, 512, 3, 3, fp8="e4m3-ue8m0"),        # packed UE8M0 scales: one int32 word per row
    Config(4, 256, 2, 2, fp8="e4m3-pow2"),         # power-of-two float32 scales
)
# (config, routing) per world size: each routing and each config runs somewhere at every size.
CASES = ((0, "random"), (1, "skewed"), (2, "one_rank"), (0, "dup"), (1, "random"), (2, "none"), (3, "random"),
         (4, "dup"))


def make_buffer(group, cfg: Config, zones: int = 1) -> PrefillBuffer:
    return PrefillBuffer(group, cfg.experts_per_rank * group.world_size, cfg.hidden, cfg.max_tokens, cfg.topk,
                         dtype=cfg.dtype, dispatch_format=formats.fp8_name(cfg.fp8), zones=zones)


def poison(buf: PrefillBuffer) -> None:
    """Fill the landing zone and the counts (a test-only look inside) with values no kernel writes
    (allocating the buffer first: collective, so every rank poisons at the same point)."""
    buf._ensure_allocated()
    buf._dispatch_ch.data.local.fill_(-1)           # all ones: NaN in every float format, fp8 included
    for zone in buf._zones:
        zone.recv_idx.fill_(12345)                  # not -1, not a local id
        zone.src_tokens.fill_(-7)
        zone.counts.fill_(-7)


def partial_rows(x: torch.Tensor, scales, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """The 'experts' of rank ``rank``: a per-rank elementwise map of the received rows (dequantized with
    fp8), exact to compute the same way from the reference's rows."""
    xf = reference.dequantize_fp8(x, scales) if scales is not None else x.float()
    return (xf * (1 + 0.25 * rank) + 0.5).to(dtype)


def valid_rows(exp: dict) -> torch.Tensor:
    """bool [R]: the reference's rows that hold a token with an expert on this rank."""
    return exp["valid"]


def token_rows(exp: dict, m: int) -> torch.Tensor:
    """Row indices s*M + t, t < T_s, of every source (where ids and weights are defined)."""
    return torch.cat([torch.arange(s * m, s * m + int(n)) for s, n in enumerate(exp["src_tokens"].tolist())])


def check_dispatch(d, exp: dict, cfg: Config, tag: str) -> list[str]:
    errs = []
    if not torch.equal(d.src_tokens.cpu(), exp["src_tokens"]):
        errs.append(f"{tag}: src_tokens {d.src_tokens.tolist()} != {exp['src_tokens'].tolist()}")
    if not torch.equal(d.expert_counts.cpu(), exp["expert_counts"]):
        errs.append(f"{tag}: expert_counts {d.expert_counts.tolist()} != {exp['expert_counts'].tolist()}")
    rows = token_rows(exp, cfg.max_tokens)
    if not torch.equal(d.recv_topk_idx[rows].cpu(), exp["topk_idx"][rows]):
        errs.append(f"{tag}: recv_topk_idx differs")
    if not torch.equal(d.recv_topk_weights[rows].cpu(), exp["topk_weights"][rows]):
        errs.append(f"{tag}: recv_topk_weights differs")
    v = valid_rows(exp)
    if not torch.equal(d.recv_x[v].view(torch.uint8).cpu(), exp["x"][v].view(torch.uint8)):
        errs.append(f"{tag}: recv_x differs in {int(v.sum())} valid rows")
    if cfg.fp8 and not torch.equal(d.recv_scales[v].cpu(), exp["scales"][v]):
        errs.append(f"{tag}: recv_scales differ")
    return errs


def ranks_per_node(group):
    """G of a group with put peers (nodes of G ranks: the combine's order, reference.prefill_combine), or
    None for one node."""
    if not group.uses_put or group.world_size == 1:
        return None
    return node_layout(group.transports, group.rank).ranks_per_node


def expected(cfg: Config, world: int, xs, idxs, ws, nodes=None, excluded=()):
    """(reference dispatch per rank, reference partial rows per rank, reference combine per rank); ``nodes``:
    ranks per node of a group with put peers (``ranks_per_node``)."""
    E = cfg.experts_per_rank * world
    exp_d = reference.prefill_dispatch(xs, idxs, ws, E, cfg.max_tokens, fp8=cfg.fp8, excluded=excluded)
    parts = [partial_rows(e["x"], e["scales"], r, cfg.dtype) for r, e in enumerate(exp_d)]
    return exp_d, parts, reference.prefill_combine(parts, idxs, E, cfg.max_tokens, excluded, nodes)


def expert_out(d, exp: dict, rank: int, cfg: Config) -> torch.Tensor:
    """partial_rows of what this rank received, NaN in every row the combine must not read."""
    out = partial_rows(d.recv_x, d.recv_scales, rank, cfg.dtype)
    out[~valid_rows(exp)] = float("nan")
    return out


def run_shm_cases(group) -> list[str]:
    """Every case of this world size on one rank of a launched group (phase='both')."""
    world, rank = group.world_size, group.rank
    errs, bufs = [], {}
    for i, (ci, routing) in enumerate(CASES):
        cfg = CONFIGS[ci]
        buf = bufs.setdefault(ci, make_buffer(group, cfg))
        seed = 1000 * world + i
        xs, idxs, ws = make_inputs(cfg, world, routing, seed)
        exp_d, _, exp_y = expected(cfg, world, xs, idxs, ws, ranks_per_node(group))
        tag = f"rank{rank} cfg{ci} {routing} seed{seed}"
        group.barrier()   # every peer has read this zone's partial rows of the previous call: poison after
        poison(buf)
        group.barrier()   # peers write this zone as soon as every combine released it: poison first
        d = buf.dispatch(xs[rank], idxs[rank], ws[rank])
        errs += check_dispatch(d, exp_d[rank], cfg, tag)
        y = buf.combine(expert_out(d, exp_d[rank], rank, cfg), d.handle)
        if not torch.equal(y, exp_y[rank]):
            errs.append(f"{tag}: combine differs from the reference")
    for buf in bufs.values():
        buf.close()
    return errs


def round_trip(bufs, cfg: Config, xs, idxs, ws, tag: str) -> list[str]:
    """One checked dispatch -> combine on a loopback world, phase by phase."""
    world = len(bufs)
    exp_d, _, exp_y = expected(cfg, world, xs, idxs, ws, ranks_per_node(bufs[0].group))
    for b in bufs:
        poison(b)
    for b, x, i, w in zip(bufs, xs, idxs, ws):
        assert b.dispatch(x, i, w, phase="send") is None
    ds = [b.dispatch(phase="recv") for b in bufs]
    errs = [e for r, d in enumerate(ds) for e in check_dispatch(d, exp_d[r], cfg, f"{tag} rank{r}")]
    eos = [expert_out(d, exp_d[r], r, cfg) for r, d in enumerate(ds)]
    for b, eo, d in zip(bufs, eos, ds):
        assert b.combine(eo, d.handle, phase="send") is None
    ys = [b.combine(phase="recv") for b in bufs]
    errs += [f"{tag} rank{r}: combine differs" for r in range(world) if not torch.equal(ys[r], exp_y[r])]
    return errs


def run_loopback_cases(groups) -> list[str]:
    world = len(groups)
    errs, bufs = [], {}
    for i, (ci, routing) in enumerate(CASES):
        cfg = CONFIGS[ci]
        if ci not in bufs:
            bufs[ci] = [make_buffer(g, cfg) for g in groups]
        seed = 2000 * world + i
        errs += round_trip(bufs[ci], cfg, *make_inputs(cfg, world, routing, seed), f"loopback cfg{ci} {routing}")
    return errs


CHUNK_TOKENS = (11, 4, 7, 0)   # tokens per rank of the chunked case, M = 5: 3 chunks, the last one partial


def run_chunked_case(group) -> list[str]:
    """prefill_moe over 3 chunks (T > capacity on rank 0, one chunk's worth on rank 1), in sequence (one
    zone) and overlapped (two zones), equals the reference for one call with room for every token."""
    from moe_comm.prefill_chunks import num_chunks, prefill_moe
    world, rank, cfg = group.world_size, group.rank, CONFIGS[0]
    g = torch.Generator().manual_seed(77)
    E, K = cfg.experts_per_rank * world, cfg.topk
    xs = [torch.randn(T, cfg.hidden, generator=g).to(cfg.dtype) for T in CHUNK_TOKENS[:world]]
    idxs = [torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(x.shape[0])]) if x.shape[0]
            else torch.zeros(0, K, dtype=torch.int64) for x in xs]
    ws = [torch.rand(x.shape[0], K, generator=g) for x in xs]
    big = max(CHUNK_TOKENS)
    exp_d = reference.prefill_dispatch(xs, idxs, ws, E, big)
    parts = [partial_rows(e["x"], None, r, cfg.dtype) for r, e in enumerate(exp_d)]
    want = reference.prefill_combine(parts, idxs, E, big, ranks_per_node=ranks_per_node(group))[rank]
    errs = []
    for zones in (1, 2):
        buf = make_buffer(group, cfg, zones)
        seen = []

        def experts(d):
            seen.append(d.handle.zone)
            return partial_rows(d.recv_x, None, rank, cfg.dtype)

        y = prefill_moe(buf, xs[rank], idxs[rank], ws[rank], experts, num_chunks(big, buf))
        buf.close()
        if not torch.equal(y, want):
            errs.append(f"rank{rank} zones={zones}: chunked prefill differs from the reference")
        if seen != [c % zones for c in range(3)]:
            errs.append(f"rank{rank} zones={zones}: chunks used zones {seen}")
    return errs


SLOW_RANK_S = 1.0   # the slow rank's pause between its combine's send and receive phases


def run_slow_reader_case(group) -> dict:
    """``slow_reader`` with one zone and with two: {zones: its result}."""
    return {zones: slow_reader(group, zones) for zones in (1, 2)}


def slow_reader(group, zones: int) -> dict:
    """World 2: rank 1 pauses between the send and the receive of a combine; rank 0's next dispatch into
    the same zone must not finish its send before rank 1's combine receive has begun (the device wait on
    every rank's ``released`` word). With zones=2 the calls are pipelined (dispatch b before combine a,
    dispatch c into a's zone). Returns the times and the errors against the reference."""
    import time
    rank, cfg = group.rank, CONFIGS[0]
    buf = make_buffer(group, cfg, zones)
    calls = [make_inputs(cfg, 2, "random", 300 + i) for i in range(3)]
    exp = [expected(cfg, 2, *c) for c in calls]
    errs, t = [], {}
    poison(buf)
    group.barrier()

    def dispatch(i, phase="both"):
        xs, idxs, ws = calls[i]
        return buf.dispatch(xs[rank], idxs[rank], ws[rank], phase=phase)

    def combine(i, d):
        y = buf.combine(expert_out(d, exp[i][0][rank], rank, cfg), d.handle)
        if not torch.equal(y, exp[i][2][rank]):
            errs.append(f"rank{rank} zones={zones} call {i}: combine differs from the reference")

    ds = {0: dispatch(0)}
    if zones == 2:
        ds[1] = dispatch(1)
    buf.combine(expert_out(ds[0], exp[0][0][rank], rank, cfg), ds[0].handle, phase="send")
    if rank == 1:
        time.sleep(SLOW_RANK_S)
    t["read_begins"] = time.monotonic()
    y = buf.combine(phase="recv")
    if not torch.equal(y, exp[0][2][rank]):
        errs.append(f"rank{rank} zones={zones} call 0: combine differs from the reference")
    nxt = 2 if zones == 2 else 1           # the next dispatch into call 0's zone
    dispatch(nxt, phase="send")
    t["next_sent"] = time.monotonic()
    ds[nxt] = buf.dispatch(phase="recv")
    for i in sorted(ds)[1:]:
        errs += check_dispatch(ds[i], exp[i][0][rank], cfg, f"rank{rank} zones={zones} call {i}")
        combine(i, ds[i])
    buf.close()
    return dict(errs=errs, **t)
