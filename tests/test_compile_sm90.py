"""Every kernel compiles for Hopper (sm_90a) without a GPU, with (next to) no register spills.

The interpreter runs Python the compiler rejects (non-constexpr globals, host calls), so CPU tests
alone do not prove a kernel compiles. Compiling runs in a subprocess with the interpreter off.
"""

import importlib
import json
import os
import subprocess
import sys

import pytest

OP_MODULES = ("alltoallv", "routing", "dispatch", "dispatch_local", "combine", "moe_comm.serving.experts")


@pytest.mark.timeout(600)
def test_every_kernel_compiles_for_sm90_without_real_spills():
    env = dict(os.environ, TRITON_INTERPRET="0")
    out = subprocess.run([sys.executable, "-m", "moe_comm.triton_kernels.compile_report", "--json"],
                         capture_output=True, text=True, env=env, timeout=540)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    compiled = {r["kernel"] for r in rows}
    # Every launchable kernel of every op module has at least one compiled configuration.
    declared = set()
    for name in OP_MODULES:
        try:
            mod = importlib.import_module(name if "." in name else f"moe_comm.triton_kernels.{name}")
        except ImportError:
            continue
        declared |= {k for k in dir(mod) if k.endswith("_kernel") and hasattr(getattr(mod, k), "arg_names")}
    assert declared and declared <= compiled, f"not compiled: {sorted(declared - compiled)}"
    for r in rows:
        assert r["registers"] is not None and r["registers"] <= 255, r
        # Triton 3.6 (the version measured on the H100) spills nothing; 3.9 spills 4 bytes in the fp8
        # dispatch send. A few bytes are harmless; a kernel that spills more has lost its shape.
        assert r["spill_store_bytes"] <= 16 and r["spill_load_bytes"] <= 16, r
