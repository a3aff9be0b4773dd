"""Eight ranks on one GPU, each on its own stream, every op, exact every step (``concurrent_ranks.py``;
``make gpu-quick`` runs it at 1000 steps). Skipped without CUDA (conftest)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import concurrent_ranks  # noqa: E402
from budget import size  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.timeout(600)
def test_eight_ranks_on_their_own_streams_stay_exact(tmp_path):
    steps = size(100, 1000)
    assert concurrent_ranks.main(["--world", "8", "--steps", str(steps), "--json", str(tmp_path / "r.jsonl")]) == 0


@pytest.mark.timeout(300)
def test_ranks_in_turn_on_one_stream_stay_exact(tmp_path):
    """compute-sanitizer's case (``--in-turn``)."""
    assert concurrent_ranks.main(["--world", "2", "--steps", "5", "--in-turn", "--json", str(tmp_path / "r.jsonl")]) == 0
