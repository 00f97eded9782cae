"""Triton paged attention over the flat KV pool, read in place: decode (flash-decoding) and
extend (varlen causal chunks, resumed prefixes, mixed decode rows).

Same contracts as `attention_ref.paged_attention_decode_ref` / `paged_attention_extend_ref`.
No host syncs and no data-dependent shapes: the grids and the number of decode splits come from
static shapes (B, Hk, block-table width, `max_query_len`), so both run inside captured graphs.
The work is bounded by each row's `seq_lens`, not the table width: a decode row divides its own
context among the splits (each at least `_MIN_SPLIT_LEN` positions), splits past its end exit at
once, so a short context in a wide (max_model_len) graph bucket costs about what it would in a
bucket of its own size, plus one empty partial per idle split.
Kernel bodies live in `attention_triton_kernels` and are jitted lazily once per interpreter mode,
like `conv1d_triton`, so tests can flip TRITON_INTERPRET per test.
"""

from __future__ import annotations

import functools
import math

import torch
import triton

from shortconv.kernels import attention_triton_kernels as _k
from shortconv.kernels import launch_config
from shortconv.kernels.launch_config import (
    ATTN_DECODE,
    ATTN_EXTEND,
    ATTN_REDUCE,
    LaunchConfig,
)

_LOG2E = math.log2(math.e)
# A decode split covers at least this many positions: below it the partials' write and the
# reduce launch cost more than the extra parallelism buys.
_MIN_SPLIT_LEN = 256
_DECODE_BLOCK_N = 64  # NOTE: every ATTN_DECODE entry's block_n (splits round to it)


def shape_config(table: dict[tuple[bool, bool], LaunchConfig], q: torch.Tensor) -> LaunchConfig:
    """The table's entry for q's shape class: (bf16/fp16?, head_dim > 64?)."""
    return table[(q.dtype != torch.float32, q.shape[-1] > 64)]


@functools.cache
def _jitted(
    interpret: bool, tune: bool
) -> tuple[launch_config.GridKernel, launch_config.GridKernel, launch_config.GridKernel]:
    # The arguments are only the cache key; triton.jit and launch_config read the same knobs.
    del interpret, tune
    return (
        launch_config.jit(_k.decode_kernel, ("group", "head_dim", "num_splits")),
        launch_config.jit(_k.reduce_kernel, ()),
        launch_config.jit(_k.extend_kernel, ("group", "head_dim")),
    )


def _interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int]:
    """(group, head_dim) after host-side shape checks (no device reads)."""
    num_heads, head_dim = q.shape[1:]
    if k_cache.dim() != 3 or k_cache.shape != v_cache.shape or k_cache.shape[2] != head_dim:
        raise ValueError(
            f"expected k/v caches [N, Hk, {head_dim}], got {tuple(k_cache.shape)} and "
            f"{tuple(v_cache.shape)}"
        )
    num_kv = k_cache.shape[1]
    if num_heads % num_kv:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv} KV heads")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim")
    return num_heads // num_kv, head_dim


def _dot_args(q: torch.Tensor) -> dict[str, object]:
    # fp32 inputs: exact fp32 dots (tf32 would miss the fp32 oracle by ~1e-3).
    return dict(UPCAST=_interpreting(), PREC="ieee" if q.dtype == torch.float32 else "tf32")


def _strides(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    out: torch.Tensor,
) -> tuple[int, ...]:
    """The strides both kernels take, in their order: q's token and head, K's and V's row and
    head, the block table's row, out's token and head (head_dim is contiguous: `_check`)."""
    return (
        *q.stride()[:2],
        *k_cache.stride()[:2],
        *v_cache.stride()[:2],
        block_tables.stride(0),
        *out.stride()[:2],
    )


def _out(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} and contiguous in head_dim")
    return out


def _target_programs(device: torch.device) -> int:
    """About how many programs keep the device busy (a host property, no sync)."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def decode_splits(
    batch: int,
    num_kv: int,
    max_context: int,
    device: torch.device,
    programs: int | None = None,
) -> int:
    """Splits per (sequence, KV head): enough programs to fill the device (`programs`, by
    default from the device's SM count), each split at least `_MIN_SPLIT_LEN` positions. From
    static shapes only (graph-capturable)."""
    programs = _target_programs(device) if programs is None else programs
    want = triton.cdiv(programs, max(1, batch * num_kv))
    return max(1, min(want, triton.cdiv(max_context, _MIN_SPLIT_LEN)))


def paged_attention_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    page_size: int,
    *,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    min_split_len: int = _MIN_SPLIT_LEN,
    window: int = 0,
) -> torch.Tensor:
    """One query per sequence at position seq_lens-1, over its paged context.

    q [B, Hq, d]; k_cache/v_cache [N, Hk, d] flat page rows (page p = rows p*page_size..);
    block_tables int32/int64 [B, P]; seq_lens int [B] (>= 1, <= P*page_size, including the
    new token, whose K/V are already in the pool) -> out [B, Hq, d] in q's dtype (written into
    `out` when given). Hq % Hk == 0; fp32 accumulation. `num_splits` (default: from B, Hk and
    P*page_size) programs share each row's context, combined by a reduce kernel; each row's
    split covers ceil(seq_len / num_splits) positions, at least `min_split_len`, rounded up to
    whole blocks, so a row uses only the splits its own length needs. `window` > 0: each query
    sees its last `window` positions only; the splits divide those (their count from
    min(P*page_size, window)) and no page before them is read.
    """
    group, head_dim = _check(q, k_cache, v_cache)
    out = _out(q, out)
    batch, num_heads = q.shape[:2]
    if batch == 0:
        return out
    num_kv, max_ctx = k_cache.shape[1], block_tables.shape[1] * page_size
    if window > 0:
        max_ctx = min(max_ctx, window)
    if num_splits is None:
        num_splits = decode_splits(batch, num_kv, max_ctx, q.device)
    # Drop splits that rounding leaves empty even for a row that fills the table.
    split_len = triton.cdiv(triton.cdiv(max_ctx, num_splits), _DECODE_BLOCK_N) * _DECODE_BLOCK_N
    num_splits = triton.cdiv(max_ctx, split_len)
    block_d = max(16, triton.next_power_of_2(head_dim))
    decode, reduce, _ = _jitted(_interpreting(), launch_config.tuning())
    direct = num_splits == 1
    parts = (batch, num_heads, 1 if direct else num_splits)
    m = torch.empty(parts, dtype=torch.float32, device=q.device)
    den = torch.empty_like(m)
    acc = torch.empty((*parts, block_d), dtype=torch.float32, device=q.device)
    cfg = shape_config(ATTN_DECODE, q)
    decode[(batch, num_kv, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        m,
        den,
        acc,
        scale * _LOG2E,
        group,
        head_dim,
        window,
        min_split_len,
        num_splits,
        num_heads,
        *_strides(q, k_cache, v_cache, block_tables, out),
        PAGE=page_size,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=cfg.block_n,
        DIRECT=direct,
        **_dot_args(q),
        **launch_config.options(cfg, "decode_kernel"),
    )
    if not direct:
        reduce[(batch, num_heads)](
            m,
            den,
            acc,
            out,
            num_splits,
            num_heads,
            head_dim,
            out.stride(0),
            out.stride(1),
            SPLITS=triton.next_power_of_2(num_splits),
            BLOCK_S=min(triton.next_power_of_2(num_splits), ATTN_REDUCE.block_n),
            BLOCK_D=block_d,
            num_warps=ATTN_REDUCE.num_warps,
            num_stages=ATTN_REDUCE.num_stages,
        )
    return out


def paged_attention_extend_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    page_size: int,
    *,
    max_query_len: int,
    out: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Causal attention of packed new tokens over their sequences' paged contexts.

    q [T, Hq, d] (sequence b's tokens are rows query_start_loc[b]..query_start_loc[b+1]-1, at
    positions seq_lens[b]-n_b .. seq_lens[b]-1, so a resumed prefix is attended from its
    pages); k_cache/v_cache [N, Hk, d] hold every context position including the new ones;
    block_tables int [B, P]; seq_lens int [B]; query_start_loc int32 [B+1]; max_query_len a
    host int >= every n_b (sizes the grid) -> out [T, Hq, d] in q's dtype. Rows past
    query_start_loc[-1] are not written. Hq % Hk == 0; fp32 accumulation. `window` > 0: the
    query at p sees p-window+1 .. p only, and a query block's loop starts at its first query's
    window (no page wholly before it is read).
    """
    group, head_dim = _check(q, k_cache, v_cache)
    out = _out(q, out)
    batch = seq_lens.shape[0]
    if batch == 0 or q.shape[0] == 0 or max_query_len == 0:
        return out
    num_kv = k_cache.shape[1]
    cfg = shape_config(ATTN_EXTEND, q)
    block_g = triton.next_power_of_2(group)
    block_m = max(1, cfg.block_i // block_g)  # block_i: query rows (tokens x group heads)
    extend = _jitted(_interpreting(), launch_config.tuning())[2]
    extend[(batch, num_kv, triton.cdiv(max_query_len, block_m))](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        scale * _LOG2E,
        group,
        head_dim,
        window,
        *_strides(q, k_cache, v_cache, block_tables, out),
        PAGE=page_size,
        BLOCK_G=block_g,
        BLOCK_M=block_m,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=cfg.block_n,
        **_dot_args(q),
        **launch_config.options(cfg, "extend_kernel"),
    )
    return out
