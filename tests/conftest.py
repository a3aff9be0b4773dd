import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


# TRITON_INTERPRET=1 turns every @triton.jit into an interpreted function, which Triton cannot compile:
# the PTX checks (sm_90 compile on the CPU) cannot run in that mode, everything else does.
GLOBAL_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs CUDA")
    no_ptx = pytest.mark.skip(reason="compiles PTX: not possible while TRITON_INTERPRET=1 interprets every kernel")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)
        if "ptx" in item.keywords and GLOBAL_INTERPRET:
            item.add_marker(no_ptx)
