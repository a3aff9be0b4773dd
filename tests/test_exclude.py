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
from moe_comm import AllToAllvDynamic, EPBuffer, GroupError, LaunchError
from moe_comm.recovery import recover

from fault_cases import check_rank, expert, step_inputs
from shm_files import own_shm_files

E_PER_RANK, H, M, K = 2, 64, 2, 2
CAP_A2A, ROW = 3, (8,)
TIMEOUT_S = 1.5
WHERE = ("before_send", "between_phases", "inside_wait", "between_ops")


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
        inputs = step_inputs(5000 + step, world, E, M, K, H, CAP_A2A, ROW)
        xs, idxs, ws, sends, counts = inputs
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
            y = ep.combine(expert(d.x), ws[me], d.handle)
            res = a2a(sends[me], counts[me])
            back = a2a.combine(res.recv * 3, res.handle)
            errs = check_rank(me, inputs, d, y, res, back, E, M, CAP_A2A, excluded=dead)
            mismatches += [f"step {step}: {e}" for e in errs]
            log.append("exact")
        except GroupError as err:
            log.append(f"error:{type(err).__name__}")
            excluded = recover([group])   # reset; a rank that does not come to it is gone: exclude it
            if excluded:
                log[-1] += f";excluded:{excluded}"
    return dict(log=log, mismatches=mismatches, live=group.live_ranks,
                excluded_slots=int(ep.excluded_slots), dropped_rows=int(a2a.dropped_rows))


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("world,steps,seed", [(3, 300, 1), (4, 120, 2)])
def test_killed_ranks_are_excluded_and_the_rest_stays_exact(world, steps, seed):
    rng = random.Random(seed)
    first, second = rng.randrange(20, steps // 2), rng.randrange(steps // 2 + 10, steps - 20)
    victims = rng.sample(range(world), 2)
    kills = {first: (victims[0], rng.choice(WHERE)), second: (victims[1], rng.choice(WHERE))}
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
    assert own_shm_files() == []
