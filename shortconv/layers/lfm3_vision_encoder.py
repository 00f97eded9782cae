"""The LFM3-VL vision encoder: a linear patch embedding and its RMSNorm, then pre-norm layers
that are each a gated 2D short conv over the patch grid or axial-RoPE attention within an image,
each followed by a SwiGLU MLP. No final norm (the projector normalises each patch).

Input: the processor's patch rows of the step's images, concatenated (`[rows, patch_dim]`, each
image's rows in merge-block order), and each image's `(h, w)` patch grid.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shortconv.configs.hf.lfm3_vl import Lfm3VisionConfig
from shortconv.layers.norm import RMSNorm
from shortconv.layers.vision_axial_attention import AxialAttention, AxialRotary, grid_positions
from shortconv.layers.vision_grid_conv import GridShortConv


class VisionSwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x), replicated on every rank (the encoder is not sharded)."""

    def __init__(self, cfg: Lfm3VisionConfig) -> None:
        super().__init__()
        d, inter = cfg.hidden_size, cfg.intermediate_size
        self.w1 = nn.Linear(d, inter, bias=False)
        self.w3 = nn.Linear(d, inter, bias=False)
        self.w2 = nn.Linear(inter, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Lfm3VisionLayer(nn.Module):
    def __init__(self, cfg: Lfm3VisionConfig, kind: str) -> None:
        super().__init__()
        self.is_attention = kind != "conv"
        if self.is_attention:
            self.self_attn = AxialAttention(cfg)
        else:
            self.conv = GridShortConv(cfg)
        self.feed_forward = VisionSwiGLU(cfg)
        self.operator_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        grids: list[tuple[int, int]],
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        h = self.operator_norm(x)
        if self.is_attention:
            h = self.self_attn(h, rope, [gh * gw for gh, gw in grids])
        else:
            h = self.conv(h, grids)
        x = x + h
        return x + self.feed_forward(self.ffn_norm(x))


class Lfm3VisionEncoder(nn.Module):
    """`forward(pixels [rows, patch_dim], grids [(h, w)] per image) -> [rows, D]`. Modules are
    named as in the checkpoints (`patchifier`, `q_layernorm`; transformers renames them)."""

    def __init__(self, cfg: Lfm3VisionConfig) -> None:
        super().__init__()
        self.merge = cfg.merge
        self.patchifier = nn.Linear(cfg.patch_dim, cfg.hidden_size, bias=False)
        self.embedding_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.rotary = AxialRotary(cfg.head_dim, cfg.rope_theta)
        self.layers = nn.ModuleList(Lfm3VisionLayer(cfg, kind) for kind in cfg.layer_types)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        x = self.embedding_norm(self.patchifier(pixels.to(self.patchifier.weight.dtype)))
        positions = torch.cat([grid_positions(h, w, self.merge, x.device) for h, w in grids])
        rope = self.rotary(positions)
        for layer in self.layers:
            x = layer(x, grids, rope)
        return x
