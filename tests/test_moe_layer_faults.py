"""The fault model inside the fused MoE layer's kernels (docs/faults.md): a peer that never sends is named by
CommTimeoutError on every rank, the error is sticky, reset() makes the next call exact on every rank; an
input error aborts the call; a data error is raised at the end of the call with its exact result; a dead
rank is excluded and the survivors stay exact; the flight recorder names the rank that never published.

Loopback worlds drive the ranks phase by phase in one process, so "never sends" is a rank that skips a
phase; the exclusion test kills a rank process (shm). What these emulations cannot show: two ranks'
kernels racing on a GPU (the interpreter runs one program at a time; the PTX rules cover ordering)."""

import os

import pytest
import torch

import moe_comm
from moe_comm import (CapacityError, CommAbortedError, CommTimeoutError, GroupError, InvalidIndexError, LaunchError,
                      reference)
from moe_comm.planner import SHAPES_ENV
from moe_comm.recovery import recover
from moe_comm.trace import analyze
from moe_comm.trace.recorder import channel_records

from budget import SWEEP, sweep
from moe_layer_cases import (CONFIGS, LayerConfig, case_inputs, check_ranks, layer_inputs, make_layer,
                             run_loopback_layers)

TIMEOUT_S = 1.0
CFG = CONFIGS[0]


def _world(world, timeout_s=TIMEOUT_S, trace=None):
    groups = moe_comm.init(backend="loopback", world_size=world, device="cpu", timeout_s=timeout_s, trace=trace)
    inputs = case_inputs(CFG, world, "random", True, 0)
    return groups, [make_layer(g, CFG, inputs[3][r], inputs[4][r]) for r, g in enumerate(groups)]


def _exact_call(layers, seed):
    """One call on every rank with exact inputs (the layers' weights replaced by the case's): [] if exact."""
    world = len(layers)
    inputs = case_inputs(CFG, world, "random", True, seed)
    for r, layer in enumerate(layers):
        layer.set_weights(inputs[3][r], inputs[4][r])
    ys = run_loopback_layers(layers, *inputs[:3])
    return check_ranks(dict(enumerate(ys)), inputs, CFG, True, f"seed {seed}")


def _call_inputs(world, seed):
    return case_inputs(CFG, world, "random", True, seed)[:3]


def _rank_2_skips_a_call(layers):
    """Ranks 0 and 1 of a world-3 loopback call, rank 2 skipping it: both raise CommTimeoutError naming rank 2
    from their experts phase (rank 0's gate/up kernel waited; rank 1 adopts its record)."""
    xs, idxs, ws = _call_inputs(3, 2)
    for r in (0, 1):
        layers[r](xs[r], idxs[r], ws[r], phase="send")
    for r in (0, 1):
        with pytest.raises(CommTimeoutError, match="dispatch: rank 0 timed out .* waiting for peer rank 2"):
            layers[r](phase="experts")


@pytest.mark.timeout(120)
def test_a_peer_that_never_sends_is_named_on_every_rank_and_reset_makes_the_next_call_exact():
    """Rank 2 skips a call: the gate/up kernels of ranks 0 and 1 wait for its dispatch flag, time out, and
    both ranks raise CommTimeoutError naming rank 2 (rank 0 waited; rank 1 adopts its record); rank 2 and
    every later call raise it too (sticky); after reset() the next calls are exact on every rank."""
    groups, layers = _world(3)
    _rank_2_skips_a_call(layers)
    xs, idxs, ws = _call_inputs(3, 3)
    for r in range(3):
        layers[r](xs[r], idxs[r], ws[r], phase="send")
    for r in range(3):   # sticky, on every rank (rank 2 included), and no wait: the group is failed
        with pytest.raises(CommTimeoutError, match="peer rank 2"):
            layers[r](phase="experts")
    for g in groups:
        g.reset()
    assert _exact_call(layers, 4) == []


@pytest.mark.timeout(120)
def test_a_peer_that_never_sends_its_expert_rows_is_named_and_the_output_is_nan():
    """Rank 1 dispatches but never runs its experts (so never sends its output tiles): the combine receive
    of rank 0 times out naming it, its y is NaN (never partial); after reset() exact again."""
    groups, layers = _world(2)
    xs, idxs, ws = _call_inputs(2, 2)
    for r in range(2):
        layers[r](xs[r], idxs[r], ws[r], phase="send")
    layers[0](phase="experts")
    out = torch.zeros_like(xs[0])
    with pytest.raises(CommTimeoutError, match="combine: rank 0 timed out .* waiting for peer rank 1"):
        layers[0](phase="recv", out=out)
    assert out.shape[0] > 0 and bool(out.isnan().all())
    for g in groups:
        g.reset()
    assert _exact_call(layers, 3) == []


@pytest.mark.timeout(120)
def test_an_input_error_on_one_rank_aborts_the_call_and_on_every_rank_leaves_the_group_usable():
    """Rank 1's topk_weights has the wrong shape: it raises ValueError having taken part (abort), rank 0
    raises CommAbortedError naming it, the group is failed until reset(); when every rank has the error,
    every rank raises ValueError and the next call is exact with no reset."""
    groups, layers = _world(2)
    xs, idxs, ws = _call_inputs(2, 2)
    with pytest.raises(ValueError, match="topk_weights"):
        layers[1](xs[1], idxs[1], ws[1][:, :1], phase="send")
    layers[0](xs[0], idxs[0], ws[0], phase="send")
    with pytest.raises(CommAbortedError, match="abort from peer rank 1"):
        layers[0](phase="experts")
    for g in groups:
        g.reset()
    for r in range(2):
        with pytest.raises(ValueError, match="topk_weights"):
            layers[r](xs[r], idxs[r], ws[r][:, :1], phase="send")
    assert _exact_call(layers, 4) == []
    for g in groups:
        g.check()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["store", sweep("put")])
def test_data_errors_are_raised_at_the_end_of_the_call_with_the_exact_result(monkeypatch, transport):
    """An out-of-range id on rank 0 (InvalidIndexError) and more rows for one expert than its capacity
    (CapacityError: every token lists expert 0 twice) are raised at the end of the call that found them,
    err.result being that call's y, equal to the reference (the bad slot not routed; the rows past the
    capacity adding zeros, though the landing slots they would have used hold an earlier call's rows), on
    the store and the put transport; the next call is exact."""
    monkeypatch.setenv("MOE_COMM_TRANSPORT", transport)
    groups, layers = _world(2)
    E = 2 * CFG.experts_per_rank
    xs, idxs, ws, w13s, w2s = layer_inputs(2, [5, 5], CFG.experts_per_rank, CFG.hidden, CFG.inter, CFG.topk, 9, True)
    for r, layer in enumerate(layers):
        layer.set_weights(w13s[r], w2s[r])

    def call(ids):
        for r in range(2):
            layers[r](xs[r], ids[r], ws[r], phase="send")
        for layer in layers:
            layer(phase="experts")
        got = []
        for layer in layers:
            try:
                got.append((layer(phase="recv"), None))
            except (InvalidIndexError, CapacityError) as err:
                got.append((err.result, type(err)))
        want = reference.moe_layer(xs, [torch.where(i < E, i, -1) for i in ids], ws, w13s, w2s, E, CFG.max_tokens)
        assert all(torch.equal(y, w) for (y, _), w in zip(got, want))
        return [kind for _, kind in got]

    # Every slot of both ranks to rank 0's experts, spread (5 rows each): rows in the slots that the
    # over-capacity call two calls later (the same landing zone) drops.
    spread = [torch.stack([torch.arange(5) % 4, (torch.arange(5) + 1) % 4], dim=1) for _ in range(2)]
    assert call(spread) == [None, None]
    bad = [i.clone() for i in idxs]
    bad[0][1, 0] = 4 * E                              # out of range: not routed, InvalidIndexError on rank 0
    assert call(bad) == [InvalidIndexError, None]
    dup = [torch.zeros_like(i) for i in idxs]         # 2 ranks x 5 tokens x 2 slots on expert 0: 20 rows, room for 10
    assert CapacityError in call(dup)
    assert _exact_call(layers, 10) == []


@pytest.mark.timeout(120)
def test_the_flight_recorder_names_the_rank_that_never_published(tmp_path, monkeypatch):
    """With the recorder on and MOE_COMM_TRACE_DIR set, the CommTimeoutError of rank 1's skipped call dumps
    rank 0, and the analyzer says rank 1 never published that dispatch call, rank 0 having waited for it
    (the call after an exact one: the recorder holds both)."""
    monkeypatch.setenv("MOE_COMM_TRACE_DIR", str(tmp_path))
    groups, layers = _world(2, trace=8)
    assert _exact_call(layers, 1) == []
    xs, idxs, ws = _call_inputs(2, 2)
    layers[0](xs[0], idxs[0], ws[0], phase="send")
    with pytest.raises(CommTimeoutError):
        layers[0](phase="experts")
    diag = analyze.analyze(analyze.load_dumps(str(tmp_path)))
    assert diag.ranks == [0]
    never = [(x["rank"], x["op"], x["call"], x["waiters"]) for x in diag.never_published]
    assert never == [(1, "dispatch", 2, [0])], diag.lines


KILL_STEP, DEAD, STEPS = 3, 2, 7


def _serve(group):
    """A serving loop of layer calls on one rank; rank DEAD dies before its send at step KILL_STEP. Survivors
    recover (reset; exclude who does not come) after a group error and check every other step against the
    reference over the survivors (the dead rank's experts not routed, its tokens gone)."""
    me, world = group.rank, group.world_size
    inputs = case_inputs(CFG, world, "random", True, 0)
    layer = make_layer(group, CFG, inputs[3][me], inputs[4][me])
    log, errs = [], []
    for step in range(STEPS):
        xs, idxs, ws, w13s, w2s = case_inputs(CFG, world, "random", True, 100 + step)
        layer.set_weights(w13s[me], w2s[me])
        dead = tuple(r for r in range(world) if r not in group.live_ranks)
        if step == KILL_STEP and me == DEAD:
            os._exit(1)
        try:
            y = layer(xs[me], idxs[me], ws[me])
            errs += check_ranks({me: y}, (xs, idxs, ws, w13s, w2s), CFG, True, f"step {step}", excluded=dead)
            log.append("exact")
        except GroupError as err:
            log.append(type(err).__name__)
            log[-1] += f";excluded:{recover([group])}"
    return log, errs, group.live_ranks


@SWEEP
@pytest.mark.timeout(900)
def test_a_dead_rank_is_excluded_and_the_survivors_stay_exact():
    """Shm processes, world 3: rank 2 dies at step 3; ranks 0 and 1 raise CommTimeoutError at that step,
    exclude it, and every later step is exact against the reference without rank 2. (An earlier step may
    time out on a loaded machine, interpreted ranks being slow: it must then recover without excluding.)"""
    with pytest.raises(LaunchError) as info:
        moe_comm.launch(_serve, 3, backend="shm", timeout_s=8.0, grace_s=600)
    assert list(info.value.failures) == [DEAD]
    for r in (0, 1):
        log, errs, live = info.value.results[r]
        assert errs == [] and live == [0, 1], (log, errs[:3])
        assert all(x in ("exact", "CommTimeoutError;excluded:[]") for x in log[:KILL_STEP]), log
        assert log[KILL_STEP] == "CommTimeoutError;excluded:[2]", log
        assert log[KILL_STEP + 1:] == ["exact"] * (STEPS - KILL_STEP - 1), log


@pytest.mark.timeout(120)
def test_a_tile_is_computed_once_its_sources_are_there_and_the_rest_waits(monkeypatch):
    """Arrival-driven tiles (GPU launch shapes: 16-row tiles): rank 0 sends 16 tokens to expert 0, rank 1
    never sends. Rank 0's gate/up kernel computes tile 0 (rows 0-15, all rank 0's: exactly the reference
    activations) without rank 1, then waits for rank 1 for the rest, times out naming it, and leaves the
    rows it could not compute untouched (NaN here)."""
    monkeypatch.setenv(SHAPES_ENV, "gpu")
    cfg = LayerConfig(2, 64, 32, 1, 16)
    groups = moe_comm.init(backend="loopback", world_size=2, device="cpu", timeout_s=TIMEOUT_S)
    xs, idxs, ws, w13s, w2s = layer_inputs(2, [16, 16], cfg.experts_per_rank, cfg.hidden, cfg.inter, cfg.topk, 3,
                                           True)
    layers = [make_layer(g, cfg, w13s[r], w2s[r]) for r, g in enumerate(groups)]
    assert layers[0].plan.block_rows == 16
    run_loopback_layers(layers, xs, idxs, ws)        # allocates; exact calls are checked elsewhere
    idxs = [torch.zeros_like(i) for i in idxs]       # every token of both ranks to expert 0 (rank 0's)
    h = layers[0].ep._h
    h.fill_(float("nan"))
    layers[0](xs[0], idxs[0], ws[0], phase="send")
    with pytest.raises(CommTimeoutError, match="dispatch: rank 0 timed out .* waiting for peer rank 1"):
        layers[0](phase="experts")
    g = xs[0].float() @ w13s[0][0, :cfg.inter].float().T
    u = xs[0].float() @ w13s[0][0, cfg.inter:].float().T
    assert torch.equal(h[0, :16], (g * torch.sigmoid(g) * u).to(h.dtype))
    assert bool(h[0, 16:].isnan().all()) and bool(h[1].isnan().all())


@pytest.mark.timeout(120)
def test_the_recorder_holds_the_fused_calls_and_names_a_rank_that_never_sent_its_expert_rows(tmp_path, monkeypatch):
    """The down kernel is the combine's send: with the recorder on, each rank's records of an exact call are
    those of EPBuffer's ops (dispatch and combine "ok", the combine sending back the rows the dispatch
    received and receiving the ones it sent, its send's start before its end). Then rank 1 dispatches but
    never runs its experts: rank 0's combine receive times out, and the analyzer says rank 1 never
    published that combine call, rank 0 having waited for it."""
    monkeypatch.setenv("MOE_COMM_TRACE_DIR", str(tmp_path))
    groups, layers = _world(2, trace=8)
    assert _exact_call(layers, 1) == []
    routed = 0
    for layer in layers:
        (d,), (c,) = channel_records(layer.ep._dispatch_ch), channel_records(layer.ep._combine_ch)
        assert (d.op, d.call, d.outcome, c.op, c.call, c.outcome) == ("dispatch", 1, "ok", "combine", 1, "ok")
        assert c.sent_rows == d.recv_rows and c.recv_rows == d.sent_rows, (d, c)
        assert 0 < c.send_start <= c.send_end, c
        routed += sum(d.sent_rows)
    assert routed > 0   # rows crossed (a rank with T = 0 routes none)
    xs, idxs, ws = _call_inputs(2, 2)
    for r in range(2):
        layers[r](xs[r], idxs[r], ws[r], phase="send")
    layers[0](phase="experts")
    with pytest.raises(CommTimeoutError, match="combine: rank 0 timed out .* waiting for peer rank 1"):
        layers[0](phase="recv")
    diag = analyze.analyze(analyze.load_dumps(str(tmp_path)))
    never = [(x["rank"], x["op"], x["call"], x["waiters"]) for x in diag.never_published]
    assert never == [(1, "combine", 2, [0])], diag.lines


def _bad_out_call(group):
    """Rank 1 passes an out of the wrong shape to a phase="both" call: it must raise ValueError having taken part
    (abort), rank 0 CommAbortedError naming it; after reset() the next call is exact on both ranks."""
    me, world = group.rank, group.world_size
    inputs = case_inputs(CFG, world, "random", True, 5)
    layer = make_layer(group, CFG, inputs[3][me], inputs[4][me])
    x = inputs[0][me]
    out = torch.empty(x.shape[0] + 1, CFG.hidden, dtype=x.dtype) if me == 1 else None
    try:
        layer(x, inputs[1][me], inputs[2][me], out=out)
        got = "no error"
    except (ValueError, CommAbortedError) as err:
        got = f"{type(err).__name__}: {err}"
    group.reset()
    y = layer(x, inputs[1][me], inputs[2][me], out=torch.empty_like(x))
    return got, check_ranks({me: y}, inputs, CFG, True, "after reset")


@pytest.mark.timeout(300)
def test_a_bad_out_is_refused_before_the_call_runs_on_every_rank():
    """``out`` of a phase="both" call is checked with the send's inputs: refused there, the rank takes part by
    aborting and nothing is left pending (refused only at the receive, the call would have run, its
    receive stayed pending and every later call of that rank refused to start, its peers then timing out).
    World 1 (the next call exact with no reset) and world 2 over shared memory."""
    (group,) = moe_comm.init(backend="loopback", world_size=1, device="cpu", timeout_s=TIMEOUT_S)
    inputs = case_inputs(CFG, 1, "random", True, 3)
    layer = make_layer(group, CFG, inputs[3][0], inputs[4][0])
    x, idx, w = inputs[0][0], inputs[1][0], inputs[2][0]
    for bad, err in ((torch.empty(x.shape[0] + 1, CFG.hidden, dtype=x.dtype), ValueError),
                     (torch.empty(x.shape[0], CFG.hidden, dtype=torch.float32), TypeError),
                     (torch.empty(CFG.hidden, x.shape[0], dtype=x.dtype).T, ValueError)):
        with pytest.raises(err, match="out"):
            layer(x, idx, w, out=bad)
        assert check_ranks({0: layer(x, idx, w)}, inputs, CFG, True, "next call") == []
    results = moe_comm.launch(_bad_out_call, 2, backend="shm", timeout_s=30.0)
    assert results[1][0].startswith("ValueError: out has shape"), results
    assert results[0][0].startswith("CommAbortedError") and "peer rank 1" in results[0][0], results
    assert [errs for _, errs in results] == [[], []]


@pytest.mark.timeout(300)
def test_an_excluded_rank_is_neither_waited_for_nor_sent_to_in_the_fused_kernels():
    """make test's representative of exclusion (the rank-process kill above is a sweep): loopback world 3,
    rank 2 skips a call, ranks 0 and 1 time out naming it, exclude it and reset; then three calls of the two
    survivors are exact against the reference without rank 2 (its experts not routed, its tokens gone): the
    gate/up kernels wait for no flag of rank 2 and the down kernels send it nothing. What it cannot show: a
    dead process (the sweep's shm test kills one)."""
    groups, layers = _world(3)
    _rank_2_skips_a_call(layers)
    assert [groups[r].exclude([2]) for r in (0, 1)] == [[2], [2]]
    for r in (0, 1):
        groups[r].reset()
    for seed in (3, 4, 5):
        inputs = case_inputs(CFG, 3, "random", True, seed)
        for r in (0, 1):
            layers[r].set_weights(inputs[3][r], inputs[4][r])
        for r in (0, 1):
            layers[r](inputs[0][r], inputs[1][r], inputs[2][r], phase="send")
        for r in (0, 1):
            layers[r](phase="experts")
        ys = {r: layers[r](phase="recv") for r in (0, 1)}
        assert check_ranks(ys, inputs, CFG, True, f"seed {seed}", excluded=(2,)) == []
