"""Inputs, byte counts and small torch oracles for the attention and fused-MoE kernel benches.

Both kernels are memory-bound at decode sizes, so each case carries the fewest bytes the kernel
must move (every input read once, the output written once); bench/kernels.py divides that by the
measured time and by the device's copy bandwidth. Several input sets per case (`sets`) rotate
between calls so a small working set is not served from L2 on repeats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

PAGE = 16
SKIP_FRACTION = 0.1  # ZAYA1-like: some tokens take the skip route (id == E)


@dataclass(frozen=True)
class AttnShape:
    """Paged decode: `batch` rows, each with `context` cached tokens, bf16 KV."""

    hq: int
    hk: int
    d: int
    batch: int
    context: int

    @property
    def label(self) -> str:
        return f"Hq{self.hq}/Hk{self.hk}/d{self.d} B={self.batch} ctx={self.context}"


@dataclass(frozen=True)
class MoeShape:
    """`tokens` rows routed top-`k` over `experts` SwiGLU experts of H -> I -> H."""

    experts: int
    hidden: int
    inter: int
    k: int
    tokens: int
    skip: bool

    @property
    def label(self) -> str:
        return f"E{self.experts}/H{self.hidden}/I{self.inter}/k{self.k} T={self.tokens}"


def _randn(
    shape: tuple[int, ...], device: str, dtype: torch.dtype, seed: int, std: float = 1.0
) -> torch.Tensor:
    """N(0, std) drawn on `device` itself: the largest cases hold GBs, too slow to draw on the
    host and copy over."""
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=g, device=device, dtype=dtype).mul_(std)


def attention_case(
    s: AttnShape, device: str, dtype: torch.dtype, seed: int = 0, ragged: bool = False
) -> tuple[tuple, int]:
    """(args in paged_attention_decode_triton's order, bytes); `ragged`: lengths drawn from
    [1, context] instead of all equal to it (for the correctness check)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    pages = -(-s.context // PAGE)
    num_pages = 1 + s.batch * pages  # page 0: scratch, never referenced
    perm = torch.randperm(num_pages - 1, generator=g) + 1  # scattered pages, like a live pool
    block_tables = perm[: s.batch * pages].view(s.batch, pages).to(device, torch.int32)
    seq_lens = torch.full((s.batch,), s.context, dtype=torch.int32)
    if ragged:
        seq_lens = torch.randint(1, s.context + 1, (s.batch,), generator=g, dtype=torch.int32)
    seq_lens = seq_lens.to(device)
    k_cache = _randn((num_pages * PAGE, s.hk, s.d), device, dtype, seed)
    v_cache = _randn((num_pages * PAGE, s.hk, s.d), device, dtype, seed + 1)
    q = _randn((s.batch, s.hq, s.d), device, dtype, seed + 2)
    nbytes = attention_bytes(s, int(seq_lens.sum()), k_cache.element_size())
    args = (q, k_cache, v_cache, block_tables, seq_lens, 1.0 / math.sqrt(s.d), PAGE)
    return args, nbytes


def attention_bytes(s: AttnShape, cached_tokens: int, esz: int) -> int:
    """The fewest bytes one decode launch moves: K and V of every cached token, q read and out
    written, the block tables and sequence lengths."""
    pages = -(-s.context // PAGE)
    return (
        2 * cached_tokens * s.hk * s.d * esz
        + 2 * s.batch * s.hq * s.d * esz
        + s.batch * pages * 4
        + s.batch * 4
    )


def attention_oracle(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    page_size: int,
) -> torch.Tensor:
    """Plain fp32 paged decode attention, one row at a time (GQA by repeating KV heads)."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    group = q.shape[1] // k_cache.shape[1]
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        pages = block_tables[b, : -(-n // page_size)].long()
        rows = (pages[:, None] * page_size + torch.arange(page_size, device=q.device)).flatten()
        k = k_cache[rows[:n]].float().repeat_interleave(group, dim=1)  # [n, Hq, d]
        v = v_cache[rows[:n]].float().repeat_interleave(group, dim=1)
        att = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        out[b] = torch.einsum("hn,nhd->hd", att.softmax(-1), v)
    return out


def moe_case(
    s: MoeShape, device: str, dtype: torch.dtype, sets: int = 4, seed: int = 0
) -> tuple[tuple[torch.Tensor, ...], list[tuple[torch.Tensor, torch.Tensor]], float]:
    """(weights (x, gate_up, down), [(ids, routing weights)] * sets, mean bytes per call)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    h, i, e = s.hidden, s.inter, s.experts
    x = _randn((s.tokens, h), device, dtype, seed)
    gate_up = _randn((e, 2 * i, h), device, dtype, seed + 1, 1 / math.sqrt(h))
    down = _randn((e, h, i), device, dtype, seed + 2, 1 / math.sqrt(i))
    esz = x.element_size()
    routes, total = [], 0
    for _ in range(sets):
        ids = torch.stack([torch.randperm(e, generator=g)[: s.k] for _ in range(s.tokens)])
        if s.skip:
            ids[torch.rand(s.tokens, generator=g) < SKIP_FRACTION, -1] = e
        w = torch.rand(s.tokens, s.k, generator=g)
        routes.append((ids.to(device), (w / w.sum(-1, keepdim=True)).to(device)))
        total += moe_bytes(s, len(set(ids.flatten().tolist()) - {e}), esz)
    return (x, gate_up, down), routes, total / sets


def moe_bytes(s: MoeShape, used_experts: float, esz: int) -> float:
    """The fewest bytes one fused-MoE launch moves: the weights of the experts used (gate, up,
    down), x read and out written, ids (int64) and routing weights (fp32) read."""
    return (
        used_experts * 3 * s.hidden * s.inter * esz
        + 2 * s.tokens * s.hidden * esz
        + (s.tokens * s.k * 12)
    )


def moe_oracle(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """Plain fp32 top-k SwiGLU experts; id == E (the skip route) contributes nothing."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    inter = down.shape[-1]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            ex = int(ids[t, j])
            if ex >= gate_up.shape[0]:
                continue
            gu = gate_up[ex].float() @ x[t].float()
            act = F.silu(gu[:inter]) * gu[inter:]
            out[t] += float(weights[t, j]) * (down[ex].float() @ act)
    return out


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """‖got − want‖ / ‖want‖ in fp32; NaN anywhere (an unwritten output) gives inf."""
    got = got.float()
    if not bool(torch.isfinite(got).all()):
        return math.inf
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def shapes(quick: bool) -> tuple[list[AttnShape], list[MoeShape]]:
    if quick:
        return [AttnShape(4, 2, 16, 2, 40)], [MoeShape(4, 32, 16, 1, 3, True)]
    attn = [
        AttnShape(16, 8, 64, 64, 2048),  # LFM2-350M's attention
        AttnShape(16, 8, 64, 128, 8192),
        AttnShape(32, 8, 128, 32, 4096),
        AttnShape(32, 8, 128, 128, 8192),
    ]
    moe = [MoeShape(16, 2048, 2048, 1, t, True) for t in (1, 8, 32, 128)]  # ZAYA1-8B
    moe += [MoeShape(32, 2048, 1792, 4, t, False) for t in (1, 32)]  # LFM2-8B-A1B-like
    return attn, moe


def check_shapes(quick: bool) -> tuple[AttnShape, MoeShape]:
    """Small cases checked against the oracles before timing (oracles loop in Python)."""
    if quick:
        return AttnShape(4, 2, 16, 2, 40), MoeShape(4, 32, 16, 1, 3, True)
    return AttnShape(32, 8, 128, 4, 300), MoeShape(16, 2048, 2048, 1, 8, True)
