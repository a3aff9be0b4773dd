"""Emulated nodes on the CPU (``MOE_COMM_RANKS_PER_NODE=k``, shm heap): ranks of another node are not
mapped at all, and the only way across is the put emulation's wire (``moe_comm/heap/wire.py``).

What these tests show: every cross-node peer pointer is 0 and no process maps a heap file of another node
(``/proc/self/maps``); the put transport is chosen for those peers; dispatch/combine (bf16, fp8) and
AllToAllvDynamic stay exact against the references when every cross-node byte travels as messages that a
proxy thread of the receiving process applies asynchronously; a rank killed on the other node is named by
a CommTimeoutError on every survivor within the timeout + 2 s, and ``exclude()`` / ``reset()`` work across
the boundary; a group-wide error recorded on one node reaches the other as a put of the status record
(the same named error on every rank, before the other node's own timeouts), and a dead receiver does
not hold up that put's sender. What they cannot show: a real NIC's ordering, completion or bandwidth, or
NVSHMEM itself.
"""

import os
import re
import time

import pytest
import torch

import moe_comm
from moe_comm import AllToAllvDynamic, CommTimeoutError, EPBuffer, GroupError, LaunchError, protocol, scale_model
from moe_comm.heap.shm import RANKS_PER_NODE_ENV, session_prefix

import a2a_cases
import ep_cases
import test_compat_deep_ep
from fault_cases import E_PER_RANK, H, K, M, expert, serve, step_inputs

TIMEOUT_S = 1.5


def _maps_of_other_nodes(group) -> list[str]:
    """Heap files of another node's ranks that this process maps."""
    heap = group.heap
    pre = re.escape(session_prefix(heap.session))
    found = []
    with open("/proc/self/maps") as f:
        for line in f:
            m = re.search(pre + r"(\d+)_\d+", line)
            if m and heap.node[int(m.group(1))] != heap.node[group.rank]:
                found.append(line.strip())
    return found


def _isolation(group) -> list[str]:
    heap, me = group.heap, group.rank
    errs = []
    far = [j for j in range(group.world_size) if heap.node[j] != heap.node[me]]
    if not far:
        errs.append(f"rank {me}: no rank on another node")
    for k, (_, _, buf) in heap._live.items():
        ptrs = buf.peer_ptrs.tolist()
        if any(ptrs[j] != 0 for j in far):
            errs.append(f"rank {me}: {buf.name} has a pointer to another node: {ptrs}")
    errs += [f"rank {me} maps {m}" for m in _maps_of_other_nodes(group)]
    if any(group.transports[j] != protocol.TRANSPORT_PUT for j in far):
        errs.append(f"rank {me}: transports {group.transports}")
    return errs


def _cases(group, which):
    errs = _isolation(group)
    if which == "compat":
        # DeepEP's API makes its own CommGroup for torch.distributed's group (compat.deep_ep): check that one.
        errs += test_compat_deep_ep.shm_rank(group)
        from moe_comm.compat import deep_ep  # noqa: PLC0415
        group, before = deep_ep._shared_group, 0
    else:
        before = group.heap.wire.stats["bytes"]
        errs += {"ep": ep_cases.run_shm_cases, "a2a": a2a_cases.run_shm_cases}[which](group)
    if group.heap.wire.stats["bytes"] <= before:
        errs.append(f"rank {group.rank}: nothing crossed the wire")
    errs += _isolation(group)   # buffers allocated by the cases too
    return errs


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world, per_node, which", [(4, 2, "ep"), (3, 1, "ep"), (4, 2, "a2a"), (3, 1, "a2a"),
                                                     (4, 2, "compat"), (3, 1, "compat")])
def test_ops_are_exact_across_emulated_nodes(monkeypatch, world, per_node, which):
    """ep: every bf16 and fp8 dispatch/combine case of tests/ep_cases.py; a2a: every AllToAllvDynamic case
    of tests/a2a_cases.py; compat: DeepEP's low-latency API (moe_comm.compat.deep_ep) through a
    torch.distributed ProcessGroup, fp8 and bf16, events and hooks (tests/test_compat_deep_ep.py)."""
    monkeypatch.setenv(RANKS_PER_NODE_ENV, str(per_node))
    monkeypatch.delenv("MOE_COMM_TRANSPORT", raising=False)
    errs = moe_comm.launch(_cases, world, which, backend="shm", timeout_s=60)
    assert errs == [[]] * world


def _killed_on_the_other_node(group, victim):
    """Rank ``victim`` (on another node than rank 0) dies after a good step; the survivors time out naming
    it, exclude it, go on."""
    world, me = group.world_size, group.rank
    E = E_PER_RANK * world
    ep = EPBuffer(group, E, H, M, K)
    inputs = step_inputs(77, world, E, M, K, H, 3, (8,))
    xs, idxs = inputs[0], inputs[1]
    d = ep.dispatch(xs[me], idxs[me])
    ep.combine(expert(d.x), inputs[2][me], d.handle)
    if me == victim:
        os._exit(9)
    t0 = time.monotonic()
    try:
        d = ep.dispatch(xs[me], idxs[me])
        ep.combine(expert(d.x), inputs[2][me], d.handle)
        named, took = None, None
    except CommTimeoutError as e:
        named, took = e.peer, time.monotonic() - t0
    ep.close()
    out = serve(group, 3, {}) if named is not None and group.exclude([named]) == [victim] else None
    return named, took, out


@pytest.mark.parametrize("world, per_node", [(4, 2), (3, 1)])
def test_killed_rank_on_the_other_node_is_named_and_excluded(monkeypatch, world, per_node):
    monkeypatch.setenv(RANKS_PER_NODE_ENV, str(per_node))
    victim = world - 1
    with pytest.raises(LaunchError) as info:
        moe_comm.launch(_killed_on_the_other_node, world, victim, backend="shm", timeout_s=TIMEOUT_S, grace_s=300)
    err = info.value
    survivors = list(range(victim))
    assert sorted(err.failures) == [victim], err.failures
    for r in survivors:
        named, took, out = err.results[r]
        assert named == victim, err.results
        assert took < TIMEOUT_S + 2, err.results
        assert out["log"] == ["exact"] * 3 and out["mismatches"] == [] and out["live"] == survivors, out


# ---- bytes on the wire: the put path at its floor -------------------------------------------------

@pytest.mark.timeout(600)
@pytest.mark.parametrize("fp8, hidden", [("e4m3", 128), ("e4m3-pow2", 128), ("e4m3-ue8m0", 512)])
def test_wire_carries_the_floor_in_one_run_per_peer(monkeypatch, fp8, hidden, nodes=2, per_node=2):
    """Dispatch and combine across emulated nodes put exactly the floor's payload (bench/wire_bytes.py:
    each routed token row once per destination rank, its bytes from the format alone (fp8 codes, 4-byte
    float32 scales or 1-byte UE8M0 ones per 128 columns), plus its control words; each routed slot's
    expert row once plus the flag), odd sizes and unrouted slots included, in at most 3 messages (rows,
    control words, signal) per peer for the dispatch and 2 (run, signal) for the combine."""
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    monkeypatch.delenv("MOE_COMM_TRANSPORT", raising=False)
    monkeypatch.setenv(RANKS_PER_NODE_ENV, str(per_node))   # measure() sets it too; restored after the test
    import wire_bytes
    args = wire_bytes.parse(["--nodes", str(nodes), "--ranks-per-node", str(per_node), "--tokens", "7",
                             "--hidden", str(hidden), "--experts", str(4 * nodes * per_node), "--topk", "3",
                             "--unrouted", "0.25", "--fp8", fp8])
    rows = wire_bytes.measure(args)
    far = nodes * per_node - per_node   # peers on other nodes
    for r in rows:
        assert r["dispatch_floor"] > 0 and r["combine_floor"] > 0, r
        assert r["dispatch_wire"] == r["dispatch_floor"] and r["combine_wire"] == r["combine_floor"], r
        assert r["dispatch_messages"] <= 3 * far and r["combine_messages"] <= 2 * far, r
    # The scale model charges each message the bytes of a row as measured here (moe_comm/scale_model.py;
    # it models the float32-scale fp8 rows).
    for op in ("dispatch", "combine") if fp8 != "e4m3-ue8m0" else ():
        design = scale_model.moe_comm_design(op, "fp8", hidden=hidden, topk=3)
        assert all(design.msg_bytes == r["row_bytes" if op == "dispatch" else "out_row_bytes"] for r in rows), op


# ---- failure status across the boundary: the record travels as a put -------------------------------

STATUS_TIMEOUT_S = 2.0   # the group timeout of the status tests
LATE_S = 1.0             # how much later than the rank that finds the failure the others start their call


def _a2a_round(group, a2a, seed) -> list[str]:
    """One exact AllToAllvDynamic call: every rank rebuilds every rank's inputs from ``seed``; [] if this
    rank's result equals the reference."""
    counts = a2a_cases.make_counts("random", group.world_size, 3, seed)
    sends = a2a_cases.make_sends(counts, (8,), torch.float32, seed)
    a2a_cases.poison(a2a)
    res = a2a(sends[group.rank], counts[group.rank])
    return a2a_cases.check_forward(group.rank, res, sends, counts, 3, f"seed {seed}")


def _fields(err) -> tuple:
    """What a GroupError names: class, op, recording rank, peer, and the calls a desync saw."""
    return (type(err).__name__, err.op, err.rank, err.peer, getattr(err, "got", None), getattr(err, "expected", None))


def _one_rank_finds_the_failure(group):
    """Ranks 0-1 on node 0, 2-3 on node 1 (only puts cross). After an exact call, rank 0 alone finds a
    group-wide error while the others are busy in an AllToAllvDynamic call that started LATE_S later
    and waits for a rank that will not come; twice, each time recovered by reset() and checked by an
    exact call: ``barrier`` rank 0 is in a host barrier nobody else joins (it times out and broadcasts
    from ``fail_group_kernel``); ``wait`` rank 1 skips the call (rank 0's receive times out naming it
    and broadcasts from its wait; rank 1 makes the call after the failure). Returns, per scenario, this
    rank's error fields, the seconds its failing call took, and the mismatches of the call after reset()."""
    me = group.rank
    a2a = AllToAllvDynamic(group, 3, (8,), torch.float32)
    out = {"first": _a2a_round(group, a2a, 1)}
    for seed, how in ((2, "barrier"), (4, "wait")):
        group.barrier()
        err, t0 = None, time.monotonic()
        try:
            if me == 0 and how == "barrier":
                group.barrier()
            elif me == 1 and how == "wait":
                time.sleep(STATUS_TIMEOUT_S + LATE_S)   # skips the call; its next call comes after the failure
                t0 = time.monotonic()
                _a2a_round(group, a2a, seed)
            else:
                if me != 0:
                    time.sleep(LATE_S)
                    t0 = time.monotonic()
                _a2a_round(group, a2a, seed)
        except GroupError as e:
            err = e
        took = time.monotonic() - t0
        group.reset()
        out[how] = (None if err is None else _fields(err), took, _a2a_round(group, a2a, seed + 1))
    return out


@pytest.mark.timeout(120)
def test_a_failure_found_on_one_node_reaches_the_other_by_puts(monkeypatch):
    """A group-wide error recorded by rank 0 (node 0), from a host barrier's timeout or from a kernel's
    wait, reaches ranks 2-3 (node 1) as a put of its status record delivered by their proxies: every
    rank raises the same named error (class, op, recording rank, peer) at its next call, ranks 2-3
    before their own waits would have expired; after reset() the next call is exact everywhere.
    (Without the put, node 1's ranks time out on their own, a timeout after their call began, naming
    themselves.)"""
    monkeypatch.setenv(RANKS_PER_NODE_ENV, "2")
    monkeypatch.delenv("MOE_COMM_TRANSPORT", raising=False)
    out = moe_comm.launch(_one_rank_finds_the_failure, 4, backend="shm", timeout_s=STATUS_TIMEOUT_S)
    assert [o["first"] for o in out] == [[]] * 4, out
    for how, op in (("barrier", "barrier"), ("wait", "alltoallv")):
        res = [o[how] for o in out]
        assert [r[0] for r in res] == [("CommTimeoutError", op, 0, 1, None, None)] * 4, (how, res)
        assert res[2][1] < STATUS_TIMEOUT_S and res[3][1] < STATUS_TIMEOUT_S, (how, res)  # adopted, not expired
        assert [r[2] for r in res] == [[]] * 4, (how, res)
    assert out[1]["wait"][1] < STATUS_TIMEOUT_S, out   # the skipper's next call raises without waiting


def _dead_receiver(group):
    """Rank 3 (node 1) dies after an exact call. Rank 0 starts the next call first, times out naming
    rank 3 and broadcasts: a store to rank 1, puts to rank 2 and to the dead rank 3. Returns the error
    fields, the seconds the failing call took, and the messages the recording rank sent rank 3 after
    its send phase (the status put and its signal)."""
    me = group.rank
    a2a = AllToAllvDynamic(group, 3, (8,), torch.float32)
    first = _a2a_round(group, a2a, 1)
    group.barrier()
    if me == 3:
        os._exit(9)
    if me != 0:
        time.sleep(LATE_S)
    counts = a2a_cases.make_counts("random", group.world_size, 3, 2)
    sends = a2a_cases.make_sends(counts, (8,), torch.float32, 2)
    t0, err = time.monotonic(), None
    a2a(sends[me], counts[me], phase="send")
    before = group.heap.wire.stats[("messages", 3)]
    try:
        a2a(phase="recv")
    except GroupError as e:
        err = e
    return first, None if err is None else _fields(err), time.monotonic() - t0, \
        group.heap.wire.stats[("messages", 3)] - before


@pytest.mark.timeout(120)
def test_a_dead_receiver_does_not_hold_up_the_broadcast(monkeypatch):
    """The status put to a dead rank on the other node is issued and never waited for: the rank that
    records the error raises within the timeout + 2 s, and the live ranks raise the same error."""
    monkeypatch.setenv(RANKS_PER_NODE_ENV, "2")
    monkeypatch.delenv("MOE_COMM_TRANSPORT", raising=False)
    with pytest.raises(LaunchError) as info:
        moe_comm.launch(_dead_receiver, 4, backend="shm", timeout_s=STATUS_TIMEOUT_S, grace_s=60)
    err = info.value
    assert sorted(err.failures) == [3], err.failures
    out = err.results[:3]
    assert [o[0] for o in out] == [[]] * 3, out
    assert [o[1] for o in out] == [("CommTimeoutError", "alltoallv", 0, 3, None, None)] * 3, out
    assert out[0][2] < STATUS_TIMEOUT_S + 2, out
    assert out[0][3] == 2, out      # the record's put and its signal, sent to the dead rank
