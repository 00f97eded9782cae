"""LFM3: LFM2's short-conv and attention stack with sliding-window and full attention layers
(each kind with its RoPE, rotated in fp32), per-head sigmoid attention gates and sandwich norms
(an RMSNorm on each operator's and MLP's output before the residual add). The MLP is the dense
SwiGLU at `intermediate_size`; state and KV layout are LFM2's."""

from __future__ import annotations

import torch
from torch import nn

from shortconv.configs.config import ModelConfig
from shortconv.execution.backend import BaseStateBackend
from shortconv.execution.parallel import ParallelContext
from shortconv.layers.norm import RMSNorm
from shortconv.layers.rotary import RotaryEmbedding
from shortconv.models.lfm2 import LFM2_RENAMES, Lfm2ForCausalLM, Lfm2Layer

# transformers' Lfm3Attention names (Qwen3's) → Lfm2Attention's. The gate is saved as
# `gate_proj` (transformers' conversion mapping renames it to `g_proj` on load); either loads.
_ATTENTION_RENAMES = {
    ".self_attn.gate_proj.": ".self_attn.g_proj.",
    ".self_attn.o_proj.": ".self_attn.out_proj.",
    ".self_attn.q_norm.": ".self_attn.q_layernorm.",
    ".self_attn.k_norm.": ".self_attn.k_layernorm.",
}


def _post_norm(cfg: ModelConfig) -> nn.Module:
    return RMSNorm(cfg.hidden_size, cfg.norm_eps) if cfg.sandwich_norm else nn.Identity()


class Lfm3Layer(Lfm2Layer):
    def __init__(self, cfg: ModelConfig, i: int, tp: ParallelContext, rope: RotaryEmbedding | None):
        super().__init__(cfg, i, tp, rope)
        self.post_operator_norm = _post_norm(cfg)
        self.post_ffn_norm = _post_norm(cfg)

    def forward(self, h: torch.Tensor, backend: BaseStateBackend) -> torch.Tensor:
        h = h + self.post_operator_norm(self.mix(self.operator_norm(h), backend))
        return h + self.post_ffn_norm(self.feed_forward(self.ffn_norm(h)))


class Lfm3ForCausalLM(Lfm2ForCausalLM):
    """`forward(input_ids[T], backend) -> hidden[T, H]`; logits via compute_logits."""

    layer_class = Lfm3Layer
    rope_in_fp32 = True  # transformers' LFM3 rotates q and k in float32 (olmo's RoPE)

    @staticmethod
    def hf_to_ours() -> dict[str, str]:
        return LFM2_RENAMES | _ATTENTION_RENAMES
