"""``moe-comm-decode-bench --profile`` on the GPU: every kernel of a step lands in a part, including the
Triton ones (dispatch, masked expert GEMMs, combine, attention), whose launches the profiler does not
link to their CPU range; that is why the profile attributes kernels by time."""

import json

import pytest

from moe_comm.serving.latency_bench import main
from moe_comm.serving.step_profile import PARTS

pytestmark = pytest.mark.gpu


@pytest.mark.timeout(300)
def test_profile_attributes_every_kernel(tmp_path):
    assert main(["--profile", "--world", "1", "--config", "llama4-scout", "--attention", "triton",
                 "--batches", "4", "--backends", "padded,fused", "--steps", "3", "--warmup", "1",
                 "--out-dir", str(tmp_path)]) == 0
    [jsonl] = tmp_path.glob("decode_profile_*.jsonl")
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    for backend in ("padded", "fused"):
        got = {r["part"]: r["us_per_step"] for r in records if r["backend"] == backend}
        assert all(got[p] > 0 for p in PARTS), (backend, got)  # Scout has a shared expert: every part runs
        assert got["outside"] <= 0.01 * got["step"], (backend, got)
        assert sum(got[p] for p in PARTS) + got["other"] == pytest.approx(got["step"]), (backend, got)
