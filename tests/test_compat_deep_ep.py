"""moe_comm.compat.deep_ep against DeepEP's own low-latency test semantics, checked exactly.

Tokens carry their source rank (first 128 columns: rank - 128) and their index (last 128 columns), as in
DeepEP's tests/legacy/test_low_latency.py; random tokens are checked against moe_comm.reference. Per local
expert: recv_count, the cumulative statistics, src_info, layout_range (every source rank's run), the rows
(bf16 bitwise; fp8 data and scales bitwise against reference.quantize_fp8 in each of DeepEP's formats:
use_fp8, round_scale, round_scale + use_ue8m0 (packed int32 scales), scales column-major), then the
combine bitwise against reference.combine. Loopback worlds 1-4 (hooks: every rank's call, then every
rank's hook), and shm world 2 in separate processes through a torch.distributed ProcessGroup, as DeepEP
is called (no hooks, async_finish events, then hooks).
"""

from __future__ import annotations

import os

import pytest
import torch

import moe_comm
from moe_comm import CommTimeoutError, LaunchError, formats
from moe_comm import reference
from moe_comm.compat import deep_ep
from moe_comm.compat.deep_ep_layout import split_range

from budget import sweep

RANK_OFFSET = 128   # DeepEP's test: token values rank - 128 stay exact in bf16 and fp8
HIDDEN = 512        # [rank - 128] * 384 columns, then [token index] * 128 columns (a whole UE8M0 word)
LOCAL_EXPERTS = 3   # experts per rank (not a power of two)
MAX_TOKENS = 5      # num_max_dispatch_tokens_per_rank


def _sizes(world):
    E = LOCAL_EXPERTS * world
    return E, min(4, E)


def make_inputs(world: int, seed: int, marked: bool):
    """Every rank's (x, topk_idx, topk_weights): distinct experts per token (top-k of random scores), about
    a fifth of the slots -1, token counts M, M-1, 0, 1 across ranks."""
    E, K = _sizes(world)
    xs, idxs, ws = [], [], []
    for r in range(world):
        g = torch.Generator().manual_seed(seed * 100 + r)
        T = (MAX_TOKENS, MAX_TOKENS - 1, 0, 1)[(seed + r) % 4]
        if marked:
            x = torch.full((T, HIDDEN), float(r - RANK_OFFSET), dtype=torch.bfloat16)
            x[:, -128:] = torch.arange(T, dtype=torch.bfloat16).view(-1, 1)
        else:
            x = (torch.randn(T, HIDDEN, generator=g) * 2).to(torch.bfloat16)
        idx = torch.topk(torch.rand(T, E, generator=g), K, dim=-1).indices
        idx[torch.rand(T, K, generator=g) < 0.2] = -1
        xs.append(x)
        idxs.append(idx if (seed + r) % 2 else idx.to(torch.int32))
        ws.append(torch.rand(T, K, generator=g))
    return xs, idxs, ws


def ll_flags(fmt) -> dict:
    """DeepEP's low-latency flags of a dispatch format (False = bf16; ``moe_comm.formats``)."""
    return dict(use_fp8=bool(fmt), round_scale=fmt in (formats.E4M3_POW2, formats.E4M3_UE8M0),
                use_ue8m0=fmt == formats.E4M3_UE8M0)


def as_bf16(recv, fp8) -> torch.Tensor:
    """DeepEP's ``per_token_cast_back`` of the received rows (bf16 as is): the simulated expert output."""
    if not fp8:
        return recv.clone()
    data, scales = recv
    return reference.dequantize_fp8(data, scales.contiguous()).to(torch.bfloat16)


def check_dispatch(rank, out, xs, idxs, fp8, stats, calls, tag, exact=True) -> list[str]:
    recv, recv_count, handle, _event, _hook = out
    scale_strides = recv[1].stride() if fp8 else None
    if recv_count.device.type != "cpu":   # a GPU run: compare on the host
        recv = (recv[0].cpu(), recv[1].cpu()) if fp8 else recv.cpu()
        recv_count, stats = recv_count.cpu(), None if stats is None else stats.cpu()
        handle = (handle[0].cpu(), handle[1].cpu(), *handle[2:])
    world = len(xs)
    E, _ = _sizes(world)
    L, R = LOCAL_EXPERTS, world * MAX_TOKENS
    errs = []
    if tuple(handle[2:]) != (MAX_TOKENS, HIDDEN, E):
        errs.append(f"{tag}: handle sizes {tuple(handle[2:])}")
    data = recv[0] if fp8 else recv
    if tuple(data.shape) != (L, R, HIDDEN) or data.dtype != (torch.float8_e4m3fn if fp8 else torch.bfloat16):
        return errs + [f"{tag}: recv_x {tuple(data.shape)} {data.dtype}"]
    S = formats.scale_columns(formats.fp8_name(fp8), HIDDEN)
    if fp8 and (tuple(recv[1].shape) != (L, R, S) or scale_strides != (S * R, 1, R)
                or recv[1].dtype != formats.scale_dtype(formats.fp8_name(fp8))):
        errs.append(f"{tag}: scales {tuple(recv[1].shape)} {recv[1].dtype} strides {recv[1].stride()} (want "
                    f"column-major)")
    if recv_count.dtype != torch.int32 or tuple(recv_count.shape) != (L,):
        return errs + [f"{tag}: recv_count {recv_count.dtype} {tuple(recv_count.shape)}"]
    src_info, layout_range = handle[0], handle[1]
    begin, count = split_range(layout_range)
    quant = [reference.quantize_fp8(x, fmt=fp8) if fp8 and len(x) else None for x in xs]
    for e in range(L):
        gid = rank * L + e
        per_rank = [(idxs[j] == gid).sum().item() for j in range(world)]
        n = int(recv_count[e])
        if n != sum(per_rank):
            errs.append(f"{tag}: expert {gid} recv_count {n} != {sum(per_rank)}")
            continue
        if stats is not None and int(stats[e]) != calls * n:
            errs.append(f"{tag}: expert {gid} cumulative stats {int(stats[e])} != {calls} * {n}")
        if count[e].tolist() != per_rank or begin[e].tolist() != [sum(per_rank[:j]) for j in range(world)]:
            errs.append(f"{tag}: expert {gid} layout_range {begin[e].tolist()} {count[e].tolist()} for {per_rank}")
            continue
        for j in range(world):
            b, c = int(begin[e, j]), int(count[e, j])
            tokens = [t for t in range(len(xs[j])) if gid in idxs[j][t].tolist()]
            got = src_info[e, b:b + c].tolist()
            if got != tokens:
                errs.append(f"{tag}: expert {gid} from rank {j}: src_info {got} != {tokens}")
                continue
            if not c:
                continue
            if fp8:
                q, s = quant[j]
                ok = reference.fp8_codes_match(recv[0][e, b:b + c], q[tokens], exact) and torch.equal(recv[1][e, b:b + c], s[tokens])
            else:
                ok = torch.equal(recv[e, b:b + c], xs[j][tokens])
            if not ok:
                errs.append(f"{tag}: expert {gid} rows from rank {j} differ")
    return errs


def expected_combine(xs, idxs, ws, fp8):
    E, _ = _sizes(len(xs))
    exp_d = reference.dispatch(xs, idxs, E, MAX_TOKENS, fp8=fp8)
    eos = [as_bf16((d["x"], d["scales"]) if fp8 else d["x"], fp8) for d in exp_d]
    return reference.combine(eos, ws, idxs, E, MAX_TOKENS)


def combine_match(y: torch.Tensor, want: torch.Tensor, exact: bool) -> bool:
    """Bitwise on CPU; compiled, float32 sums may round differently (fused multiply-adds)."""
    return torch.equal(y, want) if exact else torch.allclose(y.float(), want.float(), rtol=1e-2, atol=1e-2)


FP8_FORMATS_PER_BUFFER = 3   # the tests dispatch every fp8 format on one Buffer: the hint covers one


def rdma_bytes(world: int) -> int:
    """The hint, plus its fp8 share once more for each further fp8 format (the module docstring's rule)."""
    E, _ = _sizes(world)
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, HIDDEN, world, E)
    return hint * FP8_FORMATS_PER_BUFFER


def make_buffers(groups, **kw):
    hint = rdma_bytes(groups[0].world_size)
    return [deep_ep.Buffer(g, num_nvl_bytes=0, num_rdma_bytes=hint, low_latency_mode=True,
                           num_qps_per_rank=LOCAL_EXPERTS, **kw) for g in groups]


# ---- loopback: every rank in this process, driven through the hooks --------------------------------

def _dispatch_all(bufs, xs, idxs, fp8, stats):
    outs = [b.low_latency_dispatch(x, i, MAX_TOKENS, _sizes(len(bufs))[0], s, return_recv_hook=True, **ll_flags(fp8))
            for b, x, i, s in zip(bufs, xs, idxs, stats)]
    for o in outs:
        o[4]()
    return outs


def _combine_all(bufs, gemm, idxs, ws, outs, **kw):
    res = [b.low_latency_combine(g, i, w, o[2], return_recv_hook=True, **kw)
           for b, g, i, w, o in zip(bufs, gemm, idxs, ws, outs)]
    for r in res:
        r[2]()
    return [r[0] for r in res]


def run_loopback(world: int, device: str = "cpu") -> list[str]:
    """Six rounds (bf16 and each fp8 format x marked/random tokens); on CPU every check is exact, compiled
    on a GPU fp8 codes may differ by one step (rounding ties) and combine sums by float32 rounding."""
    exact = device == "cpu"
    groups = moe_comm.init(backend="loopback", world_size=world, device=device)
    bufs = make_buffers(groups)
    errs = []
    for seed, (fp8, marked) in enumerate(((False, True), ("e4m3", True), (False, False), ("e4m3", False),
                                          ("e4m3-ue8m0", False), ("e4m3-pow2", True))):
        xs, idxs, ws = make_inputs(world, seed + 10 * world, marked)
        dx, di, dw = ([t.to(device) for t in ts] for ts in (xs, idxs, ws))
        stats = [torch.zeros(LOCAL_EXPERTS, dtype=torch.int32, device=device) for _ in range(world)]
        for call in (1, 2):  # twice, as DeepEP's test does: the statistics accumulate
            outs = _dispatch_all(bufs, dx, di, fp8, stats)
            for r, o in enumerate(outs):
                errs += check_dispatch(r, o, xs, idxs, fp8, stats[r], call,
                                       f"w{world} seed{seed} fp8={fp8} call{call}", exact)
        gemm = [as_bf16(o[0], fp8) for o in outs]
        want = expected_combine(xs, idxs, ws, fp8)
        outs_t = [torch.full((len(x), HIDDEN), float("nan"), dtype=torch.bfloat16, device=device) for x in xs]
        ys = [y.cpu() for y in _combine_all(bufs, gemm, di, dw, outs)]
        for b, o, g in zip(bufs, outs, gemm):  # zero copy: the expert outputs written into the buffer
            b.get_next_low_latency_combine_buffer(o[2])[:] = g
        ys_zero = [b.low_latency_combine(torch.empty_like(g), i, w, o[2], zero_copy=True, return_recv_hook=True,
                                         out=t) for b, g, i, w, o, t in zip(bufs, gemm, di, dw, outs, outs_t)]
        for r in ys_zero:
            r[2]()
        for r in range(world):
            tag = f"w{world} seed{seed} fp8={fp8} rank{r}"
            if not combine_match(ys[r], want[r], exact):
                errs.append(f"{tag}: combine differs from the reference")
            if ys_zero[r][0] is not outs_t[r] or not torch.equal(outs_t[r].cpu(), ys[r]):
                errs.append(f"{tag}: zero-copy combine with out= differs")
    return errs


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [1, 2, sweep(3), sweep(4)])
def test_loopback(world):
    assert run_loopback(world) == []


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_loopback_gpu(world):
    """The same rounds compiled on the GPU (loopback: every rank on one GPU)."""
    assert run_loopback(world, "cuda") == []


def test_two_dispatches_in_flight():
    """Two dispatches of one format before either combine (two micro-batches): both results stay valid,
    and each combine answers its own dispatch."""
    world = 2
    groups = moe_comm.init(backend="loopback", world_size=world, device="cpu")
    bufs = make_buffers(groups)
    none = [None] * world
    a, b = make_inputs(world, 3, False), make_inputs(world, 4, False)
    outs_a = _dispatch_all(bufs, a[0], a[1], False, none)
    outs_b = _dispatch_all(bufs, b[0], b[1], False, none)
    errs = []
    for r in range(world):
        errs += check_dispatch(r, outs_a[r], a[0], a[1], False, None, 1, f"a rank{r}")
        errs += check_dispatch(r, outs_b[r], b[0], b[1], False, None, 1, f"b rank{r}")
    assert errs == []
    for (xs, idxs, ws), outs in ((b, outs_b), (a, outs_a)):
        ys = _combine_all(bufs, [as_bf16(o[0], False) for o in outs], idxs, ws, outs)
        want = expected_combine(xs, idxs, ws, False)
        assert all(torch.equal(y, w) for y, w in zip(ys, want))


def test_hook_runs_once_and_handle_needs_it():
    groups = moe_comm.init(backend="loopback", world_size=1, device="cpu")
    (buf,) = make_buffers(groups)
    xs, idxs, ws = make_inputs(1, 1, True)
    out = buf.low_latency_dispatch(xs[0], idxs[0], MAX_TOKENS, LOCAL_EXPERTS, use_fp8=False, return_recv_hook=True)
    with pytest.raises(RuntimeError, match="hook"):
        buf.low_latency_combine(out[0], idxs[0], ws[0], out[2])
    out[4]()
    with pytest.raises(RuntimeError, match="already run"):
        out[4]()
    assert check_dispatch(0, out, xs, idxs, False, None, 1, "w1") == []
    y, event, hook = buf.low_latency_combine(out[0].clone(), idxs[0], ws[0], out[2], async_finish=True)
    assert hook is None
    event.current_stream_wait()
    assert torch.equal(y, expected_combine(xs, idxs, ws, False)[0])


def test_unsupported_arguments_raise_and_leave_the_group_usable():
    world = 2
    groups = moe_comm.init(backend="loopback", world_size=world, device="cpu")
    E, _ = _sizes(world)
    for kw in (dict(allow_nvlink_for_low_latency_mode=False), dict(allow_mnnvl=True), dict(comm=object())):
        with pytest.raises(NotImplementedError, match="not supported"):
            deep_ep.Buffer(groups[0], num_rdma_bytes=1 << 20, **kw)
    bufs = make_buffers(groups)
    xs, idxs, ws = make_inputs(world, 5, True)
    b = bufs[0]
    # Format flags DeepEP rejects or ignores, and a hidden UE8M0 cannot pack: ValueError naming the fix
    # (raised before the op is entered: every rank passes the same arguments and raises the same).
    for x, kw, match in ((xs[0], dict(use_fp8=False, round_scale=True), "pass use_fp8=True, or drop round_scale"),
                         (xs[0], dict(use_fp8=False, use_ue8m0=True), "pass use_fp8=True, or drop"),
                         (xs[0], dict(use_ue8m0=True), "use_ue8m0=True needs round_scale=True"),
                         (xs[0][:, :256], dict(round_scale=True, use_ue8m0=True), r"hidden % 512 == 0.*'e4m3-pow2'")):
        for bb in bufs:
            with pytest.raises(ValueError, match=match):
                bb.low_latency_dispatch(x, idxs[0], MAX_TOKENS, E, return_recv_hook=True, **kw)
    with pytest.raises(ValueError, match="MOE_COMM_TRACE=1"):   # wait costs need the flight recorder
        b.low_latency_dispatch(xs[0], idxs[0], MAX_TOKENS, E, return_recv_hook=True,
                               dispatch_wait_recv_cost_stats=torch.zeros(world, dtype=torch.int64))
    with pytest.raises(NotImplementedError, match="not supported"):
        b.get_comm_stream()
    # internode_dispatch is the normal mode's dispatch (across nodes, test_compat_deep_ep_internode.py): on a
    # loopback group of several ranks the normal mode is refused by name
    with pytest.raises(NotImplementedError, match="loopback group of several ranks.* is not supported"):
        b.internode_dispatch(xs[0])
    with pytest.raises(ValueError, match="async_finish and return_recv_hook"):
        b.low_latency_dispatch(xs[0], idxs[0], MAX_TOKENS, E, async_finish=True, return_recv_hook=True)
    with pytest.raises(ValueError, match="not a multiple"):
        b.low_latency_dispatch(xs[0], idxs[0], MAX_TOKENS, E + 1, return_recv_hook=True)
    with pytest.raises(ValueError, match="return_recv_hook=True"):  # loopback: several ranks, one process
        b.low_latency_dispatch(xs[0], idxs[0], MAX_TOKENS, E, use_fp8=False)
    outs = _dispatch_all(bufs, xs, idxs, "e4m3-ue8m0", [None] * world)   # nothing above broke the group
    assert [e for r, o in enumerate(outs) for e in check_dispatch(r, o, xs, idxs, "e4m3-ue8m0", None, 1, "after")] \
        == []
    with pytest.raises(NotImplementedError, match="not supported"):
        b.low_latency_combine(as_bf16(outs[0][0], True), idxs[0], ws[0], outs[0][2], use_logfmt=True)
    with pytest.raises(ValueError, match="MOE_COMM_TRACE=1"):
        b.low_latency_combine(as_bf16(outs[0][0], True), idxs[0], ws[0], outs[0][2], return_recv_hook=True,
                              combine_wait_recv_cost_stats=torch.zeros(world, dtype=torch.int64))
    ys = _combine_all(bufs, [as_bf16(o[0], True) for o in outs], idxs, ws, outs)
    assert all(torch.equal(y, w) for y, w in zip(ys, expected_combine(xs, idxs, ws, "e4m3-ue8m0")))


def test_rdma_budget_and_hint():
    groups = moe_comm.init(backend="loopback", world_size=2, device="cpu")
    xs, idxs, _ = make_inputs(2, 1, True)
    small = deep_ep.Buffer(groups[0], num_rdma_bytes=4096)
    with pytest.raises(ValueError, match=r"too small.*get_low_latency_rdma_size_hint"):
        small.low_latency_dispatch(xs[0], idxs[0], MAX_TOKENS, 2 * LOCAL_EXPERTS, return_recv_hook=True)
    groups = moe_comm.init(backend="loopback", world_size=1, device="cpu")
    # The hint covers both formats, two buffers each, up to 11 experts per token.
    E, K = 16, 11
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(2, 128, 1, E)
    buf = deep_ep.Buffer(groups[0], num_rdma_bytes=hint)
    x = torch.ones(2, 128, dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(2)])
    for fp8 in (False, True, False, True):
        buf.low_latency_dispatch(x, idx, 2, E, use_fp8=fp8)
    assert 0 < buf.symmetric_bytes <= hint


# ---- shm world 2: separate processes, a torch.distributed ProcessGroup, no hooks ---------------------

def shm_rank(group) -> list[str]:
    import torch.distributed as dist
    world, rank = group.world_size, group.rank
    (buf,) = make_buffers_pg(dist.group.WORLD, world)
    E, _ = _sizes(world)
    errs = []
    for seed, (fp8, hooks) in enumerate((("e4m3", False), (False, False), ("e4m3-ue8m0", True),
                                         ("e4m3-pow2", False))):
        xs, idxs, ws = make_inputs(world, 40 + seed, seed != 1)
        stats = torch.zeros(LOCAL_EXPERTS, dtype=torch.int32)
        out = buf.low_latency_dispatch(xs[rank], idxs[rank], MAX_TOKENS, E, stats, async_finish=not hooks,
                                       return_recv_hook=hooks, **ll_flags(fp8))
        out[4]() if hooks else out[3].current_stream_wait()
        errs += check_dispatch(rank, out, xs, idxs, fp8, stats, 1, f"shm rank{rank} seed{seed}")
        y, event, hook = buf.low_latency_combine(as_bf16(out[0], fp8), idxs[rank], ws[rank], out[2],
                                                 async_finish=not hooks, return_recv_hook=hooks)
        hook() if hooks else event.current_stream_wait()
        if not torch.equal(y, expected_combine(xs, idxs, ws, fp8)[rank]):
            errs.append(f"shm rank{rank} seed{seed}: combine differs from the reference")
    return errs


def make_buffers_pg(pg, world):
    return [deep_ep.Buffer(pg, 0, rdma_bytes(world), low_latency_mode=True, num_qps_per_rank=LOCAL_EXPERTS,
                           explicitly_destroy=True)]


@pytest.mark.timeout(240)
def test_shm_world2_process_group():
    errs = moe_comm.launch(shm_rank, 2, backend="shm", timeout_s=60)
    assert [e for r in errs for e in r] == []


def test_invalid_expert_id_raises_after_the_call_with_its_outputs():
    """An id outside [-1, E): the slot is not routed, the call completes, InvalidIndexError carries the
    DeepEP-style outputs (the other slots were delivered)."""
    groups = moe_comm.init(backend="loopback", world_size=1, device="cpu")
    (buf,) = make_buffers(groups)
    x = torch.ones(2, HIDDEN, dtype=torch.bfloat16)
    idx = torch.tensor([[0, LOCAL_EXPERTS + 5], [1, 2]])
    with pytest.raises(moe_comm.InvalidIndexError) as info:
        buf.low_latency_dispatch(x, idx, MAX_TOKENS, LOCAL_EXPERTS, use_fp8=False)
    recv_x, recv_count, handle, _event, hook = info.value.result
    assert recv_count.tolist() == [1, 1, 1] and hook is None
    y, _, _ = buf.low_latency_combine(recv_x.clone(), idx, torch.ones(2, 2), handle)
    assert torch.equal(y, torch.stack([x[0], 2 * x[1]]))   # the bad slot counts as not routed


def test_destroy_and_events():
    groups = moe_comm.init(backend="loopback", world_size=1, device="cpu")
    (kept,) = make_buffers(groups)
    with pytest.raises(RuntimeError, match="explicitly_destroy"):
        kept.destroy()
    (buf,) = make_buffers(groups, explicitly_destroy=True)
    xs, idxs, _ = make_inputs(1, 2, True)
    out = buf.low_latency_dispatch(xs[0], idxs[0], MAX_TOKENS, LOCAL_EXPERTS, async_finish=True)
    with out[3]:    # DeepEP's overlap idiom: the stream waits for the event on exit
        pass
    with pytest.raises(RuntimeError, match="async_finish"):
        buf.low_latency_dispatch(xs[0], idxs[0], MAX_TOKENS, LOCAL_EXPERTS)[3].current_stream_wait()
    deep_ep.Buffer.capture().current_stream_wait()
    buf.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        buf.low_latency_dispatch(xs[0], idxs[0], MAX_TOKENS, LOCAL_EXPERTS)


def test_wait_recv_cost_stats_add_each_calls_waits_per_source():
    """With the flight recorder on, ``dispatch_wait_recv_cost_stats`` / ``combine_wait_recv_cost_stats``
    (int64 [W]) grow by exactly what the op's wait statistics grew (ns per source rank), call after call."""
    world = 2
    groups = moe_comm.init(backend="loopback", world_size=world, device="cpu", trace=4)
    bufs = make_buffers(groups)
    E, _ = _sizes(world)
    costs = [[torch.zeros(world, dtype=torch.int64) for _ in range(2)] for _ in range(world)]
    for seed in (1, 2, 3):   # the third call reuses the first call's EPBuffer
        xs, idxs, ws = make_inputs(world, seed, False)
        outs = [b.low_latency_dispatch(x, i, MAX_TOKENS, E, use_fp8=False, return_recv_hook=True,
                                       dispatch_wait_recv_cost_stats=c[0])
                for b, x, i, c in zip(bufs, xs, idxs, costs)]
        for o in outs:
            o[4]()
        res = [b.low_latency_combine(o[0], i, w, o[2], return_recv_hook=True, combine_wait_recv_cost_stats=c[1])
               for b, o, i, w, c in zip(bufs, outs, idxs, ws, costs)]
        for r in res:
            r[2]()
    for b, (d_cost, c_cost) in zip(bufs, costs):
        eps = next(iter(b._pairs.values()))[0]   # the two EPBuffers the calls alternate between
        assert len(eps) == 2
        assert torch.equal(d_cost, sum(ep.dispatch_wait_stats[0] for ep in eps))
        assert torch.equal(c_cost, sum(ep.combine_wait_stats[0] for ep in eps))
        assert sum(ep.dispatch_wait_stats[1] for ep in eps).tolist() == [3, 3]
        assert (d_cost > 0).all() and (c_cost > 0).all()


# ---- rank masking (enable_shrink): a rank killed mid-decode, named, masked, the survivors exact ----------

def _masked_step(buf, group, step, kill_at):
    """One decode step of DeepEP-door code on this rank: dispatch, experts (x2), combine; rank 2 is killed
    at ``kill_at`` of step 1 ("dispatch": before its dispatch; "combine": between its dispatch and its
    combine, mid-decode). Returns ("exact" | "MISMATCH", masked ranks) against the reference with the
    masked ranks excluded, or ("named", rank, mask after masking it) when the step raised CommTimeoutError."""
    world, me = group.world_size, group.rank
    E, _ = _sizes(world)
    xs, idxs, ws = make_inputs(world, 60 + step, False)
    mask = torch.full((world,), -1, dtype=torch.int32)   # poisoned: the query must write every entry
    buf.low_latency_query_mask_buffer(mask)
    masked = {r for r in range(world) if mask[r]}
    try:
        if step == 1 and me == 2 and kill_at == "dispatch":
            os._exit(3)
        recv, count, handle, _, _ = buf.low_latency_dispatch(xs[me], idxs[me], MAX_TOKENS, E, use_fp8=False)
        if step == 1 and me == 2 and kill_at == "combine":
            os._exit(3)
        y, _, _ = buf.low_latency_combine((recv.float() * 2).to(torch.bfloat16), idxs[me], ws[me], handle)
    except CommTimeoutError as e:
        buf.low_latency_update_mask_buffer(e.peer, True)      # every survivor masks the rank it names
        buf.low_latency_update_mask_buffer(e.peer, True)      # masking a masked rank does nothing
        buf.low_latency_query_mask_buffer(mask)
        return ("named", e.peer, mask.tolist())
    exp = reference.dispatch(xs, idxs, E, MAX_TOKENS, excluded=masked)[me]
    exact = torch.equal(count, exp["counts"]) and all(
        torch.equal(recv[e, :n], exp["x"][e, :n]) for e, n in enumerate(exp["counts"].tolist()))
    eos = [(d["x"].float() * 2).to(torch.bfloat16) for d in reference.dispatch(xs, idxs, E, MAX_TOKENS, excluded=masked)]
    exact = exact and torch.equal(y, reference.combine(eos, ws, idxs, E, MAX_TOKENS, excluded=masked)[me])
    return ("exact" if exact else "MISMATCH", sorted(masked))


def _masking_rank(group, kill_at):
    buf = deep_ep.Buffer(group, 0, rdma_bytes(group.world_size), low_latency_mode=True,
                         num_qps_per_rank=LOCAL_EXPERTS, enable_shrink=True)
    return [_masked_step(buf, group, step, kill_at) for step in range(4)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kill_at", ["combine", sweep("dispatch")])
def test_shrink_a_killed_rank_is_named_masked_and_the_survivors_stay_exact(kill_at):
    """Issue 45 item 4, DeepEP's shrink test (tests/legacy/test_low_latency.py --shrink-test) on moe-comm's
    exclusion: three shm ranks serve decode steps through the door with enable_shrink=True; rank 2 is
    SIGKILL-equivalently ended (os._exit) in step 1, mid-decode (after its dispatch, before its combine)
    or before its dispatch. Every survivor's step 1 raises CommTimeoutError naming rank 2 (DeepEP would
    mask it inside the kernel and return; here the call is never silent), the survivor masks it with
    low_latency_update_mask_buffer, the query shows [0, 0, 1] (DeepEP's int32 mask, on the device), and
    steps 2 and 3 are exact among the survivors: the slots routed to rank 2's experts dropped, against
    moe_comm.reference with rank 2 excluded. What this shows: the mask API maps onto exclusion on one
    node (stores); not a NIC, nor a rank lost across nodes (issue 45 items 1-3)."""
    with pytest.raises(LaunchError) as info:
        moe_comm.launch(_masking_rank, 3, kill_at, backend="shm", timeout_s=1.5, grace_s=90)
    err = info.value
    assert sorted(err.failures) == [2] and "exit code 3" in err.failures[2]
    for rank in (0, 1):
        log = err.results[rank]
        assert log == [("exact", []), ("named", 2, [0, 0, 1]), ("exact", [2]), ("exact", [2])], (rank, log)


def test_mask_api_needs_shrink_and_maps_onto_exclusion():
    """Without enable_shrink the three mask methods raise (DeepEP asserts); with it: a bad rank or mask
    tensor is refused, masking a live rank excludes it (collective: every live rank masks it), the query
    writes DeepEP's int32 mask on the device, unmasking a live rank and cleaning an empty mask do nothing,
    unmasking a masked one (or cleaning then) is refused by name, and the survivors' calls are exact
    without the masked rank's slots."""
    world = 3
    groups = moe_comm.init(backend="loopback", world_size=world, device="cpu", timeout_s=5.0)
    plain = make_buffers(groups[:1])[0]
    for call in (lambda: plain.low_latency_update_mask_buffer(1, True),
                 lambda: plain.low_latency_query_mask_buffer(torch.zeros(world, dtype=torch.int32)),
                 plain.low_latency_clean_mask_buffer):
        with pytest.raises(RuntimeError, match="enable_shrink=True"):
            call()
    bufs = make_buffers(groups, enable_shrink=True)
    mask = torch.full((world,), -1, dtype=torch.int32)
    with pytest.raises(ValueError, match="not a rank of this group"):
        bufs[0].low_latency_update_mask_buffer(world, True)
    with pytest.raises(TypeError):
        bufs[0].low_latency_query_mask_buffer(torch.zeros(world, dtype=torch.int64))
    bufs[0].low_latency_update_mask_buffer(1, False)   # live: nothing to unmask
    bufs[0].low_latency_clean_mask_buffer()            # nothing masked: nothing to do
    bufs[0].low_latency_query_mask_buffer(mask)
    assert mask.tolist() == [0, 0, 0]
    # rank 2 masked by the survivors, each in its own thread (a loopback world: every rank in this process)
    import threading
    threads = [threading.Thread(target=b.low_latency_update_mask_buffer, args=(2, True)) for b in bufs[:2]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for b in bufs[:2]:
        b.low_latency_query_mask_buffer(mask)
        assert mask.tolist() == [0, 0, 1]
        with pytest.raises(NotImplementedError, match="never rejoins"):
            b.low_latency_update_mask_buffer(2, False)
        with pytest.raises(NotImplementedError, match="never rejoins"):
            b.low_latency_clean_mask_buffer()
    xs, idxs, ws = make_inputs(world, 7, False)
    E, _ = _sizes(world)
    live = bufs[:2]
    outs = [b.low_latency_dispatch(x, i, MAX_TOKENS, E, use_fp8=False, return_recv_hook=True)
            for b, x, i in zip(live, xs, idxs)]
    for o in outs:
        o[4]()
    exp = reference.dispatch(xs, idxs, E, MAX_TOKENS, excluded={2})
    for r, o in enumerate(outs):
        assert torch.equal(o[1], exp[r]["counts"])
    ys = _combine_all(live, [o[0].clone() for o in outs], idxs[:2], ws[:2], outs)
    want = reference.combine([d["x"] for d in exp], ws, idxs, E, MAX_TOKENS, excluded={2})
    assert all(torch.equal(y, w) for y, w in zip(ys, want))
