"""Randomized fault soak (``make test-sweeps``): world 3 over shared memory, a serving loop of 40 steps
(300 under ``make test-long``), each a barrier, a
dispatch -> combine and an AllToAllvDynamic round trip, with random faults injected on random ranks:

- ``host_error``   one rank passes x of the wrong dtype (TypeError; it takes part by aborting);
- ``capacity``     every rank's tokens list one expert twice: more rows than its capacity (CapacityError
                   on the receiving rank, data error: the step goes on with ``err.result``);
- ``invalid_id``   one rank passes an expert id out of range (InvalidIndexError on that rank, data error);
- ``a2a_lie``      one rank's AllToAllvDynamic count exceeds the capacity (CapacityError, data error);
- ``skip``         one rank skips the combine of its step (the others' combine fails: group error);
- ``late``         one rank sleeps longer than the timeout before its dispatch (group error).

After a group error every rank calls ``group.reset()``, the ranks agree on the step to resume at
(``group.exchange``; a rank that left a step early finds the failure one step later), and the loop goes
on. The property: every step on every rank either raised a named error or returned results equal to the
reference (computed from every rank's inputs, with the faulty slots and rows dropped as the contract
says), never anything else, never a hang; and no /dev/shm file is left.
"""

import collections
import random
import time

import pytest
import torch

import moe_comm
from moe_comm import AllToAllvDynamic, CapacityError, EPBuffer, GroupError, InvalidIndexError

from budget import SWEEP, size
from fault_cases import check_rank, expert, step_inputs
from shm_files import own_shm_files

WORLD, STEPS, TIMEOUT_S = 3, size(40, 300), 2.0
E, H, M, K = 6, 64, 2, 2           # 2 experts per rank; capacity world * M = 6 rows per expert
CAP_A2A, ROW = 3, (8,)
KINDS = ("none", "host_error", "capacity", "invalid_id", "a2a_lie", "skip", "late")
WEIGHTS = (70, 6, 6, 6, 6, 3, 3)


def _plan(seed):
    """Random fault kinds on random ranks; every kind occurs at least once, whatever STEPS is."""
    rng = random.Random(seed)
    plan = [(rng.choices(KINDS, WEIGHTS)[0], rng.randrange(WORLD)) for _ in range(STEPS)]
    for kind in set(KINDS) - {k for k, _ in plan}:
        plan[rng.randrange(STEPS)] = (kind, rng.randrange(WORLD))
    return plan


def _inputs(step, kind, who):
    """Every rank's inputs of ``step``, the fault applied (so every rank computes the same reference)."""
    def fault(r, idx, c):
        if kind == "capacity" and len(idx):
            idx[:] = 1                    # expert 1: every slot of every token (up to 3 * 2 * 2 = 12 > 6 rows)
        if kind == "invalid_id" and r == who and len(idx):
            idx[0, 0] = E + 3
        if kind == "a2a_lie" and r == who:
            c[(who + 1) % WORLD] = CAP_A2A + 2
    return step_inputs(1000 + step, WORLD, E, M, K, H, CAP_A2A, ROW, fault)


def _soak(group, seed):
    ep = EPBuffer(group, E, H, M, K)
    a2a = AllToAllvDynamic(group, CAP_A2A, ROW, torch.float32)
    outcomes, mismatches = collections.Counter(), []
    plan, step = _plan(seed), 0
    while step < STEPS:
        kind, who = plan[step]
        xs, idxs, ws, sends, counts = _inputs(step, kind, who)
        me = group.rank
        data_errors = []
        try:
            group.barrier()
            x = xs[me].float() if kind == "host_error" and me == who else xs[me]
            if kind == "late" and me == who:
                time.sleep(TIMEOUT_S * 1.3)
            try:
                d = ep.dispatch(x, idxs[me])
            except (CapacityError, InvalidIndexError) as e:
                d, _ = e.result, data_errors.append(type(e).__name__)
            if kind == "skip" and me == who:
                raise _Skipped()
            y = ep.combine(expert(d.x), ws[me], d.handle)
            try:
                res = a2a(sends[me], counts[me])
            except CapacityError as e:
                res, _ = e.result, data_errors.append("CapacityError")
            back = a2a.combine(res.recv * 3, res.handle)
            errs = check_rank(me, (xs, idxs, ws, sends, counts), d, y, res, back, E, M, CAP_A2A)
            mismatches += [f"step {step} ({kind} on {who}): {m}" for m in errs]
            outcomes["exact+data_error" if data_errors else "exact"] += 1
        except GroupError as e:
            outcomes[f"group:{type(e).__name__}"] += 1
            # Recovery as a serving loop does it: reset, then resume every rank at the same step (a rank
            # that left a step early, by an input error or a skip, found the failure one step later).
            group.reset()
            resume = max(v[0] for v in group.exchange([step + 1]).values())
            outcomes["lost_to_recovery"] += resume - (step + 1)
            step = resume
            continue
        except TypeError:
            outcomes["input_error"] += 1          # this rank aborted its part; the peers fail the group
        except _Skipped:
            outcomes["skipped"] += 1
        step += 1
    return dict(outcomes), mismatches


class _Skipped(Exception):
    """The injected fault: this rank leaves the step before its combine."""


@SWEEP
@pytest.mark.timeout(1500)
def test_randomized_fault_soak_world3_shm():
    plan = _plan(seed=7)
    assert {k for k, _ in plan} == set(KINDS)  # every fault kind occurs
    t0 = time.monotonic()
    results = moe_comm.launch(_soak, WORLD, 7, backend="shm", timeout_s=TIMEOUT_S, grace_s=120)
    took = time.monotonic() - t0
    for rank, (outcomes, mismatches) in enumerate(results):
        print(f"rank {rank}: {outcomes}")
        assert mismatches == [], mismatches[:10]
        assert outcomes.get("exact", 0) >= STEPS // 2, outcomes
        assert sum(outcomes.values()) == STEPS
    print(f"{STEPS} steps in {took:.0f} s")
    assert own_shm_files() == []
