"""Shared by the serving-loop fault tests (test_fault_soak.py, test_exclude.py): one step's inputs for
every rank (dispatch -> combine and an AllToAllvDynamic round trip) and the check of one rank's results
against the references, with invalid ids unrouted and excluded ranks' experts and rows dropped. And the
slow-rank / dead-rank run of the observability tests (test_trace.py, test_metrics.py)."""

import contextlib
import dataclasses
import os
import threading
import time

import torch

from moe_comm import AllToAllvDynamic, CommTimeoutError, EPBuffer, GroupError, interpret_order, reference
from moe_comm.recovery import recover


def slow_then_dead(group, slow: int, dead: int, sleep_s: float, calls: int, before_death=None) -> str:
    """AllToAllvDynamic calls 1..``calls`` (one 32-byte row to every rank) with rank ``slow`` sleeping
    ``sleep_s`` before each send; ``before_death()`` if given, a barrier, then rank ``dead`` exits
    (os._exit) and the others make call ``calls + 1``, whose wait for it times out. Returns the
    survivors' CommTimeoutError text ("no error" if none came)."""
    op = AllToAllvDynamic(group, 4, (8,), torch.float32)
    counts = torch.ones(group.world_size, dtype=torch.int32)
    send = torch.randn(group.world_size, 8)
    for _ in range(calls):
        if group.rank == slow:
            time.sleep(sleep_s)
        op(send, counts, phase="send")
        op(phase="recv")
    if before_death is not None:
        before_death()
    group.barrier()
    if group.rank == dead:
        os._exit(1)
    try:
        op(send, counts)
    except CommTimeoutError as e:
        return str(e)
    return "no error"


def step_inputs(seed, world, E, M, K, H, cap, row, fault=None):
    """Every rank's (xs, idxs, ws, sends, counts) of one step: T <= M tokens, top-K distinct experts
    (20 % of slots -1), AllToAllvDynamic counts <= cap. ``fault(r, idx, counts)`` may change rank r's
    ids and counts in place before its rows are drawn (so every rank computes the same reference)."""
    g = torch.Generator().manual_seed(seed)
    xs, idxs, ws, sends, counts = [], [], [], [], []
    for r in range(world):
        T = int(torch.randint(0, M + 1, (1,), generator=g))
        xs.append(torch.randn(T, H, generator=g).to(torch.bfloat16))
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K).long()
        idx[torch.rand(idx.shape, generator=g) < 0.2] = -1
        ws.append(torch.rand(T, K, generator=g))
        c = torch.randint(0, cap + 1, (world,), generator=g).to(torch.int32)
        if fault is not None:
            fault(r, idx, c)
        idxs.append(idx)
        counts.append(c)
        sends.append(torch.randn(int(c.sum()), *row, generator=g))
    return xs, idxs, ws, sends, counts


def expert(x):
    """A deterministic 'expert' (exact in bf16 for these values)."""
    return (x.float() * 2 + 1).to(torch.bfloat16)


def check_rank(rank, inputs, d, y, res, back, E, M, cap, excluded=()):
    """Mismatches of this rank's dispatch ``d``, combine ``y``, AllToAllvDynamic ``res`` and its reverse
    ``back`` (rows times 3) against the references; [] when exact."""
    xs, idxs, ws, sends, counts = inputs
    clean = [torch.where((i >= 0) & (i < E), i, -1) for i in idxs]
    exp_d = reference.dispatch(xs, clean, E, M, excluded=excluded)
    errs = []
    if not torch.equal(d.counts, exp_d[rank]["counts"]):
        errs.append(f"counts {d.counts.tolist()} != {exp_d[rank]['counts'].tolist()}")
    for e, n in enumerate(exp_d[rank]["counts"].tolist()):
        if not torch.equal(d.x[e, :n], exp_d[rank]["x"][e, :n]):
            errs.append(f"d.x of expert {e}")
    eos = [expert(r["x"]) for r in exp_d]
    if not torch.equal(y, reference.combine(eos, ws, clean, E, M, excluded=excluded)[rank]):
        errs.append("combine y")
    recv, rc = reference.alltoallv(sends, counts, cap, excluded=excluded)[rank]
    if not torch.equal(res.recv_counts, rc):
        errs.append(f"recv_counts {res.recv_counts.tolist()} != {rc.tolist()}")
    for j in range(len(xs)):
        if not torch.equal(res.recv[j, :int(rc[j])], recv[j, :int(rc[j])]):
            errs.append(f"a2a rows from {j}")
    # reverse: the rows this rank sent come back where they were (rows it did not send are unspecified)
    for j, (off, n) in enumerate(reference.sent_rows(counts[rank].tolist(), cap, sends[rank].shape[0], excluded)):
        if not torch.equal(back[off:off + n], sends[rank][off:off + n] * 3):
            errs.append(f"a2a reverse rows for {j}")
    return errs


E_PER_RANK, H, M, K = 2, 64, 2, 2
CAP_A2A, ROW = 3, (8,)


def _die(where, now):
    if where == "inside_wait":  # the peers have sent; this rank's receive is spinning when the timer fires
        threading.Timer(0.05, os._exit, (9,)).start()
    elif now:
        os._exit(9)


def _kill_at(me, kill):
    """``serve_step``'s ``at``: the step's kill (rank, where), if it is this rank's, happens at its point."""
    who, where = kill

    def at(point):
        if who == me and (where == point or (point == "between_phases" and where == "inside_wait")):
            _die(where, where != "inside_wait")
    return at


def serve(group, steps, kills, slow=None):
    """A serving loop of dispatch -> combine and AllToAllvDynamic round trips on one rank, recovering
    (``recover``: reset, exclude who does not come) after every group error, then resuming every live rank
    at the same step (``resume_step``). kills: {step: (rank, where)} with where in before_send |
    between_phases | inside_wait | between_ops. slow: {step: (rank, delay_s)}: that rank's
    AllToAllvDynamic reverse sends sleep ``delay_s`` before each program at that step (``delayed_sends``).
    Returns ``log``, per step the outcome of its last run: 'exact' | 'error:<name>' |
    'error:<name>;excluded:<ranks>'; ``rewound``: (step, outcome) of each run a resumption repeated; the
    mismatches and the survivors' statistics."""
    me = group.rank
    ep, a2a = serve_ops(group)
    log, rewound, mismatches = [], [], []
    step = 0
    while step < steps:
        slow_rank, delay_s = (slow or {}).get(step, (None, 0.0))
        try:
            errs = serve_step(group, ep, a2a, step, _kill_at(me, kills.get(step, (None, None))),
                              delay_s if slow_rank == me else 0.0)
            mismatches += [f"step {step}: {e}" for e in errs]
            log.append("exact")
            step += 1
        except GroupError as err:
            log.append(f"error:{type(err).__name__}")
            excluded, step = recover_and_resume(group, step + 1)   # reset; exclude who does not come
            if excluded:
                log[-1] += f";excluded:{excluded}"
            rewound += [(s, log[s]) for s in range(step, len(log))]
            del log[step:]
    return dict(log=log, rewound=rewound, mismatches=mismatches, live=group.live_ranks,
                excluded_slots=int(ep.excluded_slots), dropped_rows=int(a2a.dropped_rows))


def serve_ops(group):
    """The ops ``serve_step`` runs on (collective: every rank makes them, in this order)."""
    return (EPBuffer(group, E_PER_RANK * group.world_size, H, M, K),
            AllToAllvDynamic(group, CAP_A2A, ROW, torch.float32))


def serve_step(group, ep, a2a, step, at=lambda point: None, delay_s=0.0) -> list[str]:
    """Step ``step`` of the serving loop on this rank (dispatch -> expert -> combine, an AllToAllvDynamic
    round trip), checked against the reference over the live ranks; returns its mismatches ([] when
    exact) or raises what an op raised. ``at(point)`` is called at before_send | between_phases |
    between_ops; ``delay_s``: this rank's AllToAllvDynamic reverse sends are that late (``delayed_sends``)."""
    world, me = group.world_size, group.rank
    E = E_PER_RANK * world
    inputs = step_inputs(5000 + step, world, E, M, K, H, CAP_A2A, ROW)
    xs, idxs, ws, sends, counts = inputs
    dead = set(range(world)) - set(group.live_ranks)
    at("before_send")
    ep.dispatch(xs[me], idxs[me], phase="send")
    at("between_phases")
    d = ep.dispatch(phase="recv")
    at("between_ops")
    y = ep.combine(expert(d.x), ws[me], d.handle)
    res = a2a(sends[me], counts[me])
    with delayed_sends(a2a, delay_s):
        back = a2a.combine(res.recv * 3, res.handle)
    return check_rank(me, inputs, d, y, res, back, E, M, CAP_A2A, excluded=dead)


def recover_and_resume(group, next_step: int) -> tuple[list[int], int]:
    """``recover``, then ``resume_step``, as ``DecodeEngine._recover_and_resume``: a rank that comes to
    the exchange after the others decided it without it raises ExcludedError there; the others recover
    again (their reset excludes it) and exchange again. Returns (the ranks excluded, the step)."""
    excluded = []
    while True:
        excluded += recover([group])
        try:
            return sorted(excluded), resume_step(group, next_step)
        except CommTimeoutError:
            continue


def resume_step(group, next_step: int) -> int:
    """After ``recover``: the step every live rank goes on with, the lowest of their ``next_step``s
    (``group.exchange``). Ranks leave a failed step at different steps: a rank whose waits of step s all
    got their flags before a slow peer's send to another rank ran out of time (that peer's send
    programs run one after another) returns step s exact while that other rank raises; it raises only at
    step s + 1 (the record of the failure reaches it there). Going on from its own next step, it would
    send step s + 2's inputs while its peers send step s + 1's: every op would then return, exactly, data
    of another step than the one its caller's reference is computed for. So it runs step s + 1 again
    with them, as ``DecodeEngine`` resumes from the oldest step not known good on every rank."""
    return min(v[0] for v in group.exchange([next_step]).values())


@contextlib.contextmanager
def delayed_sends(a2a, delay_s: float):
    """Within the block (``delay_s`` > 0), every program of ``a2a``'s send kernels on this rank sleeps
    ``delay_s`` first, in grid order (``MOE_COMM_INTERPRET_DELAY_S`` and ``_ORDER=asis``, read when an op
    builds its launches: a replaced plan rebuilds them), so the rank's sends reach its peers one ``delay_s``
    apart, in rank order: a slow but live rank. What it can show: a peer served before the timeout and a
    peer timed out by the same send. What it cannot: programs sending at once (the interpreter runs them
    one at a time)."""
    if delay_s <= 0:
        yield
        return
    settings = {interpret_order.DELAY_ENV: str(delay_s), interpret_order.ORDER_ENV: "asis"}
    before = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    a2a.plan = dataclasses.replace(a2a.plan)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v
        a2a.plan = dataclasses.replace(a2a.plan)
