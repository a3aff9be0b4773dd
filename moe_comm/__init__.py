"""moe-comm: Mixture-of-Experts token communication for LLM inference (Triton + symmetric memory).

Importing the package changes nothing in the process: kernels on CPU tensors run in Triton's
interpreter, chosen per launch (``moe_comm.interpreter``), and kernels on CUDA tensors are compiled.
"""

from . import metrics, reference
from .alltoallv import A2AHandle, A2AResult, AllToAllvDynamic
from .ep import ArrivalWords, DispatchResult, EPBuffer, EPHandle, ReadyWords
from .errors import (CapacityError, ClosedError, CommAbortedError, CommDesyncError, CommTimeoutError, ExcludedError,
                     GlobalScaleError, GroupError, InvalidIndexError, LaunchError, MoECommError)
from .group import CommGroup, init, launch
from .moe_layer import MoELayer
from .prefill import PrefillBuffer, PrefillDispatchResult, PrefillHandle

__version__ = "0.1.0"

__all__ = [
    "A2AHandle",
    "A2AResult",
    "AllToAllvDynamic",
    "ArrivalWords",
    "CapacityError",
    "ClosedError",
    "CommAbortedError",
    "CommDesyncError",
    "CommGroup",
    "CommTimeoutError",
    "DispatchResult",
    "EPBuffer",
    "EPHandle",
    "ExcludedError",
    "GlobalScaleError",
    "GroupError",
    "InvalidIndexError",
    "LaunchError",
    "MoECommError",
    "MoELayer",
    "PrefillBuffer",
    "PrefillDispatchResult",
    "ReadyWords",
    "PrefillHandle",
    "init",
    "launch",
    "metrics",
    "reference",
]
