"""bench/ptx_profile.py on the world-1 dispatch (DeepSeek-V3 sizes, T = 1, bf16, sm_90 compiled on the
CPU): what one call launches, and how many dependent global loads its programs wait for.

The second test is the CPU-side check of bench/NOTES.md section 22: the copy programs load their block of
x independently of the expert ids (not masked by the routing), and the bookkeeping program reads no word
that depends on the ids (at world 1 no rank's live word). What it cannot show is time: a round trip's
length, and whether ptxas's schedule lets the independent loads overlap, are the GPU's (NOTES 20 counts
the latter separately, "in issue order")."""

import json
import os
import subprocess
import sys

import pytest
from run_once import run_once

pytestmark = pytest.mark.ptx
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COPY, BOOKKEEPING = "t_begin < t_end", "blk == NBLK"   # the kernel's two top-level branches


def _profile():
    out = subprocess.run([sys.executable, "bench/ptx_profile.py", "--tokens", "1", "--dtypes", "bf16", "--json"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return {p["phases"]: p for p in map(json.loads, out.stdout.splitlines())}


@pytest.fixture(scope="module")
def profile(request, tmp_path_factory):
    return run_once(request, tmp_path_factory, "ptx_profile", _profile)


@pytest.mark.timeout(600)
def test_a_world1_dispatch_is_one_launch_and_its_split_form_copies_its_inputs(profile):
    both, split = profile["both"], profile["split"]
    assert [la["kernel"] for la in both["launches"]] == ["dispatch_local_kernel"] and both["torch_ops"] == []
    assert [la["kernel"] for la in split["launches"]] == ["dispatch_local_kernel"]
    assert split["torch_ops"] == ["clone", "clone"]   # x and topk_idx, so that the caller may reuse them


@pytest.mark.timeout(600)
def test_world1_dispatch_programs_wait_for_one_load(profile):
    (la,) = profile["both"]["launches"]
    assert la["grid"] == [2, 7] and la["num_warps"] == 4 and la["spill_store_bytes"] == 0
    copy, books = la["branches"][COPY], la["branches"][BOOKKEEPING]
    assert copy["STG.128"] == 8   # the block's one 16-byte vector per thread, to each of the top-8 rows
    assert copy["dependent_loads_at_last_store"] == 1, copy   # x and the ids: two independent loads
    assert books["dependent_loads_at_last_store"] == 1, books  # the ids; nothing loaded from them
