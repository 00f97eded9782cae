"""LFM2-VL's projector: pixel-unshuffle each image's patch grid by `downsample_factor`, then
LayerNorm (optional), Linear, activation, Linear into the language model's width."""

from __future__ import annotations

import torch
from torch import nn

from shortconv.configs.hf.lfm2_vl import VisionConfig
from shortconv.layers.vision_encoder import activation


def pixel_unshuffle(features: torch.Tensor, h: int, w: int, factor: int) -> torch.Tensor:
    """`[h * w, D]` patches (row-major) → `[(h/f) * (w/f), f * f * D]` tokens, row-major over
    the f x f blocks; a token's features are its block's patches row by row (HF's order)."""
    d = features.shape[-1]
    blocks = features.reshape(h // factor, factor, w // factor, factor, d).permute(0, 2, 1, 3, 4)
    return blocks.reshape((h // factor) * (w // factor), factor * factor * d)


class PixelUnshuffleProjector(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        width = cfg.hidden_size * cfg.downsample_factor**2
        self.factor, self.act = cfg.downsample_factor, cfg.projector_hidden_act
        self.layer_norm = nn.LayerNorm(width) if cfg.projector_use_layernorm else None
        self.linear_1 = nn.Linear(width, cfg.projector_hidden_size, bias=cfg.projector_bias)
        self.linear_2 = nn.Linear(
            cfg.projector_hidden_size, cfg.text_hidden_size, bias=cfg.projector_bias
        )

    def forward(self, features: torch.Tensor, shapes: list[tuple[int, int]]) -> torch.Tensor:
        """Encoder output `[N, L, D]` of N images → their tokens, concatenated in order."""
        tokens = torch.cat(
            [
                pixel_unshuffle(f[: h * w], h, w, self.factor)
                for f, (h, w) in zip(features, shapes, strict=True)
            ]
        )
        if self.layer_norm is not None:
            tokens = self.layer_norm(tokens)
        return self.linear_2(activation(self.act, self.linear_1(tokens)))
