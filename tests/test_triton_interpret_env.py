"""A user's own ``TRITON_INTERPRET=1`` (every ``@triton.jit`` of the process interpreted, ours included)
changes nothing for moe-comm on CPU tensors: the self-test and a representative set of tests pass with it
exported. (Stock Triton 3.6's interpreter with numpy 2.4 fails a loop bound read from memory; without the
fix every op raised ``InterpreterError`` there.)"""

import os
import subprocess
import sys

import pytest
import torch

from moe_comm.interpreter import kernel_for

from budget import SWEEP

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# One test of each kind of kernel: EPBuffer over loopback (world 2), AllToAllvDynamic's one-kernel path,
# device-side count errors, the SGLang dispatcher, the expert GEMM, the decode attention, the row copy.
CASES = [
    "tests/test_ep.py::test_matrix_loopback[2]",
    "tests/test_alltoallv.py::test_world1_one_kernel_clamps_lying_counts",
    "tests/test_error_messages.py::test_alltoallv_count_past_the_input_reports_that_peers_own_count",
    "tests/test_sglang_dispatcher.py::test_dispatch_combine_equals_reference_and_split_calls_match",
    "tests/test_experts.py::test_masked_bmm_row_tiles_and_untouched_rows",
    "tests/test_attention.py::test_matches_gather_attention_bfloat16",
    "tests/test_copy_rows.py::test_ops_dispatch_writes_the_valid_rows_only[False]",
    "tests/test_fp8_quant.py::test_interpreted_kernel_matches_the_reference_bitwise[e4m3-ue8m0]",   # a foreign kernel
]


def _env() -> dict:
    return dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p))


@SWEEP
@pytest.mark.timeout(300)
def test_info_and_selftest_with_triton_interpret_exported():
    """``info`` reports the setting; ``selftest`` (loopback and two processes over /dev/shm) passes."""
    info = subprocess.run([sys.executable, "-m", "moe_comm", "info"], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=120)
    assert info.returncode == 0 and "TRITON_INTERPRET on (TRITON_INTERPRET=1)" in info.stdout, info.stdout
    out = subprocess.run([sys.executable, "-m", "moe_comm", "selftest", "--device", "cpu"], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " 0 failed" in out.stdout and "FAIL" not in out.stdout and "shm world 2" in out.stdout, out.stdout


@SWEEP
@pytest.mark.timeout(300)
def test_representative_cases_pass_with_triton_interpret_exported():
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *CASES], cwd=ROOT,
                         env=_env(), capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert f"{len(CASES)} passed" in out.stdout, out.stdout[-2000:]


def test_kernel_defined_under_triton_interpret_is_refused_for_cuda_tensors():
    """A kernel Triton made interpreted (TRITON_INTERPRET=1 when it was defined) cannot be compiled: on
    CUDA tensors the launch says so and how to fix it, instead of interpreting raw GPU addresses."""
    from triton.runtime.interpreter import InterpretedFunction

    def some_kernel(x_ptr):
        pass

    fn = InterpretedFunction(some_kernel)
    with pytest.raises(RuntimeError, match="unset TRITON_INTERPRET"):
        kernel_for(fn, torch.device("cuda"))
    # on the CPU: the same function, interpreted with moe_comm's interpreted twins as its helpers
    cpu = kernel_for(fn, torch.device("cpu"))
    assert isinstance(cpu, InterpretedFunction) and cpu.fn.__code__ is some_kernel.__code__
