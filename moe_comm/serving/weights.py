"""Seeded random weights of a tiny MoE decoder.

Every tensor is drawn from its own generator seeded by (config seed, layer, tensor, expert), so any rank can
build exactly the experts it owns, and the single-process reference with every expert gets the same numbers.
Same device type + same seed -> same weights on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .configs import ModelConfig

# Tensor ids inside a layer (part of the seed).
_WQ, _WK, _WV, _WO, _ROUTER, _SH_GATE, _SH_UP, _SH_DOWN, _EX_GATE, _EX_UP, _EX_DOWN = range(11)
_GLOBAL_LAYER = 10_000  # pseudo layer index of embedding and LM head


@dataclass
class LayerWeights:
    """One decoder layer. H = hidden, A = num_heads*head_dim, I = expert_inter, S = shared_inter, E = held experts.

    attn_norm, moe_norm [H]; wq, wk, wv [H, A]; wo [A, H]; router [H, num_experts] (all experts, replicated);
    shared_gate, shared_up [H, S], shared_down [S, H] or None; expert_gate, expert_up [E, H, I];
    expert_down [E, I, H] for global experts [expert_lo, expert_lo + E).
    """

    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    moe_norm: torch.Tensor
    router: torch.Tensor
    shared_gate: torch.Tensor | None
    shared_up: torch.Tensor | None
    shared_down: torch.Tensor | None
    expert_gate: torch.Tensor
    expert_up: torch.Tensor
    expert_down: torch.Tensor
    expert_lo: int


@dataclass
class ModelWeights:
    """embed [vocab, H]; layers; final_norm [H]; lm_head [H, vocab]. Experts [expert_lo, expert_hi) are held."""

    cfg: ModelConfig
    embed: torch.Tensor
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor
    expert_lo: int
    expert_hi: int

    def expert_slice(self, lo: int, hi: int) -> "ModelWeights":
        """The same weights holding only experts [lo, hi) (views, no copy)."""
        if not (self.expert_lo <= lo <= hi <= self.expert_hi):
            raise ValueError(f"experts [{lo}, {hi}) not within held [{self.expert_lo}, {self.expert_hi})")
        a, b = lo - self.expert_lo, hi - self.expert_lo
        layers = [replace(lw, expert_gate=lw.expert_gate[a:b], expert_up=lw.expert_up[a:b],
                          expert_down=lw.expert_down[a:b], expert_lo=lo) for lw in self.layers]
        return replace(self, layers=layers, expert_lo=lo, expert_hi=hi)

    def for_rank(self, rank: int, world_size: int) -> "ModelWeights":
        """Rank ``rank``'s share: experts [rank*E_local, (rank+1)*E_local), everything else replicated."""
        e_local = self.cfg.experts_per_rank(world_size)
        return self.expert_slice(rank * e_local, (rank + 1) * e_local)


def _randn(cfg: ModelConfig, device, shape, fan_in: int, *key: int) -> torch.Tensor:
    seed = cfg.seed
    for k in key:
        seed = (seed * 1_000_003 + k + 1) % (2 ** 62)
    g = torch.Generator(device=device).manual_seed(seed)
    t = torch.randn(shape, generator=g, device=device, dtype=torch.float32)
    return t.mul_(fan_in ** -0.5).to(cfg.dtype)


def _experts(cfg, device, layer, tensor_id, lo, hi, shape, fan_in) -> torch.Tensor:
    out = torch.empty((hi - lo, *shape), dtype=cfg.dtype, device=device)
    for e in range(lo, hi):  # one generator per expert so a rank can build only its own
        out[e - lo] = _randn(cfg, device, shape, fan_in, layer, tensor_id, e)
    return out


def build_weights(cfg: ModelConfig, device="cpu", experts: tuple[int, int] | None = None) -> ModelWeights:
    """Build the weights of ``cfg`` on ``device``, holding experts [lo, hi) (default: all of them)."""
    device = torch.device(device)
    lo, hi = experts if experts is not None else (0, cfg.num_experts)
    h, a, i, s = cfg.hidden, cfg.num_heads * cfg.head_dim, cfg.expert_inter, cfg.shared_inter
    ones = torch.ones(h, dtype=cfg.dtype, device=device)
    layers = []
    for l in range(cfg.num_layers):
        r = lambda shape, fan_in, tid: _randn(cfg, device, shape, fan_in, l, tid)  # noqa: E731
        layers.append(LayerWeights(
            attn_norm=ones.clone(), wq=r((h, a), h, _WQ), wk=r((h, a), h, _WK), wv=r((h, a), h, _WV),
            wo=r((a, h), a, _WO), moe_norm=ones.clone(), router=r((h, cfg.num_experts), h, _ROUTER),
            shared_gate=r((h, s), h, _SH_GATE) if s else None, shared_up=r((h, s), h, _SH_UP) if s else None,
            shared_down=r((s, h), s, _SH_DOWN) if s else None,
            expert_gate=_experts(cfg, device, l, _EX_GATE, lo, hi, (h, i), h),
            expert_up=_experts(cfg, device, l, _EX_UP, lo, hi, (h, i), h),
            expert_down=_experts(cfg, device, l, _EX_DOWN, lo, hi, (i, h), i),
            expert_lo=lo))
    embed = _randn(cfg, device, (cfg.vocab, h), 1, _GLOBAL_LAYER, 0)
    lm_head = _randn(cfg, device, (h, cfg.vocab), h, _GLOBAL_LAYER, 1)
    return ModelWeights(cfg, embed, layers, ones.clone(), lm_head, lo, hi)
