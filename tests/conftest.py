import os

import pytest
import torch

from moe_comm.planner import SHAPES_ENV

HAS_CUDA = torch.cuda.is_available()


# TRITON_INTERPRET=1 turns every @triton.jit into an interpreted function, which Triton cannot compile:
# the PTX checks (sm_90 compile on the CPU) cannot run in that mode, everything else does.
GLOBAL_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# MOE_COMM_LAUNCH_SHAPES=gpu (the adversarial-order runs, docs/testing.md) plans CPU launches with the CUDA
# grids: hundreds of interpreted programs where the CPU plan has one, so a test's timeout mark is scaled.
GPU_SHAPES = os.environ.get(SHAPES_ENV) == "gpu"
GPU_SHAPES_TIMEOUT_SCALE = 4


def pytest_configure(config):
    from time_log import register  # noqa: PLC0415  (docs/testing.md, "Where the time goes")
    register(config)


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs CUDA")
    no_ptx = pytest.mark.skip(reason="compiles PTX: not possible while TRITON_INTERPRET=1 interprets every kernel")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)
        if "ptx" in item.keywords and GLOBAL_INTERPRET:
            item.add_marker(no_ptx)
        mark = item.get_closest_marker("timeout")
        if GPU_SHAPES and mark is not None and mark.args:
            item.add_marker(pytest.mark.timeout(mark.args[0] * GPU_SHAPES_TIMEOUT_SCALE), append=False)
