"""Single-process reference of the tiny MoE decoder: no KV cache, no communication, every expert local.

It recomputes the whole sequence each step with a causal mask and runs each expert on exactly the tokens
routed to it, so it shares only the small building blocks (norm, router, gated MLP) with the served model.
Every serving backend's logits are checked against it.
"""

from __future__ import annotations

import torch

from .model import ATTENTION_IN_FLOAT32, default_attention_impl, gated_mlp, rms_norm, route
from .weights import ModelWeights


class ReferenceModel:
    """weights: a ModelWeights holding every expert (``build_weights(cfg, device)``).
    attention_impl: the served model's attention ("torch" or "triton"; None = ``default_attention_impl``,
    as in ``MoEDecoder``); the reference rounds its attention scores and probabilities where that
    attention does (``model.ATTENTION_IN_FLOAT32``), and nowhere else follows it.
    """

    def __init__(self, weights: ModelWeights, attention_impl: str | None = None):
        if (weights.expert_lo, weights.expert_hi) != (0, weights.cfg.num_experts):
            raise ValueError("the reference model needs every expert")
        self.cfg, self.w = weights.cfg, weights
        impl = attention_impl or default_attention_impl(weights.embed.device)
        self.attention_in_float32 = ATTENTION_IN_FLOAT32[impl]

    @torch.no_grad()
    def logits(self, tokens: list[int], excluded_experts=frozenset()) -> torch.Tensor:
        """tokens: one sequence of S ids -> logits [S, vocab] float32 (position s predicts token s+1).
        excluded_experts: experts whose rank was excluded; slots routed to them are not routed (the router
        still picks them, their weight is dropped), as EPBuffer does after ``group.exclude``."""
        cfg, w = self.cfg, self.w
        ids = torch.tensor(tokens, dtype=torch.int64, device=w.embed.device)
        x = w.embed[ids]
        for lw in w.layers:
            x = x + self._attention(lw, rms_norm(x, lw.attn_norm))
            x = x + self._moe(lw, rms_norm(x, lw.moe_norm), excluded_experts)
        return (rms_norm(x, w.final_norm) @ w.lm_head).float()

    def _attention(self, lw, h):
        s, nh, hd = h.shape[0], self.cfg.num_heads, self.cfg.head_dim
        q, k, v = ((h @ m).view(s, nh, hd) for m in (lw.wq, lw.wk, lw.wv))
        if self.attention_in_float32:
            q, k, v = q.float(), k.float(), v.float()
        scores = torch.einsum("qhd,khd->hqk", q, k).float() * hd ** -0.5
        causal = torch.ones(s, s, dtype=torch.bool, device=h.device).tril()
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1).to(v.dtype)
        out = torch.einsum("hqk,khd->qhd", probs, v).to(h.dtype)
        return out.reshape(s, nh * hd) @ lw.wo

    def _moe(self, lw, h, excluded_experts=frozenset()):
        idx, weights = route(h, lw.router, self.cfg.topk)
        if excluded_experts:
            gone = torch.tensor(sorted(excluded_experts), device=idx.device)
            weights = torch.where(torch.isin(idx, gone), torch.zeros_like(weights), weights)
        expert_out = torch.zeros(*idx.shape, h.shape[1], dtype=h.dtype, device=h.device)  # [S, K, H]
        for e in idx.unique().tolist():
            tok, k = (idx == e).nonzero(as_tuple=True)
            expert_out[tok, k] = gated_mlp(h[tok], lw.expert_gate[e], lw.expert_up[e], lw.expert_down[e])
        routed = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
        for k in range(idx.shape[1]):  # float32, fixed k order, like EPBuffer.combine
            routed = routed + weights[:, k, None] * expert_out[:, k].float()
        routed = routed.to(h.dtype)
        if lw.shared_gate is None:
            return routed
        return gated_mlp(h, lw.shared_gate, lw.shared_up, lw.shared_down) + routed

    def generate(self, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
        """Greedy decoding: (new token ids, logits [max_new_tokens, vocab] float32 that chose them)."""
        seq, rows = list(prompt), []
        for _ in range(max_new_tokens):
            row = self.logits(seq)[-1]
            rows.append(row)
            seq.append(int(row.argmax()))
        return seq[len(prompt):], torch.stack(rows) if rows else torch.empty(0, self.cfg.vocab)
