"""LFM3-VL's short-conv layer: a gated depthwise 2D convolution over each image's patch grid.

The encoder's rows are an image's patches in merge-block order (the processor's layout: each
`merge x merge` block of the grid is contiguous, the blocks row-major), so each image is put
back on its `h x w` grid for the convolution and taken back to that order after it. Images are
convolved one by one: the zero padding of the convolution is each image's own border.
"""

from __future__ import annotations

import torch
from torch import nn

from shortconv.configs.hf.lfm3_vl import Lfm3VisionConfig


def blocks_to_grid(x: torch.Tensor, h: int, w: int, merge: int) -> torch.Tensor:
    """`[h * w, C]` rows in merge-block order → `[C, h, w]`."""
    c = x.shape[-1]
    grid = x.view(h // merge, w // merge, merge, merge, c).permute(4, 0, 2, 1, 3)
    return grid.reshape(c, h, w)


def grid_to_blocks(grid: torch.Tensor, merge: int) -> torch.Tensor:
    """`blocks_to_grid`'s inverse: `[C, h, w]` → `[h * w, C]` in merge-block order."""
    c, h, w = grid.shape
    blocks = grid.view(c, h // merge, merge, w // merge, merge).permute(1, 3, 2, 4, 0)
    return blocks.reshape(h * w, c)


class GridShortConv(nn.Module):
    """`forward(x [rows, D], grids [(h, w)] per image) -> [rows, D]`: in_proj splits into an
    input gate, an output gate and the conv input; the gated input is convolved depthwise."""

    def __init__(self, cfg: Lfm3VisionConfig) -> None:
        super().__init__()
        d, k = cfg.hidden_size, cfg.conv_kernel_size
        self.merge = cfg.merge
        self.in_proj = nn.Linear(d, 3 * d, bias=False)
        self.spatial_conv = nn.Conv2d(d, d, k, padding=k // 2, groups=d, bias=False)
        self.out_proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        input_gate, output_gate, conv_input = self.in_proj(x).chunk(3, dim=-1)
        gated = input_gate * conv_input
        sizes = [h * w for h, w in grids]
        convolved = [
            grid_to_blocks(self.spatial_conv(blocks_to_grid(rows, h, w, self.merge)), self.merge)
            for rows, (h, w) in zip(torch.split(gated, sizes), grids, strict=True)
        ]
        return self.out_proj(output_gate * torch.cat(convolved))
