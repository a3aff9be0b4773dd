"""EPBuffer dispatch / combine against moe_comm.reference: shm ranks (separate processes), loopback (one
process), buffer alternation over 150 round trips (500 under make test-long), bitwise reproducibility, validation, memory."""

import dataclasses
import inspect
import os
import subprocess
import sys
import time

import pytest
import torch

import moe_comm
from moe_comm import CapacityError, CommTimeoutError, EPBuffer, InvalidIndexError, reference
from moe_comm.planner import deepep_low_latency_bytes, plan_ep
from moe_comm.triton_kernels.routing import compute_routing

from ep_cases import (Config, check_dispatch, expert_fn, expert_outputs, make_inputs, offset_copy, poison,
                      record_launches, run_loopback_cases, run_shm_cases, snapshot)
from budget import SWEEP, size, sweep
from shm_files import own_shm_files


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROUND_TRIPS = size(75, 500)


def _round_trip(eps, xs, idxs, ws, outs=None):
    """Dispatch then combine on a loopback world, phase by phase; returns (dispatch snapshots, outputs)."""
    for ep, x, i in zip(eps, xs, idxs):
        assert ep.dispatch(x, i, phase="send") is None
    ds = [snapshot(ep.dispatch(phase="recv")) for ep in eps]
    eos = [expert_outputs(d, r, _cfg_of(eps[r])) for r, d in enumerate(ds)]
    for ep, eo, w, d in zip(eps, eos, ws, ds):
        assert ep.combine(eo, w, d.handle, phase="send") is None
    outs = outs or [None] * len(eps)
    return ds, [ep.combine(out=o, phase="recv") for ep, o in zip(eps, outs)]


def _cfg_of(ep) -> Config:
    return Config(ep.num_local_experts, ep.hidden, ep.max_tokens_per_rank, ep.topk, ep.dtype, ep.fp8_dispatch)


def _expected(cfg, world, xs, idxs, ws):
    E = cfg.experts_per_rank * world
    exp_d = reference.dispatch(xs, idxs, E, cfg.max_tokens, fp8=cfg.fp8)
    eos = [expert_fn(exp_d[r]["x"], exp_d[r]["scales"], r * cfg.experts_per_rank, cfg.dtype) for r in range(world)]
    return exp_d, reference.combine(eos, ws, idxs, E, cfg.max_tokens)


# ---- the matrix: every config x routing on worlds 1-4 ------------------------------------------------

@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", size([1, 2, sweep(4)], [1, 2, 3, 4]))   # world 3: loopback, and shm under test-long
def test_matrix_shm(world):
    """Per world: 5 configs (experts/rank 4-16, hidden 128/256, topk 1/2/4, bf16/fp16/fp32, fp8) x
    routings (random with -1, skewed to one expert, all experts on one rank, a duplicated expert, none),
    T in {0, 1, odd, max}; exact counts, order, src, payloads and combine; send+recv == both."""
    errs = moe_comm.launch(run_shm_cases, world, backend="shm", timeout_s=60)
    assert [e for r in errs for e in r] == []
    assert own_shm_files() == []


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [1, 2, 3, sweep(4)])
def test_matrix_loopback(world):
    assert run_loopback_cases(moe_comm.init(backend="loopback", world_size=world, device="cpu")) == []


def test_loopback_refuses_phase_both():
    groups = moe_comm.init(backend="loopback", world_size=2, device="cpu")
    ep = EPBuffer(groups[0], 4, 128, 2, 1)
    with pytest.raises(ValueError, match="loopback"):
        ep.dispatch(torch.zeros(1, 128, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.int64))


@pytest.mark.timeout(60)
def test_phase_split_equals_both_world1():
    """World 1 loopback accepts phase='both': it and send+recv give identical bits."""
    cfg = Config(4, 128, 5, 2)
    ep = EPBuffer(moe_comm.init(backend="loopback", device="cpu")[0], 4, 128, 5, 2)
    xs, idxs, ws = make_inputs(cfg, 1, "random", 3)
    d1 = snapshot(ep.dispatch(xs[0], idxs[0]))
    y1 = ep.combine(expert_outputs(d1, 0, cfg), ws[0], d1.handle)
    (d2,), (y2,) = _round_trip([ep], xs, idxs, ws)
    assert torch.equal(d1.counts, d2.counts) and torch.equal(d1.src, d2.src)
    for e, n in enumerate(d1.counts.tolist()):
        assert torch.equal(d1.x[e, :n], d2.x[e, :n])
    assert torch.equal(y1, y2)
    # The one world-1 kernel runs at the receive phase, yet the send phase consumed x and topk_idx:
    # overwriting them in between changes nothing.
    x, idx = xs[0].clone(), idxs[0].clone()
    ep.dispatch(x, idx, phase="send")
    x.fill_(float("nan"))
    idx.fill_(0)
    d3 = snapshot(ep.dispatch(phase="recv"))
    assert torch.equal(d1.counts, d3.counts) and torch.equal(d1.src, d3.src)
    for e, n in enumerate(d1.counts.tolist()):
        assert torch.equal(d1.x[e, :n], d3.x[e, :n])


# ---- buffer alternation, reproducibility -----------------------------------------------------------

@SWEEP
@pytest.mark.timeout(400)
def test_many_round_trips_loopback():
    """ROUND_TRIPS consecutive dispatch -> combine round trips, fresh random routing each, world 2; every one
    checked (outputs poisoned first); then a late check that two dispatches in flight do not collide."""
    world, cfg = 2, Config(2, 128, 3, 2)
    eps = [EPBuffer(g, 4, 128, 3, 2) for g in moe_comm.init(backend="loopback", world_size=world, device="cpu")]
    t0 = time.monotonic()
    bad = []
    for i in range(ROUND_TRIPS):
        xs, idxs, ws = make_inputs(cfg, world, ("random", "skewed", "dup", "one_rank")[i % 4], 50_000 + i)
        for ep in eps:
            poison(ep)
        ds, ys = _round_trip(eps, xs, idxs, ws)
        exp_d, exp_y = _expected(cfg, world, xs, idxs, ws)
        for r in range(world):
            rows_ok = all(torch.equal(ds[r].x[e, :n], exp_d[r]["x"][e, :n])
                          and torch.equal(ds[r].src[e, :n], exp_d[r]["src"][e, :n])
                          for e, n in enumerate(ds[r].counts.tolist()))
            if not (torch.equal(ds[r].counts, exp_d[r]["counts"]) and rows_ok and torch.equal(ys[r], exp_y[r])):
                bad.append((i, r))
    elapsed = time.monotonic() - t0
    print(f"{ROUND_TRIPS} round trips, loopback world 2: {elapsed:.1f} s ({elapsed / ROUND_TRIPS * 1e3:.0f} ms each)")
    assert bad == []
    assert sum(int(ep.expert_token_counts.sum()) for ep in eps) > 0


@pytest.mark.timeout(60)
def test_rank_without_tokens_still_waits_in_combine():
    """A rank with T = 0 has no token to reduce, yet its combine waits for every peer's send of that
    call: otherwise it could run calls ahead and overwrite a landing zone a peer is still reading."""
    groups = moe_comm.init(backend="loopback", world_size=2, device="cpu", timeout_s=1.0)
    eps = [EPBuffer(g, 4, 128, 2, 1) for g in groups]
    xs = [torch.ones(1, 128, dtype=torch.bfloat16), torch.zeros(0, 128, dtype=torch.bfloat16)]
    idxs = [torch.tensor([[2]]), torch.zeros(0, 1, dtype=torch.int64)]  # rank 0's token -> rank 1
    for ep, x, i in zip(eps, xs, idxs):
        ep.dispatch(x, i, phase="send")
    ds = [ep.dispatch(phase="recv") for ep in eps]
    eps[1].combine(torch.zeros(2, 4, 128, dtype=torch.bfloat16), torch.ones(0, 1), ds[1].handle, phase="send")
    with pytest.raises(CommTimeoutError) as info:  # rank 0 has not sent this call's rows yet
        eps[1].combine(phase="recv")
    assert (info.value.rank, info.value.peer) == (1, 0)


def test_world1_row_of_past_T_is_unrouted():
    """The one-kernel world-1 dispatch marks the slots of tokens past T as not routed (-1), as the
    two-phase receive does, so a handle never shows a stale row from an earlier call."""
    ep = EPBuffer(moe_comm.init(backend="loopback", device="cpu")[0], 4, 64, 4, 2)
    x, idx = torch.randn(4, 64).bfloat16(), torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]])
    ep.dispatch(x, idx)
    ep.dispatch(x, idx)
    d = ep.dispatch(x[:1], idx[:1])  # the first call's metadata set again
    assert d.handle.row_of[0, 0].tolist() == [0, 4] and (d.handle.row_of[0, 1:] == -1).all()


@pytest.mark.timeout(120)
def test_two_dispatches_in_flight():
    """Dispatch A, dispatch B, then combine A and combine B: A's counts, src and handle stay valid
    through B (two metadata sets); a third dispatch makes A's handle stale."""
    world, cfg = 2, Config(4, 128, 4, 2)
    eps = [EPBuffer(g, 8, 128, 4, 2) for g in moe_comm.init(backend="loopback", world_size=world, device="cpu")]
    ins = [make_inputs(cfg, world, "random", s) for s in (11, 12)]
    got = []
    for xs, idxs, _ in ins:
        for ep, x, i in zip(eps, xs, idxs):
            ep.dispatch(x, i, phase="send")
        got.append([ep.dispatch(phase="recv") for ep in eps])
    for (xs, idxs, ws), ds in zip(ins, got):
        exp_d, exp_y = _expected(cfg, world, xs, idxs, ws)
        for r in range(world):
            assert torch.equal(ds[r].counts, exp_d[r]["counts"])
            for e, n in enumerate(ds[r].counts.tolist()):
                assert torch.equal(ds[r].src[e, :n], exp_d[r]["src"][e, :n])
        # d.x was overwritten by the later dispatch: the experts run on the reference rows
        eos = [expert_fn(exp_d[r]["x"], None, r * cfg.experts_per_rank, cfg.dtype) for r in range(world)]
        for ep, eo, w, d in zip(eps, eos, ws, ds):
            ep.combine(eo, w, d.handle, phase="send")
        ys = [ep.combine(phase="recv") for ep in eps]
        for r in range(world):
            assert torch.equal(ys[r], exp_y[r])
    xs, idxs, _ = make_inputs(cfg, world, "random", 13)
    for ep, x, i in zip(eps, xs, idxs):
        ep.dispatch(x, i, phase="send")
    with pytest.raises(ValueError, match="stale handle"):  # A's metadata set is being rewritten
        eps[0].combine(torch.zeros(4, 8, 128, dtype=torch.bfloat16), torch.zeros(4, 2), got[0][0].handle,
                       phase="send")


@pytest.mark.timeout(180)
def test_bitwise_reproducible_across_runs_and_world_sizes():
    """The same 12 tokens (same x, ids, weights; 8 experts, top-4 with -1s and a duplicate) give
    bit-identical combine outputs on worlds 1, 2 and 4, run twice each."""
    g = torch.Generator().manual_seed(7)
    n, E, K, H = 12, 8, 4, 256
    x = (torch.randn(n, H, generator=g) * 4).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)])
    idx[torch.rand(n, K, generator=g) < 0.25] = -1
    idx[0, 1] = idx[0, 0] = 5
    w = torch.rand(n, K, generator=g)
    results = []
    for world in (1, 2, 4, 1, 2, 4):
        per = n // world
        eps = [EPBuffer(gr, E, H, per, K) for gr in moe_comm.init(backend="loopback", world_size=world, device="cpu")]
        sl = [slice(r * per, (r + 1) * per) for r in range(world)]
        _, ys = _round_trip(eps, [x[s] for s in sl], [idx[s] for s in sl], [w[s] for s in sl])
        results.append(torch.cat(ys))
    for y in results[1:]:
        assert torch.equal(y.view(torch.int16), results[0].view(torch.int16))
    exp = reference.combine([expert_fn(d["x"], None, 0, torch.bfloat16) for d in reference.dispatch([x], [idx], E, n)],
                            [w], [idx], E, n)[0]
    assert torch.equal(results[0], exp)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world,fp8,send_programs", [(1, False, 5), (1, True, 2), (2, False, 2), sweep(3, True, 5)])
def test_gpu_launch_shapes_in_the_interpreter(world, fp8, send_programs):
    """The GPU plan (many programs per kernel, one token or one landing row per iteration, routing split
    over programs, several routing chunks, one column block per combine program) run by the interpreter
    on a loopback world: the same results. send_programs=2 gives each program a range of 3 tokens, so
    positions carry a histogram across tokens and start from the earlier programs' ids."""
    cfg = Config(4, 256, 5, 4, fp8=fp8)
    groups = moe_comm.init(backend="loopback", world_size=world, device="cpu")
    eps = [EPBuffer(g, 4 * world, 256, 5, 4, fp8_dispatch=fp8) for g in groups]
    for ep in eps:
        ep.plan = plan_ep(world, 4 * world, 256, 5, 4, torch.bfloat16, fp8, "cuda")
        ep.plan = dataclasses.replace(ep.plan, route_tokens=2, send_block_words=32, recv_block_words=32,
                                      out_block_words=64, block_hidden=128, send_programs=send_programs,
                                      fp8_block_groups=1)  # 2 quantization blocks per 256-column row
    assert eps[0].plan.recv_programs > 1 and eps[0].plan.block_tokens == 1 and eps[0].plan.reduce_grid[1] == 2
    assert eps[0].plan.recv_grid[0] > 1 and eps[0].plan.recv_grid[1] == world   # several programs per source
    for seed, routing in ((1, "random"), (2, "one_rank"), (3, "dup"), (4, "skewed")):
        xs, idxs, ws = make_inputs(cfg, world, routing, seed)
        for ep in eps:
            poison(ep)
        ds, ys = _round_trip(eps, xs, idxs, ws)
        exp_d, exp_y = _expected(cfg, world, xs, idxs, ws)
        for r in range(world):
            assert check_dispatch(r, ds[r], exp_d[r], xs, cfg, f"rank{r}") == []
            assert torch.equal(ys[r], exp_y[r])


# ---- routing layout, statistics ----------------------------------------------------------------

@pytest.mark.parametrize("chunk", [None, 1, 2])
@pytest.mark.parametrize("world,experts,topk,tokens", [(1, 4, 1, 5), (2, 8, 2, 7), (4, 16, 4, 3), (3, 15, 2, 0),
                                                         (1, 64, 8, 40)])
def test_routing_layout_on_device(world, experts, topk, tokens, chunk):
    """Counts and positions from the device prefix sums; chunk=1/2 runs them over several chunks with
    running totals, as on a GPU."""
    g = torch.Generator().manual_seed(world * 100 + tokens)
    idx = torch.randint(-1, experts, (tokens, topk), generator=g)
    if tokens:
        idx[0, -1] = idx[0, 0]  # the same expert twice in one token
    lay = compute_routing(idx, experts, world, chunk_tokens=chunk)
    L = experts // world
    counts, ranks, pos = [0] * experts, [0] * world, torch.full((tokens, topk), -1, dtype=torch.int32)
    for t in range(tokens):
        hit = set()
        for k in range(topk):
            e = int(idx[t, k])
            if e >= 0:
                pos[t, k] = counts[e]
                counts[e] += 1
                hit.add(e // L)
        for r in hit:
            ranks[r] += 1
    assert lay.expert_counts.tolist() == counts
    assert lay.rank_tokens.tolist() == ranks
    assert torch.equal(lay.position, pos)


def test_expert_token_counts_accumulate():
    cfg = Config(4, 128, 5, 2)
    eps = [EPBuffer(g, 8, 128, 5, 2) for g in moe_comm.init(backend="loopback", world_size=2, device="cpu")]
    total = [torch.zeros(4, dtype=torch.int64) for _ in eps]
    for seed in range(3):
        xs, idxs, ws = make_inputs(cfg, 2, "skewed", seed)
        ds, _ = _round_trip(eps, xs, idxs, ws)
        for r in range(2):
            total[r] += ds[r].counts.long()
    for ep, t in zip(eps, total):
        assert ep.expert_token_counts.dtype == torch.int64
        assert torch.equal(ep.expert_token_counts, t) and int(t.sum()) > 0
        ep.reset_expert_token_counts()
        assert int(ep.expert_token_counts.abs().sum()) == 0


# ---- faults in device values ---------------------------------------------------------------------

def test_invalid_expert_ids_are_skipped_and_reported():
    """Ids >= num_experts, < -1 and huge int64 ids are not routed anywhere (no write anywhere), the
    rank that passed them raises InvalidIndexError, and the call completes on every rank."""
    groups = moe_comm.init(backend="loopback", world_size=2, device="cpu")
    eps = [EPBuffer(g, 8, 128, 4, 2) for g in groups]
    xs = [torch.randn(4, 128).to(torch.bfloat16), torch.randn(3, 128).to(torch.bfloat16)]
    idxs = [torch.tensor([[1, 8], [-5, 2], [2 ** 40, 7], [3, -1]], dtype=torch.int64),
            torch.tensor([[0, 4], [6, -1], [5, 1]], dtype=torch.int32)]
    clean = [torch.where((i >= 0) & (i < 8), i, -1) for i in idxs]
    for ep in eps:
        poison(ep)
    # The error is raised at the end of the op (the receive phase), with the completed result attached.
    eps[0].dispatch(xs[0], idxs[0], phase="send")
    eps[1].dispatch(xs[1], idxs[1], phase="send")
    with pytest.raises(InvalidIndexError, match=r"rank 0 got index 8, valid range is \[-1, 8\)") as info:
        eps[0].dispatch(phase="recv")
    ds = [info.value.result, eps[1].dispatch(phase="recv")]
    exp = reference.dispatch(xs, clean, 8, 4)
    for r in range(2):
        assert torch.equal(ds[r].counts, exp[r]["counts"])
        for e, n in enumerate(exp[r]["counts"].tolist()):
            assert torch.equal(ds[r].x[e, :n], exp[r]["x"][e, :n])
            assert torch.equal(ds[r].src[e, :n], exp[r]["src"][e, :n])
    groups[0].check()  # reported once
    for bad in (-5, 2 ** 40, 8, -2 ** 40):  # each alone is reported, by value
        idx = torch.tensor([[0, 1], [2, bad], [3, -1], [-1, -1]])
        for ep in eps:
            poison(ep)
        eps[0].dispatch(xs[0], idx, phase="send")
        eps[1].dispatch(xs[1], idxs[1], phase="send")
        with pytest.raises(InvalidIndexError, match=rf"rank 0 got index {bad},") as info:
            eps[0].dispatch(phase="recv")
        ds = [info.value.result, eps[1].dispatch(phase="recv")]
        exp = reference.dispatch(xs, [torch.where((idx >= 0) & (idx < 8), idx, -1), clean[1]], 8, 4)
        assert [d.counts.tolist() for d in ds] == [e["counts"].tolist() for e in exp]


def test_capacity_overflow_is_clamped_and_reported():
    """Tokens listing the same expert several times can overflow an expert's world * M rows: the first
    rows are kept in order, nothing is written past the capacity, CapacityError names the expert."""
    ep = EPBuffer(moe_comm.init(backend="loopback", device="cpu")[0], 2, 128, 2, 4)
    x = torch.randn(2, 128).to(torch.bfloat16)
    idx = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1]])
    poison(ep)
    with pytest.raises(CapacityError, match="peer/expert 1 needs 6 rows, only 2") as info:
        ep.dispatch(x, idx)
    d = info.value.result  # the dispatch completed: the error carries its result
    assert d.counts.tolist() == [2, 2]
    assert d.src.tolist() == [[0, 1], [0, 0]]
    assert torch.equal(d.x[1, :2], torch.stack([x[0], x[0]]))
    # The combine of that dispatch counts the dropped slots as zero rows, like the reference.
    handle = d.handle
    eo, w = torch.randn(2, 2, 128).to(torch.bfloat16), torch.rand(2, 4)
    ep._combine_ch.data.local.fill_(0x7F807F80)  # bf16 NaNs where a slot's row lands
    assert torch.equal(ep.combine(eo, w, handle), reference.combine([eo], [w], [idx], 2, 2)[0])


# ---- host-side validation ------------------------------------------------------------------------

def test_constructor_validation():
    g = moe_comm.init(backend="loopback", world_size=2, device="cpu")[0]
    with pytest.raises(ValueError, match="multiple of world_size"):
        EPBuffer(g, 7, 128, 4, 2)
    with pytest.raises(ValueError, match="hidden % 128"):
        EPBuffer(g, 8, 192, 4, 2, fp8_dispatch=True)
    with pytest.raises(TypeError, match="dtype"):
        EPBuffer(g, 8, 128, 4, 2, dtype=torch.int32)
    for hidden in (127, 4):   # 254 and 8 bytes: rows must be whole 16-byte vectors
        with pytest.raises(ValueError, match="multiple of 16 bytes"):
            EPBuffer(g, 8, hidden, 4, 2)
    for bad in (dict(topk=0), dict(max_tokens_per_rank=0), dict(hidden=-128)):
        kw = dict(num_experts=8, hidden=128, max_tokens_per_rank=4, topk=2) | bad
        with pytest.raises(ValueError, match="positive int"):
            EPBuffer(g, **kw)


def test_call_validation_raises_before_any_launch():
    """Every host-visible mistake raises ValueError/TypeError before a kernel runs (the call counter does
    not move), and a correct call afterwards works."""
    ep = EPBuffer(moe_comm.init(backend="loopback", device="cpu")[0], 4, 128, 3, 2)
    x, idx = torch.randn(2, 128).to(torch.bfloat16), torch.tensor([[0, 1], [2, -1]])
    bad_dispatch = [
        (ValueError, dict(x=torch.randn(4, 128).to(torch.bfloat16), topk_idx=torch.zeros(4, 2, dtype=torch.long)),
         "max_tokens"),
        (TypeError, dict(x=x.float(), topk_idx=idx), "dtype"),
        (ValueError, dict(x=torch.randn(2, 256).to(torch.bfloat16), topk_idx=idx), "shape"),
        (ValueError, dict(x=x[0], topk_idx=idx), "shape"),
        (ValueError, dict(x=x, topk_idx=idx[:, :1]), "shape"),
        (ValueError, dict(x=x, topk_idx=idx[:1]), "shape"),
        (TypeError, dict(x=x, topk_idx=idx.float()), "dtype"),
        (TypeError, dict(x=[1, 2], topk_idx=idx), "torch.Tensor"),
    ]
    for exc, kw, match in bad_dispatch:
        with pytest.raises(exc, match=match):
            ep.dispatch(**kw)
        assert ep._calls == 0
    with pytest.raises(ValueError, match="phase"):
        ep.dispatch(x, idx, phase="both_ways")
    with pytest.raises(RuntimeError, match="none has run yet"):
        ep.combine(torch.zeros(4, 3, 128), torch.zeros(2, 2), None)
    with pytest.raises(RuntimeError, match="phase='recv' needs a preceding phase='send'"):
        ep.dispatch(phase="recv")
    d = ep.dispatch(x, idx)
    eo = torch.zeros(4, 3, 128, dtype=torch.bfloat16)
    w = torch.rand(2, 2)
    bad_combine = [
        (TypeError, (eo, w, "handle"), {}, "handle"),
        (ValueError, (eo[:, :2], w, d.handle), {}, "expert_out has shape"),
        (TypeError, (eo.float(), w, d.handle), {}, "dtype"),
        (ValueError, (eo, w[:1], d.handle), {}, "topk_weights has shape"),
        (TypeError, (eo, w.long(), d.handle), {}, "dtype"),
        (ValueError, (eo, w, d.handle), dict(out=torch.zeros(3, 128, dtype=torch.bfloat16)), "out has shape"),
        (ValueError, (eo, w, d.handle), dict(out=torch.zeros(128, 2, dtype=torch.bfloat16).t()), "contiguous"),
    ]
    other = EPBuffer(moe_comm.init(backend="loopback", device="cpu")[0], 4, 128, 3, 2)
    bad_combine.append((TypeError, (eo, w, other.dispatch(x, idx).handle), {}, "this EPBuffer"))
    for exc, args, kw, match in bad_combine:
        with pytest.raises(exc, match=match):
            ep.combine(*args, **kw)
    y = ep.combine(expert_outputs(snapshot(d), 0, _cfg_of(ep)), w, d.handle)
    assert y.shape == (2, 128) and not torch.isnan(y.float()).any()


# ---- memory ------------------------------------------------------------------------------------------

def test_buffer_bytes_deepseek_v3_is_under_half_of_deepep():
    """DeepSeek-V3 decode (256 experts, hidden 7168, top-8, 128 tokens per rank, EP8): computed without
    allocating; at most half of DeepEP's low-latency buffer (bf16 and fp8 dispatch)."""
    deepep = deepep_low_latency_bytes(128, 7168, 8, 256)
    assert 1.77 * 2 ** 30 < deepep < 1.78 * 2 ** 30
    for fp8 in (False, True):
        ours = EPBuffer.required_bytes(8, 256, 7168, 128, 8, fp8_dispatch=fp8)
        print(f"DeepSeek-V3 EP8 {'fp8' if fp8 else 'bf16'}: buffer_bytes {ours:,} B = {ours / 2 ** 30:.3f} GiB, "
              f"DeepEP low-latency {deepep / 2 ** 30:.3f} GiB ({ours / deepep:.1%})")
        assert ours <= deepep / 2
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "ep_memory.py")], capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0.493 GiB" in out.stdout and "1.777 GiB" in out.stdout


@pytest.mark.parametrize("fp8,world,put", [(False, 1, False), (True, 3, False), (False, 3, True)])
def test_buffer_bytes_counts_what_is_allocated(monkeypatch, fp8, world, put):
    """buffer_bytes (from the plan, before allocation) equals the bytes of every tensor the buffer holds;
    with puts, the staging's two zones too (docs/multinode.md, "Staging reuse by causality")."""
    if put:
        monkeypatch.setenv("MOE_COMM_TRANSPORT", "put")
    groups = moe_comm.init(backend="loopback", world_size=world, device="cpu")
    eps = [EPBuffer(g, 4 * world, 256, 3, 2, fp8_dispatch=fp8) for g in groups]
    planned = eps[0].buffer_bytes
    xs, idxs, _ = make_inputs(Config(4, 256, 3, 2, fp8=fp8), world, "random", 5)
    for ep, x, i in zip(eps, xs, idxs):
        ep.dispatch(x, i, phase="send")
    for ep in eps:
        ep.dispatch(phase="recv")
    ep = eps[0]
    nb = lambda t: t.numel() * t.element_size()  # noqa: E731
    held = [ep._x, ep._stats, ep._excluded, ep._dummy, ep._ready] + ([ep._scales] if fp8 else [])
    held += [t for s in ep._sets for t in (s.src, s.counts, s.row_of, s.src_tokens, s.routed, s.runs, s.arrival)]
    if put:
        held += [t for s in ep._sets for t in (s.slot_key, s.id_base)]
    for ch in (ep._dispatch_ch, ep._combine_ch):
        held += [ch.data.local, ch.ctrl.local, ch.send_seq, ch.recv_seq, ch.done]
        held += [ch.stage.local, ch.stage_ctrl.local] if put else []
    assert ep.plan.put == put and (ep.plan.stage_bytes > 0) == put
    assert sum(map(nb, held)) == planned


# ---- alignment ------------------------------------------------------------------------------------

@pytest.mark.parametrize("hidden,topk,fp8,device", [(128, 2, False, "cpu"), (128, 2, True, "cuda"),
                                                    (7168, 8, True, "cuda"), (256, 5, False, "cuda")])
def test_dispatch_landing_rows_are_whole_16_byte_vectors(hidden, topk, fp8, device):
    """The receive declares 16-byte accesses from its base pointers: every landing row must start on a
    vector, so the row (payload, scales, K routing words) is padded to a multiple of 4 words."""
    p = plan_ep(2, 8, hidden, 4, topk, torch.bfloat16, fp8, device)
    assert p.row_words % 4 == 0 and 0 <= p.row_words - (p.x_words + p.scale_words + topk) < 4


@pytest.mark.parametrize("world,fp8", [(1, False), (2, False), (2, True)])
def test_inputs_that_do_not_start_16_byte_aligned(world, fp8, monkeypatch):
    """x, expert_out and out that start 4 bytes off a 16-byte boundary: every kernel that reads or writes
    one of them is launched without the 16-byte declaration (ALIGNED False, recorded at launch; the
    dispatch receive, which touches only the buffer's own aligned tensors, keeps it), and the results are
    exact. (The interpreter ignores alignment hints: that the compiled kernels are then right is
    tests/gpu/test_gpu_ep.py::test_inputs_not_16_byte_aligned_compiled.)"""
    from moe_comm.planner import vector_aligned
    launched = record_launches(monkeypatch, lambda fn, args, grid: (
        fn.fn.__name__, inspect.signature(fn.fn).bind_partial(*args).arguments.get("ALIGNED")))
    cfg = Config(4, 128, 5, 2, fp8=fp8)
    groups = moe_comm.init(backend="loopback", world_size=world, device="cpu")
    eps = [EPBuffer(g, 4 * world, 128, 5, 2, fp8_dispatch=fp8) for g in groups]
    xs, idxs, ws = make_inputs(cfg, world, "random", 3)   # T = 5 (and 3 on rank 1)
    xs = [offset_copy(x) for x in xs]
    assert all(not vector_aligned(x) for x in xs) and all(x.numel() for x in xs)
    outs = [offset_copy(torch.zeros(x.shape, dtype=x.dtype)) for x in xs]
    for ep, x, i in zip(eps, xs, idxs):
        assert ep.dispatch(x, i, phase="send") is None
    ds = [snapshot(ep.dispatch(phase="recv")) for ep in eps]
    eos = [offset_copy(expert_outputs(d, r, cfg)) for r, d in enumerate(ds)]
    for ep, eo, w, d in zip(eps, eos, ws, ds):
        assert ep.combine(eo, w, d.handle, phase="send") is None
    ys = [ep.combine(out=o, phase="recv") for ep, o in zip(eps, outs)]
    exp_d, exp_y = _expected(cfg, world, xs, idxs, ws)
    for r in range(world):
        assert check_dispatch(r, ds[r], exp_d[r], xs, cfg, f"rank{r}") == []
        assert torch.equal(ys[r], exp_y[r]) and ys[r].data_ptr() == outs[r].data_ptr()
    # Kernels given x, expert_out or out. At world 1 the split dispatch reads the send's copy of x (the
    # send phase consumes its inputs), which is aligned, so the world-1 dispatch is a control: True.
    touching = {"combine_recv_kernel"} | ({"dispatch_send_kernel", "combine_send_kernel"} if world > 1 else set())
    aligned_ones = {"dispatch_recv_kernel"} if world > 1 else {"dispatch_local_kernel"}
    assert {name for name, _ in launched} == touching | aligned_ones, launched
    assert all(aligned is (name in aligned_ones) for name, aligned in launched), launched
