"""Importing moe_comm changes nothing in the process: not os.environ (TRITON_INTERPRET in particular),
not Triton's global settings (knobs, hooks, JIT call path), not torch's global settings. Checked in a
fresh interpreter, before and after the import and after an interpreted kernel launch."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs in a fresh interpreter; prints one JSON object of differences (empty lists = none).
SCRIPT = r'''
import json, os, sys
env0 = dict(os.environ)
import torch, triton  # third-party imports first: their own effects are not ours
from triton.runtime import interpreter, jit

HOOKS = ("launch_enter_hook", "launch_exit_hook", "jit_cache_hook", "jit_post_compile_hook",
         "kernel_load_start_hook", "kernel_load_end_hook")

def settings():
    s = {}
    for name in ("build", "cache", "compilation", "runtime", "language", "nvidia", "amd", "autotuning"):
        for k, v in getattr(triton.knobs, name).knobs.items():
            s[f"triton.knobs.{name}.{k}"] = repr(v)
    for h in HOOKS:
        s[f"triton.knobs.runtime.{h}"] = repr(getattr(triton.knobs.runtime, h))
    s["JITFunction.__call__"] = repr(jit.JITFunction.__call__)
    s["InterpretedFunction.__call__"] = repr(interpreter.InterpretedFunction.__call__)
    s["torch.default_dtype"] = repr(torch.get_default_dtype())
    s["torch.deterministic"] = repr(torch.are_deterministic_algorithms_enabled())
    s["torch.num_threads"] = repr(torch.get_num_threads())
    s["torch.grad_enabled"] = repr(torch.is_grad_enabled())
    return s

def diff(a, b):
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))

env1, set1 = dict(os.environ), settings()
import moe_comm
import moe_comm.compat.deep_ep, moe_comm.info, moe_comm.selftest, moe_comm.__main__  # noqa: E401, F401
env2, set2 = dict(os.environ), settings()

# An interpreted launch (CPU tensors) switches the interpreter on only for our own kernels, scoped.
g = moe_comm.init(backend="loopback", world_size=1, device="cpu")[0]
ep = moe_comm.EPBuffer(g, 4, 128, 2, 2)
d = ep.dispatch(torch.ones(2, 128, dtype=torch.bfloat16), torch.tensor([[0, 1], [2, -1]]))
y = ep.combine(d.x, torch.ones(2, 2), d.handle)
assert torch.equal(y[0], torch.full((128,), 2.0, dtype=torch.bfloat16)), y
env3, set3 = dict(os.environ), settings()

print(json.dumps(dict(import_env=diff(env1, env2), import_settings=diff(set1, set2),
                      launch_env=diff(env2, env3), launch_settings=diff(set2, set3),
                      third_party_env=diff(env0, env1),
                      interpret_env="TRITON_INTERPRET" in env3)))
'''


def _run(extra_env):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MOE_COMM_INTERPRET")}
    env.update(extra_env)
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_and_launch_change_nothing():
    r = _run({})
    assert r["import_env"] == [] and r["import_settings"] == [], r
    assert r["launch_env"] == [] and r["launch_settings"] == [], r
    assert r["interpret_env"] is False, r
