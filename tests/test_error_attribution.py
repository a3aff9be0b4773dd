"""Issue 28, item 3: a data error carries the result of the op call that recorded it, wherever it is
read. On CUDA ``finish_op`` waits only for the previous op, so a dispatch's InvalidIndexError is usually
read at the end of the next call (the combine); that late read is emulated here by not reading the error
word at the end of the dispatch. On the CPU the same happens when another op ends while a call's
receive phase is pending."""

import pytest
import torch

import moe_comm
from moe_comm import AllToAllvDynamic, CapacityError, EPBuffer, InvalidIndexError, reference

from test_faults import E, H, M, K, _expert, _inputs


def test_a_dispatch_error_read_at_the_next_combine_carries_the_dispatch_result(monkeypatch):
    (g,) = moe_comm.init(backend="loopback", world_size=1, device="cpu")
    ep = EPBuffer(g, E, H, M, K)
    (x,), (idx,), (w,) = _inputs(1, 3)
    idx[0, 1] = E + 5                               # not routed; InvalidIndexError recorded by the dispatch
    g._reads_lag = True                             # as on CUDA: the end of a call may come before its kernels'
    check = g.check
    monkeypatch.setattr(g, "check", lambda: None)   # ... as the dispatch's do here
    d = ep.dispatch(x, idx)
    monkeypatch.setattr(g, "check", check)
    with pytest.raises(InvalidIndexError, match="recorded by an earlier dispatch call") as info:
        ep.combine(_expert(d), w, d.handle)
    assert info.value.result is d                   # the dispatch's result, not the combine's
    clean = torch.where(idx < E, idx, -1)
    assert torch.equal(info.value.call_result, reference.combine([_expert(d)], [w], [clean], E, M)[0])
    g.check()


def test_an_error_of_a_pending_call_is_raised_at_its_own_end():
    """AllToAllvDynamic's send phase records a CapacityError; a dispatch ends before its receive phase:
    the dispatch returns its result, the AllToAllvDynamic's receive raises the error with its own."""
    (g,) = moe_comm.init(backend="loopback", world_size=1, device="cpu")
    a2a, ep = AllToAllvDynamic(g, 2, (4,), torch.float32), EPBuffer(g, E, H, M, K)
    rows = torch.randn(5, 4)
    a2a(rows, torch.tensor([5]), phase="send")      # 5 > capacity 2: recorded by this call's send
    (x,), (idx,), _ = _inputs(1, 4)
    d = ep.dispatch(x, idx)
    exp = reference.dispatch([x], [idx], E, M)[0]
    assert torch.equal(d.counts, exp["counts"])
    with pytest.raises(CapacityError, match=r"send_counts\[0\] is 5, but only 2 rows") as info:
        a2a(phase="recv")
    res = info.value.result
    assert res is info.value.call_result and res.recv_counts.tolist() == [2]
    assert torch.equal(res.recv[0, :2], rows[:2])
    g.check()
