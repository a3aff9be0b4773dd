"""Named tiny-MoE model configurations, shaped like public MoE models.

On a GPU the hidden, head and expert sizes are the real ones and only the layer count (and the vocabulary,
so the LM head does not dominate a model of one or two layers) is cut. On the CPU every width is shrunk so
the Triton kernels, interpreted there, finish in seconds; the expert count and top-k stay the real ones,
since they decide how tokens move.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelConfig:
    """Shapes of a tiny MoE decoder.

    Every layer is attention followed by an MoE block: ``num_experts`` SiLU-gated experts of width
    ``expert_inter``, top-``topk`` routing, plus a shared expert of width ``shared_inter`` (0 = none).
    Attention is plain multi-head attention (``num_heads`` x ``head_dim`` = q/k/v width) with a KV cache of
    ``max_seq`` positions and no positional encoding beyond the causal mask.
    """

    name: str
    hidden: int
    num_layers: int
    num_heads: int
    head_dim: int
    num_experts: int
    topk: int
    expert_inter: int
    shared_inter: int
    vocab: int
    max_seq: int
    dtype: torch.dtype
    seed: int = 0

    def experts_per_rank(self, world_size: int) -> int:
        if self.num_experts % world_size:
            raise ValueError(f"{self.name}: {self.num_experts} experts do not split over {world_size} ranks")
        return self.num_experts // world_size


# Real widths; layer counts chosen so one layer set fits on one 80 GB GPU with every expert (world 1).
_GPU = {
    "llama4-scout": ModelConfig("llama4-scout", hidden=5120, num_layers=2, num_heads=40, head_dim=128,
                                num_experts=16, topk=1, expert_inter=8192, shared_inter=8192,
                                vocab=32768, max_seq=512, dtype=torch.bfloat16),
    "llama4-maverick": ModelConfig("llama4-maverick", hidden=5120, num_layers=1, num_heads=40, head_dim=128,
                                   num_experts=128, topk=1, expert_inter=8192, shared_inter=8192,
                                   vocab=32768, max_seq=512, dtype=torch.bfloat16),
    "deepseek-v3": ModelConfig("deepseek-v3", hidden=7168, num_layers=1, num_heads=56, head_dim=128,
                               num_experts=256, topk=8, expert_inter=2048, shared_inter=2048,
                               vocab=32768, max_seq=512, dtype=torch.bfloat16),
    "mixtral": ModelConfig("mixtral", hidden=4096, num_layers=2, num_heads=32, head_dim=128,
                           num_experts=8, topk=2, expert_inter=14336, shared_inter=0,
                           vocab=32768, max_seq=512, dtype=torch.bfloat16),
}

CONFIG_NAMES = tuple(_GPU)


def _shrunk(cfg: ModelConfig) -> ModelConfig:
    """CPU-sized copy: same experts / top-k / shared-expert presence, tiny widths, float32."""
    return dataclasses.replace(cfg, hidden=64, num_layers=2, num_heads=4, head_dim=16, expert_inter=32,
                               shared_inter=32 if cfg.shared_inter else 0, vocab=128, max_seq=64,
                               dtype=torch.float32)


def model_config(name: str, device: str | torch.device = "cpu", **overrides) -> ModelConfig:
    """The named config at its real widths on CUDA, shrunk on the CPU; ``overrides`` replace fields."""
    if name not in _GPU:
        raise ValueError(f"unknown model config {name!r}; choose from {CONFIG_NAMES}")
    cfg = _GPU[name] if torch.device(device).type == "cuda" else _shrunk(_GPU[name])
    return dataclasses.replace(cfg, **overrides) if overrides else cfg
