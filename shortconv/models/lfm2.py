"""LFM2 and LFM2-MoE: gated short-conv and GQA attention layers, SwiGLU or sigmoid-routed MoE."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from shortconv.cache.state_pool import StateSpec
from shortconv.configs.config import ModelConfig
from shortconv.execution.backend import BaseStateBackend
from shortconv.execution.parallel import ParallelContext
from shortconv.layers.attention import Lfm2Attention
from shortconv.layers.mlp import SwiGLU
from shortconv.layers.moe import SigmoidTopKMoE
from shortconv.layers.norm import RMSNorm
from shortconv.layers.rotary import RotaryEmbedding
from shortconv.layers.short_conv import ShortConv
from shortconv.layers.vocab import LMHead, VocabEmbedding
from shortconv.models.weights import WeightLoader


class Lfm2Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int, tp: ParallelContext, rope: RotaryEmbedding):
        super().__init__()
        self.is_attention = cfg.layer_types[i] == "attention"
        if self.is_attention:
            self.self_attn = Lfm2Attention(cfg, i, tp, rope)
        else:
            self.conv = ShortConv(cfg, i, tp)
        if cfg.arch == "lfm2_moe" and i >= cfg.num_dense_layers:
            self.feed_forward: nn.Module = SigmoidTopKMoE(cfg, tp)
        else:
            self.feed_forward = SwiGLU(cfg.hidden_size, cfg.intermediate_size, tp)
        self.operator_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)

    def forward(self, h: torch.Tensor, backend: BaseStateBackend) -> torch.Tensor:
        x = self.operator_norm(h)
        x = self.self_attn(x, backend) if self.is_attention else self.conv(x, backend)
        h = h + x
        return h + self.feed_forward(self.ffn_norm(h))


class Lfm2ForCausalLM(nn.Module):
    """`forward(input_ids[T], backend) -> hidden[T, H]`; logits via compute_logits."""

    extra_state_name: str | None = None

    def __init__(self, cfg: ModelConfig, tp: ParallelContext):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        rope = RotaryEmbedding(cfg.head_dim, cfg.rotary_dim, cfg.rope_theta, cfg.max_model_len)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(Lfm2Layer(cfg, i, tp, rope) for i in range(cfg.num_layers))
        self.embedding_norm = RMSNorm(
            cfg.hidden_size, cfg.norm_eps
        )  # HF's name; it is the final norm
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, backend: BaseStateBackend) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h, backend)
        return self.embedding_norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @staticmethod
    def state_specs(cfg: ModelConfig, tp: ParallelContext) -> list[StateSpec]:
        dim = tp.shard(cfg.hidden_size, "conv channels (hidden_size)")
        return [StateSpec("conv", cfg.conv_layer_ids, (dim, cfg.conv_width - 1))]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        loader = WeightLoader(self, self.tp, _hf_to_ours(self.cfg))
        loader.load(weights)


def _hf_to_ours(cfg: ModelConfig) -> dict[str, str]:
    """Rename rules: HF checkpoint name fragment → our parameter name fragment."""
    return {
        "model.embed_tokens.": "embed_tokens.",
        "model.embedding_norm.": "embedding_norm.",
        "model.layers.": "layers.",
        ".conv.conv.weight": ".conv.conv_weight",
        ".conv.conv.bias": ".conv.conv_bias",
        ".feed_forward.gate.weight": ".feed_forward.gate_weight",
    }
