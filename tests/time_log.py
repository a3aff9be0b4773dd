"""Where the suite's time goes: with MOE_COMM_TEST_TIME_LOG=<file>, one JSON line per test is appended
to <file>: its wall seconds and the CPU seconds of this pytest process (``self``), of the processes it
waited for (``children``: subprocesses such as the compile report or a dry run), and of the rank
processes ``moe_comm.launch`` forked for it (``ranks``, with the fork server's own start in the first
test that launches). Rank processes are children of the fork server,
which reaps them: ``time make test`` never counts them (its user time counts waited-for processes only).
Summary: ``python tests/time_log.py <file>``."""

import json
import os
import resource
import sys
import time

import pytest

TIME_LOG_ENV = "MOE_COMM_TEST_TIME_LOG"
RUN_ENV = "MOE_COMM_TEST_TIME_LOG_RUN"   # the pid of the pytest process that started the logged run


def register(config) -> None:
    """Log the tests of the run started with TIME_LOG_ENV set: in that pytest process, or in its
    pytest-xdist workers; not in a pytest that a test starts (its CPU is its test's ``children``)."""
    if not os.environ.get(TIME_LOG_ENV):
        return
    run = int(os.environ.setdefault(RUN_ENV, str(os.getpid())))
    if os.getpid() == run or (os.getppid() == run and hasattr(config, "workerinput")):
        config.pluginmanager.register(TimeLog(os.environ[TIME_LOG_ENV]), "moe_comm_time_log")


def _fork_server_children_s() -> float:
    """CPU seconds of this process's fork server (its imports, once) and of the rank processes it has
    reaped (0 before it runs)."""
    try:
        from multiprocessing import forkserver  # noqa: PLC0415
        pid = forkserver._forkserver._forkserver_pid
        if not pid:
            return 0.0
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, AttributeError, IndexError):
        return 0.0
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) / os.sysconf("SC_CLK_TCK")   # [c]utime, [c]stime


def _sample():
    own = resource.getrusage(resource.RUSAGE_SELF)
    waited = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (time.monotonic(), own.ru_utime + own.ru_stime, waited.ru_utime + waited.ru_stime,
            _fork_server_children_s())


class TimeLog:
    """The pytest plugin (``register``)."""

    def __init__(self, path: str):
        self.out = open(path, "a")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):   # where the test runs (an xdist worker, or here)
        before = _sample()
        yield
        wall, own, waited, ranks = (round(a - b, 3) for a, b in zip(_sample(), before))
        self.out.write(json.dumps(dict(test=item.nodeid, wall=wall, self=own, children=waited, ranks=ranks)) + "\n")
        self.out.flush()


def summary(path: str, top: int = 15) -> str:
    rows = [json.loads(line) for line in open(path)]
    cpu = {r["test"]: r["self"] + r["children"] + r["ranks"] for r in rows}
    by_file: dict = {}
    for t, c in cpu.items():
        f = t.split("::")[0]
        by_file[f] = by_file.get(f, 0.0) + c
    lines = [f"{len(rows)} tests: {sum(r['wall'] for r in rows) / 60:.1f} test-minutes of wall, "
             f"{sum(cpu.values()) / 60:.1f} CPU-minutes (self {sum(r['self'] for r in rows) / 60:.1f}, "
             f"subprocesses {sum(r['children'] for r in rows) / 60:.1f}, "
             f"rank processes {sum(r['ranks'] for r in rows) / 60:.1f})", "", "CPU seconds by file:"]
    lines += [f"{c:8.1f}  {f}" for f, c in sorted(by_file.items(), key=lambda x: -x[1])[:top]]
    lines += ["", "CPU seconds by test:"]
    lines += [f"{c:8.1f}  {t}" for t, c in sorted(cpu.items(), key=lambda x: -x[1])[:top]]
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(sys.argv[1]))
