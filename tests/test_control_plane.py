"""The host control plane goes through the torch.distributed store, never through a mapping of a peer's
memory (moe_comm/heap/control.py).

What these tests can show on the CPU: the shm heap allocates no symmetric control buffer; barriers and
recovery meetings work, bounded, with the store hosted by ``launch`` (so a killed rank 0 is named by the
survivors like any other rank); the nvshmem heap, with NVSHMEM replaced by a fake whose ``get_peer_tensor``
refuses peers of another "node", chooses the put transport for them instead of refusing the group, and its
``close()`` calls no NVSHMEM collective when a peer does not come. What they cannot show: real NVSHMEM
across nodes (never run here).
"""

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

import moe_comm
from moe_comm.errors import CommTimeoutError, LaunchError
from moe_comm.heap.control import ControlBlock
from moe_comm.heap.nvshmem import NvshmemHeap
from moe_comm.protocol import TRANSPORT_PUT, TRANSPORT_STORE
from moe_comm.transport import choose_transports


def _control_is_store_only(group):
    heap = group.heap
    names = [entry[2].name for entry in heap._live.values()]
    assert not [n for n in names if n.startswith("control")], names   # no mapped control buffer
    assert isinstance(heap._control, ControlBlock)
    group.barrier()
    got = group.exchange([group.rank * 10 + 1, 7])
    return sorted(got.items())


def test_control_plane_maps_nothing_and_meets_over_the_store():
    out = moe_comm.launch(_control_is_store_only, 3, backend="shm", timeout_s=10)
    expect = [(j, [j * 10 + 1, 7]) for j in range(3)]
    assert out == [expect] * 3


def _rank0_dies(group):
    if group.rank == 0:
        os._exit(3)
    t0 = time.monotonic()
    try:
        group.barrier()
    except CommTimeoutError as e:
        peer, took = e.peer, time.monotonic() - t0
    else:
        return None, 0.0, None
    gone = group.exclude([peer])   # the survivors still meet: the store did not die with rank 0
    group.barrier()
    return peer, took, gone


def test_killed_rank0_is_named_by_the_survivors_the_store_outlives_it():
    timeout = 2.0
    with pytest.raises(LaunchError) as info:
        moe_comm.launch(_rank0_dies, 3, backend="shm", timeout_s=timeout, grace_s=timeout + 10)
    results = info.value.results
    assert 0 in info.value.failures
    for r in (1, 2):
        peer, took, gone = results[r]
        assert peer == 0 and gone == [0], results
        assert took < timeout + 2, results


# ---- the nvshmem heap with a fake NVSHMEM (reachability mocked) -----------------------------------

class FakeNvshmem:
    """The nvshmem.core calls the heap makes; PEs of another node (``node_of``) cannot be mapped."""

    def __init__(self, rank, node_of):
        self.rank, self.node_of, self.calls = rank, node_of, []

    def tensor(self, shape, dtype):
        self.calls.append("tensor")
        return torch.zeros(shape, dtype=dtype)

    def get_peer_tensor(self, t, pe):
        if self.node_of(pe) != self.node_of(self.rank):
            raise RuntimeError(f"PE {pe} is not load/store reachable")
        return torch.zeros_like(t)

    def free_tensor(self, t):
        self.calls.append("free_tensor")

    def finalize(self):
        self.calls.append("finalize")


class FakeNvshmemHeap(NvshmemHeap):
    def __init__(self, rank, world, store, timeout_s, node_of):
        self.nv, self.rank, self.world_size = FakeNvshmem(rank, node_of), rank, world
        self.device, self.timeout_s = torch.device("cpu"), timeout_s
        self._start_heap(store)

    def _sync_device(self):
        pass


def _on_threads(fn, world):
    out, errs = [None] * world, []

    def run(r):
        try:
            out[r] = fn(r)
        except BaseException as e:  # noqa: BLE001
            errs.append(e)

    ts = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errs, errs
    return out


def test_nvshmem_heap_takes_unmapped_peers_with_puts_and_the_store_control_plane(monkeypatch):
    monkeypatch.delenv("MOE_COMM_TRANSPORT", raising=False)
    world, store = 4, dist.HashStore()
    heaps = _on_threads(lambda r: FakeNvshmemHeap(r, world, store, 10.0, node_of=lambda pe: pe // 2), world)
    for h in heaps:
        node = h.rank // 2
        assert h.reachable() == [pe // 2 == node for pe in range(world)]
        assert choose_transports(h) == [TRANSPORT_STORE if pe // 2 == node else TRANSPORT_PUT
                                        for pe in range(world)]
        assert h._control.store is store
    buf_ptrs = _on_threads(lambda r: heaps[r].alloc("x", (4,), torch.int64).peer_ptrs.tolist(), world)
    for r, ptrs in enumerate(buf_ptrs):
        assert [p == 0 for p in ptrs] == [pe // 2 != r // 2 for pe in range(world)]   # unmapped: 0
    _on_threads(lambda r: heaps[r].close(), world)
    for h in heaps:
        assert h.nv.calls.count("finalize") == 1


def test_nvshmem_close_calls_no_collective_when_a_peer_does_not_come():
    world, store, timeout = 2, dist.HashStore(), 1.0
    heaps = _on_threads(lambda r: FakeNvshmemHeap(r, world, store, timeout, node_of=lambda pe: pe), world)
    before = list(heaps[0].nv.calls)
    t0 = time.monotonic()
    heaps[0].close()            # rank 1 is "dead": it never closes
    assert time.monotonic() - t0 < timeout + 2
    assert heaps[0].nv.calls == before   # no free_tensor, no finalize
