"""ZAYA1: every layer is CCA attention then a top-1 MoE with a skip route, each wrapped in a
learned fp32 residual scaling; scaled/biased input embeddings; tied LM head.

Per-slot state (StatePool) per layer: "conv" [C_shard, (t0-1)+(t1-1)] raw q‖k columns and
"prev_state" [Hk_shard*d/2], the last token's delayed value projection.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from shortconv.cache.state_pool import StateSpec
from shortconv.configs.config import ModelConfig
from shortconv.configs.hf.zaya1 import CONVERTER_HINT
from shortconv.errors import CheckpointError
from shortconv.execution.backend import BaseStateBackend
from shortconv.execution.head_shard import head_shard
from shortconv.execution.parallel import ParallelContext
from shortconv.layers.cca import CCAAttention, cca_state_dims, qk_rows, value_rows
from shortconv.layers.linear import mark_shard
from shortconv.layers.norm import RMSNorm
from shortconv.layers.rotary import RotaryEmbedding
from shortconv.layers.vocab import LMHead, VocabEmbedding
from shortconv.layers.zaya_moe import ZayaMoE
from shortconv.models.weights import WeightLoader

if TYPE_CHECKING:
    from shortconv.execution.shard_rows import Rows

__all__ = ["ZayaForCausalLM"]

# Key names of the original Zyphra layout (alternating attention / MoE layers).
_LEGACY_KEY = re.compile(
    r"(\.zaya_block\.|\.self_attn\.qkv\.|\.res_scale\.|^model\.res_scale\.|\.input_norm\.)"
)
# Key names only the transformers layout has.
_NEW_KEY = re.compile(
    r"\.(qkv_proj|qk_norm|mlp|input_layernorm|post_attention_layernorm|"
    r"post_attention_residual_scale|post_mlp_residual_scale)\."
)


def _param(n: int) -> nn.Parameter:
    return mark_shard(nn.Parameter(torch.empty(n)), None)


class ZayaResidualScaling(nn.Module):
    """(f + hidden_states_bias) * hidden_states_scale + (r + residual_bias) * residual_scale;
    the residual r stays fp32 like the reference's residual_in_fp32 path."""

    def __init__(self, hidden: int):
        super().__init__()
        self.hidden_states_scale, self.hidden_states_bias = _param(hidden), _param(hidden)
        self.residual_scale, self.residual_bias = _param(hidden), _param(hidden)

    def forward(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        h = (h + self.hidden_states_bias) * self.hidden_states_scale
        return h + (residual + self.residual_bias) * self.residual_scale


class ZayaLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int, tp: ParallelContext, rope: RotaryEmbedding):
        super().__init__()
        self.self_attn = CCAAttention(cfg, i, tp, rope)
        self.mlp = ZayaMoE(cfg, i, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.post_attention_residual_scale = ZayaResidualScaling(cfg.hidden_size)
        self.post_mlp_residual_scale = ZayaResidualScaling(cfg.hidden_size)

    def forward(
        self, residual: torch.Tensor, router: torch.Tensor | None, backend: BaseStateBackend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = self.input_layernorm.weight.dtype
        x = self.self_attn(self.input_layernorm(residual.to(dtype)), backend)
        residual = self.post_attention_residual_scale(x, residual)
        x, router = self.mlp(self.post_attention_layernorm(residual.to(dtype)), router)
        return self.post_mlp_residual_scale(x, residual), router


class ZayaForCausalLM(nn.Module):
    """`forward(input_ids[T], backend) -> hidden[T, H]`; logits via compute_logits.

    NOTE: the router hidden state flows layer to layer per token of the step; it is not decode
    state. Positions come from the backend's step tensors (`backend.step.positions`).
    """

    extra_state_name: str | None = "prev_state"

    def __init__(self, cfg: ModelConfig, tp: ParallelContext):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        rope = RotaryEmbedding(cfg.head_dim, cfg.rotary_dim, cfg.rope_theta, cfg.max_model_len)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.input_hidden_states_scale = _param(cfg.hidden_size)
        self.input_hidden_states_bias = _param(cfg.hidden_size)
        self.layers = nn.ModuleList(ZayaLayer(cfg, i, tp, rope) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, tp, bias=cfg.lm_head_bias)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, backend: BaseStateBackend) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        h = ((h + self.input_hidden_states_bias) * self.input_hidden_states_scale).float()
        router: torch.Tensor | None = None
        for layer in self.layers:
            h, router = layer(h, router, backend)
        return self.norm(h.to(self.norm.weight.dtype))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @staticmethod
    def state_specs(cfg: ModelConfig, tp: ParallelContext) -> list[StateSpec]:
        chans, width, prev = cca_state_dims(cfg, tp)
        return [
            StateSpec("conv", cfg.conv_layer_ids, (chans, width)),
            StateSpec("prev_state", cfg.conv_layer_ids, (prev,)),
        ]

    @staticmethod
    def state_rows(cfg: ModelConfig, tp: ParallelContext) -> dict[str, Rows]:
        """The channels of every state kind this rank holds (`execution.state_shards`): its
        q‖k conv channels, and its part of the previous-token value."""
        heads = head_shard(cfg.num_heads, cfg.num_kv_heads, tp.size, tp.rank)
        return {"conv": qk_rows(cfg, heads), "prev_state": (value_rows(cfg, heads)[1],)}

    @staticmethod
    def hf_to_ours() -> dict[str, str]:
        """Rename rules: HF checkpoint name fragment → our parameter name fragment."""
        return _HF_TO_OURS

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        loader = WeightLoader(self, self.tp, _HF_TO_OURS)
        loader.load(self._prepare(weights))

    def _prepare(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Refuse the legacy layout before loading anything: tensors are held back until a key
        only the transformers layout has shows up (in sorted order, right after the top-level
        embedding tensors)."""
        pending: list[tuple[str, torch.Tensor]] = []
        decided = False
        for name, tensor in weights:
            if _LEGACY_KEY.search(name):
                raise CheckpointError(
                    f"checkpoint tensor {name!r} is in the original Zyphra ZAYA layout "
                    f"(alternating attention/MoE layers), which this engine does not load; "
                    + CONVERTER_HINT
                )
            if decided:
                yield name, tensor
                continue
            pending.append((name, tensor))
            if _NEW_KEY.search(name):
                decided = True
                yield from pending
                pending.clear()
        yield from pending


# Checkpoint name fragment → our parameter name fragment (module names mirror the reference).
_HF_TO_OURS = {
    "model.embed_tokens.": "embed_tokens.",
    "model.input_hidden_states_": "input_hidden_states_",
    "model.layers.": "layers.",
    "model.norm.": "norm.",
}
