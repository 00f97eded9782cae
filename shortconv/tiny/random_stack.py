"""A model, state pool and backend with random weights, built without a checkpoint.

For benchmarks and GPU checks at real model widths (LFM2-350M, ZAYA1), where writing and loading
a multi-GB checkpoint would only cost time. It needs neither transformers nor Ray: only the
engine's own config parser and model classes. Weights are seeded and scaled so activations
keep unit scale (N(0, 1/fan_in) matrices, norms and scales near 1, small biases).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shortconv.cache.kv_groups import kv_specs
from shortconv.cache.state_pool import StatePool
from shortconv.configs.config import EngineConfig, ModelConfig
from shortconv.execution.backend import ShortConvBackend
from shortconv.execution.parallel import SINGLE
from shortconv.models.build import build_model
from shortconv.models.registry import model_class

LOGIT_GAIN = 3.0  # embedding std * sqrt(hidden): clear greedy margins

# LFM2-350M's config.json (the fields the engine reads); weights are random.
LFM2_350M: dict[str, Any] = {
    "architectures": ["Lfm2ForCausalLM"],
    "model_type": "lfm2",
    "vocab_size": 65536,
    "hidden_size": 1024,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "max_position_embeddings": 128000,
    "norm_eps": 1e-5,
    "conv_bias": False,
    "conv_L_cache": 3,
    "rope_theta": 1000000.0,
    "full_attn_idxs": [2, 5, 8, 10, 12, 14],
    "block_ff_dim": 6656,
    "block_auto_adjust_ff_dim": True,
    "block_ffn_dim_multiplier": 1.0,
    "block_multiple_of": 256,
    "tie_word_embeddings": True,
    "eos_token_id": 7,
    "bos_token_id": 1,
}

# ZAYA1 at the widths of transformers' ZayaConfig defaults (the released model's shape).
ZAYA1_BASE: dict[str, Any] = {
    "architectures": ["ZayaForCausalLM"],
    "model_type": "zaya",
    "vocab_size": 262272,
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "max_position_embeddings": 131072,
    "num_experts": 16,
    "num_experts_per_tok": 1,
    "moe_intermediate_size": 2048,
    "router_hidden_size": 256,
    "cca_time0": 2,
    "cca_time1": 2,
    "tie_word_embeddings": True,
    "eos_token_id": 106,
    "bos_token_id": 2,
}


@dataclass(frozen=True)
class RandomStack:
    """What a ModelRunner holds for one rank, minus the checkpoint, sampler and graphs."""

    cfg: ModelConfig
    model: nn.Module
    pool: StatePool
    backend: ShortConvBackend

    @property
    def device(self) -> torch.device:
        return self.backend.device


@torch.no_grad()
def randomize_(model: nn.Module, seed: int = 0) -> None:
    """Seeded, scale-preserving random values for every parameter (tied ones once), drawn on
    each parameter's own device (a multi-GB model is not generated on the host)."""
    gens: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        gen = gens.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
        if p.dim() >= 2:
            fan_in = p.shape[-1] if p.dim() == 2 or "experts" in name else math.prod(p.shape[1:])
            gain = LOGIT_GAIN if "embed_tokens" in name else 1.0
            p.normal_(0.0, gain / math.sqrt(fan_in), generator=gen)
        elif "bias" in name.rsplit(".", 1)[-1]:
            p.uniform_(-0.05, 0.05, generator=gen)
        else:
            p.uniform_(0.5, 1.5, generator=gen)  # norm weights and scales


def build_random_stack(
    raw: dict[str, Any],
    device: torch.device | str,
    dtype: torch.dtype,
    engine_cfg: EngineConfig,
    num_slots: int,
    num_pages: int,
    seed: int = 0,
) -> RandomStack:
    """Parse an HF-style config dict, build the model on `device` with random weights, and a
    state pool of `num_slots` slots (slot 0 scratch) and `num_pages` KV pages (page 0 scratch)."""
    device = torch.device(device)
    cfg = ModelConfig.from_hf_dict(raw)
    cls = model_class(cfg.arch)
    model = build_model(cls, cfg, SINGLE, device, dtype)
    randomize_(model, seed)
    kv = kv_specs(cfg, SINGLE, engine_cfg.kv_page_size, num_pages)
    pool = StatePool(cls.state_specs(cfg, SINGLE), kv, num_slots, dtype, device)
    backend = ShortConvBackend(pool, device, cls.extra_state_name)
    return RandomStack(cfg, model, pool, backend)
