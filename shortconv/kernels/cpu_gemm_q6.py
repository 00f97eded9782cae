"""The q6 weight format and its CPU linear (`gemm_q6` in cpu_gemm_q6.inc, built and loaded with
the other CPU kernels by kernels.cpu_gemm.load), with `gemm_q6_ref`, its float64 oracle.

q6: symmetric 6-bit codes c in -32..31 with one fp16 scale per 32 consecutive weights of a row,
w ~= c * scale: 6.5 bits a weight, against q8's 9 (int8 + fp32 scale) and llama.cpp's Q6_K's
6.56, the format Q4_K_M keeps its output tensor in. int4 serves its LM head in it (the head's
rounding lands on the logits directly, so it gets more bits than the body's q4; at batch 1 the
head is the largest single read of a step, and q6 reads 0.72x q8's bytes of it).

Each block's scale starts at its signed largest-magnitude weight over -32 (that weight maps to
-32 exactly, so the asymmetric code's extra level is used on the long side), then alternates
`REFITS` times between the least-squares scale for its codes and the nearest codes for that
scale; each half step can only lower the block's squared error (but for fp16's rounding of the
scale). The codes are always taken against the scale as stored (fp16).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shortconv.kernels.cpu_gemm import Q8_BLOCK, Q8Weight, gemm_q8_ref

Q6_BLOCK = Q8_BLOCK  # weights per scale
BLOCK_BYTES = 24  # 16 bytes of low nibbles, 8 of 2-bit high parts
CODE_MIN, CODE_MAX = -32, 31
# Rounds of (least-squares scale, nearest codes) after the start. Measured on a 512 x 1024
# Gaussian weight, the squared error against max|w| / 31 with nearest codes: 0.947x at the -32
# start alone, 0.912x after 1 refit, 0.899x after 2, 0.894x after 3 (the test holds <= 0.95x).
REFITS = 2


@dataclass(frozen=True)
class Q6Weight:
    """A linear weight [out, in] as 6-bit codes (`q` uint8 [out, in / 32 * 24], the packing in
    `pack_codes`) and one fp16 `scale` per 32 weights of a row ([out, in / 32]). The only copy
    a q6 layer keeps."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def out_features(self) -> int:
        return self.scale.shape[0]

    @property
    def in_features(self) -> int:
        return self.scale.shape[1] * Q6_BLOCK

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * self.scale.element_size()

    def codes(self) -> torch.Tensor:
        """The codes as int64 [out, in / 32, 32] in -32..31, in weight order."""
        return unpack_codes(self.q)

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight [out, in] the codes stand for."""
        w = self.codes().float() * self.scale.float().unsqueeze(-1)
        return w.view(self.out_features, self.in_features)

    def as_q8(self) -> Q8Weight:
        """The same weight as q8 (the codes as int8, the scales widened to fp32, both exact):
        what the kernel's tiles run on."""
        q = self.codes().to(torch.int8).view(self.out_features, self.in_features)
        return Q8Weight(q.contiguous(), self.scale.float().contiguous())


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """codes [rows, nb, 32] in -32..31 -> uint8 [rows, nb * 24] (24 bytes a block).

    Each whole group of 4 blocks is 96 bytes laid out for the VNNI tile's registers (the
    kernel's header says why): in "quad order" register t (0..3) holds weights [8t, 8t + 8) of
    each of the 4 blocks in turn, so its word w is block w // 8's weight 8t + w % 8. With s the
    code's 6-bit two's complement (c & 63): bytes 0..63 are 32 little-endian words, word w
    holding s of register 0 at bits 10-15, of register 1 at bits 4-9 and the low 4 bits of
    register 2's at bits 0-3; bytes 64..95: byte w holds register 3's s at bits 2-7 and the high
    2 bits of register 2's at bits 0-1. The last nb % 4 blocks, each alone: u = c + 32; bytes
    0..15 hold u's low nibble of weight j (low) and of weight j + 16 (high); bytes 16..23: byte i
    holds u's 2-bit high part of weights i, i + 8, i + 16, i + 24 at bits 0, 2, 4, 6."""
    rows, nb, _ = codes.shape
    whole = nb // 4 * 4
    parts = []
    if whole:
        # [rows, groups, block b, register t, i] -> [rows, groups, t, w = 8b + i]
        quad = codes[:, :whole].reshape(rows, -1, 4, 4, 8).transpose(2, 3).reshape(rows, -1, 4, 32)
        s = quad.to(torch.int64) & 63
        words = (s[..., 0, :] << 10) | (s[..., 1, :] << 4) | (s[..., 2, :] & 15)
        word_bytes = torch.stack([words & 0xFF, words >> 8], dim=-1).flatten(-2)
        high = (s[..., 3, :] << 2) | (s[..., 2, :] >> 4)
        parts.append(torch.cat([word_bytes, high], dim=-1).reshape(rows, -1))
    if nb > whole:
        u = (codes[:, whole:] + 32).to(torch.int64)
        low = u & 0x0F
        nibbles = low[..., :16] | (low[..., 16:] << 4)
        tail_high = (u >> 4).unflatten(-1, (4, 8))  # [..., t, i]: weight 8t + i
        shifts = torch.arange(0, 8, 2).unsqueeze(-1)  # bits 2t
        parts.append(torch.cat([nibbles, (tail_high << shifts).sum(-2)], dim=-1).reshape(rows, -1))
    return torch.cat(parts, dim=-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [rows, nb * 24] -> int64 codes [rows, nb, 32] in weight order (pack_codes'
    inverse, written from the layout, not from pack_codes' steps)."""
    rows, nb = packed.shape[0], packed.shape[1] // BLOCK_BYTES
    whole = nb // 4 * 4
    b = packed.to(torch.int64)
    blocks = []
    if whole:
        g = b[:, : whole * BLOCK_BYTES].reshape(rows, -1, 96)
        words = g[..., 0:64:2] | (g[..., 1:64:2] << 8)  # [rows, groups, w]
        high = g[..., 64:]
        s = torch.stack(
            [words >> 10, (words >> 4) & 63, (words & 15) | ((high & 3) << 4), high >> 2], dim=-2
        )  # [rows, groups, t, w]
        c = s - 64 * (s >= 32)
        # w = 8 * block + i -> weight 8t + i of that block
        blocks.append(c.reshape(rows, -1, 4, 4, 8).transpose(2, 3).reshape(rows, whole, 32))
    if nb > whole:
        t = b[:, whole * BLOCK_BYTES :].reshape(rows, -1, BLOCK_BYTES)
        low = torch.cat([t[..., :16] & 0x0F, t[..., :16] >> 4], dim=-1)
        shifts = torch.arange(0, 8, 2).unsqueeze(-1)
        tail_high = ((t[..., 16:].unsqueeze(-2) >> shifts) & 3).flatten(-2)
        blocks.append(low + (tail_high << 4) - 32)
    return torch.cat(blocks, dim=1)


def quantize_q6(weight: torch.Tensor) -> Q6Weight:
    """Each block of 32 weights of a row as codes -32..31 with the fp16 scale fitted to them
    (module docstring; in divisible by 32). An all-zero block gets scale 0 and codes 0."""
    rows, cols = weight.shape
    if cols % Q6_BLOCK:
        raise ValueError(f"q6 needs in_features divisible by {Q6_BLOCK}, got {cols}")
    blocks = weight.detach().float().reshape(rows, cols // Q6_BLOCK, Q6_BLOCK)
    peak = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))  # signed
    scale = (peak / CODE_MIN).half().float()
    codes = _nearest_codes(blocks, scale)
    for _ in range(REFITS):
        scale = _least_squares_scale(blocks, codes, scale)
        codes = _nearest_codes(blocks, scale)
    packed = pack_codes(codes.to(torch.int64)).contiguous()
    return Q6Weight(packed, scale.squeeze(-1).half().contiguous())


def _nearest_codes(blocks: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    inv = torch.where(scale != 0, 1 / scale, torch.zeros_like(scale))
    return torch.mul(blocks, inv).round_().clamp_(CODE_MIN, CODE_MAX)


def _least_squares_scale(
    blocks: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """The scale minimising sum (c * s - w)^2 for the block's codes, in fp16; an all-zero code
    block keeps its scale."""
    cc = (codes * codes).sum(-1, keepdim=True)
    fits = cc > 0
    fitted = (codes * blocks).sum(-1, keepdim=True) / torch.where(fits, cc, 1.0)
    return torch.where(fits, fitted, scale).half().float()


def gemm_q6_ref(x: torch.Tensor, qw: Q6Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """Exact block sums of x's int16 rounding and the codes (int64), then both scales in
    float64: q8's ref on the same integers (the scales widen exactly)."""
    return gemm_q8_ref(x, qw.as_q8(), bias)


def gemm_q6(x: torch.Tensor, qw: Q6Weight, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.shortconv_cpu.gemm_q6(x, qw.q, qw.scale, bias)
