"""The put transport (NVSHMEM puts, ``moe_comm/triton_kernels/transport.py``) on the CPU.

In the interpreter the NVSHMEM calls run as plain copies and release stores into the peer's memory
(``nvshmem_device.py``'s twin), through the same kernel code the GPU compiles. So these tests check the
put path's protocol (staging layout, one put per region or row, counts and flag as the put's signal,
abort and timeout) exactly against the references, with ``MOE_COMM_TRANSPORT=put`` forcing it for every
peer, and the order of the NVSHMEM calls each program issues: no quiet and no fence on any send, and every
signal to a rank issued by the program that put the rows it covers (one queue pair: docs/multinode.md,
"Staging reuse by causality"). They cannot show RDMA timing or ordering on a real NIC: nothing here ran
on a GPU or across nodes (the reuse of the staging under a slow NIC is shown across emulated nodes,
tests/test_node_loss.py).
"""

import gc

import pytest
import torch
import triton
import triton.language as tl

import moe_comm
from moe_comm import AllToAllvDynamic, CommAbortedError, CommTimeoutError, EPBuffer, protocol, reference
from moe_comm.interpreter import kernel_for, twin_module
from moe_comm.transport import ENV, choose_transports

import a2a_cases
import ep_cases
from budget import sweep
from ep_cases import record_launches

PUT, STORE = protocol.TRANSPORT_PUT, protocol.TRANSPORT_STORE


@pytest.fixture
def put_forced(monkeypatch):
    monkeypatch.setenv(ENV, "put")


class _Puts:
    """Counts the interpreted puts; ``drop=True`` makes them copy nothing (a broken transport)."""

    def __init__(self, monkeypatch, drop=False):
        twin = twin_module("moe_comm.triton_kernels.nvshmem_device")
        original, self.count = twin._copy_to_peer, 0

        def copy(*args):
            self.count += 1
            if not drop:
                original(*args)
        monkeypatch.setattr(twin, "_copy_to_peer", copy)


# ---- the transport table ----------------------------------------------------------------------------

class _FakeHeap:
    def __init__(self, reach, kind="shm", device="cpu"):
        self._reach, self.kind, self.device, self.rank = reach, kind, torch.device(device), 0

    def reachable(self):
        return self._reach


@pytest.mark.parametrize("mode, reach, expected", [
    (None, [True, True], [STORE, STORE]), ("auto", [True, False], [STORE, PUT]),
    ("put", [True, True], [PUT, PUT]), ("store", [True, True], [STORE, STORE])])
def test_transport_choice(monkeypatch, mode, reach, expected):
    if mode is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, mode)
    assert choose_transports(_FakeHeap(reach)) == expected


def test_transport_choice_refuses_what_cannot_work(monkeypatch):
    monkeypatch.setenv(ENV, "rdma")
    with pytest.raises(ValueError, match="must be one of"):
        choose_transports(_FakeHeap([True]))
    monkeypatch.setenv(ENV, "store")
    with pytest.raises(ValueError, match=r"ranks \[1\] are not load/store reachable"):
        choose_transports(_FakeHeap([True, False]))
    monkeypatch.setenv(ENV, "put")
    with pytest.raises(ValueError, match="needs backend='nvshmem' on CUDA"):
        choose_transports(_FakeHeap([True, True], kind="loopback", device="cuda"))


def test_the_group_state_carries_the_table(put_forced):
    groups = moe_comm.init(backend="loopback", world_size=3, device="cpu")
    w = protocol.s_transport(3)
    for g in groups:
        assert g.uses_put and g.state[w:w + 3].tolist() == [PUT] * 3
        assert g.state.numel() == protocol.state_words(3)


# ---- the binding's interpreted twin -------------------------------------------------------------------

nv = twin_module("moe_comm.triton_kernels.nvshmem_device")  # the interpreted twin (this kernel runs on CPU)


@triton.jit
def _every_call(dst, src, sig, out, nbytes, pe):
    nv.putmem_nbi_block(dst, src, nbytes, pe)
    nv.fence()
    nv.putmem_signal_nbi_block(dst + 4, src, 8, sig, 5, nv.SIGNAL_SET, pe)
    nv.signal_op(sig, 2, nv.SIGNAL_ADD, pe)
    nv.uint64_atomic_add(sig + 1, 3, pe)
    nv.int64_p(sig + 2, 11, pe)
    nv.quiet()
    tl.store(out, nv.ptr(dst, pe))
    tl.store(out + 1, nv.signal_wait_until(sig + 3, nv.CMP_GE, 0))


def test_interpreted_calls_reach_the_peers_copy():
    """put / put+signal / signal add / p / atomic add / ptr / wait, from rank 0 to rank 1's copies,
    addressed by rank 0's own (symmetric) addresses, as NVSHMEM addresses them."""
    heaps = [g.heap for g in moe_comm.init(backend="loopback", world_size=2, device="cpu")]
    data = [h.alloc("d", (16,), torch.int32) for h in heaps]
    sig = [h.alloc("s", (4,), torch.int64) for h in heaps]
    src = torch.arange(100, 116, dtype=torch.int32)
    out = torch.zeros(2, dtype=torch.int64)
    kernel_for(_every_call, "cpu")[(1,)](data[0].local, src, sig[0].local, out, 16, 1)
    assert data[1].local[:4].tolist() == [100, 101, 102, 103] and data[1].local[4:6].tolist() == [100, 101]
    assert data[0].local.abs().sum() == 0 and sig[0].local.abs().sum() == 0   # nothing landed locally
    assert sig[1].local[:3].tolist() == [7, 3, 11]
    assert out[0] == data[1].local.data_ptr()


def test_a_put_outside_symmetric_memory_is_refused():
    from moe_comm.heap import peer_map
    with pytest.raises(ValueError, match="not in a registered symmetric buffer"):
        peer_map.peer_address(torch.zeros(4).data_ptr(), 0)
    # Memory a collected symmetric buffer held is ordinary memory again, whoever reuses it.
    heaps = [g.heap for g in moe_comm.init(backend="loopback", world_size=2, device="cpu")]
    bufs = [h.alloc("gone", (1024,), torch.float32) for h in heaps]
    addr = bufs[0].local.data_ptr()
    assert peer_map.peer_address(addr, 1) == bufs[1].local.data_ptr()
    del bufs, heaps
    gc.collect()
    with pytest.raises(ValueError, match="not in a registered symmetric buffer"):
        peer_map.peer_address(addr, 1)


def test_a_collection_inside_register_does_not_hang(monkeypatch):
    """A symmetric buffer collected while another registers (a garbage collection that runs inside
    ``register``, under its lock) must not wait for that lock: a make test run hung here (a finalizer of
    the collected buffer took the lock). Its memory is then ordinary memory, as above."""
    import threading
    from moe_comm.heap import peer_map
    store = peer_map._store
    monkeypatch.setattr(peer_map, "_store", lambda entries: (store(entries), gc.collect()))
    heaps = [g.heap for g in moe_comm.init(backend="loopback", world_size=2, device="cpu")]
    cycle = {"heaps": heaps, "bufs": [h.alloc("cyclic", (1024,), torch.float32) for h in heaps]}
    cycle["self"] = cycle                     # freed only by a collection: the one inside the next register
    addr = cycle["bufs"][0].local.data_ptr()
    assert peer_map.peer_address(addr, 1) == cycle["bufs"][1].local.data_ptr()
    del cycle, heaps
    other = moe_comm.init(backend="loopback", world_size=1, device="cpu")[0].heap
    done = threading.Event()
    t = threading.Thread(target=lambda: (other.alloc("next", (16,), torch.float32), done.set()), daemon=True)
    t.start()
    assert done.wait(60), "register waited for its own lock"
    with pytest.raises(ValueError, match="not in a registered symmetric buffer"):
        peer_map.peer_address(addr, 1)


# ---- the ops over puts: loopback worlds and shm processes, exact against the references ------------

def nvshmem_events(monkeypatch) -> list:
    """The interpreted NVSHMEM calls, (event, target rank, program) in the order issued (``nvshmem_device._order``),
    and ("launch", kernel name, None) where each op launch built from now on starts."""
    twin = twin_module("moe_comm.triton_kernels.nvshmem_device")
    events = []
    monkeypatch.setattr(twin, "_order", lambda event, pe, program=None: events.append((event, pe, program)))
    record_launches(monkeypatch, lambda fn, args, grid: events.append(("launch", fn.fn.__name__, None)))
    return events


def _waits(events) -> list:
    """Indices of every quiet or fence: none belongs on a steady-state path (a quiet, and with IBGDA a fence,
    waits for the completions of every queue pair, a dead peer's included, which is fatal)."""
    return [i for i, e in enumerate(events) if e[0] in ("quiet", "fence")]


@pytest.mark.timeout(300)
def test_ep_shm_processes_over_puts(put_forced):
    """One process per rank (the environment variable reaches the launched ranks)."""
    errs = moe_comm.launch(_ep_shm_cases, 2, backend="shm", timeout_s=60)
    assert [e for r in errs for e in r] == []


def _ep_shm_cases(group):
    assert group.uses_put
    return ep_cases.run_shm_cases(group)


def test_dropped_puts_are_seen(put_forced, monkeypatch):
    """Control: if the puts carried nothing (the signals still arrive), the receivers would get the wrong
    counts: the rows and counts of the world-3 cases (``test_loopback_world3_over_puts_...``) did travel
    by the put path."""
    puts = _Puts(monkeypatch, drop=True)
    groups = moe_comm.init(backend="loopback", world_size=2, device="cpu")
    ops = [AllToAllvDynamic(g, 4, (8,), torch.float32) for g in groups]
    sends = [torch.randn(4, 8) for _ in groups]
    counts = torch.tensor([2, 2])
    for op, s in zip(ops, sends):
        op(s, counts, phase="send")
    res = [op(phase="recv") for op in ops]
    assert puts.count > 0
    assert all(r.recv_counts.tolist() == [0, 0] for r in res)   # the reference says [2, 2]


# ---- the fault rules over puts -------------------------------------------------------------------------

def test_timeout_and_recovery_over_puts(put_forced):
    """A rank that skips its send: the peer's bounded wait names it, the error is sticky, reset() recovers
    and later rounds are exact."""
    groups = moe_comm.init(backend="loopback", world_size=2, device="cpu", timeout_s=0.3)
    ops = [AllToAllvDynamic(g, 4, (8,), torch.float32) for g in groups]
    sends = [torch.randn(3, 8) for _ in groups]
    counts = torch.tensor([1, 2])
    ops[0](sends[0], counts, phase="send")
    with pytest.raises(CommTimeoutError, match="peer rank 1"):
        ops[0](phase="recv")
    ops[0](sends[0], counts, phase="send")     # sticky: the next call raises at once
    with pytest.raises(CommTimeoutError, match="peer rank 1"):
        ops[0](phase="recv")
    for g in groups:
        g.reset()
    for _ in range(2):
        for op, s in zip(ops, sends):
            op(s, counts, phase="send")
        res = [op(phase="recv") for op in ops]
        exp = reference.alltoallv(sends, [counts, counts], 4)
        for r in range(2):
            assert torch.equal(res[r].recv_counts, exp[r][1])
            for j in range(2):
                n = int(exp[r][1][j])
                assert torch.equal(res[r].recv[j, :n], exp[r][0][j, :n])


def test_abort_reaches_put_peers(put_forced, monkeypatch):
    """A rank that cannot make a call publishes ABORT by an NVSHMEM signal, and waits for nothing (no
    quiet: the signal is delivered without one, reads no staging, and a quiet to a dead peer would end
    the process when the NIC gives up, docs/faults.md): the peer raises CommAbortedError instead of
    timing out."""
    groups = moe_comm.init(backend="loopback", world_size=2, device="cpu", timeout_s=5.0)
    eps = [EPBuffer(g, 8, 128, 3, 2) for g in groups]
    x = torch.randn(3, 128).to(torch.bfloat16)
    idx = torch.randint(0, 8, (3, 2))
    events = nvshmem_events(monkeypatch)
    with pytest.raises(ValueError):
        eps[1].dispatch(x[:, :64], idx, phase="send")      # bad input on rank 1 only: it aborts the call
    assert [e[:2] for e in events] == [("signal", 0)], events   # the abort: one signal to rank 0, no quiet
    eps[0].dispatch(x, idx, phase="send")
    with pytest.raises(CommAbortedError):
        eps[0].dispatch(phase="recv")


def test_no_send_launch_quiets_or_fences(put_forced, monkeypatch):
    """AllToAllvDynamic over puts (loopback world 3, every peer a put peer): each send launch flushes every
    peer (rows, then the count with the flag as the put's signal) and waits for none of it: no quiet, no
    fence (the staging's two zones are reused by causality: transport.py). The receive launches put
    nothing. (Until issue 45 each send launch ended with a quiet.)"""
    groups = moe_comm.init(backend="loopback", world_size=3, device="cpu", timeout_s=5.0)
    events = nvshmem_events(monkeypatch)
    ops = [AllToAllvDynamic(g, 4, (8,), torch.float32) for g in groups]
    counts = [torch.tensor([1, 2, 0], dtype=torch.int32) for _ in groups]
    for op, c in zip(ops, counts):
        op(torch.randn(int(c.sum()), 8), c, phase="send")
        assert _waits(events) == [], events
        assert sorted(pe for e, pe, _ in events if e == "put_signal") == [0, 1, 2], events
        events.clear()
    for op in ops:
        op(phase="recv")
    assert [e for e in events if e[0] != "launch"] == []


def test_prefill_over_puts_never_quiets_or_fences(put_forced, monkeypatch):
    """PrefillBuffer with every peer by puts (loopback world 2, nodes of one rank: docs/prefill.md "Across
    nodes"), bf16 and fp8, two zones: each round trip is exact, launches its six kernels per rank (dispatch
    send, pull, receive; combine send, node reduction, receive), puts its rows, and neither quiets nor
    fences: not the dispatch's send, not the node reduction (which quieted once per program), not the
    combine's bare signals (``ready``, ``released``), which quieted until issues 45 and 46."""
    import prefill_cases
    groups = moe_comm.init(backend="loopback", world_size=2, device="cpu", timeout_s=10)
    events = nvshmem_events(monkeypatch)
    for ci in (0, 1):
        cfg = prefill_cases.CONFIGS[ci]
        bufs = [prefill_cases.make_buffer(g, cfg, zones=2) for g in groups]
        for seed in (5, 6):
            events.clear()
            errs = prefill_cases.round_trip(bufs, cfg, *prefill_cases.make_inputs(cfg, 2, "random", seed), f"cfg{ci}")
            assert errs == [], errs
            assert sum(e[0] == "launch" for e in events) == 6 * len(groups), events
            assert any(e[0] == "put" for e in events) and _waits(events) == [], events


# ---- ordering on the put path: every signal to a rank issued by the program that put its rows ----------

def _unordered_signals(events):
    """Signals to a rank (put_signal or signal) issued by another program than a plain put to that rank
    that no signal of its own program followed yet: NVSHMEM orders a program's calls to one PE on one
    queue pair (``transport.py``), not calls of different programs. (A put_signal's own data is ordered
    before its signal by NVSHMEM.)"""
    pending, bad = {}, []
    for i, (event, pe, program) in enumerate(events):
        if event == "put":
            pending.setdefault(pe, set()).add(program)
        elif event in ("signal", "put_signal"):
            if pending.get(pe, set()) - {program}:
                bad.append(i)
            pending.pop(pe, None)
    return bad


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cases", [a2a_cases, ep_cases], ids=["alltoallv", "ep"])
def test_loopback_world3_over_puts_is_exact_and_signals_follow_their_rows(put_forced, monkeypatch, cases):
    """Every case of the op on a loopback world 3 with every peer reached by puts: exact, the rows did travel
    by puts, every signal is issued by the program that put the rows it covers, after them, and nothing
    quiets or fences."""
    puts = _Puts(monkeypatch)
    events = nvshmem_events(monkeypatch)
    assert cases.run_loopback_cases(moe_comm.init(backend="loopback", world_size=3)) == []
    assert puts.count > 0
    assert any(e[0] == "put" for e in events) and any(e[0] == "signal" for e in events)
    assert _unordered_signals(events) == [], events[:40]
    assert _waits(events) == [], events[:40]
    assert not any(e[0] == "fence_system" for e in events)   # one transport for every peer: no fence needed


def _unfenced_flags(events):
    """Signals (put_signal or signal) with no system-scope fence since their launch began: in a launch that
    reaches peers by stores and by puts, every flag must follow one (``transport.order_transports``)."""
    fenced, bad = False, []
    for i, (event, _, _) in enumerate(events):
        if event == "fence_system":
            fenced = True
        elif event == "launch":
            fenced = False
        elif event in ("put_signal", "signal") and not fenced:
            bad.append(i)
    return bad


def _two_nodes(heap):
    """The transports two nodes would give: ranks 0-1 reach each other by stores, rank 2 by puts."""
    node = [0, 0, 1]
    return [STORE if node[j] == node[heap.rank] else PUT for j in range(heap.world_size)]


def _two_node_world(monkeypatch):
    """A loopback world 3 with the transports of ``_two_nodes``, and the list of NVSHMEM calls and launches
    (``nvshmem_events``)."""
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(moe_comm.group, "choose_transports", _two_nodes)
    events = nvshmem_events(monkeypatch)
    return moe_comm.init(backend="loopback", world_size=3), events


def _assert_fenced_and_ordered(events):
    """Some launch mixed the transports and fenced; no flag unfenced, no signal ahead of another
    program's rows, nothing quieted or fenced."""
    assert any(e[0] == "fence_system" for e in events) and any(e[0] == "put_signal" for e in events)
    assert _unfenced_flags(events) == [], events[:40]
    assert _unordered_signals(events) == [] and _waits(events) == [], events[:40]


@pytest.mark.timeout(300)
def test_mixed_transports_are_exact_and_fence_before_the_flags(monkeypatch):
    """Store peers and put peers in one launch (loopback world 3; ranks 0-1 one node, rank 2 another):
    dispatch and combine exact against the references (bf16 and fp8 cases: the packed rows and the
    combine's runs beside the store path's rows), and every send launch orders its stores and staging
    with a system-scope fence before any flag. Put forced everywhere, no launch needs it (checked above)."""
    groups, events = _two_node_world(monkeypatch)
    assert [g.transports for g in groups] == [[STORE, STORE, PUT], [STORE, STORE, PUT], [PUT, PUT, STORE]]
    assert ep_cases.run_loopback_cases(groups, configs={0, 1}) == []
    _assert_fenced_and_ordered(events)


@pytest.mark.timeout(300)
def test_mixed_transports_alltoallv_fences_before_the_flags(monkeypatch):
    """The same for AllToAllvDynamic (forward and reverse; loopback world 3, ranks 0-1 one node, rank 2
    another): exact against the reference, and the last program for each destination fences at system
    scope before its flag when the live ranks are reached by both transports."""
    groups, events = _two_node_world(monkeypatch)
    cases = [(torch.float32, (64,), "random", 7), (torch.bfloat16, (3, 32), "full", 14)]
    assert a2a_cases.run_loopback_cases(groups, cases=cases) == []
    _assert_fenced_and_ordered(events)


def test_the_ordering_check_finds_a_signal_of_another_program():
    p, q = (0, 0, 0), (1, 0, 0)
    assert _unordered_signals([("put", 1, p), ("put", 1, p), ("put_signal", 1, p), ("signal", 1, q)]) == []
    assert _unordered_signals([("put", 1, p), ("put_signal", 2, q), ("signal", 1, q)]) == [2]
    assert _unordered_signals([("put", 1, p), ("put", 1, q), ("put_signal", 1, q)]) == [2]
    assert _waits([("put", 1, p), ("quiet", -1, p), ("fence", -1, q)]) == [1, 2]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world, fp8, send_programs", [sweep(3, True, 5), (2, False, 2)])
def test_gpu_launch_shapes_over_puts(put_forced, world, fp8, send_programs):
    """The GPU launch shapes run by the interpreter, every peer over puts: several send programs, so a
    program's packed rows continue those of the tokens of earlier programs (``reach_of_tokens``), and
    the combine's runs are staged by many programs, exact against the references."""
    import test_ep
    test_ep.test_gpu_launch_shapes_in_the_interpreter(world, fp8, send_programs)


# ---- the happy path's work: launches and puts as before issue 45, and no wait -----------------------------

def _expected_calls(me, idxs, experts_per_rank, counts, world):
    """The NVSHMEM calls rank ``me`` issues in one decode step (every peer, itself included, a put peer), from
    the inputs: per peer the dispatch puts the packed rows if any (rows: its tokens with an expert there),
    then the control words with the flag; the combine puts the run of the peer's slots on this rank's
    experts with the flag (an empty run, or this rank's own slots, read in place: the bare flag);
    AllToAllvDynamic's forward and reverse put the rows if any, then the count with the flag. Counter of (event, peer)."""
    from collections import Counter
    out = Counter()
    for p in range(world):
        rows = int(((idxs[me] >= 0) & (idxs[me] // experts_per_rank == p)).any(dim=1).sum())
        out[("put", p)] += rows > 0
        out[("put_signal", p)] += 1
        run = int(((idxs[p] >= 0) & (idxs[p] // experts_per_rank == me)).sum()) if p != me else 0   # own: in place
        out[("put_signal" if run else "signal", p)] += 1
        for n in (int(counts[me][p]), int(counts[p][me])):   # forward, then reverse
            out[("put", p)] += n > 0
            out[("put_signal", p)] += 1
    return +out


def test_happy_path_launches_and_puts_are_unchanged_and_nothing_waits(put_forced, monkeypatch):
    """One decode step (dispatch -> combine, AllToAllvDynamic forward and reverse) on a loopback world 3, every
    peer by puts: each rank launches its 8 kernels (send and receive of each direction), and issues exactly
    the puts and signals the inputs call for (``_expected_calls``: what the put path issued before issue 45
    too: it only dropped the quiet at the end of each send and the fence between rows and control
    words), and no quiet or fence. (The prefill path's puts: tests/test_emulated_nodes.py, on the wire.)"""
    from collections import Counter
    world, cfg = 3, ep_cases.Config(2, 128, 3, 2)
    groups = moe_comm.init(backend="loopback", world_size=world, device="cpu", timeout_s=10)
    events = nvshmem_events(monkeypatch)
    eps = [EPBuffer(g, cfg.experts_per_rank * world, cfg.hidden, cfg.max_tokens, cfg.topk) for g in groups]
    a2as = [AllToAllvDynamic(g, 3, (8,), torch.float32) for g in groups]
    xs, idxs, ws = ep_cases.make_inputs(cfg, world, "random", 11)
    counts = a2a_cases.make_counts("random", world, 3, 11)
    sends = a2a_cases.make_sends(counts, (8,), torch.float32, 11)
    by_rank = {}

    def phase(r, fn):
        start = len(events)
        out = fn()
        by_rank.setdefault(r, []).extend(events[start:])
        return out
    for r in range(world):
        phase(r, lambda: eps[r].dispatch(xs[r], idxs[r], phase="send"))
    ds = [phase(r, lambda: eps[r].dispatch(phase="recv")) for r in range(world)]
    for r in range(world):
        phase(r, lambda: eps[r].combine(ds[r].x, ws[r], ds[r].handle, phase="send"))
    for r in range(world):
        phase(r, lambda: eps[r].combine(phase="recv"))
    for r in range(world):
        phase(r, lambda: a2as[r](sends[r], counts[r], phase="send"))
    res = [phase(r, lambda: a2as[r](phase="recv")) for r in range(world)]
    for r in range(world):
        phase(r, lambda: a2as[r].combine(res[r].recv, res[r].handle, phase="send"))
    for r in range(world):
        phase(r, lambda: a2as[r].combine(phase="recv"))
    for r in range(world):
        got = by_rank[r]
        assert [e[1] for e in got if e[0] == "launch"] == [
            "dispatch_send_kernel", "dispatch_recv_kernel", "combine_send_kernel", "combine_recv_kernel",
            "a2a_send_kernel", "a2a_recv_kernel", "a2a_send_kernel", "a2a_recv_kernel"], got
        calls = Counter((e[0], e[1]) for i, e in enumerate(got) if e[0] in ("put", "put_signal", "signal")
                        and not (e[0] == "signal" and got[i - 1][:2] == ("put_signal", e[1])))   # a put_signal's own
        assert calls == _expected_calls(r, idxs, cfg.experts_per_rank, counts, world), (r, calls)
        assert _waits(got) == [], got


@pytest.mark.parametrize("mode", ["store", "put"])
def test_alltoallv_plan_counts_the_staging_it_holds(monkeypatch, mode):
    """AllToAllvDynamic's plan counts each channel's staging (two zones, as its landing zone) with puts, so
    its symmetric bytes are what the channels hold; a plan set later keeps it (``plan``)."""
    monkeypatch.setenv(ENV, mode)
    groups = moe_comm.init(backend="loopback", world_size=2, device="cpu")
    op = AllToAllvDynamic(groups[0], 3, (8,), torch.float32)
    held = op._fwd.symmetric_bytes + op._rev.symmetric_bytes
    assert op.plan.put == (mode == "put") and op.plan.symmetric_bytes == held
    from moe_comm.planner import plan_alltoallv
    op.plan = plan_alltoallv(2, 3, (8,), torch.float32, torch.device("cuda"))   # GPU launch shapes
    assert op.plan.put == (mode == "put") and op.plan.symmetric_bytes == held
