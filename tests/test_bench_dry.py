"""bench/kernels.py --dry and scripts/gpu_summary.py run on a CPU and write what they promise.

The dry run's numbers mean nothing (Triton's interpreter); what is checked is the script logic: every
section runs, every line is valid JSON carrying the dry-run label and the environment, a PNG is drawn,
and the summary reads it all back, with the targets judged from synthetic lines.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from budget import SWEEP

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LABEL = "dry run, CPU interpreter, not a GPU measurement"


def _run(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


@SWEEP
@pytest.mark.skipif(torch.cuda.is_available(), reason="--dry is for machines without a GPU")
def test_kernels_dry_run_writes_labelled_lines_png_and_summary(tmp_path):
    proc = _run("bench/kernels.py", "--dry", "--out-dir", str(tmp_path), "--a2a-rows", "1,3", "--tokens", "0,3",
                "--sections", "floor,a2a,ep,ep_emulated,ep_rank,permute,nccl,vdev", "--rank-worlds", "4",
                "--rank-tokens", "3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count(LABEL) == 2  # first and last line of the console output
    (jsonl,) = tmp_path.glob("kernels-dry-*.jsonl")
    assert (tmp_path / (jsonl.stem + ".png")).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = [json.loads(s) for s in jsonl.read_text().splitlines()]
    assert all(r["dry"] and r["label"] == LABEL and r["env"]["commit"] for r in lines)
    assert {r["op"] for r in lines if r["kind"] == "floor"} == {"copy", "empty_kernel"}
    results = [r for r in lines if r["kind"] == "result"]
    got = {(r["op"], r["impl"], r["dtype"]) for r in results}
    assert {("alltoallv", "moe_comm", "bf16"), ("alltoallv", "gloo_host_splits", "bf16"),
            ("dispatch", "torch_permute", "fp8"), ("combine", "torch_unpermute", "bf16"),
            ("dispatch", "moe_comm_emulated_w2", "fp8"), ("combine", "moe_comm_emulated_w2", "bf16"),
            ("dispatch", "moe_comm_emulated_w2_concurrent", "fp8"),
            ("combine", "moe_comm_emulated_w2_concurrent", "bf16"), ("dispatch", "moe_comm_split_phases", "fp8")} <= got
    # world 1: one call per op (phase="both") on the loopback heap too; the split dispatch on its own line
    assert {r["phases"] for r in results if r["impl"] == "moe_comm" and r["op"] != "alltoallv"} == {"both"}
    # ep_rank: one real rank of EP4, both routings, the peer emulator on lines of its own
    for kind in ("uniform", "skewed"):
        assert {("dispatch", f"moe_comm_rank_w4_{kind}", "bf16"), ("dispatch", f"moe_comm_rank_w4_{kind}", "fp8"),
                ("combine", f"moe_comm_rank_w4_{kind}", "bf16"), ("dispatch", f"peer_emulator_w4_{kind}", "fp8"),
                ("combine", f"peer_emulator_w4_{kind}", "bf16")} <= got
    for r in results:
        if r["impl"].startswith("moe_comm_rank_"):
            assert r["p50_us"] == pytest.approx(r["total_p50_us"] - r["emulator_p50_us"])
            assert r["world"] == 4 and r["rank"] == 2 and r["bytes"] > 0
    for r in results:
        assert r["p20_us"] <= r["p50_us"] <= r["p80_us"] and r["floor_us"] > 0 and r["bytes"] >= 0
    assert any(r["kind"] == "skip" and r["impl"] == "torch_symm_mem_vdev" for r in lines)
    assert not any(r["kind"] == "error" for r in lines)

    (tmp_path / "pytest-gpu.xml").write_text(
        '<testsuites><testsuite name="pytest" tests="2" failures="0" errors="0" skipped="2" time="0.1">'
        '<testcase classname="tests.gpu.test_gpu_ep" name="test_soak_10000_steps_dispatch_combine">'
        '<skipped message="needs CUDA"/></testcase>'
        '<testcase classname="tests.gpu.test_gpu_ep" name="test_world1_nvshmem"><skipped/></testcase>'
        '</testsuite></testsuites>')
    summary = _run("scripts/gpu_summary.py", str(tmp_path), "--markdown", str(tmp_path / "summary.md"))
    assert summary.returncode == 0, summary.stderr
    text = summary.stdout
    assert text.startswith(f"*** {LABEL} ***") and text.rstrip().endswith(f"*** {LABEL} ***")
    assert "tests: 0 passed, 0 failed, 0 errors, 2 skipped" in text
    assert "alltoallv moe_comm" in text and "soak: test_soak_10000_steps_dispatch_combine skipped" in text
    assert (tmp_path / "summary.md").read_text().startswith("```\n")


def test_kernels_host_cost_prints_every_op_at_both_worlds(tmp_path):
    """--host: every op's dispatch and combine at world 1 and loopback world 8, p10 <= p50 <= p90, and the
    output says what is stubbed and what is measured (tiny sizes: the script's logic, not its figures)."""
    proc = _run("bench/kernels.py", "--host", "--out-dir", str(tmp_path), "--iters", "4", "--warmup", "1",
                "--hidden", "128", "--experts", "8", "--topk", "2", "--tokens", "3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "stubbed: Triton's launch" in proc.stdout and "measured: everything else" in proc.stdout
    (jsonl,) = tmp_path.glob("kernels-host-*.jsonl")
    lines = [json.loads(s) for s in jsonl.read_text().splitlines()]
    want = {(op, call, world) for world in (1, 8) for op, calls in (
        ("EPBuffer", ("dispatch", "combine")), ("AllToAllvDynamic", ("forward", "combine")),
        ("PrefillBuffer", ("dispatch", "combine"))) for call in calls}
    assert {(r["op"], r["call"], r["world"]) for r in lines} == want and len(lines) == len(want)
    for r in lines:
        assert r["kind"] == "host" and r["stubbed"] and r["measured"] and r["env"]["commit"]
        assert 0 < r["p10_us"] <= r["p50_us"] <= r["p90_us"] and r["samples"] == 4 * r["world"]
        assert r["reference_p50_us"] > 0 and r["p50_ref"] == pytest.approx(r["p50_us"] / r["reference_p50_us"])
        assert f"{r['op']:<18} {r['call']:<9} {r['world']:>5}" in proc.stdout


@pytest.mark.parametrize("world,op", [(1, "EPBuffer"), (8, "PrefillBuffer")])
def test_host_instructions_drives_the_calls_it_counts(world, op):
    """bench/host_instructions.py's child (what runs under callgrind) makes the calls of ``op`` it says
    it counts; here without valgrind (the count itself needs it: ~1.5 min per op and world)."""
    proc = _run("bench/host_instructions.py", "--child", str(world), op, "3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    wrong = _run("bench/host_instructions.py", "--child", str(world), op + "x", "3")
    assert wrong.returncode != 0 and "unknown op" in wrong.stderr
    import bench.host_instructions as hi   # noqa: PLC0415
    assert hi.SIZES == dict(hidden=7168, experts=256, topk=8, tokens=16)   # kernels.py --host's sizes


def test_summary_judges_targets(tmp_path):
    env = {"device": "test", "torch": "x", "triton": "y", "nvshmem4py": None, "commit": "abc"}

    def res(op, impl, dtype, p50, floor, **size):
        return dict(kind="result", op=op, impl=impl, dtype=dtype, p50_us=p50, floor_us=floor,
                    x_floor=p50 / floor, dry=False, env=env, **size)
    lines = [res("dispatch", "moe_comm", "bf16", 12.0, 10.0, tokens=128),
             res("combine", "moe_comm", "bf16", 16.0, 10.0, tokens=128),
             res("alltoallv", "moe_comm", "bf16", 10.0, 5.0, rows=8),
             res("alltoallv", "nccl_host_splits", "bf16", 100.0, 5.0, rows=8),
             res("alltoallv", "torch_symm_mem_vdev", "bf16", 12.0, 5.0, rows=8)]
    (tmp_path / "kernels-x.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    # Decode: fused 50 % below sync at batch 1 and 64 and never slower; dynamic only 10 % below at 64 and
    # slower than padded at 256.
    step = {("sync", 1): 100, ("padded", 1): 60, ("fused", 1): 50, ("dynamic", 1): 55,
            ("sync", 64): 200, ("padded", 64): 150, ("fused", 64): 100, ("dynamic", 64): 180,
            ("sync", 256): 400, ("padded", 256): 300, ("fused", 256): 290, ("dynamic", 256): 310}
    dec = [dict(config="deepseek-v3", world=1, heap="nvshmem", expert_impl="masked", backend=b, batch_per_rank=n,
                us_p50=us, device="test") for (b, n), us in step.items()]
    (tmp_path / "decode_latency_x.jsonl").write_text("\n".join(json.dumps(r) for r in dec) + "\n")
    text = _run("scripts/gpu_summary.py", str(tmp_path)).stdout
    assert "PASS  decode fused vs sync (deepseek-v3 w1 masked): least 50.0 % at batch 1" in text
    assert "PASS  decode fused never slower than sync/padded (deepseek-v3 w1 masked)" in text
    assert "MISS  decode dynamic vs sync (deepseek-v3 w1 masked): least 10.0 % at batch 64" in text
    assert ("MISS  decode dynamic never slower than sync/padded (deepseek-v3 w1 masked): "
            "slower at batch 64 (padded), 256 (padded)") in text
    assert "deepseek-v3 world 1 nvshmem heap, masked expert GEMMs" in text
    assert "PASS  dispatch bf16 T=128" in text and "1.20x" in text
    assert "MISS  combine bf16 T=128" in text
    assert "PASS  alltoallv vs nccl_host_splits: speedup 8r 10.00x" in text
    assert "MISS  alltoallv vs torch_symm_mem_vdev: speedup 8r 1.20x" in text
    assert "n/a   dispatch fp8 T=128" in text and "tests: no junit XML found" in text
    assert LABEL not in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="--dry is for machines without a GPU")
@pytest.mark.timeout(300)
def test_dispatch_ab_dry_run_times_a_checkout_both_ways(tmp_path):
    """bench/dispatch_ab.py (the before/after of NOTES section 22) in its dry run: a checkout given as
    LABEL=PATH runs in its own process, and its dispatch is timed as one call and split into phases."""
    proc = _run("bench/dispatch_ab.py", "--dry", "--checkout", f"this={REPO}", "--tokens", "1", "--out-dir",
                str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (jsonl,) = tmp_path.glob("dispatch-ab-dry-*.jsonl")
    lines = [json.loads(s) for s in jsonl.read_text().splitlines()]
    assert all(r["dry"] and r["label"] == LABEL for r in lines)
    got = {(r["impl"], r["dtype"], r["phases"]) for r in lines if r["kind"] == "result"}
    assert got == {(impl, dtype, phases) for dtype in ("bf16", "fp8") for impl, phases in
                   (("this", "both"), ("this split", "split"))}


def test_world1_ops_are_timed_as_one_call_on_every_heap():
    """A world-1 op is driven as its users call it, phase="both", also on the loopback heap (the fallback
    without nvshmem4py): split into phases, a world-1 dispatch is another call (its send copies x and
    topk_idx), which is what the H200 run at dd5c2bc timed (bench/NOTES.md section 22). A loopback
    world of several ranks is still driven phase by phase."""
    import moe_comm  # noqa: PLC0415
    from bench import kernels  # noqa: PLC0415
    phases = []

    def op(*args, phase="both"):
        phases.append((phase, args))
    for world, want in ((1, [("both", (1, 2))]), (2, [("send", (1, 2)), ("recv", (None, None))])):
        groups = moe_comm.init("loopback", world_size=world, device=torch.device("cpu"))
        phases.clear()
        kernels.drive(op, groups[0], 1, 2)
        assert phases == want, world
        for g in groups:
            g.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="--dry is for machines without a GPU")
@pytest.mark.timeout(300)
def test_kernels_dry_prefill_section(tmp_path):
    """The prefill section alone (one timed round per point): dispatch bf16 / fp8 and combine lines of an
    emulated world 2, checked against the routing inside the script; link bytes are the plan's: the
    combine moves the floor pairs' rows exactly, the dispatch those plus ids, weights and control words."""
    proc = _run("bench/kernels.py", "--dry", "--out-dir", str(tmp_path), "--sections", "prefill", "--iters", "1",
                "--warmup", "0")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (jsonl,) = tmp_path.glob("kernels-dry-*.jsonl")
    lines = [json.loads(s) for s in jsonl.read_text().splitlines()]
    results = [r for r in lines if r["kind"] == "result"]
    assert {(r["op"], r["dtype"]) for r in results} == {
        ("prefill_dispatch", "bf16"), ("prefill_dispatch", "fp8"), ("prefill_combine", "bf16")}
    assert all(r["dry"] and r["impl"] == "moe_comm_emulated_w2" and r["world"] == 2 for r in results)
    row = 2 * 256   # --hidden 256 in bf16
    for r in results:
        assert r["floor_pairs"] > 0 and r["hbm_bytes"] > r["bytes"] > 0 and r["floor_us"] > 0
        if r["op"] == "prefill_combine":
            assert r["bytes"] == r["floor_pairs"] * row
        elif r["dtype"] == "bf16":
            assert r["bytes"] > r["floor_pairs"] * row


# ---- decode benchmark: the fair baselines, --emulate-ep, the counters, the report ----------------------

def _dist_free_group():
    import moe_comm  # noqa: PLC0415
    g = moe_comm.init("loopback", world_size=1, device=torch.device("cpu"))
    return g[0] if isinstance(g, list) else g


def test_padded_capacity_is_the_buckets_own_at_world_1():
    from moe_comm.serving import make_comms, model_config  # noqa: PLC0415
    cfg = model_config("deepseek-v3", "cpu")
    (padded,) = make_comms("padded", [_dist_free_group()], cfg, 256)
    assert [padded.bucket_capacity(t) for t in (1, 8, 256)] == [8, 64, 2048]  # T x min(K, E_local)
    (emu,) = make_comms("padded", [_dist_free_group()], cfg, 256, emulate_ep=8)
    # one rank of EP8: 32 local experts; two of a token's experts may share one, so T x K rows
    assert emu.experts_per_rank == 32 and emu.world == 8 and emu.inner.bucket_capacity(4) == 32


def test_wire_bytes_follow_each_backends_message_format():
    """Bytes to other ranks for a hand-made routing of 2 tokens, EP4 with 4 experts per rank (16
    experts, top-3): token 0 -> experts 0, 1 (rank 0 = self) and 5 (rank 1); token 1 -> 4, 6 (rank 1)
    and 15 (rank 3); slot -1 in neither."""
    from types import SimpleNamespace  # noqa: PLC0415

    from moe_comm.serving.step_profile import comm_wire_bytes  # noqa: PLC0415
    idx = torch.tensor([[0, 1, 5], [4, 6, 15]])
    row = 8 * 4  # hidden 8, float32
    base = dict(world=4, experts_per_rank=4, hidden=8, dtype=torch.float32, rank=0, max_tokens=2)
    c = lambda name: SimpleNamespace(name=name, **base)  # noqa: E731
    remote_pairs = 4  # (0, 5), (1, 4), (1, 6), (1, 15)
    assert comm_wire_bytes(c("sync"), idx) == remote_pairs * (row + 8) + remote_pairs * row
    assert comm_wire_bytes(c("sync-graphed"), idx) == comm_wire_bytes(c("sync"), idx)
    assert comm_wire_bytes(c("dynamic"), idx) == 2 * remote_pairs * (row + 4)
    # fused: token 0 crosses to rank 1 once, token 1 to ranks 1 and 3: 3 rows with 3 ids each
    assert comm_wire_bytes(c("fused"), idx) == 3 * (row + 4 * 3) + remote_pairs * row
    # padded at world 4: 3 peers x the largest bucket's capacity (2 tokens x min(3, 4)) both ways
    assert comm_wire_bytes(c("padded"), idx) == 3 * 6 * ((row + 8) + row)


@pytest.mark.timeout(120)
def test_counters_host_syncs_launches_and_graph_mode():
    from moe_comm.serving import make_comms, model_config  # noqa: PLC0415
    from moe_comm.serving.engine import DecodeEngine  # noqa: PLC0415
    from moe_comm.serving.model import MoEDecoder  # noqa: PLC0415
    from moe_comm.serving.piecewise import PiecewiseEngine  # noqa: PLC0415
    from moe_comm.serving.step_profile import count_step  # noqa: PLC0415
    from moe_comm.serving.weights import build_weights  # noqa: PLC0415
    cfg = model_config("mixtral", "cpu")  # 2 layers
    w = build_weights(cfg)
    got = {}
    for name in ("sync", "sync-graphed", "padded", "fused"):
        (comm,) = make_comms(name, [_dist_free_group()], cfg, 2)
        pw = getattr(comm, "piecewise", False)
        model = MoEDecoder(w, comm, 2, phased=pw)
        got[name] = count_step(PiecewiseEngine([model]) if pw else DecodeEngine([model]), 2)
        comm.close()
    # sync reads the send counts and the received counts on the host: 2 per layer, either way
    assert got["sync"]["host_reads"] == got["sync-graphed"]["host_reads"] == 2 * cfg.num_layers
    assert got["padded"]["host_reads"] == got["fused"]["host_reads"] == 0
    assert got["fused"]["triton_launches"] == 2 * cfg.num_layers  # world 1: one kernel per op
    assert got["sync"]["triton_launches"] == 0 and got["sync"]["aten_launches"] > 0
    assert {k: v["gpu_graphs"] for k, v in got.items()} == {
        "sync": "eager", "sync-graphed": "piecewise", "padded": "graph", "fused": "graph"}
    assert all(v["wire_bytes"] == 0 for v in got.values())  # world 1: nothing leaves the rank


@pytest.mark.timeout(180)
def test_emulate_ep_dry_run(tmp_path, capsys):
    """--emulate-ep 8 on the CPU, DeepSeek-V3 routing (top-8 of 256): the torch baselines end to end
    against the tiled reference, labelled, with bytes counted (sync: the counters test; fused: the next test)."""
    import json  # noqa: PLC0415

    from moe_comm.serving.latency_bench import main  # noqa: PLC0415
    backends = "sync-graphed,padded"
    assert main(["--config", "deepseek-v3", "--emulate-ep", "8", "--heap", "loopback", "--batches", "2",
                 "--backends", backends,
                 "--steps", "1", "--warmup", "0", "--check-steps", "1", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "reference check passed" in out and "one rank of EP8 EMULATED" in out
    assert "harness check" in out and out.index("host syncs") < out.index("harness check")
    [jsonl] = tmp_path.glob("decode_latency_deepseek-v3_cpu_ep8emu_*.jsonl")
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert {r["backend"] for r in records} == set(backends.split(","))
    by = {r["backend"]: r for r in records}
    assert all(r["emulate_ep"] == 8 and r["emulated"] and r["world"] == 1 for r in records)
    # mirrors of 7 peers: bytes leave the rank; padding sends more
    assert 0 < by["sync-graphed"]["step_wire_bytes"] < by["padded"]["step_wire_bytes"]
    assert by["sync-graphed"]["graphs"] == "eager" and by["sync-graphed"]["step_host_reads"] == 2 * records[0]["layers"]
    assert by["padded"]["step_host_reads"] == 0


@pytest.mark.timeout(180)
def test_emulated_rank_fused_matches_tiled_reference():
    """One rank of EP8 with the fused backend: experts [0, 32) only, top-8 of 256 (tokens often map two
    experts to one local expert); greedy decoding equals the reference in which expert e is local e mod 32."""
    from moe_comm.serving import (DecodeEngine, MoEDecoder, ReferenceModel, Request, build_weights,  # noqa: PLC0415
                                  check_generation, make_comms, model_config)
    from moe_comm.serving.backends import tiled_reference_weights  # noqa: PLC0415
    cfg = model_config("deepseek-v3", "cpu")
    share = build_weights(cfg, experts=(0, 32))
    (comm,) = make_comms("fused", [_dist_free_group()], cfg, 2, emulate_ep=8)
    engine = DecodeEngine([MoEDecoder(share, comm, 2)])
    reqs = [Request([3, 7, 11], 2), Request([5], 2)]
    [gens] = engine.generate([reqs], record_logits=True)
    ref = ReferenceModel(tiled_reference_weights(share, cfg.num_experts), "torch")
    for q, g in zip(reqs, gens):
        assert check_generation(ref, q, g, 1e-4, "fused EP8 emulated") < 1e-4
    # and the tiling is what makes it pass: the untiled reference (all 256 distinct experts) differs
    full = ReferenceModel(build_weights(cfg), "torch")
    assert not torch.allclose(full.logits(reqs[0].prompt), ref.logits(reqs[0].prompt), atol=1e-3)
    comm.close()


def test_savings_and_attribution_arithmetic():
    from moe_comm.serving.bench_report import attribution, format_savings, latest_profile, savings  # noqa: PLC0415
    recs = [dict(backend=b, batch_per_rank=1, us_p50=us) for b, us in
            (("sync", 1000.0), ("sync-graphed", 400.0), ("padded", 500.0), ("fused", 300.0))]
    rows = savings(recs, ["sync", "sync-graphed", "padded", "fused"], [1])
    pct = {(r["backend"], r["baseline"]): r["pct"] for r in rows}
    assert pct[("fused", "sync")] == pytest.approx(70.0) and pct[("fused", "sync-graphed")] == pytest.approx(25.0)
    assert pct[("sync-graphed", "sync")] == pytest.approx(60.0) and ("sync", "sync") not in pct
    assert "vs sync-graphed" in format_savings(rows, ["sync", "sync-graphed", "padded", "fused"], [1])
    prof = latest_profile([dict(bench="decode_profile", backend=b, batch_per_rank=1, part=p, us_per_step=us)
                           for b, p, us in (("sync", "dispatch", 60.0), ("sync", "combine", 40.0),
                                            ("fused", "dispatch", 7.0), ("fused", "combine", 3.0),
                                            ("sync", "dispatch", 70.0))])  # the last line wins
    [fused] = [r for r in attribution(recs, prof, "sync") if r["backend"] == "fused"]
    assert fused["saved_us"] == 700.0 and fused["communication_us"] == 100.0 and fused["graphs_us"] == 600.0
    assert all(r["backend"] == "fused" for r in attribution(recs, prof, "sync"))  # others have no profile


def test_committed_gpu_results_are_labelled():
    from moe_comm.serving.latency_bench import committed_gpu_results  # noqa: PLC0415
    text = committed_gpu_results("llama4-scout")
    assert "NVIDIA H100" in text and "commit " in text and "fused vs sync" in text
    assert "predate the sync-graphed baseline" in text
    assert "none under" in committed_gpu_results("no-such-config")


@pytest.mark.timeout(120)
def test_decode_bench_without_the_bench_extra(tmp_path, monkeypatch, capsys):
    """Without tqdm and matplotlib the bench says which extra to install and runs without them."""
    import importlib.util  # noqa: PLC0415

    from moe_comm.serving import latency_bench  # noqa: PLC0415
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("tqdm", "matplotlib") else real(name, *a))
    monkeypatch.setitem(__import__("sys").modules, "tqdm", None)  # import tqdm -> ImportError
    assert latency_bench.main(["--config", "mixtral", "--world", "1", "--heap", "loopback", "--batches", "1",
                               "--backends", "sync",
                               "--steps", "1", "--warmup", "0", "--check-steps", "1",
                               "--out-dir", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "moe-comm[bench]" in err and "tqdm, matplotlib" in err
    assert not list(tmp_path.glob("*.png")) and list(tmp_path.glob("*.jsonl"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="piecewise CUDA graph capture needs CUDA")
def test_sync_graphed_piecewise_graphs_equal_eager_on_gpu():
    """sync-graphed replayed as piecewise CUDA graphs gives the tokens and logits of the same pieces run
    eagerly, and of sync; the graphs really are used (pieces per step recorded)."""
    import torch.distributed as dist  # noqa: PLC0415

    import moe_comm  # noqa: PLC0415
    from moe_comm.serving import MoEDecoder, Request, build_weights, make_comms, model_config  # noqa: PLC0415
    from moe_comm.serving.engine import DecodeEngine  # noqa: PLC0415
    from moe_comm.serving.piecewise import PiecewiseEngine  # noqa: PLC0415
    dev = torch.device("cuda", 0)
    cfg = model_config("mixtral", "cpu", dtype=torch.float32)  # small widths, on the GPU
    w = build_weights(cfg, dev)
    reqs = [Request([3, 1, 4], 4), Request([1, 5], 3)]
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1, device_id=dev)
    try:
        with moe_comm.init("nvshmem") as group:
            outs = {}
            for label, graphs in (("eager", False), ("graphs", True), ("sync", None)):
                (comm,) = make_comms("sync" if graphs is None else "sync-graphed", [group], cfg, 2)
                if graphs is None:
                    engine = DecodeEngine([MoEDecoder(w, comm, 2)])
                else:
                    engine = PiecewiseEngine([MoEDecoder(w, comm, 2, phased=True)], use_graphs=graphs)
                [gens] = engine.generate([reqs], record_logits=True)
                outs[label] = gens
                if graphs:
                    assert engine.pieces_per_step[0] == 2 * cfg.num_layers + 1
            for a, b, c in zip(outs["eager"], outs["graphs"], outs["sync"]):
                assert a.tokens == b.tokens == c.tokens
                torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=0)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(240)
def test_cpu_runs_are_labelled_and_counted_in_their_file(tmp_path, capsys):
    """Two CPU runs into one --out-dir: every JSON line carries its run; the second run says the file holds
    two and that its PNG shows it; how this run ran (eager) and how a GPU would run the step are separate
    fields and columns, never contradicting each other."""
    import json  # noqa: PLC0415

    from moe_comm.serving.latency_bench import main  # noqa: PLC0415
    from moe_comm.serving.step_profile import GRAPH_MODES  # noqa: PLC0415
    args = ["--config", "mixtral", "--world", "1", "--heap", "loopback", "--batches", "1", "--backends", "sync,fused",
            "--steps", "1", "--warmup", "0", "--check-steps", "1", "--out-dir", str(tmp_path)]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    second = capsys.readouterr().out
    [jsonl] = tmp_path.glob("*.jsonl")
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert len(records) == 4 and len({r["run"] for r in records}) == 2
    assert "of 2 runs" not in first and "(the latest of 2 runs in" in second and "plot of this run" in second
    assert all(r["graphs"] == "eager" and r["cuda_graphs"] is False for r in records)
    assert {r["backend"]: r["step_gpu_graphs"] for r in records} == {"sync": "eager", "fused": "graph"}
    assert "every step eager (no CUDA graphs on a CPU)" in second and "on a GPU the step runs" in second
    assert GRAPH_MODES["graph"] in second and "one CUDA graph" not in second.split("on a GPU the step runs")[0]
    assert len(list(tmp_path.glob("*.png"))) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="--dry is for machines without a GPU")
@pytest.mark.timeout(300)
def test_moe_layer_dry_writes_each_impl_with_its_speedup_and_the_fp8_bits(tmp_path):
    """bench/moe_layer.py --dry at world 2: one labelled line per implementation, unfused timed first so every
    line carries its speedup, fused_fp8's difference from fused (0: the same tiles on the same dequantized
    operands)."""
    proc = _run("bench/moe_layer.py", "--dry", "--shapes", "dsv3", "--worlds", "2", "--tokens", "1", "--iters", "1",
                "--warmup", "0", "--out-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(s) for s in open(tmp_path / "moe_layer.jsonl")]
    res = {r["impl"]: r for r in rows if r["kind"] == "result"}
    assert list(res) == ["unfused", "fused", "grouped_mm", "fused_fp8"]
    assert all(r["dry"] and r["speedup_vs_unfused"] > 0 and r["max_abs_diff_vs_unfused"] is not None for r in res.values())
    assert res["fused"]["max_abs_diff_vs_unfused"] == 0.0 and res["fused_fp8"]["max_abs_diff_vs_fused"] == 0.0
    assert res["fused"]["streams"] == "one (ranks in turn)"
