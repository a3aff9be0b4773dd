"""``moe_comm warmup`` fills Triton's cache so that another process compiles nothing, and the cache keys it
relies on are the same in every process (``moe_comm/jit_keys.py``).

On a CPU nothing can launch a compiled kernel, so "a second serving process" is emulated: it drives the
same ops with the same launch arguments as ``warmup`` records, but compiles each variant itself, with the
launch's own tensors, through ``JITFunction.run(..., warmup=True)`` (the call a launch makes, minus the
launch) for sm_90, and the Triton cache directory is counted before and after it. What this shows: the
variants ``warmup`` compiles in its worker processes (from recorded argument types) have exactly the
keys of the ones a process driving the ops computes. What it cannot show: that a real launch on a GPU
computes the same keys (the ops on CUDA tensors and the nvshmem heap, not CPU tensors with the CUDA
plans); ``make gpu-quick`` checks that on a GPU (its cold-start step: a serving process after
``warmup`` adds no entry to the cache).
"""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--world", "1", "--experts", "8", "--hidden", "128", "--topk", "2", "--max-tokens", "3"]

# A process that compiles what its ops launch (not from warmup's records): the emulated serving process.
SERVING = """
import json, sys
from moe_comm import warmup as w
cfg = w.WarmupConfig(world=1, num_experts=8, hidden=128, topk=2, max_tokens=3)
before = w.cached_kernels(w.cache_dir())
rec = w.record(cfg, compile_now=True)
print(json.dumps(dict(variants=len(rec.variants), compiled=w.cached_kernels(w.cache_dir()) - before,
                      compile_calls=len(rec.compile_s))))
"""

# Hashes one kernel first (or not), then settles the keys (or not): prints combine_recv_kernel's key.
KEY = """
import sys
from moe_comm import jit_keys
from moe_comm.triton_kernels import combine, dispatch_local
if sys.argv[1] == "dispatch_first":
    dispatch_local.dispatch_local_kernel.cache_key
if sys.argv[2] == "settle":
    jit_keys.settle()
print(combine.combine_recv_kernel.cache_key)
"""


def _run(args, env=None, timeout=600):
    e = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    e.update(env or {})
    e["PYTHONPATH"] = REPO + os.pathsep + e.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, *args], cwd=REPO, env=e, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


@pytest.mark.ptx
def test_cache_keys_are_the_same_whatever_the_kernel_hashed_first():
    settled = {_run(["-c", KEY, order, "settle"]).strip() for order in ("dispatch_first", "combine_first")}
    assert len(settled) == 1
    # The premise, on the Triton this suite pins (3.6): without settling, the key depends on the order.
    raw = {_run(["-c", KEY, order, "raw"]).strip() for order in ("dispatch_first", "combine_first")}
    assert len(raw) == 2 or not raw.isdisjoint(settled)


@pytest.mark.ptx
def test_warmup_lists_every_rank_token_class_and_the_fault_path():
    out = _run(["-m", "moe_comm", "warmup", "--list", "--json", "--world", "2", "--experts", "8", "--hidden", "128",
                "--topk", "2", "--max-tokens", "3", "--ops", "ep,prefill,a2a", "--prefill-tokens", "3"], timeout=300)
    rows = [json.loads(s) for s in out.splitlines() if s.startswith("{")]
    kernels = [r["kernel"] for r in rows]
    # rank 0 (a multiple of 16) and rank 1 (the constant 1) are different variants; T = 1, 0, 2 are three
    assert kernels.count("dispatch_send_kernel") == 2 * 3
    assert kernels.count("prefill_dispatch_send_kernel") == 2 * 3
    assert kernels.count("a2a_send_kernel") >= 2 * 3
    # the fault path: an aborted call (abort) and the next one (drain), both ranks (channels whose control
    # words have the same size share a variant)
    for kernel, label in (("abort_kernel", "ep abort"), ("drain_kernel", "ep drain")):
        assert [r["label"] for r in rows if r["kernel"] == kernel].count(label) == 2
    assert len({r["key"] for r in rows}) == len(rows)   # one row per distinct variant


@pytest.mark.ptx
@pytest.mark.timeout(900)
def test_after_warmup_a_second_process_compiles_nothing(tmp_path):
    cache = str(tmp_path / "triton-cache")
    rep = json.loads(_run(["-m", "moe_comm", "warmup", *TINY, "--jobs", "2", "--cache-dir", cache, "--json"]))
    # world 1: dispatch_local and combine_recv, each for T = 1, 0 (a multiple of 16) and 2
    assert rep["variants"] == 6 and rep["kernels"] == {"dispatch_local_kernel": 3, "combine_recv_kernel": 3}
    assert rep["compiled"] == 6 and rep["arch"] == 90 and rep["jobs"] == 2
    serving = json.loads(_run(["-c", SERVING], env={"TRITON_CACHE_DIR": cache}))
    assert serving["variants"] == 6 and serving["compile_calls"] == 6
    assert serving["compiled"] == 0, "the second process compiled variants warmup had compiled"
