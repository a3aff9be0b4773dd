"""`python -m moe_comm.demo` (the AllToAllvDynamic demo) runs and checks itself."""

import pytest

from moe_comm import demo


@pytest.mark.timeout(120)
def test_demo_runs_and_matches_reference(capsys):
    assert demo.main(["--world", "2", "--calls", "2", "--cap", "3", "--hidden", "64"]) == 0
    out = capsys.readouterr().out
    assert "matches reference" in out and out.count("True") == 2
