"""Which transport this rank's kernels use for each peer (the ``transports`` section of the group state).

- ``store``: the peer's memory is mapped here (same node: NVLink / PCIe peer access, or CPU shared
  memory); the kernels store rows into its landing zone and publish the flag with a release.
- ``put``: NVSHMEM puts (IB / RoCE across nodes): the kernels store the rows into this rank's staging
  copy of the peer's landing layout, then ``putmem_nbi`` them into the peer's landing zone and deliver
  the flag as the signal of a ``putmem_signal_nbi`` (``moe_comm/triton_kernels/transport.py``).

``MOE_COMM_TRANSPORT`` chooses, the same on every rank: ``auto`` (default: store where the heap can map
the peer, put elsewhere), ``store`` (every peer; an error if one is unreachable) or ``put`` (every peer,
this rank included: the put path on one node or one GPU, for testing). On CPU the put path runs through
the interpreted twin of the NVSHMEM calls; on CUDA it needs the nvshmem heap.
"""

from __future__ import annotations

import os

from .protocol import TRANSPORT_PUT, TRANSPORT_STORE

ENV = "MOE_COMM_TRANSPORT"
MODES = ("auto", "store", "put")


def choose_transports(heap) -> list[int]:
    """TRANSPORT_STORE / TRANSPORT_PUT for every rank, as this rank reaches it."""
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{ENV} must be one of {MODES}, got {mode!r}")
    reachable = list(heap.reachable())
    if mode == "store" and not all(reachable):
        gone = [j for j, r in enumerate(reachable) if not r]
        raise ValueError(f"{ENV}=store, but ranks {gone} are not load/store reachable from rank {heap.rank}: "
                         f"use auto or put")
    out = [TRANSPORT_PUT if mode == "put" or (mode == "auto" and not r) else TRANSPORT_STORE for r in reachable]
    if TRANSPORT_PUT in out and heap.device.type == "cuda" and heap.kind != "nvshmem":
        raise ValueError(f"the put transport ({ENV}={mode}) needs backend='nvshmem' on CUDA, not {heap.kind!r}")
    return out
