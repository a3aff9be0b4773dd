"""CUDA graph captures and a channel's launch ordering (issue 33, item 7), compiled on a GPU.

A channel orders each launch after its previous one with an event wait when they run on different streams
(``moe_comm.channel.Channel``), but only within one capture sequence: two captures under way at once on
two streams must not wait across each other (CUDA rejects an event of another capture and invalidates
the capture). The CPU test of the decision is tests/test_stream_order.py. Skipped without CUDA (conftest).
"""

import pytest
import torch

import moe_comm
from moe_comm import AllToAllvDynamic
from moe_comm.channel import current_capture

pytestmark = pytest.mark.gpu

DEV = "cuda:0"
CAP, ROW = 4, (256,)


def test_two_captures_under_way_on_two_streams_do_not_wait_across_each_other():
    g = moe_comm.init(backend="loopback", world_size=1, device=DEV, timeout_s=10)[0]
    op = AllToAllvDynamic(g, CAP, ROW, torch.bfloat16)
    counts = torch.tensor([3], dtype=torch.int32, device=DEV)
    sends = [torch.randn(3, *ROW, device=DEV).bfloat16() for _ in range(2)]
    eager = op(sends[0], counts)                 # compiles the kernels outside any capture
    want = eager.recv[0, :3].clone()
    torch.cuda.synchronize()
    main = torch.cuda.current_stream()
    s1, s2, side = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
    g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    for s in (s1, s2):
        s.wait_stream(main)
    with torch.cuda.stream(s1):
        g1.capture_begin(capture_error_mode="relaxed")
        r1 = op(sends[0], counts)
        assert current_capture()() is g1
        side.wait_stream(s1)                     # a side stream joined into capture 1
        with torch.cuda.stream(side):
            assert current_capture() == current_capture() and current_capture()() is g1
    with torch.cuda.stream(s2):
        g2.capture_begin(capture_error_mode="relaxed")
        assert current_capture()() is g2
        r2 = op(sends[1], counts)                # a flag "capturing" would wait for capture 1's event here
        g2.capture_end()
    with torch.cuda.stream(s1):
        s1.wait_stream(side)
        g1.capture_end()
    for graph, res, send in ((g1, r1, sends[0]), (g2, r2, sends[1])):
        res.recv.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(res.recv[0, :3], send)
    assert torch.equal(want, sends[0])
    g.check()
    g.close()
