"""``bench/timeout_repeats.py`` at small shapes on the CPU (the interpreter): the reproducer of issue 33's
lost CUDA contexts stays runnable, and it can fail. What this shows: every op's timed-out receive names
the peer that skipped the call and the round after ``reset()`` equals the reference, under the
interpreter (one thread per program: it cannot show threads of a program disagreeing, which is what the
GPU run of the same script and ``test_compile_sm90``'s uniformity rule are for)."""

import importlib.util
import os

import pytest

spec = importlib.util.spec_from_file_location(
    "timeout_repeats", os.path.join(os.path.dirname(__file__), "..", "bench", "timeout_repeats.py"))
tr = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tr)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("op", tr.OPS)
def test_every_timed_out_receive_names_the_peer_and_the_next_round_is_exact(op):
    r = tr.run_case(op, timeout_ms=20, repeats=2, shape="small", warps=0, exact_every=1)
    assert r["ok"] == 2 and r["wrong"] == 0 and r["exact_rounds"] == 2 and r["exact_before"], r
    assert tr.verdict(r), r


@pytest.mark.timeout(300)
def test_the_reproducer_sees_a_wrong_outcome(monkeypatch):
    """Controls: a repeat where the skipping rank sends after all (no timeout) counts as wrong, and a
    round whose result differs from the reference is not exact."""
    real_fault = tr.Case.fault

    def both_send(self):
        if self.op == "alltoallv":
            self.bufs[tr.SKIPPER](self._on(self.sends[tr.SKIPPER]), self._on(self.counts[tr.SKIPPER]), phase="send")
        real_fault(self)
        self.bufs[tr.SKIPPER](phase="recv")
    monkeypatch.setattr(tr.Case, "fault", both_send)
    r = tr.run_case("alltoallv", timeout_ms=20, repeats=1, shape="small", warps=0, exact_every=1)
    assert r["wrong"] == 1 and not tr.verdict(r), r
    monkeypatch.setattr(tr.Case, "fault", real_fault)
    real_init = tr.Case.__init__

    def wrong_reference(self, *a, **k):
        real_init(self, *a, **k)
        self.want_a[0][0][1, 0] += 1
    monkeypatch.setattr(tr.Case, "__init__", wrong_reference)
    r = tr.run_case("alltoallv", timeout_ms=20, repeats=1, shape="small", warps=0, exact_every=1)
    assert r["exact_before"] is False and r["inexact_rounds"] == 1 and not tr.verdict(r), r
