"""Symmetric memory providers. Each gives, for a buffer allocated collectively on every rank, this rank's
local tensor and ``peer_ptrs``: the base address of every rank's copy as mapped in this process."""

from .base import Heap, SymmetricBuffer

__all__ = ["Heap", "SymmetricBuffer"]
