"""The suite's time log (``tests/time_log.py``, docs/testing.md "Where the time goes") counts the CPU of
the rank processes a test launches, which ``time make test`` misses (the fork server reaps them)."""

import json
import os
import subprocess
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))

BURNING_TEST = '''
import time
import moe_comm

def _burn(group):
    t = time.process_time()
    while time.process_time() - t < 1.0:
        pass

def _noop(group):
    pass

def test_a_fork_server_starts():
    moe_comm.launch(_noop, 1, backend="shm", timeout_s=20)

def test_b_ranks_burn():
    moe_comm.launch(_burn, 2, backend="shm", timeout_s=20)
'''


@pytest.mark.timeout(120)
def test_the_time_log_counts_rank_processes(tmp_path):
    (tmp_path / "test_burn.py").write_text(BURNING_TEST)
    (tmp_path / "conftest.py").write_text(f"import os, sys\nsys.path.insert(0, {TESTS!r})\n"
                                         "from time_log import register as pytest_configure  # noqa: F401\n")
    log = tmp_path / "times.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_COMM_TEST_TIME_LOG")}
    env["MOE_COMM_TEST_TIME_LOG"] = str(log)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                          str(tmp_path / "test_burn.py")], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=110)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    start, row = [json.loads(line) for line in log.read_text().splitlines()]
    assert start["test"].endswith("::test_a_fork_server_starts") and row["test"].endswith("::test_b_ranks_burn")
    assert 2.0 <= row["ranks"] < 3.0 and row["self"] < 1.0 and row["wall"] >= 1.0, row
