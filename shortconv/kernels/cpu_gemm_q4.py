"""The q4 weight format and its CPU linear (`gemm_q4` in cpu_gemm_q4.inc, built and loaded with
the other CPU kernels by kernels.cpu_gemm.load), with `gemm_q4_ref`, its float64 oracle.

q4: 4-bit codes c in 0..15 with an fp16 scale and an fp16 min per 32 consecutive weights of a
row, w ~= c * scale + min. The min (llama.cpp's Q4_1 and Q4_K keep one too; Q4_K_M, the quality
anchor, is scale + min per 32 weights under 6-bit super-block scales) lets a block whose values
are not centred on zero use all 16 levels, where a symmetric code wastes one and rounds the
short side of the block as coarsely as the long one. The scale and min are fp16, as Q4_1 stores
them: 5 bits a weight with the codes (fp32 took 6; Q4_K stores 4.5), and decode at one row
reads every byte, so fewer bytes are the speed. fp16 rounds them by at most 2^-11 relative,
against a code step of 1/15 of the block's range; the codes are taken against the rounded pair,
so the only error is the codes' own rounding.

Each block starts from its own [min, max] mapped onto 0..15, then alternates twice more between
the least-squares pair for its codes and the nearest codes for that pair (`REFITS`): each half
step can only lower the block's squared error (but for fp16's rounding of the pair), and on
Gaussian weights three rounds take it to 0.87x the min/max mapping's. Q4_K searches its pair too
(over a grid of scales); this search is our own and cheaper: on a 4608 x 1024 weight, 0.09 s
of one thread's CPU against 0.05 s for the min/max mapping alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shortconv.kernels.cpu_gemm import Q8_BLOCK, quantize_x8, quantize_x16, set_isa

Q4_BLOCK = Q8_BLOCK  # weights per scale and min
LEVELS = 15  # codes 0..15
# Rounds of (least-squares pair, nearest codes) after the min/max start. Measured on Gaussian
# blocks, the squared error against the min/max mapping's: 0.92x after 1, 0.88x after 2,
# 0.87x after 3, 0.86x after 4.
REFITS = 3


@dataclass(frozen=True)
class Q4Weight:
    """A linear weight [out, in] as 4-bit codes, two a byte (`q` uint8 [out, in / 2]: in each
    block of 32, byte j holds weight j low and weight j + 16 high), `scale` and `min` fp16
    [out, in / 32]. The only copy a q4 layer keeps."""

    q: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor

    @property
    def out_features(self) -> int:
        return self.q.shape[0]

    @property
    def in_features(self) -> int:
        return self.q.shape[1] * 2

    @property
    def nbytes(self) -> int:
        params = self.scale.numel() * self.scale.element_size()
        return self.q.numel() + params + self.min.numel() * self.min.element_size()

    def codes(self) -> torch.Tensor:
        """The codes as int64 [out, in / 32, 32], in weight order."""
        blocks = self.q.view(self.out_features, -1, Q4_BLOCK // 2).to(torch.int64)
        return torch.cat([blocks & 0x0F, blocks >> 4], dim=-1)

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight [out, in] the codes stand for."""
        w = self.codes().float() * self.scale.float().unsqueeze(-1) + self.min.float().unsqueeze(-1)
        return w.view(self.out_features, self.in_features)


def quantize_q4(weight: torch.Tensor) -> Q4Weight:
    """Each block of 32 weights of a row as codes 0..15 with the fp16 scale and min that fit
    them best (module docstring; in divisible by 32). An all-equal block gets scale 0 and its
    value as min."""
    rows, cols = weight.shape
    if cols % Q4_BLOCK:
        raise ValueError(f"q4 needs in_features divisible by {Q4_BLOCK}, got {cols}")
    blocks = weight.detach().float().reshape(rows, cols // Q4_BLOCK, Q4_BLOCK)
    lo = blocks.amin(dim=-1, keepdim=True)
    # The pair as stored (fp16) from the start: the codes are always taken against it.
    scale = ((blocks.amax(dim=-1, keepdim=True) - lo) / LEVELS).half().float()
    low = lo.half().float()
    total = blocks.sum(-1, keepdim=True)
    codes = _nearest_codes(blocks, scale, low)
    for _ in range(REFITS):
        scale, low = _least_squares_pair(blocks, total, codes, scale, low)
        codes = _nearest_codes(blocks, scale, low)
    c = codes.to(torch.uint8)
    packed = c[..., : Q4_BLOCK // 2] | (c[..., Q4_BLOCK // 2 :] << 4)
    packed = packed.reshape(rows, cols // 2).contiguous()
    return Q4Weight(packed, scale.squeeze(-1).half(), low.squeeze(-1).half())


def _nearest_codes(blocks: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The code nearest each weight for the pair (float, 0..15; 0 where the scale is 0): a
    min rounded up clamps its block's smallest weights to 0, a scale rounded down its largest
    to 15."""
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    return torch.sub(blocks, low).mul_(inv).round_().clamp_(0, LEVELS)


def _least_squares_pair(
    blocks: torch.Tensor,
    total: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    low: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (scale, min) minimising each block's sum of (c * scale + min - w)^2 for its codes,
    rounded to fp16; a block whose codes are all equal keeps its pair (no slope to fit)."""
    n = Q4_BLOCK
    c_sum = codes.sum(-1, keepdim=True)
    c_var = (codes * codes).sum(-1, keepdim=True) - c_sum * c_sum / n
    cov = (codes * blocks).sum(-1, keepdim=True) - c_sum * total / n
    fits = c_var > 0
    new_scale = torch.where(fits, cov / torch.where(fits, c_var, 1.0), scale).half().float()
    new_low = torch.where(fits, (total - new_scale * c_sum) / n, low).half().float()
    return new_scale, new_low


def gemm_q4_ref(
    x: torch.Tensor, qw: Q4Weight, bias: torch.Tensor | None, int8_x: bool = False
) -> torch.Tensor:
    """The kernel's integers summed exactly (int64), then the scales and mins in float64:
    y = sum_b xs (scale * sum(xq c) + min * sum(xq)). `int8_x`: x rounded as on AVX-512 VNNI
    CPUs (`q4_int8_activations`), else to int16."""
    xq, xs = quantize_x8(x) if int8_x else quantize_x16(x)  # [M, B, 32], [M, B]
    sums = torch.einsum("mbk,nbk->mnb", xq, qw.codes()).double()  # exact: |sum| < 2^24
    xsum = xq.sum(-1).double().unsqueeze(1)  # [M, 1, B]
    per_block = sums * qw.scale.double().unsqueeze(0) + xsum * qw.min.double().unsqueeze(0)
    y = (per_block * xs.double().unsqueeze(1)).sum(-1)
    return (y + bias.double() if bias is not None else y).float()


def q4_int8_activations() -> bool:
    """Whether `gemm_q4` rounds x to int8 (the AVX-512 VNNI tiles) rather than int16."""
    return set_isa() == "avx512vnni"


def gemm_q4(x: torch.Tensor, qw: Q4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.shortconv_cpu.gemm_q4(x, qw.q, qw.scale, qw.min, bias)
