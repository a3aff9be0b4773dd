"""A standing guard against kernels that depend on program order (docs/testing.md): a representative
subset of the EP, AllToAllvDynamic and fault tests re-run in a subprocess with the GPU launch shapes
(multi-program grids) and the programs of every launch reversed, or shuffled (one seed; three under
``make test-long``; send programs are delayed a little, so that receivers of other rank processes run
before some senders publish)."""

import os
import subprocess
import sys

import pytest

from moe_comm.interpret_order import DELAY_ENV, ORDER_ENV, SEED_ENV
from moe_comm.planner import SHAPES_ENV

from budget import LONG, SWEEP

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)

# Loopback cases (one process, every grid reordered) and one shm case (a process per rank: the delays
# let receivers run before senders publish). Chosen to stay near 45 s a mode on 2 cores.
CASES = (
    "test_ep.py::test_rank_without_tokens_still_waits_in_combine",
    "test_ep.py::test_capacity_overflow_is_clamped_and_reported",
    "test_ep.py::test_two_dispatches_in_flight",
    "test_alltoallv.py::test_lying_device_counts_write_nothing_out_of_bounds",
    "test_faults.py::test_alltoallv_failed_receive_returns_no_partial_counts",
    "test_faults.py::test_an_error_found_while_another_is_pending_is_not_silent",
    "test_faults.py::test_data_error_found_by_a_receive_carries_the_result_and_the_group_goes_on",
    "test_ep_faults.py::test_silent_peer_on_loopback_times_out_naming_it",
    "test_ep_faults.py::test_killed_peer_is_named[combine]",
    "test_formats.py::test_nvfp4_global_scales_that_differ_between_ranks_raise_then_the_next_call_is_exact[ep]",
)
# make test-sweeps: reversed and one shuffle; make test-long (tests/budget.py): reversed and three shuffles.
MODES = [("reverse", 0), ("random", 0), ("random", 1), ("random", 2)] if LONG else [("reverse", 0), ("random", 1)]
RUN_TIMEOUT_S = 600


@SWEEP
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
@pytest.mark.parametrize("order, seed", MODES, ids=[f"{o}-{s}" for o, s in MODES])
def test_subset_under_adversarial_order(order, seed):
    env = dict(os.environ, **{ORDER_ENV: order, SEED_ENV: str(seed), SHAPES_ENV: "gpu"})
    env.pop(DELAY_ENV, None)   # each mode's default: none when reversed, random small sleeps when shuffled
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *CASES],
                          cwd=TESTS, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, f"{order} seed {seed}: {summary}\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}"
    assert f"{len(CASES)} passed" in summary, summary
