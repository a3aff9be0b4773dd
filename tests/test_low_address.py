"""Every address reaches the kernels as a 64-bit value, whatever its value.

Triton types a Python int kernel argument by its value: an address below 2**31 used to become an i32
argument, and turning an i32 into a 64-bit pointer failed (a fresh machine's allocator happened to put
the pinned error word at 0x3e6fad00). Here every buffer the kernels use, the error word included, is
placed below 2**31 on purpose (an anonymous mapping at a fixed low address), and dispatch -> combine,
an AllToAllvDynamic round trip and a timeout path run through them.
"""

import ctypes

import pytest
import torch

import moe_comm
from moe_comm import AllToAllvDynamic, CommTimeoutError, EPBuffer, reference
from moe_comm.group import CommGroup
from moe_comm.heap.loopback import LoopbackHeap

LOW = 2 ** 31
CANDIDATES = (0x10000000, 0x20000000, 0x30000000, 0x40000000, 0x50000000)
PROT_RW, MAP_PRIVATE_ANON, MAP_FIXED_NOREPLACE = 0x3, 0x22, 0x100000


class LowArena:
    """Anonymous memory mapped at a fixed address below 2**31; hands out 64-byte aligned uint8 tensors."""

    def __init__(self, nbytes: int):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.libc, self.size, self.used, self.base = libc, nbytes, 0, None
        for addr in CANDIDATES:
            got = libc.mmap(addr, nbytes, PROT_RW, MAP_PRIVATE_ANON | MAP_FIXED_NOREPLACE, -1, 0)
            if got == addr:
                self.base = addr
                break
            if got not in (None, ctypes.c_void_p(-1).value):  # an old kernel took the address as a hint
                libc.munmap(got, nbytes)
        if self.base is None:
            pytest.skip("no free address below 2**31 to map")
        self.memory = (ctypes.c_uint8 * nbytes).from_address(self.base)

    def __call__(self, nbytes: int) -> torch.Tensor:
        off = self.used
        self.used = (off + max(nbytes, 1) + 63) // 64 * 64
        assert self.used <= self.size, "arena too small"
        return torch.frombuffer(self.memory, dtype=torch.uint8, count=nbytes, offset=off)


def low_world(arena: LowArena, world: int, timeout_s: float):
    heaps = LoopbackHeap.create_world(world, "cpu", allocator=arena)
    return [CommGroup(h, "loopback", timeout_s, error_word=arena(64).view(torch.int64)) for h in heaps]


def test_buffers_below_2_31_dispatch_combine_alltoallv_and_timeout():
    arena = LowArena(32 << 20)
    groups = low_world(arena, 2, timeout_s=0.5)
    for g in groups:
        assert g.error_word.data_ptr() < LOW and g.status.local.data_ptr() < LOW

    # dispatch -> combine, checked against the reference
    eps = [EPBuffer(g, 8, 128, 3, 2) for g in groups]
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(3, 128, generator=gen).to(torch.bfloat16) for _ in groups]
    idxs = [torch.randint(-1, 8, (3, 2), generator=gen) for _ in groups]
    ws = [torch.rand(3, 2, generator=gen) for _ in groups]
    for ep, x, i in zip(eps, xs, idxs):
        ep.dispatch(x, i, phase="send")
    ds = [ep.dispatch(phase="recv") for ep in eps]
    for ep in eps:
        for ch in (ep._dispatch_ch, ep._combine_ch):
            assert ch.data.local.data_ptr() < LOW and ch.ctrl.local.data_ptr() < LOW
    exp = reference.dispatch(xs, idxs, 8, 3)
    for d, e in zip(ds, exp):
        assert torch.equal(d.counts, e["counts"])
    eos = [d.x.clone() for d in ds]
    for ep, eo, w, d in zip(eps, eos, ws, ds):
        ep.combine(eo, w, d.handle, phase="send")
    ys = [ep.combine(phase="recv") for ep in eps]
    assert all(torch.equal(y, e) for y, e in zip(ys, reference.combine(eos, ws, idxs, 8, 3)))

    # AllToAllvDynamic round trip
    a2as = [AllToAllvDynamic(g, 4, (16,), torch.float32) for g in groups]
    sends = [torch.randn(5, 16, generator=gen) for _ in groups]
    counts = [torch.tensor([2, 3], dtype=torch.int32), torch.tensor([4, 1], dtype=torch.int64)]
    for a, s, c in zip(a2as, sends, counts):
        a(s, c, phase="send")
    res = [a(phase="recv") for a in a2as]
    assert torch.equal(res[1].recv[0, :3], sends[0][2:5]) and torch.equal(res[0].recv[1, :4], sends[1][:4])
    for a, r in zip(a2as, res):
        a.combine(r.recv, r.handle, phase="send")
    backs = [a.combine(phase="recv") for a in a2as]
    assert torch.equal(backs[0], sends[0]) and torch.equal(backs[1], sends[1])

    # timeout path: rank 1 skips its send; rank 0's wait expires and the record goes through the low word
    a2as[0](sends[0], counts[0], phase="send")
    with pytest.raises(CommTimeoutError, match="rank 0 timed out after 0.5 s waiting for peer rank 1"):
        a2as[0](phase="recv")
    assert int(groups[0].error_word[0]) != 0


def test_loopback_default_world_places_nothing_in_kernel_arguments_by_value():
    """The group state (every address a kernel reads) is an int64 tensor: a kernel never gets one as a
    Python int argument."""
    (g,) = moe_comm.init(backend="loopback", world_size=1, device="cpu")
    assert g.state.dtype == torch.int64
    assert int(g.state[1]) == g.error_word.data_ptr()
