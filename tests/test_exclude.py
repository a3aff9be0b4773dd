"""Keep serving without a dead rank: ``group.exclude`` and going on among the survivors.

A rank is killed (``os._exit``) at a random point of a serving loop of dispatch -> combine and
AllToAllvDynamic round trips: before its send, between the send and receive phases, inside a wait (from
a timer thread while it spins), or between dispatch and combine; later a second rank is killed the same
way. The survivors raise the named error (CommTimeoutError naming a peer), find at ``reset()`` which rank
does not come, ``exclude()`` it, and every later step is exact against the reference computed over the
surviving ranks with the excluded ranks' experts unrouted and their rows dropped. No hang, no process
left, no /dev/shm file left.
"""

import os
import random
import threading
import time

import pytest
import torch

import moe_comm
from moe_comm import AllToAllvDynamic, CommTimeoutError, EPBuffer, GroupError, LaunchError, reference

E_PER_RANK, H, M, K = 2, 64, 2, 2
CAP_A2A, ROW = 3, (8,)
TIMEOUT_S = 1.5
WHERE = ("before_send", "between_phases", "inside_wait", "between_ops")


def _inputs(world, step, E):
    g = torch.Generator().manual_seed(5000 + step)
    xs, idxs, ws, sends, counts = [], [], [], [], []
    for _ in range(world):
        T = int(torch.randint(0, M + 1, (1,), generator=g))
        xs.append(torch.randn(T, H, generator=g).to(torch.bfloat16))
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K).long()
        idx[torch.rand(idx.shape, generator=g) < 0.2] = -1
        idxs.append(idx)
        ws.append(torch.rand(T, K, generator=g))
        c = torch.randint(0, CAP_A2A + 1, (world,), generator=g).to(torch.int32)
        counts.append(c)
        sends.append(torch.randn(int(c.sum()), *ROW, generator=g))
    return xs, idxs, ws, sends, counts


def _expert(x):
    return (x.float() * 2 + 1).to(torch.bfloat16)


def _die(where, now):
    if where == "inside_wait":  # the peers have sent; this rank's receive is spinning when the timer fires
        threading.Timer(0.05, os._exit, (9,)).start()
    elif now:
        os._exit(9)


def _serve(group, steps, kills):
    """kills: {step: (rank, where)}. Returns per step 'exact' | 'error:<name>' | 'excluded:<ranks>'."""
    world, me = group.world_size, group.rank
    E = E_PER_RANK * world
    ep = EPBuffer(group, E, H, M, K)
    a2a = AllToAllvDynamic(group, CAP_A2A, ROW, torch.float32)
    log, mismatches = [], []
    for step in range(steps):
        xs, idxs, ws, sends, counts = _inputs(world, step, E)
        dead = set(range(world)) - set(group.live_ranks)
        who, where = kills.get(step, (None, None))
        mine = who == me
        try:
            if mine and where == "before_send":
                _die(where, True)
            ep.dispatch(xs[me], idxs[me], phase="send")
            if mine and where in ("between_phases", "inside_wait"):
                _die(where, where == "between_phases")
            d = ep.dispatch(phase="recv")
            if mine and where == "between_ops":
                _die(where, True)
            y = ep.combine(_expert(d.x), ws[me], d.handle)
            res = a2a(sends[me], counts[me])
            back = a2a.combine(res.recv * 3, res.handle)
            exp_d = reference.dispatch(xs, idxs, E, M, excluded=dead)
            eos = [_expert(e["x"]) for e in exp_d]
            errs = []
            if not torch.equal(d.counts, exp_d[me]["counts"]):
                errs.append("counts")
            for e, n in enumerate(exp_d[me]["counts"].tolist()):
                if not torch.equal(d.x[e, :n], exp_d[me]["x"][e, :n]):
                    errs.append(f"d.x {e}")
            if not torch.equal(y, reference.combine(eos, ws, idxs, E, M, excluded=dead)[me]):
                errs.append("combine")
            recv, rc = reference.alltoallv(sends, counts, CAP_A2A, excluded=dead)[me]
            if not torch.equal(res.recv_counts, rc) or any(
                    not torch.equal(res.recv[j, :int(rc[j])], recv[j, :int(rc[j])]) for j in range(world)):
                errs.append("a2a")
            for off, n in (x for j, x in enumerate(reference.sent_rows(counts[me].tolist(), CAP_A2A,
                                                                      sends[me].shape[0], dead))):
                if not torch.equal(back[off:off + n], sends[me][off:off + n] * 3):
                    errs.append("a2a reverse")
            mismatches += [f"step {step}: {e}" for e in errs]
            log.append("exact")
        except GroupError as err:
            log.append(f"error:{type(err).__name__}")
            try:
                group.reset()
            except CommTimeoutError as missing:  # a rank does not come to the reset: it is gone
                excluded = group.exclude([missing.peer])
                log[-1] += f";excluded:{excluded}"
    return dict(log=log, mismatches=mismatches, live=group.live_ranks,
                excluded_slots=int(ep.excluded_slots), dropped_rows=int(a2a.dropped_rows))


def _shm_files():
    return {f for f in os.listdir("/dev/shm") if f.startswith("moecomm_")}


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("world,steps,seed", [(3, 300, 1), (4, 120, 2)])
def test_killed_ranks_are_excluded_and_the_rest_stays_exact(world, steps, seed):
    rng = random.Random(seed)
    first, second = rng.randrange(20, steps // 2), rng.randrange(steps // 2 + 10, steps - 20)
    victims = rng.sample(range(world), 2)
    kills = {first: (victims[0], rng.choice(WHERE)), second: (victims[1], rng.choice(WHERE))}
    before = _shm_files()
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as info:
        moe_comm.launch(_serve, world, steps, kills, backend="shm", timeout_s=TIMEOUT_S, grace_s=1200)
    took = time.monotonic() - t0
    err = info.value
    assert sorted(err.failures) == sorted(victims), err.failures
    survivors = [r for r in range(world) if r not in victims]
    print(f"world {world}, kills {kills}, {took:.0f} s")
    for r in survivors:
        out = err.results[r]
        assert out["mismatches"] == [], out["mismatches"][:5]
        assert out["live"] == survivors
        log = out["log"]
        assert len(log) == steps
        errors = [s for s, entry in enumerate(log) if entry != "exact"]
        # each death costs the step where it happens (and at most the one after: the reset's own wait)
        assert 1 <= len(errors) <= 4, log
        assert all(entry == "exact" for entry in log[second + 2:])
        assert any(f"excluded:[{victims[0]}]" in entry or f"excluded:{sorted(victims[:1])}" in entry
                   for entry in log), log
        assert out["excluded_slots"] > 0
    assert not (_shm_files() - before)
