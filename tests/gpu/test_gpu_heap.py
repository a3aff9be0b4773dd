"""The nvshmem heap on a GPU (world 1: NVSHMEM's peer pointer is the buffer itself) and loopback on CUDA."""

import pytest
import torch

import moe_comm

pytestmark = pytest.mark.gpu


def test_nvshmem_heap_alloc_peer_ptrs_barrier_free():
    pytest.importorskip("nvshmem.core")
    with moe_comm.init(backend="nvshmem", timeout_s=10) as g:
        assert (g.backend, g.world_size, g.device.type) == ("nvshmem", 1, "cuda")
        bufs = [g.heap.alloc(f"b{i}", (3, 5), dt) for i, dt in enumerate((torch.bfloat16, torch.int64))]
        for b in bufs:
            assert b.local.is_cuda and tuple(b.local.shape) == (3, 5)
            assert b.peer_ptrs.tolist() == [b.local.data_ptr()]
            assert int(b.local.abs().sum()) == 0  # zeroed at allocation
        g.barrier()
        for b in reversed(bufs):
            g.heap.free(b)
        # The pinned error word is readable without a device sync.
        assert g.error_word.is_pinned() and g.error_word.tolist()[0] == 0


def test_loopback_heap_on_cuda():
    groups = moe_comm.init(backend="loopback", world_size=4, device="cuda")
    bufs = [g.heap.alloc("x", (8,), torch.float32) for g in groups]
    assert all(b.local.is_cuda for b in bufs)
    assert bufs[0].peer_ptrs.tolist() == [b.local.data_ptr() for b in bufs]
