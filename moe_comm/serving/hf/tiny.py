"""Tiny random-weight transformers MoE models, built from configs in code (no download): what the door's
tests and ``python -m moe_comm generate`` run. Each family keeps what makes it different (DeepSeek-V3:
shared experts, grouped top-k with a correction bias, a dense first layer; gpt-oss: biases, transposed
weights, its own clamped gate, sliding-window layers; Mixtral and Qwen3-MoE: plain SiLU-gated experts) at
hidden 64 (128 where an fp8 dispatch needs hidden % 128 == 0), 8 experts, top-2.
"""

from __future__ import annotations

import torch

FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss")
VOCAB = 96
INIT_RANGE = 0.2   # weights ~ N(0, 0.2): logits spread enough that greedy choices are not near-ties


def tiny_config(family: str, layers: int = 2, hidden: int = 64, experts: int = 8, topk: int = 2,
                intermediate: int | None = None):
    """A transformers config of ``family`` with ``layers`` decoder layers (for DeepSeek-V3 the first is
    dense when layers > 1, as its checkpoints have), ``experts`` experts of width ``intermediate`` (default
    hidden / 2), top-``topk``."""
    import transformers  # noqa: PLC0415
    common = dict(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, initializer_range=INIT_RANGE,
                  num_experts_per_tok=topk, eos_token_id=None, bos_token_id=None, pad_token_id=0,
                  tie_word_embeddings=False)
    inter = intermediate or hidden // 2
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, head_dim=hidden // 4, intermediate_size=hidden,
                                           moe_intermediate_size=inter, num_experts=experts, norm_topk_prob=True)
    if family == "mixtral":
        return transformers.MixtralConfig(**common, head_dim=hidden // 4, intermediate_size=inter,
                                          num_local_experts=experts)
    if family == "deepseek_v3":
        common["num_key_value_heads"] = common["num_attention_heads"]   # MLA: one latent per head
        return transformers.DeepseekV3Config(**common, intermediate_size=hidden, moe_intermediate_size=inter,
                                             n_routed_experts=experts, n_shared_experts=1, n_group=2, topk_group=1,
                                             first_k_dense_replace=1 if layers > 1 else 0, kv_lora_rank=32,
                                             q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                                             routed_scaling_factor=2.5)
    if family == "gpt_oss":
        return transformers.GptOssConfig(**common, head_dim=hidden // 4, intermediate_size=inter,
                                         num_local_experts=experts, sliding_window=8,
                                         rope_parameters=dict(rope_type="default", rope_theta=10000.0),
                                         layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(layers)])
    raise ValueError(f"unknown family {family!r}: one of {FAMILIES}")


def tiny_model(family: str, dtype: torch.dtype = torch.float32, seed: int = 0, experts_implementation: str = "eager",
               **config):
    """The same random weights for the same (family, dtype, seed, config) in every process, in eval mode."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415
    cfg = tiny_config(family, **config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, experts_implementation=experts_implementation,
                                             attn_implementation="eager")
    if family == "deepseek_v3":   # the router's correction bias starts at zero: give grouped top-k something to do
        g = torch.Generator().manual_seed(seed + 1)
        for m in model.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.copy_(0.1 * torch.randn(m.e_score_correction_bias.shape, generator=g))
    return model.to(dtype).eval()
