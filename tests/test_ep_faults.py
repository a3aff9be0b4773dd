"""EPBuffer under faults: a peer that dies or never sends makes the others raise CommTimeoutError naming
it, within about twice the timeout, and nothing hangs or leaks. (A survivor may raise the record of the
other survivor, which timed out first and broadcast it: docs/faults.md.)"""

import os
import time

import pytest
import torch

import moe_comm
from moe_comm import CommTimeoutError, EPBuffer, LaunchError

from shm_files import own_shm_files


TIMEOUT_S = 3.0


def _die_before(group, where):
    """One healthy round trip, then rank 1 exits right before `where` ('dispatch' or 'combine'); the
    others return what they saw (error type, named peer, seconds from the call to the error)."""
    ep = EPBuffer(group, 4 * group.world_size, 128, 2, 2)
    g = torch.Generator().manual_seed(group.rank)
    x = torch.randn(2, 128, generator=g).to(torch.bfloat16)
    idx = torch.randint(0, ep.num_experts, (2, 2), generator=g)
    w = torch.rand(2, 2, generator=g)
    d = ep.dispatch(x, idx)
    ep.combine(torch.zeros_like(d.x), w, d.handle)
    if where == "combine":
        d = ep.dispatch(x, idx)
    if group.rank == 1:
        os._exit(3)
    t0 = time.monotonic()
    try:
        if where == "dispatch":
            ep.dispatch(x, idx)
        else:
            ep.combine(torch.zeros_like(d.x), w, d.handle)
    except CommTimeoutError as e:
        return dict(error="CommTimeoutError", op=e.op, rank=e.rank, peer=e.peer, seconds=time.monotonic() - t0)
    return dict(error=None, seconds=time.monotonic() - t0)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("where", ["dispatch", "combine"])
def test_killed_peer_is_named(where):
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as info:
        moe_comm.launch(_die_before, 3, where, backend="shm", timeout_s=TIMEOUT_S)
    err = info.value
    assert sorted(err.failures) == [1] and "exit code 3" in err.failures[1]
    for rank in (0, 2):
        got = err.results[rank]
        assert got["error"] == "CommTimeoutError", got
        # The error names the op and the dead peer. The waiting rank it names is this rank, or the other
        # survivor whose timeout came first and was broadcast (every rank raises the same error).
        assert (got["op"], got["peer"]) == (where, 1) and got["rank"] in (0, 2), got
        assert got["seconds"] < 2 * TIMEOUT_S + 2, got
    assert time.monotonic() - t0 < 120
    assert own_shm_files() == []


def test_silent_peer_on_loopback_times_out_naming_it():
    """Rank 1 skips its send phase: rank 0's receive gives up after the timeout and names rank 1."""
    groups = moe_comm.init(backend="loopback", world_size=2, timeout_s=0.5, device="cpu")
    eps = [EPBuffer(g, 8, 128, 2, 2) for g in groups]
    x, idx = torch.randn(2, 128).to(torch.bfloat16), torch.tensor([[0, 5], [7, -1]])
    eps[0].dispatch(x, idx, phase="send")
    t0 = time.monotonic()
    with pytest.raises(CommTimeoutError, match="rank 0 timed out after 0.5 s waiting for peer rank 1"):
        eps[0].dispatch(phase="recv")
    assert time.monotonic() - t0 < 5
