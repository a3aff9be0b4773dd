"""moe-comm: Mixture-of-Experts token communication for LLM inference (Triton + symmetric memory)."""

from . import reference
from .alltoallv import A2AHandle, A2AResult, AllToAllvDynamic
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
    "InvalidIndexError",
    "LaunchError",
    "MoECommError",
    "init",
    "launch",
    "reference",
]
