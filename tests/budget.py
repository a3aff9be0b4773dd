"""How much of the suite a command runs, and how long the long-running tests run.

- ``make test``: every behaviour at its representative cases, the soak-like tests at a size that keeps
  the suite short on 2 cores (every fault kind, kill point and order mode is still in them).
- ``make test-sweeps`` (CI runs it after ``make test``): the tests marked ``sweep``, variants of tests
  ``make test`` runs: the other worlds and node layouts, the GPU launch shapes at world 3 and over puts,
  the program-order and ``TRITON_INTERPRET`` re-runs, the randomized soaks, the decode benchmark under
  torchrun, and the whole dry runs of the GPU scripts (``scripts/gpu_quick.py``, ``bench/kernels.py``).
  A sweep finds what a representative case misses only when the bug depends on the variant.
- ``make test-long`` (``MOE_COMM_LONG_TESTS=1``): both, with the soak, exclusion, round-trip and order tests at
  full size: longer loops find the rarer interleavings, they do not test anything the short run leaves out.
"""

import os

import pytest

LONG_ENV = "MOE_COMM_LONG_TESTS"
LONG = os.environ.get(LONG_ENV) == "1"
SWEEP = pytest.mark.sweep   # `make test` deselects it (-m "not sweep"); `make test-sweeps` runs only it


def size(short, long):
    """``long`` under ``make test-long``, else ``short`` (a count, or a list of cases)."""
    return long if LONG else short


def sweep(*values, id=None):
    """One parametrize case that runs under ``make test-sweeps`` (and ``make test-long``), not ``make test``."""
    return pytest.param(*values, marks=SWEEP, id=id)
