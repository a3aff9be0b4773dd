"""How long the long-running tests run.

``make test`` (and CI) runs the soak, exclusion, round-trip, shm-matrix and adversarial-order tests at a
size that keeps the suite short on 2 cores; every fault kind, kill point and order mode
is still in it. ``make test-long`` (``MOE_COMM_LONG_TESTS=1``) runs them at full size: longer loops find the rarer
interleavings, they do not test anything the short run leaves out.
"""

import os

LONG_ENV = "MOE_COMM_LONG_TESTS"
LONG = os.environ.get(LONG_ENV) == "1"


def size(short, long):
    """``long`` under ``make test-long``, else ``short`` (a count, or a list of cases)."""
    return long if LONG else short
