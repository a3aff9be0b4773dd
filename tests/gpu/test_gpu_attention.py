"""The Triton decode attention compiled on the GPU against the float32 gather attention, at DeepSeek-V3's
head shape (56 heads of 128, 512 cache positions), and replayed from a CUDA graph with new positions.

Tolerance: bf16 inputs and output; within 1e-2 of the largest |output| (the output's own rounding).
"""

import pytest
import torch

from moe_comm.serving.attention import attend_triton
from moe_comm.serving.model import attend_gather

pytestmark = pytest.mark.gpu


def _inputs(T, seed, slots_n=9, max_seq=512, heads=56, head_dim=128):
    g = torch.Generator(device="cuda").manual_seed(seed)
    k = torch.randn(slots_n, max_seq, heads, head_dim, generator=g, device="cuda").bfloat16()
    v = torch.randn(slots_n, max_seq, heads, head_dim, generator=g, device="cuda").bfloat16()
    q = torch.randn(T, heads, head_dim, generator=g, device="cuda").bfloat16()
    slots = torch.randint(0, slots_n, (T,), generator=g, device="cuda")
    positions = torch.randint(0, max_seq, (T,), generator=g, device="cuda")
    return q, k, v, slots, positions


def _check(got, q, k, v, slots, positions):
    want = attend_gather(q.float(), k.float(), v.float(), slots, positions)
    err = (got.float() - want).abs().max() / want.abs().max()
    assert err <= 1e-2 and torch.isfinite(got).all(), float(err)


@pytest.mark.parametrize("T", [1, 7, 256])
def test_decode_attention_compiled(T):
    q, k, v, slots, positions = _inputs(T, T)
    positions[0] = 0
    if T > 1:
        positions[1] = 511
    _check(attend_triton(q, k, v, slots, positions), q, k, v, slots, positions)


def test_decode_attention_in_cuda_graph_with_new_positions():
    q, k, v, slots, positions = _inputs(16, 0)
    attend_triton(q, k, v, slots, positions)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend_triton(q, k, v, slots, positions)
    for seed in range(1, 4):
        q2, _, _, slots2, positions2 = _inputs(16, seed)
        q.copy_(q2), slots.copy_(slots2), positions.copy_(positions2)
        out.fill_(float("nan"))
        graph.replay()
        _check(out, q, k, v, slots, positions)
