"""One direction of one op on one rank: its symmetric landing zone, control words and call counter."""

from __future__ import annotations

import torch

PHASES = ("send", "recv", "both")


class Channel:
    """Symmetric buffers + device-side signalling state of one op direction (e.g. a2a forward).

    data  symmetric, ``data_shape`` ``data_dtype``; by convention [2 zones, ...] (zone = call % 2)
    ctrl  symmetric int64 [2 zones, world source ranks, ctrl_words]; the last word of each is the flag
    seq   int64 [1] on device: calls whose send phase has run (advanced by the send kernel, so a CUDA
          graph replay keeps counting; the host never reads it)
    done  int32 [world + 1] on device: arrival counters for "last program publishes" (zero between launches)
    """

    def __init__(self, group, name: str, data_shape, data_dtype: torch.dtype, ctrl_words: int = 2):
        heap, dev, world = group.heap, group.device, group.world_size
        self.group, self.name = group, name
        self.data = heap.alloc(f"{name}.data", data_shape, data_dtype)
        self.ctrl = heap.alloc(f"{name}.ctrl", (2, world, ctrl_words), torch.int64)
        self.seq = torch.zeros(1, dtype=torch.int64, device=dev)
        self.done = torch.zeros(world + 1, dtype=torch.int32, device=dev)
        self.expect = "send"  # host-side phase order check: send, recv, send, recv, ...

    @property
    def symmetric_bytes(self) -> int:
        return sum(b.local.numel() * b.local.element_size() for b in (self.data, self.ctrl))

    def phases(self, phase: str) -> tuple[bool, bool]:
        """Validate ``phase`` against the call order; returns (run send, run recv)."""
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        g = self.group
        if phase == "both" and g.backend == "loopback" and g.world_size > 1:
            raise ValueError("loopback groups hold every rank in one process: call phase='send' on every "
                             "rank, then phase='recv' on every rank (phase='both' would wait for peers "
                             "that have not sent yet)")
        if phase in ("send", "both") and self.expect != "send":
            raise RuntimeError(f"{self.name}: the previous call's phase='recv' has not run yet")
        if phase == "recv" and self.expect != "recv":
            raise RuntimeError(f"{self.name}: phase='recv' needs a preceding phase='send'")
        return phase != "recv", phase != "send"

    def free(self) -> None:
        self.group.heap.free(self.ctrl)
        self.group.heap.free(self.data)
