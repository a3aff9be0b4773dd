"""PrefillBuffer against moe_comm.reference: worlds 1-4 on shm ranks (processes) and loopback (one
process), in place and split phases, bad inputs, invalid ids, a timeout and its recovery, exclusion,
and the memory statement."""

import math
import threading

import pytest
import torch

import moe_comm
from moe_comm import CommAbortedError, CommTimeoutError, EPBuffer, InvalidIndexError, PrefillBuffer, reference
from moe_comm.planner import deepep_v2_bytes, plan_prefill

import budget
from ep_cases import Config, make_inputs
from shm_files import own_shm_files
from prefill_cases import (CONFIGS, check_dispatch, expected, expert_out, make_buffer, poison, round_trip,
                           run_chunked_case, run_loopback_cases, run_shm_cases, run_slow_reader_case)

GIB = 2 ** 30
DEEPEP_V2_EP16_4096_BYTES = 1.13 * GIB   # DeepEP V2 ElasticBuffer, EP16, 4096 tokens per rank (issue 25)


def _loopback(world, cfg=CONFIGS[0], timeout_s=20.0):
    groups = moe_comm.init(backend="loopback", world_size=world, device="cpu", timeout_s=timeout_s)
    return groups, [make_buffer(g, cfg) for g in groups]


# ---- exact against the reference ---------------------------------------------------------------------

@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2, 3, budget.sweep(4)])
def test_matrix_shm(world):
    errs = moe_comm.launch(run_shm_cases, world, backend="shm", timeout_s=60)
    assert [e for r in errs for e in r] == []
    assert own_shm_files() == []


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2, 3, budget.sweep(4)])
def test_matrix_loopback(world):
    groups = moe_comm.init(backend="loopback", world_size=world, device="cpu")
    assert run_loopback_cases(groups) == []


@pytest.mark.timeout(120)
def test_in_place_combine_and_repeated_calls_are_bitwise_stable():
    """expert_out = recv_x (the experts wrote in place): nothing copied, same result; three rounds with
    the same inputs give the same bits (fixed summation order)."""
    cfg = CONFIGS[0]
    groups, bufs = _loopback(2, cfg)
    xs, idxs, ws = make_inputs(cfg, 2, "random", 5)
    exp_d, _, _ = expected(cfg, 2, xs, idxs, ws)
    want = reference.prefill_combine([e["x"] for e in exp_d], idxs, 8, cfg.max_tokens)
    for _ in range(3):
        for b, x, i, w in zip(bufs, xs, idxs, ws):
            b.dispatch(x, i, w, phase="send")
        ds = [b.dispatch(phase="recv") for b in bufs]
        for b, d in zip(bufs, ds):
            b.combine(d.recv_x, d.handle, phase="send")
        outs = [torch.full_like(x, float("nan")) for x in xs]
        ys = [b.combine(out=o, phase="recv") for b, o in zip(bufs, outs)]
        assert all(y is o for y, o in zip(ys, outs))
        assert all(torch.equal(y, e) for y, e in zip(ys, want))


def test_each_token_crosses_once_per_rank():
    """A token whose 4 experts all live on rank 1 is one row there (4 local ids), none on rank 0; the
    plan's link bytes are the floor's payload plus metadata."""
    cfg = Config(4, 128, 2, 4)
    groups, bufs = _loopback(2, cfg)
    x = torch.randn(2, 128).bfloat16()
    idx, w = torch.tensor([[4, 5, 6, 7], [0, 4, -1, 1]]), torch.rand(2, 4)
    empty = (torch.zeros(0, 128).bfloat16(), torch.zeros(0, 4, dtype=torch.int64), torch.zeros(0, 4))
    bufs[0].dispatch(x, idx, w, phase="send")
    bufs[1].dispatch(*empty, phase="send")
    d0, d1 = [b.dispatch(phase="recv") for b in bufs]
    assert d1.recv_topk_idx[:2].tolist() == [[0, 1, 2, 3], [-1, 0, -1, -1]]
    assert d0.recv_topk_idx[:2].tolist() == [[-1, -1, -1, -1], [0, -1, -1, 1]]
    assert d1.expert_counts.tolist() == [2, 1, 1, 1] and d0.expert_counts.tolist() == [1, 1, 0, 0]
    assert torch.equal(d1.recv_x[:2], x) and torch.equal(d0.recv_x[1], x[1])
    pairs = reference.prefill_pairs(idx, 8, 2, rank=0)
    assert pairs == 2
    p = bufs[0].plan
    assert p.dispatch_link_bytes(pairs, 2, 1) == 2 * 256 + 2 * 32 + 8 * p.dispatch_ctrl_words


# ---- memory --------------------------------------------------------------------------------------

def test_memory_at_deepseek_v3():
    """DeepSeek-V3 (hidden 7168, 256 experts, top-8), bf16: EP16 with 4096 tokens per rank fits DeepEP
    V2's 1.13 GiB per rank, computed by the function the buffer allocates with; the expert-major
    decode buffer of the same shape is an order of magnitude larger."""
    ep16 = PrefillBuffer.required_bytes(16, 256, 7168, 4096, 8)
    assert ep16 <= DEEPEP_V2_EP16_4096_BYTES
    assert ep16 == plan_prefill(16, 256, 7168, 4096, 8, torch.bfloat16, False, "cpu").buffer_bytes
    assert EPBuffer.required_bytes(16, 256, 7168, 4096, 8) > 10 * ep16
    # Overlapped chunks: two zones double the zone memory at the same capacity, and fit at half of it
    # (4096 tokens per rank in two chunks of 2048).
    assert PrefillBuffer.required_bytes(16, 256, 7168, 4096, 8, zones=2) > DEEPEP_V2_EP16_4096_BYTES
    two = PrefillBuffer.required_bytes(16, 256, 7168, 2048, 8, zones=2)
    assert two <= DEEPEP_V2_EP16_4096_BYTES and abs(two - ep16) < 2 ** 20
    # The zone is the output: W * M rows of payload plus 8 * topk bytes of ids and weights.
    assert ep16 >= 16 * 4096 * (7168 * 2 + 64)
    groups = moe_comm.init(backend="loopback", world_size=2, device="cpu")
    buf = PrefillBuffer(groups[0], 8, 128, 3, 2)
    buf._allocate()   # what the first dispatch does: the plan's symmetric bytes are what it allocates
    held = buf._dispatch_ch.symmetric_bytes + buf._combine_ch.symmetric_bytes
    assert held == buf.plan.symmetric_bytes
    # Across nodes (4 nodes of 8, docs/prefill.md "Across nodes"): the routing plane and the node inbox
    # added, EP32 with 4096 tokens per rank still within DeepEP V2's buffer, whose EP16 figure is the 1.13
    # GiB above by its own formula
    assert abs(deepep_v2_bytes(16, 4096, 7168, 8) - DEEPEP_V2_EP16_4096_BYTES) < 0.01 * GIB
    ep32 = PrefillBuffer.required_bytes(32, 256, 7168, 4096, 8, ranks_per_node=8)
    assert PrefillBuffer.required_bytes(32, 256, 7168, 4096, 8) < ep32 <= deepep_v2_bytes(32, 4096, 7168, 8)
    # two zones of half the capacity: the zones' memory again; the put staging (two parities of M payload rows,
    # docs/multinode.md "Staging reuse by causality") follows M
    staged = [4 * math.prod(plan_prefill(32, 256, 7168, m, 8, torch.bfloat16, False, "cpu",
                                         ranks_per_node=8).dispatch_stage_shape) for m in (4096, 2048)]
    assert staged[0] == 2 * 4096 * 7168 * 2 and staged[1] == staged[0] // 2
    assert PrefillBuffer.required_bytes(32, 256, 7168, 2048, 8, zones=2, ranks_per_node=8) == pytest.approx(
        ep32 - staged[0] + staged[1], rel=1e-3)
    buf2 = PrefillBuffer(moe_comm.init(backend="loopback", device="cpu")[0], 8, 128, 3, 2, zones=2)
    buf2._allocate()
    assert buf2._dispatch_ch.symmetric_bytes + buf2._combine_ch.symmetric_bytes == buf2.plan.symmetric_bytes
    with pytest.raises(ValueError, match=r"zones must be one of \(1, 2\)"):
        PrefillBuffer(groups[0], 8, 128, 3, 2, zones=3)



def _vector_starts(plan) -> dict:
    """{(zone, region): first word} of every region of the landing zones (and, with puts, the node inboxes)
    whose rows the kernels move as 16-byte vectors, offsets from the start of the channel's data; plus the
    row strides of those regions as ("stride", region)."""
    p, out = plan.ep, {}
    vector_scales = p.fp8 and p.scale_words % 4 == 0   # the kernels' own condition (ALIGNED & S_WORDS % 4 == 0)
    for z in range(plan.zones):
        base = z * plan.zone_words
        out[z, "zone"] = base
        out[z, "recv_x / partial rows"] = base + plan.x_offset
        if vector_scales:
            out[z, "recv_scales"] = base + plan.scales_offset
        if plan.put:
            out[z, "routing plane"] = base + plan.route_offset
            out[z, "node inbox"] = z * plan.inbox_words
    out["stride", "recv_x"], out["stride", "partial rows"] = p.x_words, p.combine_words
    if plan.put:
        out["stride", "inbox rows"] = p.out_words
    return out


@pytest.mark.parametrize("fmt,hidden", [(None, 64), ("e4m3", 128), ("e4m3-ue8m0", 512), ("nvfp4", 64)])
def test_every_zone_of_the_plan_starts_on_a_16_byte_vector(fmt, hidden):
    """Issue 46 item 5: with zones=2, zone 1 starts zone_words after zone 0, and the kernels store its rows
    with 16-byte vectors (st.v4 on a GPU, where a misaligned one faults): every region of every zone, and
    the node inboxes with puts, must start on a 16-byte boundary for every (W, M, K, G) and format, W * M
    odd included (W 3, M 5, K 2 put the routing plane's 2K + 2 words a row, 90 words, before zone 1). The
    CPU cannot fault on a misaligned vector, so this checks the plan's arithmetic; a real allocation of that
    case is checked below."""
    bad = []
    for world in (1, 2, 3, 4, 5, 6):
        for nodes_of in [None] + [g for g in (1, 2, 3) if world % g == 0 and world > 1]:
            if fmt == "nvfp4" and nodes_of is not None:
                continue   # one node only (PrefillBuffer._plan refuses it across nodes)
            for m in (1, 2, 3, 5):
                for k in (1, 2, 3):
                    plan = PrefillBuffer._plan(world, 2 * world, hidden, m, k, torch.bfloat16, False, "cpu", zones=2,
                                               ranks_per_node=nodes_of, dispatch_format=fmt)
                    bad += [(world, m, k, nodes_of, where, words) for where, words in _vector_starts(plan).items()
                            if words % 4]
    assert bad == [], bad[:8]


def test_put_zones_of_an_odd_world_times_tokens_are_vector_aligned(monkeypatch):
    """The case of issue 46 item 5 allocated (W 3, M 5, K 2, every peer by puts, zones=2): every zone's views
    and its peer pointers start on a 16-byte boundary."""
    monkeypatch.setenv("MOE_COMM_TRANSPORT", "put")
    groups = moe_comm.init(backend="loopback", world_size=3, device="cpu")
    buf = PrefillBuffer(groups[0], 6, 64, 5, 2, zones=2)
    buf._allocate()
    assert buf.plan.put and buf.plan.rows * buf.plan.route_words % 4
    starts = [(z, name, t.data_ptr() % 16) for z, zone in enumerate(buf._zones)
              for name, t in (("words", zone.words), ("recv_x", zone.recv_x), ("inbox", zone.inbox))]
    starts += [(z, "peer", int(p) % 16) for z, zone in enumerate(buf._zones) for p in zone.peer_ptrs.tolist()]
    assert [s for s in starts if s[2]] == []


# ---- faults ---------------------------------------------------------------------------------------

def test_bad_inputs_raise_before_launch_with_the_fix():
    groups, bufs = _loopback(1)
    b = bufs[0]
    x, idx, w = torch.randn(2, 128).bfloat16(), torch.tensor([[0, 1], [2, -1]]), torch.rand(2, 2)
    with pytest.raises(TypeError, match="topk_weights has dtype torch.float16"):
        b.dispatch(x, idx, w.half())
    with pytest.raises(ValueError, match="dispatch the batch in chunks of at most 5"):
        b.dispatch(torch.randn(6, 128).bfloat16(), torch.zeros(6, 2, dtype=torch.int64), torch.rand(6, 2))
    with pytest.raises(ValueError, match="multiple of world_size"):
        PrefillBuffer(moe_comm.init(backend="loopback", world_size=2, device="cpu")[0], 5, 128, 2, 2)
    d = b.dispatch(x, idx, w)
    with pytest.raises(RuntimeError, match="has not been combined"):
        b.dispatch(x, idx, w)
    with pytest.raises(ValueError, match=r"expert_out has shape \(2, 128\), expected \(5, 128\)"):
        b.combine(x, d.handle)
    d = b.dispatch(x, idx, w)     # the refused combine answered the dispatch
    y = b.combine(d.recv_x, d.handle)
    assert torch.equal(y, x)      # one rank: every token's partial row is its own row


def test_every_rank_refusing_a_combine_leaves_the_group_usable():
    """Both ranks refuse the combine's inputs: both abort and release their zones, nobody waits, and the
    next rounds are exact (the next dispatch does not wait for a combine that never read anything)."""
    cfg = CONFIGS[0]
    groups, bufs = _loopback(2, cfg, timeout_s=2.0)
    for b, x, i, w in zip(bufs, *make_inputs(cfg, 2, "random", 1)):
        b.dispatch(x, i, w, phase="send")
    ds = [b.dispatch(phase="recv") for b in bufs]
    for b, d in zip(bufs, ds):
        with pytest.raises(TypeError, match="expert_out has dtype torch.float32"):
            b.combine(d.recv_x.float(), d.handle, phase="send")
    for seed in (2, 3):
        assert round_trip(bufs, cfg, *make_inputs(cfg, 2, "random", seed), f"seed{seed}") == []
    for g in groups:
        g.check()


def test_one_rank_refusing_a_dispatch_fails_the_group_loudly_until_reset():
    cfg = CONFIGS[0]
    groups, bufs = _loopback(2, cfg, timeout_s=2.0)
    xs, idxs, ws = make_inputs(cfg, 2, "random", 4)
    with pytest.raises(TypeError, match="dtype"):
        bufs[0].dispatch(xs[0].float(), idxs[0], ws[0], phase="send")
    bufs[1].dispatch(xs[1], idxs[1], ws[1], phase="send")
    with pytest.raises(CommAbortedError, match="prefill.dispatch: rank 1 got an abort from peer rank 0"):
        bufs[1].dispatch(phase="recv")
    for g in groups:
        g.reset()
    assert round_trip(bufs, cfg, *make_inputs(cfg, 2, "skewed", 5), "after reset") == []


def test_invalid_expert_id_is_a_named_data_error_with_nothing_out_of_bounds():
    """Ids 8 and -5 (8 experts) are not routed: InvalidIndexError naming the first one carries the result,
    which matches the reference with those slots unrouted; the rest of the zone keeps its poison."""
    cfg = CONFIGS[0]
    groups, bufs = _loopback(2, cfg)
    xs, idxs, ws = make_inputs(cfg, 2, "random", 6)
    bad = [i.clone() for i in idxs]
    bad[0][0, 1], bad[0][-1, 0] = 8, -5
    clean = [torch.where((i >= 0) & (i < 8), i, -1) for i in bad]
    exp_d, _, _ = expected(cfg, 2, xs, clean, ws)
    for b in bufs:
        poison(b)
    for b, x, i, w in zip(bufs, xs, bad, ws):
        b.dispatch(x, i, w, phase="send")
    with pytest.raises(InvalidIndexError, match="8") as info:
        bufs[0].dispatch(phase="recv")
    ds = [info.value.result, bufs[1].dispatch(phase="recv")]
    for r, d in enumerate(ds):
        assert check_dispatch(d, exp_d[r], cfg, f"rank{r}") == []
        # rows of no token (past every source's count) were not written: still poisoned
        m = cfg.max_tokens
        for s, n in enumerate(exp_d[r]["src_tokens"].tolist()):
            assert (d.recv_topk_idx[s * m + n:(s + 1) * m] == 12345).all()
    for b, d in zip(bufs, ds):
        b.combine(d.recv_x, d.handle, phase="send")
    ys = [b.combine(phase="recv") for b in bufs]
    want = reference.prefill_combine([e["x"] for e in exp_d], clean, 8, cfg.max_tokens)
    assert all(torch.equal(y, e) for y, e in zip(ys, want))


@pytest.mark.timeout(120)
def test_timeout_is_sticky_poisons_and_recovers_after_reset():
    """Rank 1 skips its combine: rank 0's combine raises CommTimeoutError naming it and its output is
    NaN (no partial sum); every later call on both ranks raises the group error with zero counts; after
    reset() rounds are exact."""
    cfg = CONFIGS[0]
    groups, bufs = _loopback(2, cfg, timeout_s=0.5)
    xs, idxs, ws = make_inputs(cfg, 2, "random", 6)   # rank 0 has M tokens
    for b, x, i, w in zip(bufs, xs, idxs, ws):
        b.dispatch(x, i, w, phase="send")
    ds = [b.dispatch(phase="recv") for b in bufs]
    bufs[0].combine(ds[0].recv_x, ds[0].handle, phase="send")
    out = torch.zeros_like(xs[0])
    with pytest.raises(CommTimeoutError, match="rank 0 timed out after 0.5 s waiting for peer rank 1") as info:
        bufs[0].combine(out=out, phase="recv")
    assert info.value.op == "prefill.combine"
    assert out.shape[0] > 0 and out.isnan().all()
    bufs[1].combine(ds[1].recv_x, ds[1].handle, phase="send")
    with pytest.raises(CommTimeoutError):
        bufs[1].combine(phase="recv")
    for b, x, i, w in zip(bufs, xs, idxs, ws):   # sticky: the next dispatch raises on every rank
        b.dispatch(x, i, w, phase="send")
    for b in bufs:
        with pytest.raises(CommTimeoutError) as info:
            b.dispatch(phase="recv")
        assert b._zones[0].counts.tolist() == [0] * cfg.experts_per_rank
    for g in groups:
        g.reset()
    for seed in (8, 9):
        assert round_trip(bufs, cfg, *make_inputs(cfg, 2, "random", seed), f"seed{seed}") == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("slow_in,transport", [("combine", "store"), ("dispatch", "store"), ("dispatch", "put"),
                                               ("pull", "put")])
def test_a_receive_whose_flags_came_before_the_group_failed_raises(monkeypatch, slow_in, transport):
    """A slow but live rank: rank 1 stops between the send and the receive of a call, every flag of that
    call already in its control words, while rank 0 goes on and times out waiting for it (``combine``:
    rank 0's next dispatch waits for rank 1 to release the zones; ``dispatch``: rank 0's combine waits for
    rank 1's partial rows; ``pull``, every peer by puts: the same, between rank 1's dispatch receive kernel
    and its pull of the rows). Rank 1's receive then waits for nothing, and the group has failed: it raises
    the group's error (rank 0's record, adopted), never the call's poisoned output (NaN rows, zero counts,
    rows not pulled) as a result. After reset() rounds are exact."""
    if transport == "put":
        monkeypatch.setenv("MOE_COMM_TRANSPORT", "put")
    cfg = CONFIGS[0]
    groups, bufs = _loopback(2, cfg, timeout_s=0.5)
    assert bufs[0].plan.put == (transport == "put")
    xs, idxs, ws = make_inputs(cfg, 2, "random", 6)   # rank 0 has M tokens
    for b, x, i, w in zip(bufs, xs, idxs, ws):
        b.dispatch(x, i, w, phase="send")
    named = "rank 0 timed out after 0.5 s waiting for peer rank 1"
    if slow_in == "combine":
        ds = [b.dispatch(phase="recv") for b in bufs]
        for b, d in zip(bufs, ds):
            b.combine(d.recv_x, d.handle, phase="send")
        assert not bufs[0].combine(phase="recv").isnan().any()
        bufs[0].dispatch(xs[0], idxs[0], ws[0], phase="send")   # waits for rank 1's release: times out
        with pytest.raises(CommTimeoutError, match=named) as info:
            bufs[1].combine(phase="recv")
        with pytest.raises(CommTimeoutError, match=named):
            bufs[0].dispatch(phase="recv")
    else:
        d0 = bufs[0].dispatch(phase="recv")
        bufs[0].combine(d0.recv_x, d0.handle, phase="send")

        def rank0_times_out():   # rank 1's partial rows never come
            with pytest.raises(CommTimeoutError, match=named):
                bufs[0].combine(phase="recv")
        if slow_in == "pull":    # after rank 1's receive kernel, before its pull
            recv = bufs[1]._zones[0].launches["dispatch_recv"]
            monkeypatch.setattr(recv, "run", lambda run=recv.run: (run(), rank0_times_out()))
        else:
            rank0_times_out()
        with pytest.raises(CommTimeoutError, match=named) as info:
            bufs[1].dispatch(phase="recv")
        monkeypatch.undo()
    assert info.value.rank == 0 and info.value.peer == 1
    for g in groups:
        g.reset()
    for seed in (8, 9):
        assert round_trip(bufs, cfg, *make_inputs(cfg, 2, "random", seed), f"seed{seed}") == []


@pytest.mark.timeout(120)
def test_excluded_rank_sends_and_receives_nothing():
    """World 3, rank 2 excluded: ranks 0 and 1 exchange exactly what the reference with rank 2 excluded
    gives; slots routed to rank 2's experts are counted in excluded_slots and skipped by the combine."""
    cfg = CONFIGS[0]
    groups, bufs = _loopback(3, cfg, timeout_s=2.0)
    live_groups, live = groups[:2], bufs[:2]
    for b in bufs:
        poison(b)   # rank 2's zone too: nothing may write it once it is excluded
    # The survivors agree (an exclude meets the live ranks: one thread each); rank 2 never answers.
    threads = [threading.Thread(target=g.exclude, args=([2],)) for g in live_groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [g.live_ranks for g in live_groups] == [[0, 1], [0, 1]]
    xs, idxs, ws = make_inputs(cfg, 3, "random", 10)
    E, m = 12, cfg.max_tokens
    exp_d = reference.prefill_dispatch(xs, idxs, ws, E, m, excluded=(2,))
    for b in live:
        poison(b)
    for r, b in enumerate(live):
        b.dispatch(xs[r], idxs[r], ws[r], phase="send")
    ds = [b.dispatch(phase="recv") for b in live]
    for r, d in enumerate(ds):
        assert check_dispatch(d, exp_d[r], cfg, f"rank{r}") == []
    for b, d in zip(live, ds):
        b.combine(d.recv_x, d.handle, phase="send")
    ys = [b.combine(phase="recv") for b in live]
    want = reference.prefill_combine([e["x"] for e in exp_d], idxs, E, m, excluded=(2,))
    assert all(torch.equal(ys[r], want[r]) for r in range(2))
    ids_words = bufs[2]._zones[0].recv_idx.numel()   # the rest of the zone (weights, rows): all-ones words
    assert (bufs[2]._zones[0].recv_idx == 12345).all() and (bufs[2]._dispatch_ch.data.local[0, ids_words:] == -1).all()
    to_2 = sum(int(((i >= 8) & (i < 12)).sum()) for i in idxs[:2])
    assert int(live[0].excluded_slots) + int(live[1].excluded_slots) == to_2 > 0


# ---- chunks ----------------------------------------------------------------------------------------

@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [1, 2])
def test_chunked_prefill_beyond_capacity(world):
    errs = moe_comm.launch(run_chunked_case, world, backend="shm", timeout_s=60)
    assert [e for r in errs for e in r] == []


@pytest.mark.timeout(180)
def test_next_dispatch_waits_for_every_rank_to_release_the_zone():
    """shm world 2, rank 1 slow between its combine's send and receive: rank 0's next dispatch into the
    same zone returns from its send only after rank 1's combine receive began (the device wait on the
    released words), with one zone and with two (pipelined), and every call is exact."""
    r0, r1 = moe_comm.launch(run_slow_reader_case, 2, backend="shm", timeout_s=60)
    for zones in (1, 2):
        assert r0[zones]["errs"] == [] and r1[zones]["errs"] == []
        assert r0[zones]["next_sent"] > r1[zones]["read_begins"], f"zones={zones}"


def _round(bufs, calls, i, phase):
    xs, idxs, ws = calls[i]
    return [b.dispatch(x, k, w, phase=phase) for b, x, k, w in zip(bufs, xs, idxs, ws)]


def test_two_zones_pipeline_exact_and_a_third_dispatch_is_refused():
    """zones=2, loopback world 2: dispatch a, dispatch b (other zone: a's result intact), combine a,
    dispatch c (a's zone), combine b, combine c: every result exact. A third dispatch in flight, or one
    while combine a's receive is still to run, raises before any launch and loses nothing."""
    cfg = CONFIGS[0]
    groups = moe_comm.init(backend="loopback", world_size=2, device="cpu", timeout_s=5.0)
    bufs = [make_buffer(g, cfg, zones=2) for g in groups]
    calls = [make_inputs(cfg, 2, "random", 40 + i) for i in range(3)]
    exp = [expected(cfg, 2, *c) for c in calls]
    for b in bufs:
        poison(b)
    ds = {}
    for i in (0, 1):
        _round(bufs, calls, i, "send")
        ds[i] = [b.dispatch(phase="recv") for b in bufs]
    assert [d.handle.zone for d in ds[0] + ds[1]] == [0, 0, 1, 1]
    with pytest.raises(RuntimeError, match="at most 2 may be in flight"):
        _round(bufs, calls, 2, "send")

    def combine(i, phases=("send", "recv")):
        if "send" in phases:
            for r, (b, d) in enumerate(zip(bufs, ds[i])):
                b.combine(expert_out(d, exp[i][0][r], r, cfg), d.handle, phase="send")
        if "recv" in phases:
            ys = [b.combine(phase="recv") for b in bufs]
            assert all(torch.equal(y, e) for y, e in zip(ys, exp[i][2])), f"call {i}"

    for r, d in enumerate(ds[0]):   # b landed in the other zone
        assert check_dispatch(d, exp[0][0][r], cfg, f"call 0 rank{r}") == []
    combine(0, ("send",))
    with pytest.raises(RuntimeError, match="has not been combined"):
        _round(bufs, calls, 2, "send")   # c would write a's zone while a's combine still reads it
    combine(0, ("recv",))
    _round(bufs, calls, 2, "send")
    ds[2] = [b.dispatch(phase="recv") for b in bufs]
    assert [d.handle.zone for d in ds[2]] == [0, 0]
    for i in (1, 2):
        for r, d in enumerate(ds[i]):
            assert check_dispatch(d, exp[i][0][r], cfg, f"call {i} rank{r}") == []
        combine(i)
    for g in groups:
        g.check()


@pytest.mark.timeout(120)
def test_two_zones_a_refused_combine_releases_its_own_call():
    """zones=2, loopback world 2: dispatch 1; every rank refuses combine 1; dispatch 2; combine 2's send;
    dispatch 3 (zone of call 1) waits for every rank's release of combine 1, which the refusal published:
    no false CommTimeoutError, and every result is exact. (The release once carried the previous call's
    number: dispatch 3 then waited for a release no rank published.)"""
    cfg = CONFIGS[0]
    groups = moe_comm.init(backend="loopback", world_size=2, device="cpu", timeout_s=2.0)
    bufs = [make_buffer(g, cfg, zones=2) for g in groups]
    calls = [make_inputs(cfg, 2, "random", 60 + i) for i in range(3)]
    exp = [expected(cfg, 2, *c) for c in calls]
    _round(bufs, calls, 0, "send")
    d1 = [b.dispatch(phase="recv") for b in bufs]
    for b, d in zip(bufs, d1):
        with pytest.raises(TypeError, match="expert_out has dtype torch.float32"):
            b.combine(d.recv_x.float(), d.handle, phase="send")
    _round(bufs, calls, 1, "send")
    d2 = [b.dispatch(phase="recv") for b in bufs]
    for r, (b, d) in enumerate(zip(bufs, d2)):
        b.combine(expert_out(d, exp[1][0][r], r, cfg), d.handle, phase="send")
    _round(bufs, calls, 2, "send")
    d3 = [b.dispatch(phase="recv") for b in bufs]
    assert [d.handle.zone for d in d3] == [0, 0]
    for r, d in enumerate(d3):
        assert check_dispatch(d, exp[2][0][r], cfg, f"call 3 rank{r}") == []
    y2 = [b.combine(phase="recv") for b in bufs]
    assert all(torch.equal(y, e) for y, e in zip(y2, exp[1][2]))
    for r, (b, d) in enumerate(zip(bufs, d3)):
        b.combine(expert_out(d, exp[2][0][r], r, cfg), d.handle, phase="send")
    y3 = [b.combine(phase="recv") for b in bufs]
    assert all(torch.equal(y, e) for y, e in zip(y3, exp[2][2]))
    for g in groups:
        g.check()


@pytest.mark.timeout(120)
def test_two_zones_fault_mid_pipeline_is_sticky_and_reset_starts_the_zones_over():
    """zones=2, loopback world 2, dispatches a and b in flight; rank 1 skips combine a: rank 0's combine
    raises CommTimeoutError naming it with NaN rows, every later call on both ranks raises (NaN rows for
    b's combine, zero counts for c in a's zone: no stale data), and after reset() the in-flight calls are gone and a new
    pipeline starts again in zone 0 and is exact."""
    cfg = CONFIGS[0]
    groups = moe_comm.init(backend="loopback", world_size=2, device="cpu", timeout_s=0.5)
    bufs = [make_buffer(g, cfg, zones=2) for g in groups]
    calls = [make_inputs(cfg, 2, "random", 60 + i) for i in range(3)]
    exp = [expected(cfg, 2, *c) for c in calls]
    ds = {}
    for i in (0, 1):
        _round(bufs, calls, i, "send")
        ds[i] = [b.dispatch(phase="recv") for b in bufs]
    bufs[0].combine(expert_out(ds[0][0], exp[0][0][0], 0, cfg), ds[0][0].handle, phase="send")
    out = torch.zeros_like(calls[0][0][0])
    with pytest.raises(CommTimeoutError, match="waiting for peer rank 1") as info:
        bufs[0].combine(out=out, phase="recv")
    assert info.value.op == "prefill.combine" and out.isnan().all()
    bufs[1].combine(expert_out(ds[0][1], exp[0][0][1], 1, cfg), ds[0][1].handle, phase="send")
    with pytest.raises(CommTimeoutError):
        bufs[1].combine(phase="recv")
    for b, d in zip(bufs, ds[1]):      # b's combine: the group error, NaN rows
        b.combine(d.recv_x, d.handle, phase="send")
    for b in bufs:
        with pytest.raises(CommTimeoutError):
            assert b.combine(phase="recv").isnan().all()
    _round(bufs, calls, 2, "send")
    for b in bufs:
        with pytest.raises(CommTimeoutError):
            b.dispatch(phase="recv")
        assert b._zones[0].counts.tolist() == [0] * cfg.experts_per_rank   # c's zone (a's, freed)
    for g in groups:
        g.reset()
    ds = {}
    for i in (0, 1):
        _round(bufs, calls, i, "send")
        ds[i] = [b.dispatch(phase="recv") for b in bufs]
    assert [d.handle.zone for i in (0, 1) for d in ds[i]] == [0, 0, 1, 1]
    for i in (0, 1):
        for r, (b, d) in enumerate(zip(bufs, ds[i])):
            assert check_dispatch(d, exp[i][0][r], cfg, f"call {i} rank{r}") == []
            b.combine(expert_out(d, exp[i][0][r], r, cfg), d.handle, phase="send")
        ys = [b.combine(phase="recv") for b in bufs]
        assert all(torch.equal(y, e) for y, e in zip(ys, exp[i][2])), f"call {i} after reset"


def test_zone_pointers_follow_the_buffers_after_a_new_epoch():
    """An exclusion repoints an excluded peer's buffer pointer at this rank's own copy (the heap), then
    resets: the next call re-derives every zone's pointers from the buffer's, so zone 1 of that peer is
    this rank's own zone 1 (an address that stays valid), not the released mapping."""
    cfg = CONFIGS[0]
    groups = moe_comm.init(backend="loopback", world_size=2, device="cpu", timeout_s=5.0)
    bufs = [make_buffer(g, cfg, zones=2) for g in groups]
    for b in bufs:
        b._ensure_allocated()
        b._in_flight_now()
    base = bufs[0]._dispatch_ch.data.peer_ptrs
    saved = base.clone()
    base[1] = base[0]                     # what heap.release_peer(1) does on rank 0
    for g in groups:
        g.reset()
    bufs[0]._in_flight_now()
    zone_bytes = bufs[0].plan.zone_words * 4
    assert bufs[0]._zones[1].peer_ptrs.tolist() == [int(saved[0]) + zone_bytes] * 2
    base.copy_(saved)
    for g in groups:
        g.reset()
    for seed in (70, 71):   # zone 0, then zone 1
        assert round_trip(bufs, cfg, *make_inputs(cfg, 2, "random", seed), f"seed{seed}") == []


def test_one_zone_dispatch_waits_for_the_combine_receive():
    """zones=1: a dispatch between a combine's send and its receive would overwrite the partial rows that
    receive reads (the peer's rows of this rank's tokens): refused before any launch; after the receive
    both rounds are exact."""
    cfg = CONFIGS[0]
    groups, bufs = _loopback(2, cfg, timeout_s=5.0)
    calls = [make_inputs(cfg, 2, "random", 50 + i) for i in range(2)]
    exp = [expected(cfg, 2, *c) for c in calls]
    _round(bufs, calls, 0, "send")
    ds = [b.dispatch(phase="recv") for b in bufs]
    for r, (b, d) in enumerate(zip(bufs, ds)):
        b.combine(expert_out(d, exp[0][0][r], r, cfg), d.handle, phase="send")
    with pytest.raises(RuntimeError, match="has not been combined"):
        _round(bufs, calls, 1, "send")
    ys = [b.combine(phase="recv") for b in bufs]
    assert all(torch.equal(y, e) for y, e in zip(ys, exp[0][2]))
    assert round_trip(bufs, cfg, *calls[1], "after") == []


@pytest.mark.parametrize("zones,fp8,dtype", [(1, False, torch.float32), (2, False, torch.float32),
                                             (2, True, torch.bfloat16)])
def test_moe_layer_helper_equals_per_token_experts(zones, fp8, dtype):
    """A MoE layer through prefill_moe + local_experts at world 1, 11 tokens in chunks of 5, top-3, -1 slots
    and a token routed nowhere: y[t] = sum over k of w * expert(e_k, x_t) in float32, in k order, rounded
    to dtype, bitwise (float32 keeps the k order visible; fp8: of the dequantized rows)."""
    from moe_comm.prefill_chunks import local_experts, num_chunks, prefill_moe
    g = torch.Generator().manual_seed(21)
    E, H, K, T = 4, 128, 3, 11
    buf = PrefillBuffer(moe_comm.init(backend="loopback", device="cpu")[0], E, H, 5, K, dtype=dtype,
                        fp8_dispatch=fp8, zones=zones)
    x = (torch.randn(T, H, generator=g) * 3).to(dtype)
    idx = torch.randint(0, E, (T, K), generator=g)
    idx[3, 1], idx[7] = -1, -1
    w = torch.rand(T, K, generator=g)
    scale = torch.rand(E, generator=g) + 0.5

    def expert(e, rows):   # row-independent, so batching cannot change a bit
        return (rows.float() * scale[e] + 0.3 * e).to(dtype)

    y = prefill_moe(buf, x, idx, w, local_experts(buf, expert), num_chunks(T, buf))
    xin = reference.dequantize_fp8(*reference.quantize_fp8(x)).to(dtype) if fp8 else x
    want = torch.zeros(T, H)
    for k in range(K):
        for t in range(T):
            if idx[t, k] >= 0:
                want[t] += w[t, k] * expert(int(idx[t, k]), xin[t:t + 1])[0].float()
    assert torch.equal(y, want.to(dtype))
    buf.close()


def test_chunked_prefill_needs_enough_chunks():
    from moe_comm.prefill_chunks import prefill_moe
    b = make_buffer(moe_comm.init(backend="loopback", device="cpu")[0], CONFIGS[0])
    x = torch.zeros(11, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="11 tokens need 3 chunks of 5, got chunks=2"):
        prefill_moe(b, x, torch.zeros(11, 2, dtype=torch.int64), torch.zeros(11, 2), lambda d: d.recv_x, 2)


def test_exact_size_output():
    """exact(): the valid rows in layout order, equal to the reference's; scattering partial rows back
    by ``rows`` gives the combine what it needs."""
    cfg = CONFIGS[1]   # fp8: scales too
    groups, bufs = _loopback(2, cfg)
    xs, idxs, ws = make_inputs(cfg, 2, "random", 12)
    exp_d, _, _ = expected(cfg, 2, xs, idxs, ws)
    for b in bufs:
        poison(b)
    for b, x, i, w in zip(bufs, xs, idxs, ws):
        b.dispatch(x, i, w, phase="send")
    ds = [b.dispatch(phase="recv") for b in bufs]
    for d, e in zip(ds, exp_d):
        got = d.exact()
        rows = e["valid"].nonzero().flatten()
        assert rows.numel() > 0 and torch.equal(got["rows"], rows)
        assert torch.equal(got["x"].view(torch.uint8), e["x"][rows].view(torch.uint8))
        assert torch.equal(got["scales"], e["scales"][rows]) and torch.equal(got["topk_idx"], e["topk_idx"][rows])
        assert torch.equal(got["topk_weights"], e["topk_weights"][rows])
    for b, d in zip(bufs, ds):
        b.combine(d.recv_x.new_zeros(d.recv_x.shape, dtype=cfg.dtype), d.handle, phase="send")
    for b in bufs:
        b.combine(phase="recv")


@pytest.mark.timeout(300)
def test_every_peer_by_puts_is_exact(monkeypatch):
    """MOE_COMM_TRANSPORT=put on a loopback world 2 (3 under MOE_COMM_LONG_TESTS; nodes of one rank: every
    row and partial row crosses by puts, this rank's own included, through the put path of docs/prefill.md
    "Across nodes"): every case of tests/prefill_cases.py equals the reference, puts carried them, and the
    put plan's symmetric bytes are what the buffer holds."""
    monkeypatch.setenv("MOE_COMM_TRANSPORT", "put")
    from moe_comm.interpreter import twin_module
    twin = twin_module("moe_comm.triton_kernels.nvshmem_device")
    original, puts = twin._copy_to_peer, []
    monkeypatch.setattr(twin, "_copy_to_peer", lambda *a: (puts.append(1), original(*a)))
    groups = moe_comm.init(backend="loopback", world_size=budget.size(2, 3), device="cpu", timeout_s=10)
    assert groups[0].uses_put and make_buffer(groups[0], CONFIGS[0]).plan.put
    assert run_loopback_cases(groups) == []
    assert len(puts) > 0
    bufs = [make_buffer(g, CONFIGS[1], zones=2) for g in groups]   # what the put plan says is what it holds
    for b in bufs:
        b._allocate()
    assert all(b._dispatch_ch.symmetric_bytes + b._combine_ch.symmetric_bytes == b.plan.symmetric_bytes for b in bufs)


def test_loopback_nodes_of_several_ranks_over_puts_are_refused(monkeypatch):
    """A loopback world whose nodes have several ranks and reach the others by puts cannot order the node
    reduction (it waits within the send phase for the node's other ranks): refused at construction, naming
    the alternatives; nodes that are not consecutive ranks are refused too."""
    from moe_comm.protocol import TRANSPORT_PUT as P, TRANSPORT_STORE as S
    monkeypatch.delenv("MOE_COMM_TRANSPORT", raising=False)
    monkeypatch.setattr(moe_comm.group, "choose_transports", lambda heap: [[S, S, P, P], [S, S, P, P],
                                                                          [P, P, S, S], [P, P, S, S]][heap.rank])
    groups = moe_comm.init(backend="loopback", world_size=4, device="cpu")
    with pytest.raises(NotImplementedError, match="use the shm heap.*MOE_COMM_TRANSPORT=put"):
        PrefillBuffer(groups[0], 8, 128, 2, 2)
    from moe_comm.topology import node_layout
    with pytest.raises(NotImplementedError, match="consecutive ranks"):
        node_layout([S, P, S, P], 0)
    assert node_layout([P, P, S, S], 3).ranks_per_node == 2 and node_layout([P, P], 1).ranks_per_node == 1


@pytest.mark.gpu
def test_overlapped_chunks_on_cuda_streams_equal_sequential():
    """CUDA, world 1 (loopback heap): prefill_moe with two zones (dispatches on the side stream, experts
    and combines on the caller's) gives the bits of one zone, chunk for chunk, and leaves the group clean."""
    from moe_comm.prefill_chunks import local_experts, num_chunks, prefill_moe
    dev = torch.device("cuda", 0)
    g = torch.Generator().manual_seed(23)
    E, H, K, T, M = 8, 256, 4, 1000, 128
    x = torch.randn(T, H, generator=g).bfloat16().to(dev)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(dev)
    w = torch.rand(T, K, generator=g).to(dev)
    scale = (torch.rand(E, generator=g) + 0.5).to(dev)
    ys = []
    for zones in (1, 2):
        group = moe_comm.init(backend="loopback", world_size=1, device=dev)[0]
        buf = PrefillBuffer(group, E, H, M, K, zones=zones)
        y = prefill_moe(buf, x, idx, w, local_experts(buf, lambda e, rows: (rows.float() * scale[e]).bfloat16()),
                        num_chunks(T, buf))
        torch.cuda.synchronize(dev)
        group.check()
        ys.append(y)
        buf.close()
    assert torch.equal(ys[0], ys[1])
