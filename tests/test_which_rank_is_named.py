"""Which rank a blocked rank names (issue 45, docs/faults.md "Which rank is named").

Rank 1 (B) waits in its AllToAllvDynamic receive for rank 2, which died after its last good call. Rank 0 (S)
records a timeout naming B, as a survivor whose wait depended on B does when B's forward or combine is
blocked on the dead rank (the node-loss race: S's wait can expire before B's). The record is S's host
barrier path (``group._fail_group``), the same record a kernel's timed-out wait broadcasts.

- ``during``: S's record comes while B's wait is pending. B was blocked, not late: it records its own
  timeout naming rank 2, at once (well before its own timeout), so ``exclude([err.peer])`` works on B.
  (Before, B adopted S's record and raised a CommTimeoutError naming itself, which it cannot exclude.)
- ``before``: S's record was there when B's wait began: B is the late rank and adopts it (names itself).
- ``mutual``: as ``during``, but S never sent B this call: B waits for S too (the two wait for each other),
  so it adopts S's record, and every rank raises the same error.
  The same across nodes, rank 0 in a barrier: tests/test_emulated_nodes.py::
  test_a_failure_found_on_one_node_reaches_the_other_by_puts.

What this can show: the wait's decision on the interpreter (shm world 3, one process per rank). What it
cannot: the same race on a GPU (the decision reads the status once per poll, as every failed-group check
does; its block-uniformity is checked on the PTX by tests/test_compile_sm90.py).
"""

import os
import time

import pytest
import torch

import moe_comm
from moe_comm import AllToAllvDynamic, CommDesyncError, CommTimeoutError, GroupError, LaunchError
from moe_comm.errors import ERR_ABORTED, ERR_DESYNC, OPS
from moe_comm.interpret_order import ORDER_ENV
from moe_comm.interpreter import kernel_for
from moe_comm.triton_kernels.sync import fail_group_kernel

TIMEOUT_S = 20.0   # B's own wait would end here: the record comes long before it
RECORD_AFTER_S = 1.0   # S records once B's receive is launched and this long has passed
SIGNAL_WAIT = __import__("datetime").timedelta(seconds=120)
S, B, DEAD = 0, 1, 2


def _signal(group, key):
    group.heap._control.store.set(f"test/{key}", b"1")


def _await(group, key):
    group.heap._control.store.wait([f"test/{key}"], SIGNAL_WAIT)


def _blocked(group, when):
    op = AllToAllvDynamic(group, 4, (8,), torch.float32)
    counts = torch.ones(group.world_size, dtype=torch.int32)
    send = torch.full((group.world_size, 8), float(group.rank))
    op(send, counts)   # a good call: every rank's kernels warm
    group.barrier()
    if group.rank == DEAD:
        os._exit(1)
    if group.rank != S or when != "mutual":
        op(send, counts, phase="send")
    if group.rank == S:
        _await(group, "b-sent")
        if when != "before":
            time.sleep(RECORD_AFTER_S)
        group._fail_group(CommTimeoutError("alltoallv", S, B, TIMEOUT_S))
        _signal(group, "recorded")
        if when != "mutual":   # (mutual: S never sent this call, so it has no receive to make)
            with pytest.raises(CommTimeoutError):
                op(phase="recv")
        return None
    _signal(group, "b-sent")
    if when == "before":
        _await(group, "recorded")
    t0 = time.monotonic()
    try:
        op(phase="recv")
    except CommTimeoutError as e:
        return e.rank, e.peer, time.monotonic() - t0
    return None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("order", ["asis", "reverse"])
@pytest.mark.parametrize("when, record", [("during", (B, DEAD)), ("before", (S, B)), ("mutual", (S, B))])
def test_a_blocked_rank_names_whom_it_waits_for(monkeypatch, when, record, order):
    """B's CommTimeoutError: ``record`` (the rank that timed out, the rank it names). The receive's programs
    wait for one source each: in reverse order the program waiting for the dead rank meets S's record first,
    and B still sees that its launch waits for S too (a GPU runs them at once: any may see it first)."""
    monkeypatch.setenv(ORDER_ENV, order)
    with pytest.raises(LaunchError) as info:
        moe_comm.launch(_blocked, 3, when, backend="shm", timeout_s=TIMEOUT_S, grace_s=120)
    err = info.value
    assert sorted(err.failures) == [DEAD], err.failures
    rank, peer, took = err.results[B]
    assert (rank, peer) == record, err.results[B]
    assert took < TIMEOUT_S / 2, took   # ended by S's record (or adopted at once), not by B's own timeout


def _record(group, code, peer):
    """This rank's broadcast record of ``code`` naming ``peer``, as a kernel's failed wait stores it
    (``fail_group_kernel`` is that store path; only the code differs from ``group._fail_group``)."""
    w = group.world_size
    kernel_for(fail_group_kernel, group.device)[(1,)](
        group.state, code, OPS.index("alltoallv"), group.rank, peer, 0, WORLD=w,
        WORLD_P2=1 << max(w - 1, 0).bit_length(), **group.put_launch_args())
    group.synchronize()


def _blocked_named_by(group, code):
    """As ``_blocked`` (``during``), but S's record naming B is not a timeout: B adopts it."""
    op = AllToAllvDynamic(group, 4, (8,), torch.float32)
    counts = torch.ones(group.world_size, dtype=torch.int32)
    send = torch.full((group.world_size, 8), float(group.rank))
    op(send, counts)
    group.barrier()
    if group.rank == DEAD:
        os._exit(1)
    op(send, counts, phase="send")
    if group.rank == S:
        _await(group, "b-sent")
        time.sleep(RECORD_AFTER_S)
        _record(group, code, B)
        with pytest.raises(GroupError):
            op(phase="recv")
        return None
    _signal(group, "b-sent")
    t0 = time.monotonic()
    try:
        op(phase="recv")
    except GroupError as e:
        return type(e).__name__, e.rank, e.peer, time.monotonic() - t0
    return None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("code, name", [(ERR_DESYNC, CommDesyncError.__name__), (ERR_ABORTED, "CommAbortedError")])
def test_a_record_naming_the_blocked_rank_that_is_no_timeout_is_adopted(code, name):
    """Only a timeout naming B is answered by B's own timeout: S's desync (B's flag of a later call) or
    abort (B aborted the call) naming B is the group's error, and B raises it as S recorded it."""
    with pytest.raises(LaunchError) as info:
        moe_comm.launch(_blocked_named_by, 3, code, backend="shm", timeout_s=TIMEOUT_S, grace_s=120)
    err = info.value
    assert sorted(err.failures) == [DEAD], err.failures
    cls, rank, peer, took = err.results[B]
    assert (cls, rank, peer) == (name, S, B), err.results[B]
    assert took < TIMEOUT_S / 2, took
