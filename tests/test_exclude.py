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


# The slow rank's reverse send reaches rank 0 after SLOW_DELAY_S and rank 1 after twice that: each 1.5 s
# from the timeout, the slack for the ranks' skew on a loaded machine.
SLOW_TIMEOUT_S, SLOW_DELAY_S, SLOW_STEP = 4.5, 3.0, 1


@pytest.mark.timeout(300)
def test_a_rank_that_finished_the_step_its_peers_failed_resumes_with_them():
    """A slow but live rank, no death: at step SLOW_STEP rank 2's AllToAllvDynamic reverse send (the step's
    last op) reaches rank 0 after SLOW_DELAY_S (< the timeout) and rank 1 after twice that (> the timeout).
    Rank 0 returns the step exact (every flag it waited for came); rank 1 times out naming rank 2, rank 2
    adopts its record; rank 0 raises at step SLOW_STEP + 1, where the record reaches it. After ``recover``
    the loop resumes every rank at the lowest next step (``fault_cases.resume_step``): rank 0 runs step
    SLOW_STEP + 1 again with the others, and every step is exact or raised on every rank. Without that
    agreement rank 0 goes on one step ahead, sending one step's inputs while its peers send the one
    before: each call exact for what was sent, every check against the step's reference wrong (the
    mismatches test_killed_ranks_are_excluded_and_the_rest_stays_exact once found under load). Other
    steps may time out too on a loaded machine; they are recovered the same way."""
    steps = SLOW_STEP + 3
    slow = {SLOW_STEP: (2, SLOW_DELAY_S)}
    outs = moe_comm.launch(_serve, 3, steps, {}, slow, backend="shm", timeout_s=SLOW_TIMEOUT_S, grace_s=120)
    for r, out in enumerate(outs):
        assert out["mismatches"] == [], (r, out["mismatches"][:5])
        assert out["live"] == [0, 1, 2] and len(out["log"]) == steps, (r, out)
    assert outs[0]["log"][SLOW_STEP] == "exact", outs[0]
    assert outs[0]["rewound"][:1] == [(SLOW_STEP + 1, "error:CommTimeoutError")], outs[0]
    for r in (1, 2):
        assert outs[r]["log"][SLOW_STEP] == "error:CommTimeoutError", (r, outs[r])
    assert own_shm_files() == []
