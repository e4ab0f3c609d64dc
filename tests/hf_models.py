"""Tiny transformers MoE configs (random init, no download) shared by the adapter tests and benchmarks."""

from __future__ import annotations

import transformers

ARCHS = ("qwen3_moe", "deepseek_v3", "qwen3_next")


def tiny_config(
    arch: str, hidden: int = 64, layers: int = 3, moe_intermediate: int = 40
) -> transformers.PretrainedConfig:
    """A few-layer config of `arch` with an odd number of experts per layer where the arch allows it."""
    common = dict(vocab_size=256, hidden_size=hidden, num_hidden_layers=layers, max_position_embeddings=256)
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=96,
            moe_intermediate_size=moe_intermediate,
            num_experts=13,
            num_experts_per_tok=3,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    if arch == "deepseek_v3":  # shared experts, grouped routing, a dense first layer
        return transformers.DeepseekV3Config(
            **common,
            num_attention_heads=4,
            num_key_value_heads=4,
            intermediate_size=96,
            moe_intermediate_size=moe_intermediate,
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
        )
    if arch == "qwen3_next":  # hybrid: gated-deltanet linear attention + full attention every 3rd layer
        return transformers.Qwen3NextConfig(
            **common,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=96,
            moe_intermediate_size=moe_intermediate,
            num_experts=11,
            num_experts_per_tok=3,
            shared_expert_intermediate_size=32,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            full_attention_interval=3,
        )
    raise ValueError(f"unknown arch {arch!r}; one of {ARCHS}")


def num_routed_experts(cfg: transformers.PretrainedConfig) -> int:
    return getattr(cfg, "num_experts", None) or cfg.n_routed_experts
