"""``make gpu-quick`` (scripts/gpu_quick.py) without a GPU, and the tables scripts/gpu_summary.py publishes.

- The dry run: every step runs its dry form (tiny shapes, Triton's interpreter, the GPU tests collected
  and skipped, the sanitizer case without compute-sanitizer), writes its verdict and JSON lines under
  OUT, every line labelled as not a GPU measurement and carrying device, versions and commit; the
  summary lists every step. What it shows: the commands, their options and the summary still fit the
  scripts they call. What it cannot show: anything about a GPU (timings, compiles, concurrency).
- A step past its budget is killed with its process group (a grandchild included), recorded as cut,
  the next step runs, and the summary is rebuilt after each; a step that would start with less than
  the minimum left of the total is recorded as not run.
- --publish writes README's and docs/benchmarks.md's tables between their markers from run folders.
"""

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LABEL = "dry run, CPU interpreter, not a GPU measurement"
STEPS = ("gpu-tests", "concurrent-ranks", "faults", "sanitizers", "kernels", "kernels-baseline", "kernels-trace",
         "ep-rank", "prefill", "decode", "hf-door", "moe-layer", "cold-start")


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "scripts", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


gpu_quick = _load("gpu_quick")   # puts scripts/ on sys.path, as run from there
import gpu_summary  # noqa: E402
from budget import SWEEP  # noqa: E402


def _jsonl(path):
    with open(path) as f:
        return [json.loads(s) for s in f if s.strip()]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is what a machine without a GPU runs")
@SWEEP
@pytest.mark.timeout(1800)
def test_dry_run_runs_every_step_and_labels_everything(tmp_path):
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("BASELINE", "TRITON_INTERPRET")}
    # budgets x4: a slow shared CI machine must not cut a dry step (the cut itself is tested below)
    proc = subprocess.run([sys.executable, "scripts/gpu_quick.py", str(out), "--budget-s", "1800"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    verdicts = {v["step"]: v for v in _jsonl(out / "verdicts.jsonl")}
    assert tuple(verdicts) == STEPS
    fault_script = os.path.exists(os.path.join(REPO, "bench", "timeout_repeats.py"))
    want = dict.fromkeys(STEPS, "pass") | {"kernels-baseline": "skipped",
                                            "faults": "pass" if fault_script else "missing"}
    assert {s: v["status"] for s, v in verdicts.items()} == want, verdicts
    for name, v in verdicts.items():
        assert v["dry"] and v["label"] == LABEL and v["env"]["commit"] and v["env"]["torch"]
        step_dir = out / f"{v['index']:02d}-{name}"
        assert json.loads((step_dir / "verdict.json").read_text()) == v
        for path in step_dir.rglob("*.jsonl"):   # every JSON row: device, versions, commit
            for row in _jsonl(path):
                env_ = row.get("env", row)
                assert {"device", "torch", "triton", "cuda", "commit"} <= env_.keys(), (path, row)
                assert row.get("dry", True) is True   # labelled where the row says
    assert "0 failed" in verdicts["gpu-tests"]["verdict"] and "skipped" in verdicts["gpu-tests"]["verdict"]
    assert "2/2 steps exact" in verdicts["concurrent-ranks"]["verdict"]
    assert "without compute-sanitizer" in verdicts["sanitizers"]["verdict"]
    door_words = verdicts["hf-door"]["verdict"]
    for words in ("generation: 2/2 equal to transformers' eager (loopback; experts: qwen3_moe fused, qwen3_moe torch)",
                  "loopback world 2 refused (one process per rank)", "B=1 step: door", "B=2 step: door"):
        assert words in door_words, door_words
    door = [r for r in _jsonl(out / "11-hf-door" / "hf_door.jsonl") if r["kind"] == "result"]
    impls = ("grouped_mm", "eager", "moe_comm", "moe_comm-fused")
    assert {(r["impl"], r["what"]) for r in door} == {(i, w) for i in impls for w in ("step", "experts")}
    assert all(r["agrees"] and r["floor_us"] > 0 and r["label"] == LABEL for r in door)
    cold = [r for r in _jsonl(out / "13-cold-start" / "cold_start.jsonl") if r["kind"] == "run"]
    assert [r["case"] for r in cold] == ["cold", "warm", "after-warmup"] and all(r["label"] == LABEL for r in cold)
    summary = (out / "summary.md").read_text()
    assert summary.startswith(f"*** {LABEL} ***") and summary.rstrip().endswith(f"*** {LABEL} ***")
    for name in STEPS:
        assert f"| {name} |" in summary
    data = json.loads((out / "summary.json").read_text())
    assert data["dry"] and [s["status"] for s in data["steps"]] == [want[s] for s in STEPS]


def _context(tmp_path):
    return gpu_quick.Context(out=str(tmp_path), dry=True, python=sys.executable, env=dict(os.environ),
                             baseline=None, baseline_commit=None, nvshmem=False,
                             env_record=dict(device="test", torch="t", triton="y", cuda=None, commit="abc"))


SLOW = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open(sys.argv[1], "w").write(str(child.pid))
print("slow step started", flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:   # a zombie is dead
        return f.read().split()[2] != "Z"


def test_a_step_past_its_budget_is_cut_and_the_run_goes_on(tmp_path):
    ctx = _context(tmp_path)
    pid_file = tmp_path / "grandchild.pid"
    summaries = []

    def step(name, budget, code, *args):
        return gpu_quick.Step(name, budget, f"test step {name}",
                              lambda c, d: [([sys.executable, "-c", code, *args], {}, None)])

    steps = [step("slow", 2, SLOW, str(pid_file)), step("after", 20, "print('after ran')"),
             step("late", 20, "print('never')")]
    original = gpu_quick.rebuild_summary

    def rebuild(out):
        original(out)
        summaries.append((tmp_path / "summary.md").read_text())

    gpu_quick.rebuild_summary = rebuild
    try:
        t0 = time.monotonic()
        # slow is cut at 2 s, after runs 5 s, then less than MIN_STEP_S is left of the total: late is not run
        steps[1].commands = lambda c, d: [([sys.executable, "-c", "import time; time.sleep(5); print('after ran')"],
                                           {}, None)]
        verdicts = gpu_quick.run(steps, ctx, total_s=2 + 5 + gpu_quick.MIN_STEP_S - 1, scale=1.0)
        wall = time.monotonic() - t0
    finally:
        gpu_quick.rebuild_summary = original
    assert [v.status for v in verdicts] == ["cut", "pass", "not-run"]
    assert verdicts[0].rc is None and verdicts[0].wall_s < 2 + gpu_quick.KILL_GRACE_S + 2
    assert "cut at its budget of 2 s" in verdicts[0].verdict
    assert not _alive(int(pid_file.read_text())), "the cut step's grandchild survived"
    assert "slow step started" in (tmp_path / "01-slow" / "step.log").read_text()
    assert "after ran" in (tmp_path / "02-after" / "step.log").read_text()
    assert wall < 30
    # the summary is rebuilt at the start and after every step: pending, then each verdict in turn
    assert len(summaries) == 4
    assert "| 1 | slow | 2 | pending |" in summaries[0] and "| 1 | slow | 2 | cut |" in summaries[1]
    assert "| 2 | after | 20 | pending |" in summaries[1] and "| 2 | after | " in summaries[2]
    assert "| 3 | late | 20 | not-run |" in summaries[3]
    assert [v["status"] for v in _jsonl(tmp_path / "verdicts.jsonl")] == ["cut", "pass", "not-run"]


def test_a_parallel_step_runs_its_commands_at_once(tmp_path):
    ctx = _context(tmp_path)
    cmd = ([sys.executable, "-c", "import time; time.sleep(3); print('slept')"], {}, None)
    step = gpu_quick.Step("both", 20, "two at once", lambda c, d: [cmd, cmd], parallel=True)
    t0 = time.monotonic()
    (v,) = gpu_quick.run([step], ctx, total_s=60, scale=1.0)
    assert v.status == "pass" and time.monotonic() - t0 < 5.5   # one after the other would take 6 s
    for i in (1, 2):
        assert "slept" in (tmp_path / "01-both" / f"step-{i}.log").read_text()


def test_the_hf_door_step_is_missing_without_transformers_and_fails_on_any_failed_check(tmp_path):
    ctx = _context(tmp_path)
    ctx.transformers = False
    got = gpu_quick.hf_door(ctx, str(tmp_path))
    assert isinstance(got, gpu_quick.NotRun) and got.status == "missing" and ".whl/hf" in got.why
    gen = dict(kind="generate", heap="nvshmem", family="qwen3_moe", expert_kernel="masked", ok=True)
    step = dict(kind="result", what="step", batch=1, p50_us=50.0, x_floor=2.0, agrees=True)
    good = [gen, dict(kind="refused", ok=True), dict(step, impl="moe_comm"), dict(step, impl="grouped_mm")]
    bad = {"a generation differs": [dict(gen, ok=False, error="AssertionError")] + good[1:],
           "no refusal": [gen] + good[2:], "the door disagrees": good[:2] + [dict(good[2], agrees=False), good[3]],
           "an error line": good + [dict(kind="error", error="RuntimeError: x")], "no timing": good[:2]}
    for case, rows in {"good": good, **bad}.items():
        (tmp_path / "hf_door.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        ok, words = gpu_quick.judge_hf_door(str(tmp_path), "", 0, False)
        assert ok == (case == "good"), (case, words)
    (tmp_path / "hf_door.jsonl").write_text("".join(json.dumps(r) + "\n" for r in good))
    assert not gpu_quick.judge_hf_door(str(tmp_path), "", 1, False)[0]   # a failed exit status fails the step


def test_budgets_scale_with_the_total():
    assert gpu_quick.scale_for(gpu_quick.TOTAL_S) == pytest.approx(1.0)
    assert gpu_quick.scale_for(360) == pytest.approx(0.8)
    assert sum(s.budget_s for s in gpu_quick.STEPS) >= gpu_quick.TOTAL_S   # the total, not the sum, ends a run
    # a subset gets its share of the total: half the budgets in half the time keep their size
    half = [s for s in gpu_quick.STEPS if s.name in ("gpu-tests", "concurrent-ranks")]
    share = sum(s.budget_s for s in half) / sum(s.budget_s for s in gpu_quick.STEPS)
    assert gpu_quick.scale_for(gpu_quick.TOTAL_S * share, half) == pytest.approx(1.0)


def _kernel_rows(device, commit, dispatch_p50, tag=""):
    env = dict(device=device, torch="2.11.0+cu130", triton="3.6.0", cuda="13.0", commit=commit, tag=tag)
    rows = [dict(kind="floor", op="copy", GBps=3000.0, env=env), dict(kind="floor", op="empty_kernel", p50_us=3.5, env=env)]
    for t in (1, 128):
        for dtype in ("bf16", "fp8"):
            rows.append(dict(kind="result", op="dispatch", impl="moe_comm", dtype=dtype, tokens=t, p50_us=dispatch_p50 * t,
                             p20_us=1.0, p80_us=2.0, x_floor=1.5, GBps=10.0, env=env))
    return rows


def test_publish_writes_both_tables_with_device_and_commit(tmp_path):
    for name in ("README.md", os.path.join("docs", "benchmarks.md")):
        os.makedirs(tmp_path / os.path.dirname(name), exist_ok=True)
        mark = gpu_summary.README_MARK if name == "README.md" else gpu_summary.DOCS_MARK
        (tmp_path / name).write_text(f"before\n<!-- {mark}: begin -->\nold\n<!-- {mark}: end -->\nafter\n")
    os.makedirs(tmp_path / "bench" / "results")
    for run, device, commit, p50 in (("a", "NVIDIA H100 80GB HBM3", "1111111aaaa", 5.0), ("b", "NVIDIA H200", "2222222bbbb", 7.0)):
        d = tmp_path / "bench" / "results" / run
        os.makedirs(d)
        rows = _kernel_rows(device, commit, p50) + _kernel_rows(device, commit, 99.0, tag="trace=on")
        (d / "kernels-x.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "bench" / "results" / "b" / "run.json").write_text(json.dumps(dict(commit="3333333", note="copy")))
    listed = gpu_summary.publish([str(tmp_path / "bench" / "results" / r) for r in ("a", "b")], root=str(tmp_path))
    assert listed == ["bench/results/a", "bench/results/b"]
    readme = (tmp_path / "README.md").read_text()
    assert readme.startswith("before\n") and readme.endswith("after\n") and "\nold\n" not in readme
    assert "| H100 80GB HBM3 · 1111111 | H200 · 3333333 |" in readme    # run.json names b's commit
    assert "| dispatch bf16 | 128 | 640.0 (1.50x) | 896.0 (1.50x) |" in readme   # trace=on rows left out
    assert "3000 GB/s, 3.50 µs" in readme and "docs/benchmarks.md" in readme
    docs = (tmp_path / "docs" / "benchmarks.md").read_text()
    # the README keeps README_ROWS; docs/benchmarks.md has the whole summary, each column's versions, every row
    assert "| dispatch fp8 | 128 |" in docs and "| dispatch fp8 |" not in readme and "(copy)" in docs
    assert "| dispatch bf16 | 128 | 640.0 (1.50x) | 896.0 (1.50x) |" in docs
    rows = [s for s in docs.splitlines() if s.startswith("| NVIDIA")]
    assert len(rows) == 8 and all("2.11.0+cu130 | 3.6.0 | 13.0 |" in s for s in rows)
    assert sum("3333333" in s for s in rows) == 4 and sum("1111111" in s for s in rows) == 4
    # publishing again changes nothing
    gpu_summary.publish([], root=str(tmp_path))
    assert (tmp_path / "README.md").read_text() == readme


def test_the_moe_layer_judge_reads_the_crossover_from_the_data(tmp_path):
    """judge_moe_layer: the crossover of path="auto" from the measured speedups (against FUSED_MAX_TOKENS as
    the tree has it), the T a cut run did not reach, memory skips, and a failed verdict when the fp8-weight
    layer's bits differ from the bf16 fused layer's (same tiles, same dequantized operands)."""
    limit = gpu_quick.fused_max_tokens()
    row = dict(kind="result", shape="dsv3", world=8, p50_us=100.0, x_floor=2.0, max_abs_diff_vs_unfused=0.0)
    speeds = {1: 1.2, 128: 1.05, 512: 0.8}
    rows = [dict(row, impl="fused", tokens=t, speedup_vs_unfused=x) for t, x in speeds.items()]
    rows += [dict(row, impl="fused_fp8", tokens=t, max_abs_diff_vs_fused=0.0, speedup_vs_unfused=2.0) for t in speeds]
    rows += [dict(kind="skip", shape="dsv3", world=8, tokens=512, impl="grouped_mm", why="out of GPU memory (x)")]
    (tmp_path / "moe_layer.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ok, words = gpu_quick.judge_moe_layer(str(tmp_path), "", 0, False)
    assert ok, words
    assert f"crossover between T=128 (fused faster) and T=512 (unfused faster): FUSED_MAX_TOKENS = {limit}" in words
    assert "not measured: T 8,64" in words and "skipped: dsv3 W8 T512 grouped_mm" in words
    rows[3]["max_abs_diff_vs_fused"] = 0.5
    (tmp_path / "moe_layer.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ok, words = gpu_quick.judge_moe_layer(str(tmp_path), "", 0, False)
    assert not ok and "fused_fp8 differs from fused at 1 point" in words
    assert gpu_quick.moe_layer_crossover({1: 1.3, 64: 0.9}) == (
        f"crossover between T=1 (fused faster) and T=64 (unfused faster): FUSED_MAX_TOKENS = {limit} "
        + ("fits it" if 1 <= limit < 64 else "does not (set it in [1, 64))"))
    assert gpu_quick.moe_layer_crossover({1: 1.3, 512: 1.1}).startswith("fused faster at every T measured (up to 512)")
