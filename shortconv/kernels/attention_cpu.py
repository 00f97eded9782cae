"""The CPU fast path for paged attention (production code, not an oracle).

K/V are gathered head-major into reused `StepScratch` buffers; decode rows are two batched
matmuls around a softmax, multi-token chunks go through SDPA per group (see `_groups`). The
oracles are in `attention_ref`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from shortconv.kernels.attention_dense import DenseAttentionIndices, dense_indices
from shortconv.kernels.attention_step import PagedAttentionStep
from shortconv.kernels.scratch import StepScratch


@dataclass(frozen=True)
class _Group:
    """Sequences of one step attended together: `seqs` [G] (indices into the step), `tokens`
    (their query rows, in packed order), `max_len` (longest context), `gather` [G, max_len]
    (KV rows) and, for multi-token chunks, `q_rows` [G*Q] into q plus a zero row and `unpad`
    (each token's row of the padded [G*Q] output)."""

    seqs: torch.Tensor
    tokens: torch.Tensor
    max_len: int
    gather: torch.Tensor
    q_rows: torch.Tensor | None = None
    unpad: torch.Tensor | None = None


def _groups(
    step: PagedAttentionStep, dense: DenseAttentionIndices
) -> tuple[_Group | None, _Group | None]:
    """(one-query rows, multi-token chunks) of an eager step, from its host mirrors.

    Why: the padded layout gives every sequence the longest chunk's query count, so a step that
    mixes decode rows with one 400-token prefill chunk would attend 400 padded queries per
    decode row; split, each row attends its own single query over its own context length.
    """
    qsl = step.query_start_loc_cpu.tolist()
    seq_lens = step.seq_lens_cpu.tolist()
    dev = dense.kv_gather.device
    groups: list[_Group | None] = []
    for single in (True, False):
        seqs = [i for i in range(step.num_seqs) if (qsl[i + 1] - qsl[i] == 1) == single]
        if not seqs:
            groups.append(None)
            continue
        toks = [t for i in seqs for t in range(qsl[i], qsl[i + 1])]
        # A windowed layout's columns start at each row's window (`DenseAttentionIndices`).
        max_q = max(qsl[i + 1] - qsl[i] for i in seqs)
        max_len = dense.columns(max(seq_lens[i] for i in seqs), max_q)
        idx = torch.tensor(seqs, dtype=torch.int64, device=dev)
        group = _Group(idx, torch.tensor(toks, device=dev), max_len, dense.kv_gather[idx, :max_len])
        if not single:
            q = step.max_query_len
            unpad = [
                g * q + t - qsl[i] for g, i in enumerate(seqs) for t in range(qsl[i], qsl[i + 1])
            ]
            q_rows = dense.q_pad_index.view(step.num_seqs, q)[idx].reshape(-1)
            group = replace(group, q_rows=q_rows, unpad=torch.tensor(unpad, device=dev))
        groups.append(group)
    return groups[0], groups[1]


# Decode attention gathers K and V for this many bytes of sequences at a time: a chunk's
# gathered rows are still in the last-level cache when its matmuls read them back, instead of
# a whole batch's (70 MB at batch 32, context 512 on LFM2-350M) making a round trip through
# memory. 8 MB: a quarter of the 32 MB L3 we measured on; 1-4 sequences there were alike.
_ATTN_CHUNK_BYTES = 8 << 20


def _kv_rows(gather: torch.Tensor, hk: int, scratch: StepScratch, key: object) -> torch.Tensor:
    """Head-major flat row indices `[G, Hk*L]` into a `[N*Hk, d]` view of the cache, built once
    per step (`key` names the group)."""
    return scratch.per_step(
        ("kv_rows", key, hk),
        lambda: (gather[:, None, :] * hk + torch.arange(hk, device=gather.device)[:, None]).view(
            gather.shape[0], -1
        ),
    )


def _gathered(
    cache: torch.Tensor, rows: torch.Tensor, name: str, scratch: StepScratch
) -> torch.Tensor:
    """cache `[N, Hk, d]`, rows `[G, Hk*L]` (see `_kv_rows`) → head-major `[G, Hk, L, d]` in a
    reused buffer."""
    hk, d = cache.shape[1:]
    g, length = rows.shape[0], rows.shape[1] // hk
    out = scratch.buffer(name, rows.numel() * d, cache).view(-1, d)
    return torch.index_select(cache.view(-1, d), 0, rows.reshape(-1), out=out).view(
        g, hk, length, d
    )


def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    gather: torch.Tensor,
    live: torch.Tensor,
    scale: float,
    scratch: StepScratch,
    key: object,
) -> torch.Tensor:
    """One query per row: q [G, Hq, d], gather [G, L], live bool [G, L] → [G, Hq, d]."""
    g, num_heads, head_dim = q.shape
    num_kv, length = k_cache.shape[1], gather.shape[1]
    bias = scratch.per_step(
        ("bias", key, q.dtype),
        lambda: torch.zeros(g, 1, 1, length, dtype=q.dtype, device=q.device).masked_fill_(
            ~live.view(g, 1, 1, length), float("-inf")
        ),
    )
    rows = _kv_rows(gather, num_kv, scratch, key)
    qg = q.view(g, num_kv, num_heads // num_kv, head_dim)
    per_seq = 2 * rows.shape[1] * head_dim * k_cache.element_size()
    chunk = max(1, _ATTN_CHUNK_BYTES // per_seq)

    def attend(i: int, j: int, out: torch.Tensor | None) -> torch.Tensor:
        keys = _gathered(k_cache, rows[i:j], "k", scratch)
        values = _gathered(v_cache, rows[i:j], "v", scratch)
        scores = torch.matmul(qg[i:j], keys.transpose(-1, -2)).mul_(scale).add_(bias[i:j])
        return torch.matmul(torch.softmax(scores, dim=-1), values, out=out)

    if chunk >= g:  # small batches and contexts: one chunk, no output buffer to fill
        return attend(0, g, None).view(g, num_heads, head_dim)
    out = q.new_empty(g, num_kv, num_heads // num_kv, head_dim)
    for i in range(0, g, chunk):
        attend(i, min(g, i + chunk), out[i : i + chunk])
    return out.view(g, num_heads, head_dim)


def _uniform_chunks(single: _Group | None, g: int, max_q: int, num_tokens: int) -> bool:
    """Every row a chunk of the same length (a speculative verify step, or equal prefill
    chunks): the padded layout is q itself, in order, so the general path's zero row, gather
    and scatter are identities; the same values in the same layout reach SDPA either way."""
    return single is None and g * max_q == num_tokens


def paged_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    step: PagedAttentionStep,
    scale: float,
    scratch: StepScratch,
    window: int = 0,
) -> torch.Tensor:
    """The CPU path: K/V gathered straight into head-major `[G, Hk, L, d]` reused buffers, so
    the attention matmuls read contiguous rows (a strided `[B, L, Hk, d]` view made SDPA copy
    or crawl) and no layer allocates (or page-faults) tens of MB. Decode rows (one query) are
    two batched matmuls around a softmax; multi-token chunks go through SDPA, each group over
    its own longest context (see `_groups`). `window` > 0: each row gathers only the positions
    its queries see (`attention_dense._build_windowed`), so L is at most window + Q - 1.

    NOTE: the per-step values are keyed by the window: full and sliding layers share a step."""
    num_tokens, num_heads, head_dim = q.shape
    dense = dense_indices(step, scratch, window)
    if step.max_query_len == 1 and num_tokens == step.num_seqs:  # all decode (graph buffers too)
        mask = dense.attn_mask.view(dense.kv_gather.shape)
        gather = dense.kv_gather
        return _decode_attention(q, k_cache, v_cache, gather, mask, scale, scratch, ("all", window))
    single, multi = scratch.per_step(("attn_groups", window), lambda: _groups(step, dense))
    out = q.new_empty(q.shape)
    if single is not None:
        live = scratch.per_step(
            ("single_live", window), lambda: dense.attn_mask[single.seqs, 0, : single.max_len]
        )
        key = ("single", window)
        part = _decode_attention(
            q[single.tokens], k_cache, v_cache, single.gather, live, scale, scratch, key
        )
        out[single.tokens] = part
    assert multi is not None
    rows = _kv_rows(multi.gather, k_cache.shape[1], scratch, ("multi", window))
    keys = _gathered(k_cache, rows, "k", scratch)
    values = _gathered(v_cache, rows, "v", scratch)
    g, max_q = multi.seqs.numel(), step.max_query_len
    mask = scratch.per_step(
        ("multi_mask", window), lambda: dense.attn_mask[multi.seqs, :, : multi.max_len][:, None]
    )
    uniform = _uniform_chunks(single, g, max_q, num_tokens)
    if uniform:
        q_pad = q.contiguous().view(g, max_q, num_heads, head_dim).transpose(1, 2)
    else:
        q_rows = torch.cat([q, q.new_zeros(1, num_heads, head_dim)], dim=0)
        q_pad = q_rows[multi.q_rows].view(g, max_q, num_heads, head_dim).transpose(1, 2)
    res = F.scaled_dot_product_attention(
        q_pad, keys, values, attn_mask=mask, scale=scale, enable_gqa=keys.shape[1] != num_heads
    )
    padded = res.transpose(1, 2).reshape(g * max_q, num_heads, head_dim)
    if uniform:
        return padded
    out[multi.tokens] = padded[multi.unpad]
    return out
