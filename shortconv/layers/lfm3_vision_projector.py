"""LFM3-VL's projector: LayerNorm each patch, merge each `merge x merge` block (contiguous rows
in the processor's order) into one row, then Linear, activation, Linear into the text width."""

from __future__ import annotations

import torch
from torch import nn

from shortconv.configs.hf.lfm3_vl import Lfm3VisionConfig
from shortconv.layers.vision_encoder import activation

_LAYER_NORM_EPS = 1e-6  # transformers' Lfm3VlMultiModalProjector hard-codes it


class MergeProjector(nn.Module):
    def __init__(self, cfg: Lfm3VisionConfig) -> None:
        super().__init__()
        self.merged = cfg.hidden_size * cfg.merge**2
        self.act = cfg.projector_hidden_act
        self.layer_norm = nn.LayerNorm(cfg.hidden_size, eps=_LAYER_NORM_EPS)
        hidden, bias = cfg.projector_hidden_size, cfg.projector_bias
        self.linear_1 = nn.Linear(self.merged, hidden, bias=bias)
        self.linear_2 = nn.Linear(hidden, cfg.text_hidden_size, bias=bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Encoder rows `[rows, D]` → image tokens `[rows / merge**2, text hidden]`."""
        merged = self.layer_norm(features).reshape(-1, self.merged)
        return self.linear_2(activation(self.act, self.linear_1(merged)))
