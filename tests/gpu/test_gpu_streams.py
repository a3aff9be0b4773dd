"""Memory that crosses from a send phase's stream to its receive's (issue 33, item 2), compiled on a GPU.

What a send leaves for its receive (a copy the op made, or a tensor it allocated for the receive to
write) is allocated on the send's stream; the receive's kernels use it on theirs. Each is recorded for the
receive's stream (``phased.record_for_current_stream``), so the caching allocator does not hand its
memory to a new tensor on the send's stream before the receive's kernels are done with it. Here the
receive stream is held back by a sleep kernel while the send stream allocates and fills many tensors of
the same sizes: without the records one of them takes the freed memory, and either the receive reads
the filler (the world-1 dispatch's copies) or the filler is overwritten by the receive (AllToAllvDynamic's
reverse output). The CPU test of which tensors are recorded is tests/test_stream_order.py. Skipped
without CUDA (conftest).
"""

import pytest
import torch

import moe_comm
from moe_comm import AllToAllvDynamic, EPBuffer, reference

pytestmark = pytest.mark.gpu

DEV = "cuda:0"
SLEEP_CYCLES = 200_000_000   # ~0.1 s at 2 GHz: the receive's kernels start long after the host moved on
FILLERS = 64                 # tensors of the freed sizes allocated on the send stream meanwhile


def test_world1_dispatch_copies_outlive_the_send_until_the_receive_read_them():
    E, H, M, K = 4, 256, 8, 2
    g = moe_comm.init(backend="loopback", world_size=1, device=DEV, timeout_s=10)[0]
    ep = EPBuffer(g, E, H, M, K)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(M, H, generator=gen).bfloat16()
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(M)])
    want = reference.dispatch([x], [idx], E, M)[0]
    xd, idxd = x.to(DEV), idx.to(DEV)
    ep.dispatch(xd, idxd)                     # compiles outside the timed part
    torch.cuda.synchronize()
    main, send_s, recv_s = torch.cuda.current_stream(), torch.cuda.Stream(), torch.cuda.Stream()
    send_s.wait_stream(main)
    recv_s.wait_stream(main)
    with torch.cuda.stream(send_s):
        ep.dispatch(xd, idxd, phase="send")   # world 1, split: the send copies x and topk_idx
    with torch.cuda.stream(recv_s):
        torch.cuda._sleep(SLEEP_CYCLES)
        d = ep.dispatch(phase="recv")         # the copies' last references die when this returns
    with torch.cuda.stream(send_s):
        fillers = [(torch.full((M, H), float("nan"), dtype=torch.bfloat16, device=DEV),
                    torch.full((M, K), E - 1, dtype=idxd.dtype, device=DEV)) for _ in range(FILLERS)]
    torch.cuda.synchronize()
    assert torch.equal(d.counts.cpu(), want["counts"])
    for e, n in enumerate(want["counts"].tolist()):
        assert torch.equal(d.x[e, :n].cpu(), want["x"][e, :n]), e
    del fillers
    g.close()


def test_reverse_output_is_not_handed_out_before_the_receive_wrote_it():
    world, cap, row = 2, 4, (512,)
    groups = moe_comm.init(backend="loopback", world_size=world, device=DEV, timeout_s=10)
    ops = [AllToAllvDynamic(g, cap, row, torch.float32) for g in groups]
    counts = [torch.full((world,), cap, dtype=torch.int32, device=DEV) for _ in range(world)]
    sends = [torch.randn(world * cap, *row, device=DEV) for _ in range(world)]

    def forward():
        for op, s, c in zip(ops, sends, counts):
            op(s, c, phase="send")
        return [op(phase="recv") for op in ops]

    res = forward()
    for op, r in zip(ops, res):               # compiles the reverse outside the timed part
        op.combine(r.recv, r.handle, phase="send")
    [op.combine(phase="recv") for op in ops]
    res = forward()
    torch.cuda.synchronize()
    main, send_s, recv_s = torch.cuda.current_stream(), torch.cuda.Stream(), torch.cuda.Stream()
    send_s.wait_stream(main)
    recv_s.wait_stream(main)
    with torch.cuda.stream(send_s):
        for op, r in zip(ops, res):
            op.combine(r.recv, r.handle, phase="send")   # allocates the reverse outputs on send_s
    with torch.cuda.stream(recv_s):
        torch.cuda._sleep(SLEEP_CYCLES)
        backs = [op.combine(phase="recv") for op in ops]
    nbytes = backs[0].numel() * backs[0].element_size()
    del backs                                 # freed on the host while the receives are still queued
    with torch.cuda.stream(send_s):
        fillers = [torch.full((nbytes // 4,), float("nan"), device=DEV) for _ in range(FILLERS)]
    torch.cuda.synchronize()
    assert all(bool(f.isnan().all()) for f in fillers)   # no receive wrote into a tensor handed out meanwhile
    for g in groups:
        g.close()
