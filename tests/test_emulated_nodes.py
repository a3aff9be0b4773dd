"""Emulated nodes on the CPU (``MOE_COMM_RANKS_PER_NODE=k``, shm heap): ranks of another node are not
mapped at all, and the only way across is the put emulation's wire (``moe_comm/heap/wire.py``).

What these tests show: every cross-node peer pointer is 0 and no process maps a heap file of another node
(``/proc/self/maps``); the put transport is chosen for those peers; dispatch/combine (bf16, fp8) and
AllToAllvDynamic stay exact against the references when every cross-node byte travels as messages that a
proxy thread of the receiving process applies asynchronously; a rank killed on the other node is named by
a CommTimeoutError on every survivor within the timeout + 2 s, and ``exclude()`` / ``reset()`` work across
the boundary. What they cannot show: a real NIC's ordering, completion or bandwidth, or NVSHMEM itself.
"""

import os
import re
import time

import pytest

import moe_comm
from moe_comm import CommTimeoutError, EPBuffer, LaunchError, protocol, scale_model
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
def test_wire_carries_the_floor_in_one_run_per_peer(monkeypatch, nodes=2, per_node=2, fp8=True):
    """Dispatch and combine across emulated nodes put exactly the floor's payload (bench/wire_bytes.py:
    each routed token row once per destination rank plus its control words; each routed slot's expert
    row once plus the flag), odd sizes and unrouted slots included, in at most 3 messages (rows, control
    words, signal) per peer for the dispatch and 2 (run, signal) for the combine."""
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    monkeypatch.delenv("MOE_COMM_TRANSPORT", raising=False)
    monkeypatch.setenv(RANKS_PER_NODE_ENV, str(per_node))   # measure() sets it too; restored after the test
    import wire_bytes
    args = wire_bytes.parse(["--nodes", str(nodes), "--ranks-per-node", str(per_node), "--tokens", "7",
                             "--hidden", "128", "--experts", str(4 * nodes * per_node), "--topk", "3",
                             "--unrouted", "0.25"] + (["--fp8"] if fp8 else []))
    rows = wire_bytes.measure(args)
    far = nodes * per_node - per_node   # peers on other nodes
    for r in rows:
        assert r["dispatch_floor"] > 0 and r["combine_floor"] > 0, r
        assert r["dispatch_wire"] == r["dispatch_floor"] and r["combine_wire"] == r["combine_floor"], r
        assert r["dispatch_messages"] <= 3 * far and r["combine_messages"] <= 2 * far, r
    # The scale model charges each message the bytes of a row as measured here (moe_comm/scale_model.py).
    for op in ("dispatch", "combine"):
        design = scale_model.moe_comm_design(op, "fp8" if fp8 else "bf16", hidden=128, topk=3)
        assert all(design.msg_bytes == r["row_bytes" if op == "dispatch" else "out_row_bytes"] for r in rows), op
