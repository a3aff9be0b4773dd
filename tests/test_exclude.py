"""Keep serving without a dead rank: ``group.exclude`` and going on among the survivors.

A rank is killed (``os._exit``) at a random point of a serving loop of dispatch -> combine and
AllToAllvDynamic round trips: before its send, between the send and receive phases, inside a wait (from
a timer thread while it spins), or between dispatch and combine; later a second rank is killed the same
way. The survivors raise the named error (CommTimeoutError naming a peer), find at ``reset()`` which rank
does not come, ``exclude()`` it, and every later step is exact against the reference computed over the
surviving ranks with the excluded ranks' experts unrouted and their rows dropped. No hang, no process
left, no /dev/shm file left.
"""

import random
import time

import pytest

import moe_comm
from moe_comm import LaunchError

from budget import SWEEP, size
from fault_cases import serve as _serve
from shm_files import own_shm_files

TIMEOUT_S = 1.5
WHERE = ("before_send", "between_phases", "inside_wait", "between_ops")


@SWEEP
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("world,steps,seed", size([(4, 70, 2)], [(3, 300, 1), (4, 120, 2)]))
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
