"""The masked expert GEMMs compiled on the GPU against torch on the valid rows, and in a CUDA graph.

Tolerance: bf16 inputs, float32 accumulation; within 2e-2 of the largest |output| of the expert (torch
rounds the gate and up products to bf16 before multiplying them, the kernel rounds once).
"""

import pytest
import torch

from moe_comm.serving.experts import dense_expert_mlp, masked_expert_mlp

pytestmark = pytest.mark.gpu


def _inputs(E, R, H, inter, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(E, R, H, generator=g, device="cuda").bfloat16()
    gate = (torch.randn(E, H, inter, generator=g, device="cuda") / H ** 0.5).bfloat16()
    up = (torch.randn(E, H, inter, generator=g, device="cuda") / H ** 0.5).bfloat16()
    down = (torch.randn(E, inter, H, generator=g, device="cuda") / inter ** 0.5).bfloat16()
    return x, gate, up, down


@pytest.mark.parametrize("E,R,H,inter,expected", [(16, 33, 640, 1024, 2), (8, 128, 7168, 256, 64), (4, 5, 136, 200, 1)])
def test_masked_expert_mlp_compiled(E, R, H, inter, expected):
    x, gate, up, down = _inputs(E, R, H, inter, E + R)
    counts = torch.randint(0, R + 1, (E,), dtype=torch.int32, device="cuda")
    counts[0], counts[-1] = 0, R + 7  # an idle expert and a count above R (clamped)
    gate[0] = float("nan")  # the idle expert's weights are never read
    y = masked_expert_mlp(x, counts, gate, up, down, expected_rows=expected)
    want = dense_expert_mlp(x.float(), counts, gate.float(), up.float(), down.float())
    for e, n in enumerate(counts.clamp(0, R).tolist()):
        if n:
            err = (y[e, :n].float() - want[e, :n]).abs().max() / want[e, :n].abs().max()
            assert err <= 2e-2 and not y[e, :n].isnan().any(), (e, n, float(err))


def test_masked_expert_mlp_in_cuda_graph_with_new_counts():
    E, R, H, inter = 16, 64, 512, 768
    x, gate, up, down = _inputs(E, R, H, inter, 0)
    counts = torch.zeros(E, dtype=torch.int32, device="cuda")
    masked_expert_mlp(x, counts, gate, up, down)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = masked_expert_mlp(x, counts, gate, up, down)
    want = dense_expert_mlp(x.float(), counts, gate.float(), up.float(), down.float())
    for step in range(4):
        counts.copy_(torch.randint(0, R + 1, (E,), dtype=torch.int32, device="cuda"))
        graph.replay()
        for e, n in enumerate(counts.tolist()):
            if n:
                err = (y[e, :n].float() - want[e, :n]).abs().max() / want[e, :n].abs().max()
                assert err <= 2e-2, (step, e, n, float(err))
