"""`python -m moe_comm.demo` (the AllToAllvDynamic demo) runs and checks itself."""

import pytest

from moe_comm import demo


@pytest.mark.timeout(120)
def test_demo_runs_and_matches_reference(capsys):
    assert demo.main(["--world", "2", "--calls", "2", "--cap", "3", "--hidden", "64"]) == 0
    out = capsys.readouterr().out
    assert "matches reference" in out and out.count("True") == 2


@pytest.mark.timeout(300)
def test_generate_runs_a_transformers_model_through_moe_comm(capsys):
    """`python -m moe_comm generate` (what `make demo` runs after the decode benchmark): a tiny transformers
    Qwen3-MoE on 2 ranks, prompts through the PrefillBuffer, decode steps through the EPBuffer, every token
    beside transformers' own."""
    pytest.importorskip("transformers")
    from moe_comm.__main__ import main  # noqa: PLC0415
    assert main(["generate", "--new-tokens", "3", "--layers", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("identical") == 3 + 1 and "DIFFERENT" not in out, out   # 3 prompts, then the summary
    assert "1 prefill-size" in out and "2 decode-size" in out, out
