"""EPBuffer dispatch / combine compiled on a GPU, against ``moe_comm.reference``.

World 1 on the nvshmem heap, worlds 2-8 on the loopback heap; T = 0 / 1 / odd; bf16 and fp8 dispatch;
outputs poisoned before every checked call (a row the kernels forget shows); CUDA-graph capture and
replay with new routing; a 10 000-step randomized dispatch -> combine soak checked at every step.
Skipped without CUDA (conftest). Inputs are fresh per case, from seeded generators.
"""

import random

import pytest
import torch

import moe_comm
from moe_comm import reference

EPBuffer = pytest.importorskip("moe_comm.ep").EPBuffer
pytestmark = pytest.mark.gpu
if not hasattr(reference, "ep_rows"):
    pytest.skip("moe_comm.reference has no EP reference", allow_module_level=True)

DEV = "cuda:0"  # with its index: tensors made on "cuda" report cuda:0, and the op checks compare devices


# ---- inputs, driving, poisoning --------------------------------------------------------------------

def make_inputs(tokens, num_experts, topk, hidden, seed):
    """Per rank: x [T_r, hidden] bf16, topk_idx [T_r, topk] int64 (distinct experts per token, about one
    slot in eight -1), topk_weights [T_r, topk] float32; all on the GPU."""
    g = torch.Generator().manual_seed(seed)
    xs, idxs, ws = [], [], []
    for t in tokens:
        xs.append(torch.randn(t, hidden, generator=g).to(torch.bfloat16).to(DEV))
        idx = torch.rand(t, num_experts, generator=g).topk(topk, dim=1).indices
        idx[torch.rand(idx.shape, generator=g) < 0.125] = -1
        idxs.append(idx.to(DEV))
        ws.append(torch.rand(t, topk, generator=g).to(DEV))
    return xs, idxs, ws


def dispatch_all(eps, xs, idxs):
    if eps[0].group.backend != "loopback":
        return [ep.dispatch(x, i) for ep, x, i in zip(eps, xs, idxs)]
    for ep, x, i in zip(eps, xs, idxs):
        assert ep.dispatch(x, i, phase="send") is None
    return [ep.dispatch(phase="recv") for ep in eps]


def combine_all(eps, expert_outs, ws, ds, outs=None):
    outs = outs or [None] * len(eps)
    if eps[0].group.backend != "loopback":
        return [ep.combine(eo, w, d.handle, out=o) for ep, eo, w, d, o in zip(eps, expert_outs, ws, ds, outs)]
    for ep, eo, w, d in zip(eps, expert_outs, ws, ds):
        assert ep.combine(eo, w, d.handle, phase="send") is None
    return [ep.combine(out=o, phase="recv") for ep, o in zip(eps, outs)]


def toy_experts(ep, d):
    """Global expert e multiplies its rows by (e + 1) / 4 (fp8 rows dequantized first): [E_local, R, H] bf16."""
    L = ep.num_local_experts
    f = (torch.arange(L, device=DEV, dtype=torch.float32) + ep.group.rank * L + 1) / 4
    x = d.x.float()
    if d.scales is not None:
        x = (x.unflatten(-1, (-1, 128)) * d.scales.unsqueeze(-1)).flatten(-2)
    return (x * f.view(-1, 1, 1)).to(torch.bfloat16)


def poison(ds):
    """Overwrite everything a dispatch returned, so that the next call must rewrite what it claims."""
    for d in ds:
        d.x.view(torch.uint8).fill_(0x7F)  # bf16 3.4e38 / fp8 e4m3fn NaN
        if d.scales is not None:
            d.scales.fill_(float("nan"))
        d.src.fill_(-7)
        d.counts.fill_(-7)


def sync_check(eps):
    if torch.device(DEV).type == "cuda":
        torch.cuda.synchronize()
    for ep in eps:
        ep.group.check()


# ---- checks ----------------------------------------------------------------------------------------

def check_dispatch(ds, xs, idxs, num_experts, max_tokens, fp8):
    rows = reference.ep_rows([i.cpu() for i in idxs], num_experts, max_tokens)
    for r, d in enumerate(ds):
        want_counts = torch.tensor([len(lst) for lst in rows[r]], dtype=torch.int32)
        assert torch.equal(d.counts.cpu(), want_counts), f"rank {r}: counts"
        pick = [(e, i, s, t) for e, lst in enumerate(rows[r]) for i, (s, t, _k) in enumerate(lst)]
        if not pick:
            continue
        e_i, r_i, s_i, t_i = (torch.tensor(c, device=DEV) for c in zip(*pick))
        assert torch.equal(d.src[e_i, r_i].cpu(), (s_i * max_tokens + t_i).int().cpu()), f"rank {r}: src"
        want = torch.stack([xs[s][t] for _e, _i, s, t in pick]).cpu()
        got = d.x[e_i, r_i].cpu()
        if not fp8:
            assert torch.equal(got, want), f"rank {r}: rows"
            continue
        q, scales = reference.quantize_fp8(want)
        assert torch.equal(d.scales[e_i, r_i].cpu(), scales), f"rank {r}: fp8 scales"
        assert reference.fp8_codes_match(got, q, exact=False, max_fraction=1e-3), f"rank {r}: fp8 rows"


def check_combine(ys, expert_outs, ws, idxs, num_experts, max_tokens):
    want = reference.combine(expert_outs, [w.cpu() for w in ws], [i.cpu() for i in idxs], num_experts, max_tokens)
    for r, (y, yw) in enumerate(zip(ys, want)):
        assert y.shape == yw.shape, f"rank {r}: combine shape"
        # Same float32 products summed in the same k order; only FMA contraction can move the last bit.
        torch.testing.assert_close(y.cpu().float(), yw.float(), rtol=1e-2, atol=1e-2, msg=f"rank {r}: combine")


def run_case(eps, tokens, num_experts, topk, hidden, max_tokens, fp8, seed):
    """Two rounds with fresh inputs; every output of round 1 is poisoned before round 2."""
    for rnd in range(2):
        xs, idxs, ws = make_inputs(tokens[rnd], num_experts, topk, hidden, seed * 10 + rnd)
        ds = dispatch_all(eps, xs, idxs)
        sync_check(eps)
        check_dispatch(ds, xs, idxs, num_experts, max_tokens, fp8)
        eos = [toy_experts(ep, d) for ep, d in zip(eps, ds)]
        outs = [torch.full((len(x), hidden), float("nan"), dtype=torch.bfloat16, device=DEV) for x in xs]
        ys = combine_all(eps, eos, ws, ds, outs)
        sync_check(eps)
        assert all(y.data_ptr() == o.data_ptr() for y, o in zip(ys, outs) if len(o)), "combine ignored out="
        check_combine(ys, eos, ws, idxs, num_experts, max_tokens)
        poison(ds)


# ---- world 1, nvshmem heap -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def nvshmem_group():
    pytest.importorskip("nvshmem.core")
    g = moe_comm.init(backend="nvshmem", timeout_s=10)
    yield g
    g.close()


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
# "long": more tokens than the dispatch has programs (132), so programs walk several tokens and carry
# their running expert counts from one to the next.
@pytest.mark.parametrize("shape", [(256, 8, 7168, 128), (16, 4, 256, 9), (64, 8, 512, 300)],
                         ids=["dsv3", "small", "long"])
def test_world1_nvshmem(nvshmem_group, shape, fp8):
    E, K, H, M = shape
    ep = EPBuffer(nvshmem_group, E, H, M, K, dtype=torch.bfloat16, fp8_dispatch=fp8)
    try:
        for seed, t in enumerate((0, 1, 7, M)):
            run_case([ep], [[t], [M - t]], E, K, H, M, fp8, seed)
    finally:
        ep.close()


# ---- worlds 2-8, loopback heap ---------------------------------------------------------------------

TOKENS = (0, 1, 7, 9, 3, 5, 8, 2)  # per rank: empty, one, odd, full (M = 9)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("hidden", [256, 7168])
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_loopback_compiled(world, hidden, fp8):
    E, K, M = 8 * world, 4, 9
    groups = moe_comm.init(backend="loopback", world_size=world, device=DEV, timeout_s=10)
    eps = [EPBuffer(g, E, hidden, M, K, dtype=torch.bfloat16, fp8_dispatch=fp8) for g in groups]
    for seed in range(2):
        tokens = [[TOKENS[(r + seed + rnd) % len(TOKENS)] for r in range(world)] for rnd in range(2)]
        run_case(eps, tokens, E, K, hidden, M, fp8, seed)
    for ep in eps:
        ep.close()


def _misaligned(t):
    """``t`` copied to a view that starts 4 bytes past a 16-byte boundary (compiled kernels must not
    declare 16-byte accesses for it: a misaligned vector access faults)."""
    n = t.numel() * t.element_size()
    flat = torch.empty(n + 32, dtype=torch.uint8, device=t.device)
    start = (-flat.data_ptr()) % 16 + 4
    v = flat[start:start + n].view(t.dtype).view(t.shape)
    v.copy_(t)
    return v


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("world", [1, 2])
def test_inputs_not_16_byte_aligned_compiled(world, fp8):
    """x, expert_out and out starting 4 bytes off a 16-byte boundary, compiled: no fault, exact."""
    E, K, M, H = 8 * world, 4, 9, 7168
    groups = moe_comm.init(backend="loopback", world_size=world, device=DEV, timeout_s=10)
    eps = [EPBuffer(g, E, H, M, K, dtype=torch.bfloat16, fp8_dispatch=fp8) for g in groups]
    xs, idxs, ws = make_inputs([M] * world, E, K, H, 5)
    xs = [_misaligned(x) for x in xs]
    ds = dispatch_all(eps, xs, idxs)
    sync_check(eps)
    check_dispatch(ds, xs, idxs, E, M, fp8)
    eos = [_misaligned(toy_experts(ep, d)) for ep, d in zip(eps, ds)]
    outs = [_misaligned(torch.zeros((M, H), dtype=torch.bfloat16, device=DEV)) for _ in eps]
    ys = combine_all(eps, eos, ws, ds, outs)
    sync_check(eps)
    check_combine(ys, eos, ws, idxs, E, M)
    for ep in eps:
        ep.close()


# ---- CUDA graphs -----------------------------------------------------------------------------------

@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("world", [1, 2])
def test_cuda_graph_replay_with_new_routing(world, fp8, request):
    E, K, H, M = 16, 4, 256, 8
    if world == 1:
        groups = [request.getfixturevalue("nvshmem_group")]
    else:
        groups = moe_comm.init(backend="loopback", world_size=world, device=DEV, timeout_s=10)
    eps = [EPBuffer(g, E, H, M, K, dtype=torch.bfloat16, fp8_dispatch=fp8) for g in groups]
    xs = [torch.zeros(M, H, dtype=torch.bfloat16, device=DEV) for _ in range(world)]
    idxs = [torch.full((M, K), -1, dtype=torch.int64, device=DEV) for _ in range(world)]
    ws = [torch.zeros(M, K, device=DEV) for _ in range(world)]
    ys = [[torch.empty(M, H, dtype=torch.bfloat16, device=DEV) for _ in range(world)] for _ in range(2)]

    def step():
        # Two dispatch/combine rounds per replay keep the host-chosen buffer sets in step with the device.
        for rnd in range(2):
            ds = dispatch_all(eps, xs, idxs)
            eos = [toy_experts(ep, d) for ep, d in zip(eps, ds)]
            combine_all(eps, eos, ws, ds, ys[rnd])
        return ds, eos

    step()  # allocates the symmetric buffers and compiles, outside the capture
    sync_check(eps)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ds, eos = step()
    try:
        for seed in range(20):
            tokens = [random.Random(seed * 8 + r).randint(0, M) for r in range(world)]
            nx, ni, nw = make_inputs(tokens, E, K, H, 1000 + seed)
            for r in range(world):  # tokens past T_r: unrouted padding, as a graph-captured caller does
                xs[r].zero_()[:tokens[r]] = nx[r]
                idxs[r].fill_(-1)[:tokens[r]] = ni[r]
                ws[r].zero_()[:tokens[r]] = nw[r]
            poison(ds)
            for y in ys[0] + ys[1]:
                y.fill_(float("nan"))
            graph.replay()
            sync_check(eps)
            check_dispatch(ds, xs, idxs, E, M, fp8)
            for rnd in range(2):
                check_combine(ys[rnd], eos, ws, idxs, E, M)
    finally:
        del graph
        for ep in eps:
            ep.close()


# ---- soak ------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_soak_10000_steps_dispatch_combine():
    soak(world=4, num_experts=32, topk=4, hidden=256, max_tokens=16, steps=10_000)


def soak(world, num_experts, topk, hidden, max_tokens, steps):
    """Random steps (T per rank 0..M, random routing with -1 slots) on a loopback world, every step
    checked on the device: counts, every valid row and its order, and the combined result. The host
    reads the verdicts every 500 steps (reading every step would serialize the GPU)."""
    E, K, H, M = num_experts, topk, hidden, max_tokens
    L = E // world
    groups = moe_comm.init(backend="loopback", world_size=world, device=DEV, timeout_s=10)
    eps = [EPBuffer(g, E, H, M, K, dtype=torch.bfloat16) for g in groups]
    gen = torch.Generator(device=DEV).manual_seed(7)
    host = random.Random(7)
    factor = (torch.arange(E, device=DEV, dtype=torch.float32) + 1) / 4
    bad = torch.zeros(steps, 3, dtype=torch.int32, device=DEV)  # [counts, rows, combine] wrong at step
    for step in range(steps):
        tokens = [host.randint(0, M) for _ in range(world)]
        xs = [torch.randn(t, H, device=DEV, generator=gen).to(torch.bfloat16) for t in tokens]
        idxs = [torch.rand(t, E, device=DEV, generator=gen).topk(K, dim=1).indices for t in tokens]
        idxs = [torch.where(torch.rand(i.shape, device=DEV, generator=gen) < 0.125, -1, i) for i in idxs]
        ws = [torch.rand(t, K, device=DEV, generator=gen) for t in tokens]
        ds = dispatch_all(eps, xs, idxs)
        # counts: every rank's slots per expert (unrouted slots land in bin E, dropped)
        flat = torch.cat([i.reshape(-1) for i in idxs])
        per_expert = torch.zeros(E + 1, dtype=torch.int32, device=DEV).scatter_add_(
            0, torch.where(flat < 0, E, flat), torch.ones_like(flat, dtype=torch.int32))[:E]
        x_pad = torch.zeros(world * M, H, dtype=torch.bfloat16, device=DEV)
        for r, x in enumerate(xs):
            x_pad[r * M:r * M + len(x)] = x
        for r, d in enumerate(ds):
            bad[step, 0] |= (d.counts != per_expert[r * L:(r + 1) * L]).any().int()
            valid = torch.arange(d.src.shape[1], device=DEV)[None, :] < d.counts[:, None]
            rows_ok = (d.x == x_pad[d.src.clamp(0, world * M - 1).long()]).all(dim=2) | ~valid
            ordered = (d.src[:, 1:] > d.src[:, :-1]) | ~valid[:, 1:]
            bad[step, 1] |= (~rows_ok.all() | ~ordered.all()).int()
        eos = [toy_experts(ep, d) for ep, d in zip(eps, ds)]
        ys = combine_all(eps, eos, ws, ds)
        for x, idx, w, y in zip(xs, idxs, ws, ys):
            want = torch.zeros(x.shape, dtype=torch.float32, device=DEV)
            for k in range(K):
                e = idx[:, k]
                row = (x.float() * factor[e.clamp(min=0)][:, None]).to(torch.bfloat16).float()
                want += torch.where((e >= 0)[:, None], w[:, k:k + 1] * row, 0.0)
            want = want.to(torch.bfloat16).float()
            bad[step, 2] |= ((y.float() - want).abs() > 1e-2 + 1e-2 * want.abs()).any().int()
        if step % 500 == 499 or step == steps - 1:
            sync_check(eps)
            failed = bad[:step + 1].any(dim=1).nonzero()
            assert failed.numel() == 0, (f"soak: step {int(failed[0])} wrong "
                                         f"(counts, rows, combine) = {bad[int(failed[0])].tolist()}")
    for ep in eps:
        ep.close()
