"""LFM2 and LFM2-MoE: gated short-conv and GQA attention layers, SwiGLU or sigmoid-routed MoE."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from shortconv.execution.shard_rows import Rows


class Lfm2Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int, tp: ParallelContext, rope: RotaryEmbedding | None):
        super().__init__()
        self.is_attention = rope is not None
        if rope is not None:
            self.self_attn = Lfm2Attention(cfg, i, tp, rope)
        else:
            self.conv = ShortConv(cfg, i, tp)
        if cfg.arch == "lfm2_moe" and i >= cfg.num_dense_layers:
            self.feed_forward: nn.Module = SigmoidTopKMoE(cfg, tp)
        else:
            self.feed_forward = SwiGLU(cfg.hidden_size, cfg.intermediate_size, tp)
        self.operator_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)

    def mix(self, x: torch.Tensor, backend: BaseStateBackend) -> torch.Tensor:
        """The layer's operator: attention or short conv."""
        return self.self_attn(x, backend) if self.is_attention else self.conv(x, backend)

    def forward(self, h: torch.Tensor, backend: BaseStateBackend) -> torch.Tensor:
        h = h + self.mix(self.operator_norm(h), backend)
        return h + self.feed_forward(self.ffn_norm(h))


class Lfm2ForCausalLM(nn.Module):
    """`forward(input_ids[T], backend) -> hidden[T, H]`; logits via compute_logits."""

    extra_state_name: str | None = None
    layer_class: type[Lfm2Layer] = Lfm2Layer
    rope_in_fp32 = False  # rotate in q's dtype (LFM2's reference casts cos/sin to it)

    def __init__(self, cfg: ModelConfig, tp: ParallelContext):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        # One RoPE table per attention kind (LFM3's two kinds differ), shared by its layers.
        ropes = {
            kind: RotaryEmbedding.of(
                cfg.head_dim, cfg.rope_of(kind), cfg.max_model_len, self.rope_in_fp32
            )
            for kind in dict.fromkeys(cfg.layer_types)
            if kind in ("attention", "sliding_attention")
        }
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(
            self.layer_class(cfg, i, tp, ropes.get(t)) for i, t in enumerate(cfg.layer_types)
        )
        self.embedding_norm = RMSNorm(
            cfg.hidden_size, cfg.norm_eps
        )  # HF's name; it is the final norm
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        backend: BaseStateBackend,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`inputs_embeds` (a multimodal model's, images placed) replaces the token lookup."""
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        for layer in self.layers:
            h = layer(h, backend)
        return self.embedding_norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @staticmethod
    def state_specs(cfg: ModelConfig, tp: ParallelContext) -> list[StateSpec]:
        dim = tp.shard(cfg.hidden_size, "conv channels (hidden_size)")
        return [StateSpec("conv", cfg.conv_layer_ids, (dim, cfg.conv_width - 1))]

    @staticmethod
    def state_rows(cfg: ModelConfig, tp: ParallelContext) -> dict[str, Rows]:
        """The channels of every state kind this rank holds (`execution.state_shards`): a
        contiguous block of the conv's hidden_size channels."""
        dim = tp.shard(cfg.hidden_size, "conv channels (hidden_size)")
        return {"conv": ((tp.rank * dim, (tp.rank + 1) * dim),)}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        loader = WeightLoader(self, self.tp, self.hf_to_ours())
        loader.load(weights)

    @staticmethod
    def hf_to_ours() -> dict[str, str]:
        """Rename rules: HF checkpoint name fragment → our parameter name fragment."""
        return LFM2_RENAMES


LFM2_RENAMES = {
    "model.embed_tokens.": "embed_tokens.",
    "model.embedding_norm.": "embedding_norm.",
    "model.layers.": "layers.",
    ".conv.conv.weight": ".conv.conv_weight",
    ".conv.conv.bias": ".conv.conv_bias",
    ".feed_forward.gate.weight": ".feed_forward.gate_weight",
}
