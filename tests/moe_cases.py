"""Inputs, a toy expert and a pure-torch reference MoE layer, shared by the ops and vLLM-adapter tests.

Every rank rebuilds every rank's inputs from the seed, so each checks its own output by itself.
"""

from __future__ import annotations

import torch


def make_inputs(world: int, tokens: list[int], num_experts: int, topk: int, hidden: int, seed: int,
                dtype=torch.bfloat16):
    """Per rank r: x [T_r, hidden] dtype, topk_idx [T_r, topk] int64 (distinct experts per token, about
    one slot in eight set to -1), topk_weights [T_r, topk] float32."""
    g = torch.Generator().manual_seed(seed)
    xs, idxs, ws = [], [], []
    for r in range(world):
        t = tokens[r]
        xs.append(torch.randn(t, hidden, generator=g).to(dtype))
        idx = torch.stack([torch.randperm(num_experts, generator=g)[:topk] for _ in range(t)]) if t else \
            torch.empty(0, topk, dtype=torch.int64)
        idx[torch.rand(idx.shape, generator=g) < 0.125] = -1
        idxs.append(idx)
        ws.append(torch.rand(t, topk, generator=g))
    return xs, idxs, ws


def toy_experts(rank: int, local_experts: int, x: torch.Tensor) -> torch.Tensor:
    """Expert e (global id) multiplies its rows by (e + 1) / 4: [E_local, rows, hidden] -> same shape/dtype."""
    e = torch.arange(local_experts, dtype=torch.float32) + rank * local_experts
    return (x.float() * ((e + 1) / 4).view(-1, 1, 1)).to(x.dtype)


def reference_moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """y[t] = sum over k with topk_idx[t,k] >= 0 of w[t,k] * expert(topk_idx[t,k], x[t]), in float32, k in order."""
    y = torch.zeros(x.shape, dtype=torch.float32)
    for k in range(topk_idx.shape[1]):
        e = topk_idx[:, k]
        routed = (e >= 0).float().view(-1, 1)
        scaled = (x.float() * ((e.float() + 1) / 4).view(-1, 1)).to(x.dtype).float()
        y += routed * topk_weights[:, k].view(-1, 1) * scaled
    return y.to(x.dtype)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """bf16 results of a weighted sum: equal up to one rounding of the output."""
    return a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2)
