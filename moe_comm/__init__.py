"""moe-comm: Mixture-of-Experts token communication for LLM inference (Triton + symmetric memory)."""

import os as _os

import torch as _torch

# Without CUDA, Triton kernels can only run in Triton's interpreter (CPU development and CI):
# turn it on before any kernel is defined, unless the user chose either way.
if "TRITON_INTERPRET" not in _os.environ and not _torch.cuda.is_available():
    _os.environ["TRITON_INTERPRET"] = "1"

# ruff: noqa: E402  (the imports below must follow the interpreter switch)
from . import reference
from .alltoallv import A2AHandle, A2AResult, AllToAllvDynamic
from .ep import DispatchResult, EPBuffer, EPHandle
from .errors import CapacityError, CommTimeoutError, InvalidIndexError, LaunchError, MoECommError
from .group import CommGroup, init, launch

__version__ = "0.1.0"

__all__ = [
    "A2AHandle",
    "A2AResult",
    "AllToAllvDynamic",
    "CapacityError",
    "CommGroup",
    "CommTimeoutError",
    "DispatchResult",
    "EPBuffer",
    "EPHandle",
    "InvalidIndexError",
    "LaunchError",
    "MoECommError",
    "init",
    "launch",
    "reference",
]
