"""Issue 28, item 1: an aborted call keeps the protection of the call two back. A rank's send of call
i+2 may write the landing zone a peer reads for call i only once that peer is done with call i; for a
made call i+1 the rank's own receive guarantees it, for an aborted one the receive side of the abort
(``Channel.drain``, at the next launch) does. Loopback world 2: both ranks send call 1, rank 0 receives
it, raises on a float32 ``x`` at call 2 and sends call 3 before rank 1 has received call 1."""

import pytest
import torch

import moe_comm
from moe_comm import AllToAllvDynamic, CommTimeoutError, EPBuffer, GroupError, reference
from moe_comm.errors import CommDesyncError

from test_faults import E, H, M, K, _exact_round, _inputs

CAP, ROW = 3, (8,)   # AllToAllvDynamic: rows per peer, row shape


class _EP:
    """Dispatch on a loopback world: one call's send (``bad``: x of the wrong dtype) and receive."""

    def __init__(self, groups):
        self.ops = [EPBuffer(g, E, H, M, K) for g in groups]
        self.inputs = {}

    def channel(self, r):
        return self.ops[r]._dispatch_ch

    def send(self, r, call, bad=False):
        xs, idxs, _ = _inputs(2, call)
        self.inputs[call] = (xs, idxs)
        self.ops[r].dispatch(xs[r].float() if bad else xs[r], idxs[r], phase="send")

    def recv_exact(self, r, call):
        d = self.ops[r].dispatch(phase="recv")
        exp = reference.dispatch(*self.inputs[call], E, M)[r]
        assert torch.equal(d.counts, exp["counts"])
        for e, n in enumerate(exp["counts"].tolist()):
            assert torch.equal(d.x[e, :n], exp["x"][e, :n])

    def recv(self, r):
        self.ops[r].dispatch(phase="recv")

    def exact_round(self, seed):
        _exact_round(self.ops, seed)


class _A2A:
    """AllToAllvDynamic forward on a loopback world, the same interface as ``_EP``."""

    def __init__(self, groups):
        self.ops = [AllToAllvDynamic(g, CAP, ROW, torch.float32) for g in groups]
        self.inputs = {}

    def channel(self, r):
        return self.ops[r]._fwd

    def _make(self, call):
        g = torch.Generator().manual_seed(call)
        counts = [torch.randint(0, CAP + 1, (2,), generator=g).to(torch.int32) for _ in range(2)]
        return [torch.randn(int(c.sum()), *ROW, generator=g) for c in counts], counts

    def send(self, r, call, bad=False):
        sends, counts = self.inputs[call] = self._make(call)
        self.ops[r](sends[r].double() if bad else sends[r], counts[r], phase="send")

    def recv_exact(self, r, call):
        res = self.ops[r](phase="recv")
        recv, rc = reference.alltoallv(*self.inputs[call], CAP)[r]
        assert torch.equal(res.recv_counts, rc)
        for j, n in enumerate(rc.tolist()):
            assert torch.equal(res.recv[j, :n], recv[j, :n])

    def recv(self, r):
        self.ops[r](phase="recv")

    def exact_round(self, seed):
        for r in range(2):
            self.send(r, seed)
        for r in range(2):
            self.recv_exact(r, seed)


@pytest.mark.parametrize("kind", [_EP, _A2A], ids=["dispatch", "alltoallv"])
def test_an_aborted_call_keeps_the_call_two_back_intact(kind):
    """Rank 0's send of call 3 must not touch rank 1's landing zone of call 1 (its rows and flag) while
    rank 1 has not received call 1. On loopback rank 1 cannot get there before rank 0's send returns, so
    rank 0's wait for it times out: every rank's next call raises that named error (never call 3's rows
    as call 1's, never CommDesyncError), and after reset() rounds are exact."""
    groups = moe_comm.init(backend="loopback", world_size=2, device="cpu", timeout_s=0.3)
    op = kind(groups)
    for r in range(2):
        op.send(r, 1)
    op.recv_exact(0, 1)
    with pytest.raises(TypeError, match="dtype"):
        op.send(0, 2, bad=True)                    # call 2: rank 0 aborts
    ch = op.channel(1)
    zone = ch.data.local.clone(), ch.ctrl.local.clone()
    op.send(0, 3)                                  # call 3: waits for rank 1's call 2 (it cannot come)
    intact = torch.equal(ch.data.local, zone[0]) and torch.equal(ch.ctrl.local, zone[1])
    assert intact, \
        "rank 0's send of call 3 wrote rank 1's landing zone of call 1"
    with pytest.raises(CommTimeoutError, match="rank 0 timed out after 0.3 s waiting for peer rank 1"):
        op.recv(1)                                 # call 1 on rank 1: the group failed meanwhile
    op.send(1, 2)
    for r in (1, 0):
        with pytest.raises(GroupError) as info:
            op.recv(r)
        assert not isinstance(info.value, CommDesyncError)
    for g in groups:
        g.reset()
    for seed in (4, 5):
        op.exact_round(seed)


@pytest.mark.parametrize("kind", [_EP, _A2A], ids=["dispatch", "alltoallv"])
def test_repeated_symmetric_aborts_leave_the_group_usable(kind):
    """Every rank aborts two calls in a row (the second abort first finishes the first one's receive
    side): nobody fails, and the next rounds are exact."""
    groups = moe_comm.init(backend="loopback", world_size=2, device="cpu", timeout_s=1.0)
    op = kind(groups)
    op.exact_round(1)
    for call in (2, 3):
        for r in range(2):
            with pytest.raises(TypeError, match="dtype"):
                op.send(r, call, bad=True)
    for seed in (4, 5):
        op.exact_round(seed)
    for g in groups:
        g.check()


# ---- shm processes: the same bad input on every rank while one rank is slow ------------------------

E3, SLOW_RANK, SLOW_S = 6, 2, 2.0   # world 3: experts; the rank that sleeps before its receive of call 1


def _world3_call(kind, call):
    """Every rank's inputs of one call (the same on every process): dispatch (xs, idxs), a2a (sends, counts)."""
    g = torch.Generator().manual_seed(call)
    if kind == "dispatch":
        return ([torch.randn(M, H, generator=g).to(torch.bfloat16) for _ in range(3)],
                [torch.randint(-1, E3, (M, K), generator=g) for _ in range(3)])
    counts = [torch.randint(0, CAP + 1, (3,), generator=g).to(torch.int32) for _ in range(3)]
    return [torch.randn(int(c.sum()), *ROW, generator=g) for c in counts], counts


def _world3_exact(kind, op, r, call, result):
    """Mismatches of rank r's ``result`` of ``call`` against the reference ([] when exact)."""
    ins = _world3_call(kind, call)
    if kind == "dispatch":
        exp = reference.dispatch(*ins, E3, M)[r]
        ok = torch.equal(result.counts, exp["counts"]) and all(
            torch.equal(result.x[e, :n], exp["x"][e, :n]) for e, n in enumerate(exp["counts"].tolist()))
    else:
        recv, rc = reference.alltoallv(*ins, CAP)[r]
        ok = torch.equal(result.recv_counts, rc) and all(
            torch.equal(result.recv[j, :n], recv[j, :n]) for j, n in enumerate(rc.tolist()))
    return [] if ok else [f"call {call}"]


def _slow_receiver(group, kind):
    """Call 1 (rank SLOW_RANK sleeps before receiving it), call 2 with a bad input on every rank, call 3.
    Returns (what call 2 raised, mismatches of calls 1 and 3, what else was raised)."""
    r = group.rank
    op = (EPBuffer(group, E3, H, M, K) if kind == "dispatch" else AllToAllvDynamic(group, CAP, ROW, torch.float32))
    run = op.dispatch if kind == "dispatch" else op
    errs, call2 = [], None
    try:
        a, b = _world3_call(kind, 1)
        run(a[r], b[r], phase="send")
        if r == SLOW_RANK:
            import time  # noqa: PLC0415
            time.sleep(SLOW_S)
        errs += _world3_exact(kind, op, r, 1, run(phase="recv"))
        a, b = _world3_call(kind, 2)
        try:
            run(a[r].double(), b[r])
        except TypeError as e:
            call2 = type(e).__name__
        a, b = _world3_call(kind, 3)
        errs += _world3_exact(kind, op, r, 3, run(a[r], b[r]))
        group.check()
    except moe_comm.MoECommError as e:
        errs.append(f"{type(e).__name__}: {e}")
    return call2, errs


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["dispatch", "alltoallv"])
def test_same_bad_input_while_a_rank_is_slow_keeps_every_call_exact(kind):
    """Acceptance of issue 28: every rank raises the input error at call 2, and calls 1 and 3 are exact on
    every rank although rank 2 received call 1 long after the others sent call 3."""
    results = moe_comm.launch(_slow_receiver, 3, kind, backend="shm", timeout_s=20)
    assert results == [("TypeError", [])] * 3, results
