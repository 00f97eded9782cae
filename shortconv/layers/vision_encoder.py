"""The SigLIP2 NaFlex vision encoder of LFM2-VL: patch embedding with the learned position grid
resized to each image, pre-norm encoder layers, and the final layer norm.

Images arrive patchified by transformers' image processor (`[N, L, channels * p * p]` rows,
padded to the longest); each image's `(h, w)` patch grid says how many rows are real (h * w).
Padding rows are never attended to, so an image's output does not depend on its batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shortconv.configs.hf.lfm2_vl import VisionConfig
from shortconv.layers.vision_attention import encoder_attention


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """The activations of configs.hf.lfm2_vl.ACTIVATIONS (checked at start-up)."""
    return F.gelu(x, approximate="tanh" if name == "gelu_pytorch_tanh" else "none")


class VisionEmbeddings(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.grid = cfg.position_grid
        self.patch_embedding = nn.Linear(cfg.patch_dim, cfg.hidden_size)
        self.position_embedding = nn.Embedding(cfg.num_positions, cfg.hidden_size)

    def positions(self, h: int, w: int) -> torch.Tensor:
        """The position grid resized to `h x w` patches, `[h * w, D]` (antialiased bilinear,
        as SigLIP2 resizes it)."""
        table = self.position_embedding.weight
        grid = table.reshape(self.grid, self.grid, -1).permute(2, 0, 1)[None].float()
        resized = F.interpolate(grid, (h, w), mode="bilinear", align_corners=False, antialias=True)
        return resized[0].reshape(table.shape[1], h * w).t().to(table.dtype)

    def forward(self, pixels: torch.Tensor, shapes: list[tuple[int, int]]) -> torch.Tensor:
        h = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype))
        pos = torch.zeros_like(h)
        for i, (ph, pw) in enumerate(shapes):
            pos[i, : ph * pw] = self.positions(ph, pw)
        return h + pos


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads, d = cfg.num_heads, cfg.hidden_size
        self.q_proj, self.k_proj = nn.Linear(d, d), nn.Linear(d, d)
        self.v_proj, self.out_proj = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        n, length, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(n, length, self.num_heads, -1).transpose(1, 2)

        out = encoder_attention(
            heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)), key_mask
        )
        return self.out_proj(out.transpose(1, 2).reshape(n, length, -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.act = cfg.hidden_act
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(activation(self.act, self.fc1(x)))


class VisionEncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = VisionAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), key_mask)
        return x + self.mlp(self.layer_norm2(x))


class _Encoder(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(cfg) for _ in range(cfg.num_layers))


class VisionEncoder(nn.Module):
    """`forward(pixels [N, L, channels*p*p], shapes [(h, w)] * N) -> [N, L, D]`; rows past an
    image's h * w patches are padding (their output is garbage, never read)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.embeddings = VisionEmbeddings(cfg)
        self.encoder = _Encoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, pixels: torch.Tensor, shapes: list[tuple[int, int]]) -> torch.Tensor:
        lengths = torch.tensor([h * w for h, w in shapes], device=pixels.device)
        positions = torch.arange(pixels.shape[1], device=pixels.device)
        key_mask = (positions[None] < lengths[:, None])[:, None, None, :]
        x = self.embeddings(pixels, shapes)
        for layer in self.encoder.layers:
            x = layer(x, key_mask)
        return self.post_layernorm(x)
