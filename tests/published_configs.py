"""config.json field sets of published checkpoints, in the transformers format.

Sources: the config.json files of the Hugging Face repos named on each entry (the public model
cards), as recalled, cross-checked against transformers 5.24, whose Lfm2Config documents
LiquidAI/LFM2-1.2B, Lfm2MoeConfig LiquidAI/LFM2-8B-A1B and ZayaConfig Zyphra/ZAYA1-8B with
these widths as class defaults. Only fields that change a shape are listed beyond the
identifying ones; which layers are attention matters to the shapes only by their count
(LFM2-350M/1.2B: 6 of 16, LFM2-2.6B: 8 of 30, LFM2-8B-A1B: 6 of 24, as the model cards state).
"""

from __future__ import annotations

from typing import Any


def _attention_at(n: int, idxs: list[int]) -> list[str]:
    return ["full_attention" if i in idxs else "conv" for i in range(n)]


_LFM2_COMMON: dict[str, Any] = {
    "architectures": ["Lfm2ForCausalLM"],
    "model_type": "lfm2",
    "vocab_size": 65536,
    "max_position_embeddings": 128000,
    "norm_eps": 1e-05,
    "conv_L_cache": 3,
    "conv_bias": False,
    "rope_theta": 1000000.0,
    "block_auto_adjust_ff_dim": True,
    "block_ffn_dim_multiplier": 1.0,
    "block_multiple_of": 256,
    "tie_embedding": True,
    "bos_token_id": 1,
    "eos_token_id": 7,
    "pad_token_id": 0,
    "torch_dtype": "bfloat16",
}


# LiquidAI/LFM2-350M: 16 layers (10 conv + 6 attention), 16 query / 8 KV heads of 64.
LFM2_350M: dict[str, Any] = {
    **_LFM2_COMMON,
    "hidden_size": 1024,
    "block_ff_dim": 6656,
    "intermediate_size": 6656,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "layer_types": _attention_at(16, [2, 5, 8, 10, 12, 14]),
}
# LiquidAI/LFM2-1.2B: 16 layers (10 conv + 6 attention), 32 query / 8 KV heads of 64.
LFM2_1_2B: dict[str, Any] = {
    **_LFM2_COMMON,
    "hidden_size": 2048,
    "block_ff_dim": 12288,
    "intermediate_size": 12288,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "layer_types": _attention_at(16, [2, 5, 8, 10, 12, 14]),
}
# LiquidAI/LFM2-2.6B: 30 layers (22 conv + 8 attention), 32 query / 8 KV heads of 64.
LFM2_2_6B: dict[str, Any] = {
    **_LFM2_COMMON,
    "hidden_size": 2048,
    "block_ff_dim": 10752,
    "intermediate_size": 10752,
    "num_hidden_layers": 30,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "layer_types": _attention_at(30, [2, 6, 10, 14, 18, 21, 24, 27]),
}
# LiquidAI/LFM2-8B-A1B: 24 layers (18 conv + 6 attention), 2 dense then sparse MoE layers of
# 32 experts (top-4, 1792 wide), 32 query / 8 KV heads of 64.
LFM2_8B_A1B: dict[str, Any] = {
    **_LFM2_COMMON,
    "architectures": ["Lfm2MoeForCausalLM"],
    "model_type": "lfm2_moe",
    "hidden_size": 2048,
    "intermediate_size": 7168,
    "moe_intermediate_size": 1792,
    "num_hidden_layers": 24,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_dense_layers": 2,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "use_expert_bias": True,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "layer_types": _attention_at(24, [2, 6, 10, 14, 18, 21]),
}
# Zyphra/ZAYA1-8B in the transformers layout: 40 layers of CCA attention + top-1 MoE (16
# experts of 2048), 8 query / 2 KV heads of 128 (KV head 0 current-token, 1 previous-token
# values), partial RoPE over half of each head.
ZAYA1_8B: dict[str, Any] = {
    "architectures": ["ZayaForCausalLM"],
    "model_type": "zaya",
    "vocab_size": 262272,
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "moe_intermediate_size": 2048,
    "num_experts": 16,
    "num_experts_per_tok": 1,
    "router_hidden_size": 256,
    "cca_time0": 2,
    "cca_time1": 2,
    "rope_parameters": {
        "hybrid": {"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.5}
    },
    "tie_word_embeddings": True,
    "bos_token_id": 2,
    "eos_token_id": 106,
    "pad_token_id": 0,
    "torch_dtype": "bfloat16",
}

# LiquidAI/LFM3-1.7B as transformers 5.24's Lfm3Config documents it (its class defaults): 24
# layers (13 conv of width 7, 5 sliding-window attention of 256, 6 full attention), 16 query /
# 4 KV heads of 128, gated attention and sandwich norms, a dense MLP of 7680.
LFM3_1_7B: dict[str, Any] = {
    "architectures": ["Lfm3ForCausalLM"],
    "model_type": "lfm3",
    "vocab_size": 128000,
    "hidden_size": 2048,
    "intermediate_size": 7680,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "conv_L_cache": 7,
    "sliding_window": 256,
    "max_position_embeddings": 128000,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}
