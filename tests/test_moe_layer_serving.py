"""The MoE layer as the DecodeEngine's backend (``fused-layer``: moe_comm.serving.backends.FusedLayerEP): greedy
decoding equals the single-process reference model, as every other backend's (tests/test_serving.py's
tolerance: float32 logits within 1e-4 of the reference relative to the largest, every token equal)."""

import pytest

import moe_comm

from budget import sweep
from test_serving import _assert_matches_reference, _serve, _serve_rank


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, sweep(1), sweep(4)])
def test_engine_on_the_layer_matches_the_reference_loopback(world):
    """Every rank in one process, the layer's three phases driven in lockstep; prefill chunks and decode
    steps (buckets 1, 2, 4, a rank with no requests at T = 0) all through the layer."""
    groups = moe_comm.init(backend="loopback", world_size=world)
    per_backend = _serve(groups, "llama4-scout", ["fused-layer"])
    _assert_matches_reference("llama4-scout", world, per_backend, list(range(world)))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [sweep(2)])
def test_engine_on_the_layer_matches_the_reference_in_rank_processes(world):
    results = moe_comm.launch(_serve_rank, world, "mixtral", ["fused-layer"], backend="shm", timeout_s=120)
    _assert_matches_reference("mixtral", world, {"fused-layer": [r["fused-layer"][0] for r in results]},
                              list(range(world)))


@pytest.mark.timeout(300)
def test_the_layer_benchmark_dry_run(tmp_path):
    """bench/moe_layer.py without a GPU (the gpu-quick step's dry form): every implementation runs at world 1
    and 2, the lines carry the floor and the speedup, and fused (bf16 and fp8 weights) equals unfused bit
    for bit; the fp8 layer's floor is below the bf16 one's (half the weight bytes)."""
    import json  # noqa: PLC0415
    import os  # noqa: PLC0415
    import sys  # noqa: PLC0415
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench.moe_layer import main  # noqa: PLC0415
    assert main(["--dry", "--shapes", "dsv3", "--worlds", "1,2", "--tokens", "1", "--iters", "1", "--warmup", "0",
                 "--out-dir", str(tmp_path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "moe_layer.jsonl").read_text().splitlines()]
    res = [r for r in rows if r["kind"] == "result"]
    impls = ("fused", "fused_fp8", "unfused", "grouped_mm")
    assert {(r["impl"], r["world"]) for r in res} == {(i, w) for i in impls for w in (1, 2)}
    for r in res:
        assert r["dry"] and r["floor_us"] > 0 and r["speedup_vs_unfused"] > 0 and r["env"]["commit"]
        if r["impl"] in ("fused", "fused_fp8"):
            assert r["max_abs_diff_vs_unfused"] == 0.0
    floor = {(r["impl"], r["world"]): r["floor_us"] for r in res}
    assert all(floor[("fused_fp8", w)] < floor[("fused", w)] for w in (1, 2))
