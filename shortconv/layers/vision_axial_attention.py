"""LFM3-VL's encoder attention: bidirectional grouped-query attention within each image, with
RMSNorm on the query and key heads and an axial 2D RoPE (rows and columns of the patch grid).

Images never attend to each other (transformers runs one attention per image): the step's
images are padded into a batch and a key mask hides the padding, through the shared encoder
attention (SDPA on the torch path, none under `SHORTCONV_KERNELS=triton`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from shortconv.configs.hf.lfm3_vl import Lfm3VisionConfig
from shortconv.layers.norm import RMSNorm
from shortconv.layers.vision_attention import encoder_attention


def grid_positions(h: int, w: int, merge: int, device: torch.device) -> torch.Tensor:
    """`[h * w, 2]` (row, column) of each patch, in the processor's merge-block order."""
    rows = torch.arange(h, device=device)[:, None].expand(h, w)
    cols = torch.arange(w, device=device)[None, :].expand(h, w)

    def blocks(p: torch.Tensor) -> torch.Tensor:
        return p.reshape(h // merge, merge, w // merge, merge).transpose(1, 2).flatten()

    return torch.stack([blocks(rows), blocks(cols)], dim=-1)


class AxialRotary(nn.Module):
    """cos/sin `[rows, head_dim]`: a quarter of the head's frequencies for the row, the same for
    the column, the two concatenated and repeated over both halves (rotate-half pairs)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        half = head_dim // 2
        exponents = torch.arange(0, half, 2, dtype=torch.float32) / half
        self.register_buffer("inv_freq", 1.0 / theta**exponents, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq  # [rows, 2, head_dim / 4]
        angles = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of `x [rows, heads, d]` in fp32, back in x's dtype."""
    h = x.float()
    x1, x2 = h.chunk(2, dim=-1)
    out = h * cos[:, None] + torch.cat([-x2, x1], dim=-1) * sin[:, None]
    return out.to(x.dtype)


def per_image(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """`[rows, heads, d]` → `[images, heads, longest, d]` (zero padding)."""
    return pad_sequence(list(torch.split(x, sizes)), batch_first=True).transpose(1, 2)


class AxialAttention(nn.Module):
    def __init__(self, cfg: Lfm3VisionConfig) -> None:
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        self.q_proj = nn.Linear(d, self.heads * hd, bias=False)
        self.k_proj = nn.Linear(d, self.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, self.kv_heads * hd, bias=False)
        self.out_proj = nn.Linear(self.heads * hd, d, bias=False)
        self.q_layernorm = RMSNorm(hd, cfg.norm_eps)
        self.k_layernorm = RMSNorm(hd, cfg.norm_eps)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], sizes: list[int]
    ) -> torch.Tensor:
        """x `[rows, D]` of images of `sizes` rows each; rope from `AxialRotary`."""
        rows = x.shape[0]
        q = rotate(self.q_layernorm(self.q_proj(x).view(rows, -1, self.head_dim)), *rope)
        k = rotate(self.k_layernorm(self.k_proj(x).view(rows, -1, self.head_dim)), *rope)
        v = self.v_proj(x).view(rows, -1, self.head_dim)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        lengths = torch.tensor(sizes, device=x.device)
        key_mask = torch.arange(max(sizes), device=x.device)[None] < lengths[:, None]
        out = encoder_attention(
            per_image(q, sizes), per_image(k, sizes), per_image(v, sizes), key_mask[:, None, None]
        ).transpose(1, 2)  # [images, longest, heads, d]
        real = torch.cat([out[i, :n] for i, n in enumerate(sizes)])
        return self.out_proj(real.reshape(rows, -1))
