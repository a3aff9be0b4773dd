"""Emulated nodes on the CPU (``MOE_COMM_RANKS_PER_NODE=k``, shm heap): ranks of another node are not
mapped at all, and the only way across is the put emulation's wire (``moe_comm/heap/wire.py``).

What these tests show: every cross-node peer pointer is 0 and no process maps a heap file of another node
(``/proc/self/maps``); the put transport is chosen for those peers; dispatch/combine (bf16, fp8) and
AllToAllvDynamic stay exact against the references when every cross-node byte travels as messages that a
proxy thread of the receiving process applies asynchronously, with the bytes and puts the floor says; a
rank alive but no longer coming (its wire still acknowledges) is named by every survivor, and excluding it
and then its whole node keeps prefill exact; a rank that finished closes its wire only after the live
ranks met in the heap's finalize barrier (as ``nvshmem_finalize``), so no happy path loses a rank to a
closed wire; a group-wide error recorded on one node reaches the other as a put of the status record (the
same named error on every rank, before the other node's own timeouts), and a dead receiver does not hold
up that put's sender. A rank or a whole node killed: tests/test_node_loss.py. What they cannot show: a
real NIC's ordering, completion, retry time or bandwidth, or NVSHMEM itself.
"""

import os
import re
import time

import pytest
import torch

import moe_comm
from moe_comm import AllToAllvDynamic, CommTimeoutError, GroupError, LaunchError, protocol, scale_model
from moe_comm.heap.shm import RANKS_PER_NODE_ENV, session_prefix

import a2a_cases
import budget
import ep_cases
import test_compat_deep_ep

TIMEOUT_S = 1.5
PREFILL_TIMEOUT_S = 5.0   # the interpreted prefill kernels of one step take seconds on a loaded 2-core machine
PREFILL_NAMED_S = PREFILL_TIMEOUT_S + 4   # a failing step: its send phase (1-2 s interpreted), the bounded wait


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
@pytest.mark.parametrize("world, per_node, which", [(4, 2, "ep"), budget.sweep(3, 1, "ep"),
                                                     budget.sweep(4, 2, "a2a"), budget.sweep(3, 1, "a2a"),
                                                     (4, 2, "compat"), budget.sweep(3, 1, "compat")])
def test_ops_are_exact_across_emulated_nodes(monkeypatch, world, per_node, which):
    """ep: every bf16 and fp8 dispatch/combine case of tests/ep_cases.py; a2a: every AllToAllvDynamic case
    of tests/a2a_cases.py; compat: DeepEP's low-latency API (moe_comm.compat.deep_ep) through a
    torch.distributed ProcessGroup, fp8 and bf16, events and hooks (tests/test_compat_deep_ep.py)."""
    monkeypatch.setenv(RANKS_PER_NODE_ENV, str(per_node))
    monkeypatch.delenv("MOE_COMM_TRANSPORT", raising=False)
    errs = moe_comm.launch(_cases, world, which, backend="shm", timeout_s=60)
    assert errs == [[]] * world


# The transport_failed message of the wire (what a process ends with when the emulated NIC gives up on a
# message something waits on): tests/test_node_loss.py reads it from the ranks' stderr.
FATAL = re.compile(r"rank (\d+)'s puts to rank (\d+) were not acknowledged after ([\d.]+) s")  # wire.transport_failed


def _fatal_ends(stderr: str) -> list[tuple[int, int, float]]:
    """(rank, peer, seconds waited) of every transport_failed message in the ranks' ``stderr``."""
    return sorted((int(r), int(pe), float(s)) for r, pe, s in FATAL.findall(stderr))


# ---- bytes on the wire: the put path at its floor -------------------------------------------------

@pytest.mark.timeout(600)
@pytest.mark.parametrize("fp8, hidden", [("e4m3", 128), ("e4m3-pow2", 128), ("e4m3-ue8m0", 512)])
def test_wire_carries_the_floor_in_one_run_per_peer(monkeypatch, fp8, hidden, nodes=2, per_node=2):
    """Dispatch and combine across emulated nodes put exactly the floor's payload (bench/wire_bytes.py:
    each routed token row once per destination rank, its bytes from the format alone (fp8 codes, 4-byte
    float32 scales or 1-byte UE8M0 ones per 128 columns), plus its control words; each routed slot's
    expert row once plus the flag), odd sizes and unrouted slots included, in at most 3 messages (rows,
    control words, signal) per peer for the dispatch and 2 (run, signal) for the combine, and exactly the
    puts the put path issues (rows if any, control words; a non-empty run)."""
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    monkeypatch.delenv("MOE_COMM_TRANSPORT", raising=False)
    monkeypatch.setenv(RANKS_PER_NODE_ENV, str(per_node))   # measure() sets it too; restored after the test
    import wire_bytes
    args = wire_bytes.parse(["--nodes", str(nodes), "--ranks-per-node", str(per_node), "--tokens", "7",
                             "--hidden", str(hidden), "--experts", str(4 * nodes * per_node), "--topk", "3",
                             "--unrouted", "0.25", "--dispatch-format", fp8])
    rows = wire_bytes.measure(args)
    far = nodes * per_node - per_node   # peers on other nodes
    for r in rows:
        assert r["dispatch_floor"] > 0 and r["combine_floor"] > 0, r
        assert r["dispatch_wire"] == r["dispatch_floor"] and r["combine_wire"] == r["combine_floor"], r
        assert r["dispatch_puts"] == r["dispatch_puts_floor"] and r["combine_puts"] == r["combine_puts_floor"], r
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
    """Rank 3 (node 1) dies after an exact call. Rank 0 reaches a host barrier first (the others LATE_S
    later), times out naming rank 3 and broadcasts from ``fail_group_kernel``: a store to rank 1, puts
    to rank 2 and to the dead rank 3, none quieted. Returns the first call's mismatches, the error
    fields, the seconds the failing barrier took, and the messages this rank sent rank 3 meanwhile (the
    status put and its signal). (An op's send to the dead rank is not waited for either:
    tests/test_node_loss.py.)"""
    me = group.rank
    a2a = AllToAllvDynamic(group, 3, (8,), torch.float32)
    first = _a2a_round(group, a2a, 1)
    group.barrier()
    if me == 3:
        os._exit(9)
    if me != 0:
        time.sleep(LATE_S)
    t0, err = time.monotonic(), None
    before = group.heap.wire.stats[("messages", 3)]
    try:
        group.barrier()
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
    assert [o[1] for o in out] == [("CommTimeoutError", "barrier", 0, 3, None, None)] * 3, out
    assert out[0][2] < STATUS_TIMEOUT_S + 2, out
    assert out[0][3] == 2, out      # the record's put and its signal, sent to the dead rank


# ---- prefill across nodes: one copy per destination node ----------------------------------------------

def _prefill_wire(group, variants):
    """PrefillBuffer's dispatch and combine once per variant (bench/wire_bytes.py: wire bytes, floor,
    exactness), and for the node-limited variants EPBuffer's too (one copy per destination rank)."""
    import wire_bytes
    out = []
    for args in variants:
        row = wire_bytes._prefill_rank(group, args)
        if args.node_limit:
            row["ep_dispatch_wire"] = wire_bytes._rank(group, args)["dispatch_wire"]
        out.append(row)
    return out + [_isolation(group)]


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("nodes, per_node", [(2, 2), budget.sweep(2, 3), budget.sweep(3, 2)])
def test_prefill_wire_is_one_row_per_token_and_node(monkeypatch, nodes, per_node):
    """PrefillBuffer across emulated nodes (docs/prefill.md "Across nodes"): on every rank, the bytes the
    wire carries between nodes equal the per-node floor (bench/wire_bytes.py ``prefill_floor_bytes``: one
    payload row plus its routing words per (token, destination node), one output row per (token, node)
    back, and the control words), ratio 1.00, bf16, fp8 and power-of-two fp8 dispatch (odd sizes, unrouted slots), in
    the puts counted there (per (token, node) 2, or 3 with fp8 scales, and one per node of the control words;
    one per (token, node) back), with results
    equal to the reference in the node order; with node-limited routing (each token's experts on one
    node of 2, two of 3) it carries fewer rows than one copy per destination rank, which EPBuffer's put
    path, measured on the same inputs, sends. 2x2 in ``make test``; 2x3 and 3x2 in ``make test-sweeps``."""
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    monkeypatch.delenv("MOE_COMM_TRANSPORT", raising=False)
    monkeypatch.setenv(RANKS_PER_NODE_ENV, str(per_node))
    import wire_bytes
    world = nodes * per_node
    common = ["--nodes", str(nodes), "--ranks-per-node", str(per_node), "--tokens", "7", "--hidden", "256",
              "--experts", str(2 * world), "--topk", "3", "--prefill"]
    variants = [wire_bytes.parse(common + ["--unrouted", "0.25"]), wire_bytes.parse(common + ["--fp8"]),
                wire_bytes.parse(common + ["--dispatch-format", "e4m3-pow2"]),
                wire_bytes.parse(common + ["--node-limit", str(nodes - 1)])]
    out = moe_comm.launch(_prefill_wire, world, variants, backend="shm", timeout_s=120)
    assert [o[-1] for o in out] == [[]] * world           # no mapping of another node, puts to it
    for v, args in enumerate(variants):
        rows = [o[v] for o in out]
        for r in rows:
            assert r["exact"], (v, r)
            assert r["dispatch_floor"] > 0 and r["combine_floor"] > 0, (v, r)
            assert r["dispatch_wire"] == r["dispatch_floor"] and r["combine_wire"] == r["combine_floor"], (v, r)
            assert r["dispatch_puts"] == r["dispatch_puts_floor"] and r["combine_puts"] == r["combine_puts_floor"], (v, r)
        if args.node_limit:
            per_node_rows, per_rank_rows = (sum(r[k] for r in rows) for k in ("rows_per_node", "rows_per_rank"))
            assert per_rank_rows > per_node_rows > 0, rows
            payload = rows[0]["row_bytes"] + rows[0]["route_bytes"]
            assert sum(r["ep_dispatch_wire"] for r in rows) > sum(r["dispatch_wire"] for r in rows), rows
            assert per_node_rows * payload < sum(r["dispatch_wire"] for r in rows) < per_rank_rows * payload, rows


def _prefill_round(group, buf, seed, excluded=(), slow=None, poison=True):
    """One checked PrefillBuffer dispatch -> combine on a launched group: every rank rebuilds every rank's
    inputs from ``seed`` and checks its own results against the reference (excluded ranks unrouted, the
    node order). ``slow`` = (rank, seconds): that rank pauses between its dispatch's send and receive.
    ``poison``: poison the zone first, between two host barriers (a step that must fail in its kernels,
    not in a barrier, passes False). Returns (mismatches, monotonic time this rank's dispatch returned,
    time its receive began)."""
    import prefill_cases
    cfg, world, me = prefill_cases.CONFIGS[0], group.world_size, group.rank
    xs, idxs, ws = ep_cases.make_inputs(cfg, world, "random", seed)
    exp_d, _, exp_y = prefill_cases.expected(cfg, world, xs, idxs, ws, prefill_cases.ranks_per_node(group), excluded)
    if poison:
        group.barrier()   # (every peer has read this rank's partial rows of the previous round)
        prefill_cases.poison(buf)
        group.barrier()
    buf.dispatch(xs[me], idxs[me], ws[me], phase="send")
    if slow is not None and slow[0] == me:
        time.sleep(slow[1])
    began = time.monotonic()
    d = buf.dispatch(phase="recv")
    returned = time.monotonic()
    errs = prefill_cases.check_dispatch(d, exp_d[me], cfg, f"rank{me} seed{seed}")
    part = prefill_cases.expert_out(d, exp_d[me], me, cfg)
    d.recv_x.fill_(float("nan"))      # the experts' in-place writes: this rank's zone rows are its own now
    y = buf.combine(part, d.handle)
    if not torch.equal(y, exp_y[me]):
        errs.append(f"rank{me} seed{seed}: combine differs")
    return errs, returned, began


SLOW_PULL_S = 1.0


def _slow_puller(group):
    """Rank 1 (node 0) pauses before its dispatch's receive, where it loads the rows of source 2 (node 1)
    from rank 0, that source's rail on node 0; rank 0 overwrites its rows as soon as its own dispatch
    returns."""
    import prefill_cases
    buf = prefill_cases.make_buffer(group, prefill_cases.CONFIGS[0])
    out = _prefill_round(group, buf, 90, slow=(1, SLOW_PULL_S))
    buf.close()
    return out + (prefill_cases.run_chunked_case(group),)


@pytest.mark.timeout(600)
def test_prefill_dispatch_returns_after_its_node_pulled_from_its_rows_and_chunks_overlap(monkeypatch):
    """A rail's landing rows are its own output rows: no rank's dispatch returns before every rank of its
    node has loaded what it needs from them (the pull's node barrier). Rank 0 returns only after rank 1's
    delayed receive began, and rank 1's rows from rank 0 are exact although rank 0 wrote NaN over its
    rows at once (without the barrier rank 0 returns ~1 s earlier and rank 1 loads NaN rows). Then the
    chunked MoE layer (``prefill_chunks.prefill_moe``, 3 chunks of M, one zone and two overlapped) equals
    one call of the reference across the nodes too (tests/prefill_cases.py ``run_chunked_case``)."""
    monkeypatch.setenv(RANKS_PER_NODE_ENV, "2")
    monkeypatch.delenv("MOE_COMM_TRANSPORT", raising=False)
    out = moe_comm.launch(_slow_puller, 4, backend="shm", timeout_s=30)
    assert [o[0] for o in out] == [[]] * 4, out
    assert out[0][1] > out[1][2], out          # rank 0's dispatch returned after rank 1's receive began
    assert [o[3] for o in out] == [[]] * 4, out


def _prefill_step_after_fault(group, buf, seed, excluded, late):
    """The survivors' step after a fault: ``late`` ranks start LATE_S later (the first timeout is the
    others'). Returns (the rank its CommTimeoutError named or None, seconds the step took)."""
    if late:
        time.sleep(LATE_S)
    t0 = time.monotonic()
    try:
        _prefill_round(group, buf, seed, tuple(excluded), poison=False)
        return None, None
    except CommTimeoutError as e:
        return e.peer, time.monotonic() - t0


class _Hang:
    """A rank that stops coming to the group's calls but stays alive (its process, and so its wire's
    proxy, still acknowledge every message: what a hung or skipping rank is, unlike a dead one) until the
    ranks ``waits_for`` are done, told through the group's store."""

    KEY = "test/done/{}"

    def __init__(self, group, waits_for):
        self.store, self.waits_for = group.heap._control.store, waits_for

    def done(self, rank):
        self.store.set(self.KEY.format(rank), "1")

    def hang(self, limit_s=600.0):
        deadline = time.monotonic() + limit_s
        while not self.store.check([self.KEY.format(r) for r in self.waits_for]):
            if time.monotonic() > deadline:
                raise TimeoutError("the survivors never finished")
            time.sleep(0.1)


def _prefill_hung(group, victims):
    """A good PrefillBuffer step; then ``victims[0]`` stops coming (alive: its wire acknowledges), the
    others' next step names it, they exclude it and make three exact steps; then the same for
    ``victims[1]``. Per victim this rank survived: (the rank named, seconds the failing step took,
    mismatches of the three steps after exclude). A victim returns what it saw before its turn."""
    import prefill_cases
    me, out, excluded = group.rank, [], []
    hang = _Hang(group, [r for r in range(group.world_size) if r not in victims])
    buf = prefill_cases.make_buffer(group, prefill_cases.CONFIGS[0])
    errs = _prefill_round(group, buf, 100)[0]
    for i, victim in enumerate(victims):
        if me == victim:
            hang.hang()
            return errs, out
        late = group.heap.node[me] != group.heap.node[victim]   # the victim's node mates time out first
        named, took = _prefill_step_after_fault(group, buf, 101 + 10 * i, excluded, late)
        if named is None or group.exclude([named]) != sorted(excluded + [victim]):
            out.append((named, took, None))
            break
        excluded.append(victim)
        steps = [_prefill_round(group, buf, 102 + 10 * i + s, tuple(excluded))[0] for s in range(3)]
        out.append((named, took, steps))
    hang.done(me)
    return errs, out


@pytest.mark.timeout(900)
def test_prefill_hung_rank_and_then_its_whole_node_are_named_and_excluded(monkeypatch):
    """The recoverable fault across nodes (2 x 2 emulated nodes): a rank alive but no longer coming (hung,
    skipping calls: its process and NIC still acknowledge, so nobody's quiet fails). Rank 3 (node 1)
    stops after a good step: every other rank (rank 2 on its node, ranks 0-1 on the other) names it by
    CommTimeoutError within the timeout + 4 s (rank 2 starts the step first, so its own wait decides:
    the rows of rank 1, whose rail on node 1 was rank 3, are missing too, but the wait for its node's
    ranks names the absent rail itself); after exclude([3]) three steps are exact among the survivors
    (rank 1's rail on node 1 is now rank 2). Then rank 2 stops too: named by ranks 0-1, excluded (node 1
    has no live rank left), three exact steps. (A rank that dies instead costs its put peers their
    process: the test above.)"""
    monkeypatch.setenv(RANKS_PER_NODE_ENV, "2")
    monkeypatch.delenv("MOE_COMM_TRANSPORT", raising=False)
    res = moe_comm.launch(_prefill_hung, 4, [3, 2], backend="shm", timeout_s=PREFILL_TIMEOUT_S, grace_s=600)
    assert [r[0] for r in res] == [[]] * 4, res
    assert res[3][1] == [], res
    for r, victims in ((0, [3, 2]), (1, [3, 2]), (2, [3])):
        out = res[r][1]
        assert [o[0] for o in out] == victims, (r, res[r])
        for named, took, steps in out:
            assert took < PREFILL_NAMED_S and steps == [[]] * 3, (r, res[r])


def _doors(group):
    import test_compat_deep_ep_internode
    import test_sglang_dispatcher
    import test_vllm_adapter
    return dict(deep_ep=test_compat_deep_ep_internode.internode_rank(group),
                vllm=test_vllm_adapter.standard_shm_rank(group, 3),
                sglang=test_sglang_dispatcher.normal_shm_rank(group, 5), isolation=_isolation(group))


@pytest.mark.timeout(900)
def test_prefill_doors_across_emulated_nodes(monkeypatch):
    """The high-throughput doors across 2 x 2 emulated nodes: DeepEP's normal mode through a
    torch.distributed ProcessGroup in the style of DeepEP's tests/test_internode.py (its ``dispatch`` /
    ``combine`` and ``internode_dispatch`` / ``internode_combine``, group-limited routing, layout with
    ``num_tokens_per_rdma_rank``; tests/test_compat_deep_ep_internode.py), vLLM's Standard-format
    prepare/finalize and SGLang's normal-mode dispatcher, each bitwise against the reference in the node
    order; no process maps another node's memory."""
    monkeypatch.setenv(RANKS_PER_NODE_ENV, "2")
    monkeypatch.delenv("MOE_COMM_TRANSPORT", raising=False)
    out = moe_comm.launch(_doors, 4, backend="shm", timeout_s=60)
    assert out == [dict(deep_ep=[], vllm=[], sglang=[], isolation=[])] * 4, out
