"""The tiny checkpoints' transformers configs, one preset per architecture (small enough for
CPU tests, with every layer kind of the family), and the special token ids they share."""

from __future__ import annotations

from typing import Any

from shortconv.engine import tokenizer as toks

TOKEN_IDS = {
    "pad_token_id": toks.SPECIAL_TOKENS.index(toks.PAD_TOKEN),
    "bos_token_id": toks.SPECIAL_TOKENS.index(toks.BOS_TOKEN),
    "eos_token_id": toks.SPECIAL_TOKENS.index(toks.EOS_TOKEN),
}

TINY_PRESETS: dict[str, dict[str, Any]] = {
    "lfm2": {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        # False: with True the MLP width would be rounded up to a multiple of 256.
        "block_auto_adjust_ff_dim": False,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "layer_types": ["conv", "conv", "full_attention", "conv", "full_attention", "conv"],
        "conv_L_cache": 3,
        "conv_bias": False,
        "tie_word_embeddings": True,
        **TOKEN_IDS,
    },
    "lfm2_moe": {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        # Layer 0 is the dense one; MoE covers both a conv and an attention layer.
        "layer_types": ["conv", "full_attention", "conv", "full_attention"],
        "num_dense_layers": 1,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "use_expert_bias": True,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "conv_L_cache": 3,
        "conv_bias": False,
        "tie_word_embeddings": True,
        **TOKEN_IDS,
    },
    "lfm3": {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 6,
        # 16 q / 4 KV heads in the real model: tp 2 and 4 shard the KV heads here too.
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 16,
        "max_position_embeddings": 1024,
        # Both attention kinds, three conv layers (one between two sliding layers).
        "layer_types": [
            "conv",
            "sliding_attention",
            "conv",
            "full_attention",
            "sliding_attention",
            "conv",
        ],
        # A window of a few KV pages at the tests' page sizes; RoPE, conv width and the gates
        # and sandwich norms take Lfm3Config's defaults.
        "sliding_window": 8,
        "tie_word_embeddings": True,
        **TOKEN_IDS,
    },
    "zaya1": {  # transformers model_type "zaya", ZayaForCausalLM
        "vocab_size": 512,
        "hidden_size": 64,
        "head_dim": 16,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "num_experts": 4,
        "num_experts_per_tok": 1,
        "moe_intermediate_size": 32,
        "router_hidden_size": 32,
        "cca_time0": 2,
        "cca_time1": 2,
        "tie_word_embeddings": True,
        **TOKEN_IDS,
    },
}
