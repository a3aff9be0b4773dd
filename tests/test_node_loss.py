"""A node dies, the others keep serving (issue 45): a rank, or a whole node, SIGKILLed across emulated nodes.

The put path quiets and fences nothing on its steady-state paths (docs/multinode.md, "Staging reuse by
causality"), so under NVSHMEM's IBGDA transport a put to a dead rank is harmless until something waits on
its completion, which nothing does: every survivor's receive times out and names the dead rank
(CommTimeoutError), no survivor process is lost, ``exclude()`` stops all traffic to it and three steps are
exact among the survivors. Under the proxy transport (IBRC) the proxy thread polls every completion and a
failed one ends the process: the ranks that put to the dead rank are lost (the documented outcome).

The emulated NIC (``moe_comm/heap/wire.py``, ``MOE_COMM_WIRE_NIC``) follows NVSHMEM 3.4.5's source: with
``ibgda`` a message nobody waits on is never looked at; a quiet, a fence (IBGDA's fence polls every queue
pair) or a post that finds the send queue full (``MOE_COMM_WIRE_QP_DEPTH``) waits for it and, once the NIC
gives up, ends the process; with ``proxy`` a watchdog ends it whether or not anything waits. Every test
says which model its assertions hold under. The NIC's give-up time is set below the time the survivors
take to name, exclude and serve, so a wait on the dead rank anywhere (a quiet, a fence, a full queue)
would end a survivor within the test: the survivors' exits are part of what is checked.

What the emulation cannot show: a real NIC's completion and retry timing, a real send queue's wrap (its
depth is NVSHMEM's, the count of work requests per message its IBGDA code's, not measured), RDMA ordering
(the wire is an ordered TCP stream per pair; the kernels' order is checked on the event log in
tests/test_put_transport.py), or NVSHMEM itself. Nothing here ran on a GPU or across real nodes.
"""

import ctypes
import os
import time

import pytest
import torch

import moe_comm
from moe_comm import AllToAllvDynamic, CommTimeoutError, EPBuffer, LaunchError
from moe_comm.heap import wire as wire_mod
from moe_comm.heap.shm import RANKS_PER_NODE_ENV
from moe_comm.interpret_order import ORDER_ENV, SEED_ENV
from moe_comm.planner import SHAPES_ENV

import budget
import ep_cases
from fault_cases import CAP_A2A, E_PER_RANK, H, K, M, ROW, check_rank, expert, step_inputs
from test_emulated_nodes import _fatal_ends

DECODE_TIMEOUT_S = 5.0     # the group timeout of the decode tests (generous: 2 cores shared, GPU launch shapes)
PREFILL_TIMEOUT_S = 10.0   # the interpreted prefill kernels of one step take seconds on a loaded 2-core machine
# A failing step names the dead rank within the timeout plus this: its send phase and (for a survivor that
# finished the failing step before the status record reached it) one more step, interpreted under load.
DECODE_SLACK_S, PREFILL_SLACK_S = 6.0, 12.0
# The emulated NIC gives up on an unacknowledged message this long after it was posted: shorter than what
# the survivors do after the kill (a timeout, the exclusion, three steps, the close), so that a quiet, a
# fence or a full send queue waiting on the dead rank would end a survivor within the test.
NIC_GIVE_UP_S = 4.0
ORDERS = ("asis", "reverse", "random")


def _decode_ops(group):
    world = group.world_size
    return EPBuffer(group, E_PER_RANK * world, H, M, K), AllToAllvDynamic(group, CAP_A2A, ROW, torch.float32)


def _decode_step(group, ops, seed, excluded=(), die=None):
    """One decode step (dispatch -> combine, then an AllToAllvDynamic round trip) checked against the
    references with ``excluded`` ranks unrouted; this rank dies (SIGKILL) at ``die``: "dispatch" (after its
    dispatch's send, before its receive), "combine" (before its combine's send), "alltoallv" (after its
    AllToAllvDynamic's send). Returns this rank's mismatches."""
    ep, a2a = ops
    world, me = group.world_size, group.rank
    E = E_PER_RANK * world
    inputs = step_inputs(seed, world, E, M, K, H, CAP_A2A, ROW)
    xs, idxs, ws, sends, counts = inputs
    ep.dispatch(xs[me], idxs[me], phase="send")
    if die == "dispatch":
        os.kill(os.getpid(), 9)
    d = ep.dispatch(phase="recv")
    if die == "combine":
        os.kill(os.getpid(), 9)
    y = ep.combine(expert(d.x), ws[me], d.handle)
    a2a(sends[me], counts[me], phase="send")
    if die == "alltoallv":
        os.kill(os.getpid(), 9)
    res = a2a(phase="recv")
    back = a2a.combine(res.recv * 3, res.handle)
    return check_rank(me, inputs, d, y, res, back, E, M, CAP_A2A, excluded=excluded)


def _prefill_ops(group):
    import prefill_cases
    return prefill_cases.make_buffer(group, prefill_cases.CONFIGS[0])


def _prefill_step(group, buf, seed, excluded=(), die=None):
    """One PrefillBuffer dispatch -> combine across the nodes, checked against the reference in the node
    order (excluded ranks unrouted); this rank dies at ``die``: "dispatch" (between its dispatch's send and
    receive), "forward" (in its combine's send phase, after the send kernel published ``ready`` and before
    the node reduction that forwards the rows of the sources whose rail it is), "combine" (before its
    combine's send). Returns this rank's mismatches."""
    import prefill_cases
    cfg, world, me = prefill_cases.CONFIGS[0], group.world_size, group.rank
    xs, idxs, ws = ep_cases.make_inputs(cfg, world, "random", seed)
    exp_d, _, exp_y = prefill_cases.expected(cfg, world, xs, idxs, ws, prefill_cases.ranks_per_node(group), excluded)
    if die == "forward":
        buf._ensure_allocated()
        for zone in buf._zones:   # the node reduction's launch: the process dies instead
            zone.launches["combine_forward"].run = lambda **_: os.kill(os.getpid(), 9)
    buf.dispatch(xs[me], idxs[me], ws[me], phase="send")
    if die == "dispatch":
        os.kill(os.getpid(), 9)
    d = buf.dispatch(phase="recv")
    errs = prefill_cases.check_dispatch(d, exp_d[me], cfg, f"rank{me} seed{seed}")
    part = prefill_cases.expert_out(d, exp_d[me], me, cfg)
    d.recv_x.fill_(float("nan"))      # the experts' in-place writes: this rank's zone rows are its own now
    if die == "combine":
        os.kill(os.getpid(), 9)
    y = buf.combine(part, d.handle)
    if not torch.equal(y, exp_y[me]):
        errs.append(f"rank{me} seed{seed}: combine differs")
    return errs


KINDS = {"decode": (_decode_ops, _decode_step), "prefill": (_prefill_ops, _prefill_step)}


def _lose(group, kind, victims, where):
    """A good step; then ``victims`` die at ``where`` of the next one (os.kill 9: SIGKILL) while every
    other rank makes it: the step (or, for a survivor that finished it before the failure reached it, the
    next one) raises CommTimeoutError; ``exclude([the rank it names])``, then three steps exact among the
    survivors. Returns (mismatches of the good step, the rank named, seconds from the failing step's start
    to the error, the ranks excluded, mismatches of the three steps)."""
    make, step = KINDS[kind]
    ops = make(group)
    first = step(group, ops, 1)
    group.barrier()
    t0, named, took = time.monotonic(), None, None
    try:
        for seed in (2, 3):
            step(group, ops, seed, die=where if group.rank in victims else None)
    except CommTimeoutError as e:
        named, took = e.peer, time.monotonic() - t0
    if named is None:
        return first, None, None, None, None
    excluded = group.exclude([named])
    steps = [step(group, ops, 10 + s, excluded=tuple(excluded)) for s in range(3)]
    for op in ops if isinstance(ops, tuple) else (ops,):
        op.close()
    return first, named, took, excluded, steps


def _blamed(results, named, victims):
    """The victim behind ``named``: itself, or, for a survivor blocked on a victim (a wait that depended on it
    can expire before its record comes, docs/faults.md "Which rank is named"), the rank it named."""
    if named is None or named in victims or results[named] is None:
        return named
    return results[named][1]


def _survive(monkeypatch, capfd, kind, nodes, per_node, victims, where, order="asis"):
    """Launch ``_lose`` on emulated nodes (IBGDA model) and check: only the victims' processes end; every
    survivor named a victim (of a whole node, the one whose flag it missed first), or a survivor that named
    one (``_blamed``), within the timeout + slack, excluded exactly the victims and made
    three exact steps; no survivor's process ended at a wait on the dead rank (none quiets, fences or fills
    a send queue)."""
    world = nodes * per_node
    monkeypatch.setenv(RANKS_PER_NODE_ENV, str(per_node))
    monkeypatch.setenv(wire_mod.TRANSPORT_TIMEOUT_ENV, str(NIC_GIVE_UP_S))
    monkeypatch.setenv(ORDER_ENV, order)
    monkeypatch.setenv(SEED_ENV, "7")
    # The interpreter's launch shapes: it runs a launch's programs one after another, so with the GPU
    # shapes' many programs a wait that a GPU starts at launch starts seconds later here, and a survivor's
    # wait that depends on a live rank blocked on the dead one can expire first and name that rank
    # (docs/faults.md, "A dead peer across nodes"). The GPU shapes over puts: tests/test_put_transport.py.
    monkeypatch.setenv(SHAPES_ENV, "auto")
    monkeypatch.delenv(wire_mod.NIC_ENV, raising=False)   # the default: ibgda
    monkeypatch.delenv("MOE_COMM_TRANSPORT", raising=False)
    timeout, slack = (DECODE_TIMEOUT_S, DECODE_SLACK_S) if kind == "decode" else (PREFILL_TIMEOUT_S, PREFILL_SLACK_S)
    with pytest.raises(LaunchError) as info:
        moe_comm.launch(_lose, world, kind, victims, where, backend="shm", timeout_s=timeout, grace_s=600)
    err = info.value
    assert _fatal_ends(capfd.readouterr().err) == []   # no survivor waited on the dead rank
    assert sorted(err.failures) == sorted(victims), err.failures
    assert all("exit code -9" in err.failures[v] for v in victims), err.failures   # SIGKILL
    for r in range(world):
        if r in victims:
            continue
        first, named, took, excluded, steps = err.results[r]
        assert first == [], (r, first)
        assert _blamed(err.results, named, victims) in victims and took < timeout + slack, (r, named, took)
        assert excluded == sorted(victims), (r, excluded)
        assert steps == [[]] * 3, (r, steps)


# ---- decode: EPBuffer dispatch / combine, AllToAllvDynamic -----------------------------------------------

# (nodes, ranks per node, victims, where): a rank of another node than rank 0 at each kill point, and a
# whole node, at two nodes of two and at three nodes of two (at 3 x 2 rank 5 is the rail of sources 1
# and 3 on node 2, rank 4 of sources 0 and 2).
DECODE_CASES = [(2, 2, (3,), "dispatch"), (2, 2, (3,), "combine"), (2, 2, (2,), "alltoallv"),
                (2, 2, (2, 3), "combine"), (3, 2, (4,), "dispatch"), (3, 2, (3,), "combine"),
                (3, 2, (5,), "alltoallv"), (3, 2, (2, 3), "dispatch")]
PREFILL_CASES = [(2, 2, (3,), "dispatch"), (2, 2, (3,), "forward"), (2, 2, (2,), "combine"),
                 (2, 2, (2, 3), "dispatch"), (3, 2, (3,), "dispatch"), (3, 2, (5,), "forward"),
                 (3, 2, (4,), "combine"), (3, 2, (2, 3), "combine"), (3, 2, (4, 5), "forward")]


def _matrix(cases, *representatives):
    """Every case in every program order under the ``sweep`` mark; the ``representatives`` (case, order) in
    ``make test``."""
    out = []
    for case in cases:
        for order in ORDERS:
            if (case, order) in representatives:
                out.append(pytest.param(*case, order, id=f"{case[0]}x{case[1]}-{case[2]}-{case[3]}-{order}"))
            else:
                out.append(budget.sweep(*case, order, id=f"{case[0]}x{case[1]}-{case[2]}-{case[3]}-{order}"))
    return out


@pytest.mark.timeout(900)
@pytest.mark.parametrize("nodes, per_node, victims, where, order",
                         _matrix(DECODE_CASES, ((2, 2, (3,), "dispatch"), "asis"), ((3, 2, (4,), "dispatch"), "asis")))
def test_decode_survivors_name_exclude_and_continue(monkeypatch, capfd, nodes, per_node, victims, where, order):
    """IBGDA model. A rank (or a whole node) of another node than rank 0 SIGKILLed mid-decode: every
    survivor raises CommTimeoutError naming it (a victim) within the timeout + slack, no survivor
    process is lost (none waits on the dead rank's puts), exclude() removes exactly the victims and three
    steps of dispatch -> combine -> AllToAllvDynamic are exact among the survivors. (Until issue 45 every
    rank that put to the dead rank ended at its send's quiet.)"""
    _survive(monkeypatch, capfd, "decode", nodes, per_node, victims, where, order)


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("nodes, per_node, victims, where, order",
                         _matrix(PREFILL_CASES, ((2, 2, (3,), "forward"), "reverse"), ((2, 2, (3,), "dispatch"), "asis")))
def test_prefill_survivors_name_exclude_and_continue(monkeypatch, capfd, nodes, per_node, victims, where, order):
    """IBGDA model. PrefillBuffer across nodes: a rank (or a whole node) SIGKILLed mid-prefill, the dead
    rank a rail's forwarder among them (at 2 x 2 rank 3 is source 1's rail on node 1; killed at "forward"
    it dies with rank 1's rows in its zone, before it reduces and forwards them): every survivor names it
    within the timeout + slack, none is lost, exclude() removes exactly the victims (source 1's rail on
    node 1 becomes rank 2) and three prefill steps are exact among the survivors. Killed at "dispatch" (after
    its send) rank 3 is a rail that never pulls nor forwards: its node mate's pull barrier must name it,
    not a rank of the other node, which publishes no ``pulled`` there (it named rank 0 until issue 45)."""
    _survive(monkeypatch, capfd, "prefill", nodes, per_node, victims, where, order)


# ---- the proxy transport: the documented fatal outcome ---------------------------------------------------

PROXY_GIVE_UP_S = 12.0  # the emulated NIC's give-up time: longer than the group timeout, as NVSHMEM's 34 s are
# How long a rank stays after its CommTimeoutError: every put it made to rank 3 was posted before that error,
# so by then the NIC gave up on each (PROXY_GIVE_UP_S after its post) and the proxy thread, polling every
# wire_mod.PROXY_POLL_S, ended the process; the rest is room for a loaded machine to run that thread.
PROXY_STAY_S = PROXY_GIVE_UP_S + 2.0


def _until(done, what, within_s):
    """Poll ``done()`` until it holds; AssertionError naming ``what`` after ``within_s``."""
    deadline = time.monotonic() + within_s
    while not done():
        assert time.monotonic() < deadline, f"not {what} within {within_s} s"
        time.sleep(wire_mod.PROXY_POLL_S)


def _named_then_wait(group):
    """A good decode step; in the next one rank 3 dies once its dispatch's puts landed (its wire quieted:
    ranks 0 and 1 get its rows and go on to their combine), and ranks 0 and 1 send their combine, which
    puts to rank 3, only once rank 3's connection is gone: so their puts to it are never acknowledged,
    whatever the machine's load (if rank 3 were still alive when they arrived, or its rows never left its
    NIC and they never sent their combine, nothing of theirs would be outstanding and a real proxy would
    end nothing). Every rank records what it raised and stays PROXY_STAY_S after it (rank 2 until ranks 0
    and 1 are gone, or that long), sending nothing more."""
    ops = _decode_ops(group)
    _decode_step(group, ops, 1)
    group.barrier()
    ep, wire, me = ops[0], group.heap.wire, group.rank
    if me == 3:
        send = ep.dispatch

        def send_then_die(*args, **kwargs):
            send(*args, **kwargs)
            wire.quiet()                  # every message of its dispatch acknowledged: it landed
            os.kill(os.getpid(), 9)
        ep.dispatch = send_then_die
    elif me in (0, 1):
        combine = ep.combine

        def combine_to_the_dead(*args, **kwargs):
            _until(lambda: 3 in wire.lost, "rank 3's connection gone", PROXY_GIVE_UP_S)
            return combine(*args, **kwargs)
        ep.combine = combine_to_the_dead
    t0, named, took = time.monotonic(), None, None
    try:
        _decode_step(group, ops, 2)
    except CommTimeoutError as e:
        named, took = e.peer, time.monotonic() - t0
    end = time.monotonic() + PROXY_STAY_S
    while time.monotonic() < end and not (me == 2 and {0, 1} <= wire.lost):
        time.sleep(wire_mod.PROXY_POLL_S)
    return named, took


@pytest.mark.timeout(600)
def test_under_the_proxy_transport_the_dead_ranks_put_peers_are_lost(monkeypatch, capfd):
    """Proxy (IBRC) model, 2 x 2, rank 3 SIGKILLed mid-dispatch (once its dispatch landed): every survivor
    names it within the timeout + slack, and yet ranks 0 and 1, which put to it after it died (their
    combine), end once the NIC gives up on those puts (exit 255, naming rank 3, at least PROXY_GIVE_UP_S
    after them), with nothing waiting on the puts: the proxy thread polls every completion. Rank 2 (its
    node mate, stores only, whose puts went to live ranks) stays. This is why survival across nodes needs
    IBGDA (the same kill under the IBGDA model: ``test_decode_survivors_name_exclude_and_continue``)."""
    monkeypatch.setenv(RANKS_PER_NODE_ENV, "2")
    monkeypatch.setenv(wire_mod.NIC_ENV, "proxy")
    monkeypatch.setenv(wire_mod.TRANSPORT_TIMEOUT_ENV, str(PROXY_GIVE_UP_S))
    monkeypatch.setenv(SHAPES_ENV, "auto")   # (rank 2's record must reach ranks 0-1 before they end)
    monkeypatch.delenv("MOE_COMM_TRANSPORT", raising=False)
    with pytest.raises(LaunchError) as info:
        moe_comm.launch(_named_then_wait, 4, backend="shm", timeout_s=DECODE_TIMEOUT_S, grace_s=600)
    err = info.value
    assert sorted(err.failures) == [0, 1, 3], err.failures
    assert all("exit code 255" in err.failures[r] for r in (0, 1)) and "exit code -9" in err.failures[3], err.failures
    fatal = _fatal_ends(capfd.readouterr().err)
    assert [(r, pe) for r, pe, _ in fatal] == [(0, 3), (1, 3)], fatal
    assert all(waited >= PROXY_GIVE_UP_S for _, _, waited in fatal), fatal
    named, took = err.results[2]
    assert named == 3 and took < DECODE_TIMEOUT_S + DECODE_SLACK_S, err.results[2]


# ---- the emulated NIC itself: what each model does with a message to a dead rank --------------------------

def _wire_pair(monkeypatch, model, transport_timeout_s, depth=None, raises=True):
    """Two wires in this process (ranks 0 and 1) over a HashStore, rank 1's proxy applying into a local
    buffer (allocation index 0), NIC model ``model``; ``transport_failed`` records (and with ``raises``
    raises) instead of ending the process."""
    from torch.distributed import HashStore
    monkeypatch.setenv(wire_mod.NIC_ENV, model)
    monkeypatch.setenv(wire_mod.TRANSPORT_TIMEOUT_ENV, str(transport_timeout_s))
    if depth is not None:
        monkeypatch.setenv(wire_mod.QP_DEPTH_ENV, str(depth))
    failed = []

    def record(rank, pe, waited_s):
        failed.append((rank, pe, waited_s))
        if raises:
            raise RuntimeError("transport failed")
    monkeypatch.setattr(wire_mod, "transport_failed", record, raising=False)
    store, buf = HashStore(), (ctypes.c_int64 * 4)()
    wires = [wire_mod.Wire(r, store, 0.2, lambda index: ctypes.addressof(buf)) for r in range(2)]
    return wires, buf, failed


def _dead_receiver(wires, buf):
    wires[0].signal(1, 0, 0, 7, add=False)
    wires[0].quiet()                      # alive: delivered, acknowledged
    assert buf[0] == 7
    wires[1].close()                      # rank 1 dies: its end acknowledges nothing more
    time.sleep(0.3)


def test_the_wire_quiet_waits_for_a_slow_receiver_past_the_group_timeout(monkeypatch):
    """Either model: a receiver that acknowledges late (0.6 s, three times the group timeout of 0.2 s) but
    within the emulated NIC's retries: a quiet waits for it, and every message lands."""
    wires, buf, failed = _wire_pair(monkeypatch, "ibgda", 5.0)
    deliver = wires[1]._deliver

    def slow(conn):
        time.sleep(0.6)
        deliver(conn)
    monkeypatch.setattr(wires[1], "_deliver", slow)
    try:
        wires[0].signal(1, 0, 8, 41, add=False)
        t0 = time.monotonic()
        wires[0].quiet()
        took = time.monotonic() - t0
        assert buf[1] == 41 and failed == [] and 0.3 < took < 5.0, (buf[1], failed, took)
        wires[0].signal(1, 0, 8, 42, add=False)
        wires[0].quiet()
        assert buf[1] == 42
    finally:
        for w in wires:
            w.close()


@pytest.mark.parametrize("then", ["nothing", "quiet", "fence"])
def test_ibgda_a_put_to_a_dead_rank_is_harmless_until_a_quiet_or_fence(monkeypatch, then):
    """IBGDA model: messages to a dead receiver sit unacknowledged; past the NIC's give-up time nothing has
    happened (nobody polls their completions); a quiet, or a fence (IBGDA's polls every queue pair as its
    quiet does), then waits for them and fails the transport at once (they were given up on already)."""
    wires, buf, failed = _wire_pair(monkeypatch, "ibgda", 0.5)
    try:
        _dead_receiver(wires, buf)
        wires[0].put(1, 0, 8, ctypes.addressof(buf), 8)
        wires[0].signal(1, 0, 0, 8, add=False)
        time.sleep(1.0)                   # twice the give-up time: still nothing
        assert failed == [] and wires[0].lost == {1}
        if then == "nothing":
            return
        with pytest.raises(RuntimeError, match="transport failed"):
            wires[0].quiet() if then == "quiet" else wires[0].fence()
        assert [(r, pe) for r, pe, _ in failed] == [(0, 1)] and failed[0][2] >= 0.5, failed
        wires[0].quiet(skip={1})          # masked: an excluded rank is not waited for
    finally:
        wires[0].close()


def test_ibgda_a_dead_ranks_full_send_queue_is_fatal_a_live_ones_is_not(monkeypatch):
    """IBGDA model, a send queue of 8 work requests: to a live receiver, 40 puts (more than the queue holds)
    go through, each post waiting for room as NVSHMEM's does; to a dead one, the post that finds the queue
    full (8 puts in, one WQE each) waits for the oldest to complete and fails once the NIC gives up on it."""
    wires, buf, failed = _wire_pair(monkeypatch, "ibgda", 0.5, depth=8)
    try:
        for i in range(40):
            wires[0].signal(1, 0, 16, i, add=False)    # 3 WQEs each
        wires[0].quiet()
        assert buf[2] == 39 and failed == []
        wires[1].close()
        time.sleep(0.3)
        for _ in range(8):
            wires[0].put(1, 0, 8, ctypes.addressof(buf), 8)   # 8 WQEs: the queue is full, nothing waits yet
        assert failed == []
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="transport failed"):
            wires[0].put(1, 0, 8, ctypes.addressof(buf), 8)
        assert [(r, pe) for r, pe, _ in failed] == [(0, 1)] and 0.2 < time.monotonic() - t0 < 3.0, failed
    finally:
        wires[0].close()


def test_proxy_a_put_to_a_dead_rank_is_fatal_without_any_wait(monkeypatch):
    """Proxy (IBRC) model: the proxy thread polls every completion, so a message to a dead receiver fails
    the transport once the NIC gives up on it, with nothing quieting or fencing (in the watchdog thread:
    the process would end there)."""
    wires, buf, failed = _wire_pair(monkeypatch, "proxy", 0.5, raises=False)
    try:
        _dead_receiver(wires, buf)
        wires[0].signal(1, 0, 0, 8, add=False)
        deadline = time.monotonic() + 5.0
        while not failed and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [(r, pe) for r, pe, _ in failed] == [(0, 1)] and failed[0][2] >= 0.5, failed
    finally:
        wires[0].close()


def test_the_nic_model_is_chosen_by_its_variable(monkeypatch):
    monkeypatch.delenv(wire_mod.NIC_ENV, raising=False)
    assert wire_mod.nic_model() == "ibgda"
    monkeypatch.setenv(wire_mod.NIC_ENV, "ibrc")
    with pytest.raises(ValueError, match="ibgda, proxy"):
        wire_mod.nic_model()
    monkeypatch.setenv(wire_mod.QP_DEPTH_ENV, "0")
    with pytest.raises(ValueError, match="positive whole number"):
        wire_mod.qp_depth()
    monkeypatch.setenv(wire_mod.NIC_DELAY_ENV, "2:0.3,0:0.1")
    assert (wire_mod.nic_delay_s(2), wire_mod.nic_delay_s(0), wire_mod.nic_delay_s(1)) == (0.3, 0.1, 0.0)


# ---- staging reuse by causality, under a slow NIC -------------------------------------------------------

def _slow_nic_rounds(group, what):
    """Rank 0's NIC is slow (the test sets by how much). ``a2a``: AllToAllvDynamic forward calls back to back
    (no reverse between them: only the channel's own receives order its sends); ``one-zone``: the same with
    rank 0's send using one staging zone for every call (the control); ``prefill``: PrefillBuffer steps,
    whose experts overwrite this rank's zone rows as soon as its dispatch returns. Every result checked;
    returns this rank's mismatches."""
    from test_emulated_nodes import _a2a_round
    if what == "one-zone" and group.rank == 0:
        import triton
        from moe_comm.interpreter import twin_module

        @triton.jit
        def _one_zone(stage_ptr, zone, zone_elems):
            return stage_ptr
        twin_module("moe_comm.triton_kernels.alltoallv").stage_zone = _one_zone
    errs = []
    if what == "prefill":
        buf = _prefill_ops(group)
        for seed in range(30, 32):
            errs += _prefill_step(group, buf, seed)
    else:
        a2a = AllToAllvDynamic(group, 3, (8,), torch.float32)
        for seed in range(20, 24):
            errs += _a2a_round(group, a2a, seed)
    return errs


@pytest.mark.timeout(900)
@pytest.mark.parametrize("what, slow_s", [("a2a", 1.0), ("prefill", 0.1),
                                          budget.sweep("one-zone", 1.0, id="control-one-zone")])
def test_staging_is_reused_only_once_the_nic_read_it(monkeypatch, what, slow_s):
    """2 x 2 emulated nodes, rank 0's NIC reading each message's bytes ``slow_s`` after the one before:
    AllToAllvDynamic calls back to back and PrefillBuffer steps (whose experts overwrite their zone rows
    at once: the rows a rail gets are staged, not read from there) stay exact on every rank, with no quiet
    anywhere: a staging zone is rewritten only after a receive proved the NIC read it. Control (``make
    test-sweeps``): with one staging zone rank 0 rewrites its staging while its NIC has not read the last
    call's, and a peer receives the wrong count or rows."""
    monkeypatch.setenv(RANKS_PER_NODE_ENV, "2")
    monkeypatch.setenv(wire_mod.NIC_DELAY_ENV, f"0:{slow_s}")
    monkeypatch.delenv("MOE_COMM_TRANSPORT", raising=False)
    out = moe_comm.launch(_slow_nic_rounds, 4, what, backend="shm", timeout_s=60)
    if what == "one-zone":
        assert any(out), out
    else:
        assert out == [[]] * 4, out
