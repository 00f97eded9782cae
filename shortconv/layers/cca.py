"""ZAYA1 Compressed Convolutional Attention: conv-mixed q/k, previous-token values, paged GQA.

Tensor parallelism. ZAYA1's value vector is [current-token ‖ previous-token] channels
(Hk*d/2 each) viewed as Hk heads, and query head j attends with KV head j // (Hq/Hk). Heads are
split as attention sees them (shortconv.execution.head_shard):
rank r holds a contiguous block of query
heads and the KV heads they use, so at tp 2 on 2 KV heads rank 0 holds the current-token head
and rank 1 the previous-token head, each with its 4 query heads. A rank's value channels are
thus all current-token, all previous-token, or (a head straddling the middle) both:
v_proj_current, v_proj_delayed and the previous-token state hold this rank's part, possibly
none. The CCA conv is per channel (depthwise) and per head (grouped), so a rank convolves the
q‖k channels of its own query and KV heads, and its conv state holds exactly those.
With replicated KV heads (tp > Hk), a KV head's key residual averages the query residuals of
its whole group, part of which other ranks attend with; so q_proj also projects the group's
other query heads (loaded, a few rows) and only the rank's own go on to the conv and attention.
"""

from __future__ import annotations

import torch
from torch import nn

from shortconv.configs.config import ModelConfig
from shortconv.execution.backend import BaseStateBackend, ShortConvMetadata
from shortconv.execution.head_shard import HeadShard, head_shard
from shortconv.execution.parallel import ParallelContext
from shortconv.execution.state_checkpoints import checkpoint_state
from shortconv.kernels import (
    cca_prev_value_fn,
    cca_prev_value_update,
    write_kv,
)
from shortconv.kernels.bound import bind_kernels
from shortconv.layers.linear import (
    ColumnSliceLinear,
    RowParallelLinear,
    mark_rows,
)
from shortconv.layers.rotary import RotaryEmbedding


def _heads(cfg: ModelConfig, tp: ParallelContext) -> HeadShard:
    return head_shard(cfg.num_heads, cfg.num_kv_heads, tp.size, tp.rank)


def value_rows(cfg: ModelConfig, heads: HeadShard) -> tuple[tuple[int, int], tuple[int, int]]:
    """[start, stop) rows of v_proj_current and of v_proj_delayed this rank holds: its KV heads'
    channels of the [current ‖ previous] value vector, cut at the middle (either may be empty)."""
    half = cfg.num_kv_heads * cfg.head_dim // 2
    ((lo, hi),) = heads.kv_rows(cfg.head_dim)
    return (min(lo, half), min(hi, half)), (max(lo, half) - half, max(hi, half) - half)


def qk_rows(cfg: ModelConfig, heads: HeadShard) -> tuple[tuple[int, int], tuple[int, int]]:
    """The rank's channels of the conv's [q (Hq*d) ‖ k (Hk*d)] packing: its own query heads,
    then its KV heads."""
    d, q_channels = cfg.head_dim, cfg.num_heads * cfg.head_dim
    ((k_lo, k_hi),) = heads.kv_rows(d)
    own_q = (heads.q_start * d, (heads.q_start + heads.num_q) * d)
    return own_q, (q_channels + k_lo, q_channels + k_hi)


def cca_state_dims(cfg: ModelConfig, tp: ParallelContext) -> tuple[int, int, int]:
    """(conv channels, conv state width K, previous-token state width) of one rank's shard."""
    heads = _heads(cfg, tp)
    k = (cfg.cca_time0 - 1) + (cfg.cca_time1 - 1)
    _, (prev_lo, prev_hi) = value_rows(cfg, heads)
    return (heads.num_q + heads.num_kv) * cfg.head_dim, k, prev_hi - prev_lo


class _ConvParams(nn.Module):
    """Holds one conv stage's weight and bias under the checkpoint's names: the rows of this
    rank's q‖k channels (see `qk_rows`)."""

    def __init__(self, rows: tuple[tuple[int, int], ...], shape: tuple[int, ...]):
        super().__init__()
        n = sum(stop - start for start, stop in rows)
        self.weight = mark_rows(nn.Parameter(torch.empty(n, *shape)), 0, rows)
        self.bias = mark_rows(nn.Parameter(torch.empty(n)), 0, rows)


class CCAProjection(nn.Module):
    """x [T, H] → q [T, hq, d], k [T, hk, d], v [T, hk, d]; reads and updates the slot state
    ("conv": last K raw q‖k columns; "prev_state": the last token's delayed value)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: ParallelContext):
        super().__init__()
        self.layer_id = layer_id
        self.kernels = bind_kernels()
        d, h = cfg.head_dim, cfg.hidden_size
        self.head_dim = d
        heads = _heads(cfg, tp)
        self.num_heads, self.num_kv_heads, self.groups = heads.num_q, heads.num_kv, heads.groups
        # q_proj projects every query head of the rank's KV groups; the rank's own start at
        # q_offset (at 0, and are all of them, unless KV heads are replicated).
        self.q_offset = heads.q_start - heads.group_q_start
        group_q = (heads.group_q_start * d, (heads.group_q_start + heads.num_kv * heads.groups) * d)
        bias = cfg.attention_bias
        self.q_proj = ColumnSliceLinear(h, (group_q,), bias)
        self.k_proj = ColumnSliceLinear(h, heads.kv_rows(d), bias)
        current, previous = value_rows(cfg, heads)
        self.v_proj_current = ColumnSliceLinear(h, (current,), bias)
        self.v_proj_delayed = ColumnSliceLinear(h, (previous,), bias)
        self.has_current, self.has_previous = current[1] > current[0], previous[1] > previous[0]
        rows = qk_rows(cfg, heads)
        self.conv_qk_depthwise = _ConvParams(rows, (cfg.cca_time0,))
        self.conv_qk_grouped = _ConvParams(rows, (d, cfg.cca_time1))

    def forward(
        self, x: torch.Tensor, backend: BaseStateBackend
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t, d, hq, hk = x.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
        gq = hk * self.groups  # query heads of this rank's KV groups; hq of them its own
        q0, k0 = self.q_proj(x), self.k_proj(x)
        # Residual paths: q_res = (q + its KV head's k) / 2; k_res = mean of its group's q_res.
        k_rep = k0.view(t, hk, 1, d).expand(t, hk, self.groups, d).reshape(t, gq, d)
        q_res = (q0.view(t, gq, d) + k_rep) * 0.5
        k_res = q_res.view(t, hk, self.groups, d).mean(dim=-2)
        if gq != hq:  # replicated KV heads: only this rank's own query heads go on
            own = slice(self.q_offset, self.q_offset + hq)
            q0, q_res = q0.view(t, gq, d)[:, own].reshape(t, hq * d), q_res[:, own]

        md = backend.conv_state_metadata(self.layer_id)
        assert md.extra_state is not None, "ZAYA1 needs the prev_state pool (extra_state_name)"
        qk = torch.cat([q0, k0], dim=-1)
        dw, gw = self.conv_qk_depthwise, self.conv_qk_grouped
        if md.is_decode:
            conv = self.kernels.cca_conv_update(
                qk, md.conv_state, dw.weight, dw.bias, gw.weight, gw.bias, md.cache_indices
            )
        else:
            checkpoint_state(qk.t(), md.conv_state, md.step)
            conv = self.kernels.cca_conv_fn(
                qk.t(),
                dw.weight,
                dw.bias,
                gw.weight,
                gw.bias,
                md.conv_state,
                md.query_start_loc,
                md.cache_indices,
                md.has_initial_state,
            ).t()
        q = conv[:, : hq * d].reshape(t, hq, d) + q_res
        k = conv[:, hq * d :].reshape(t, hk, d) + k_res
        return q, k, self._values(x, md).view(t, hk, d)

    def _values(self, x: torch.Tensor, md: ShortConvMetadata) -> torch.Tensor:
        """This rank's value channels: its current-token part, then its previous-token part."""
        parts = [self.v_proj_current(x)] if self.has_current else []
        if self.has_previous:
            parts.append(self._previous_values(self.v_proj_delayed(x), md))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def _previous_values(self, delayed: torch.Tensor, md: ShortConvMetadata) -> torch.Tensor:
        """Each token's previous-token delayed value; updates the slot's prev_state."""
        if md.is_decode:
            return cca_prev_value_update(delayed, md.extra_state, md.cache_indices)
        checkpoint_state(delayed.t(), md.extra_state, md.step)
        # A fresh sequence's first token sees v_proj_delayed(0), which is the bias.
        return cca_prev_value_fn(
            delayed,
            md.extra_state,
            self.v_proj_delayed.bias,
            md.query_start_loc,
            md.cache_indices,
            md.has_initial_state,
        )


class CCAQKNorm(nn.Module):
    """q, k ← sqrt(d)·x/‖x‖ per head; k also scaled by a learned per-KV-head `temp`."""

    def __init__(self, cfg: ModelConfig, tp: ParallelContext):
        super().__init__()
        self.scale = cfg.head_dim**0.5
        heads = _heads(cfg, tp)
        kv = ((heads.kv_start, heads.kv_start + heads.num_kv),)
        self.temp = mark_rows(nn.Parameter(torch.empty(heads.num_kv)), 0, kv)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        eps = torch.finfo(q.dtype).eps
        q = q * (self.scale / q.norm(p=2, dim=-1, keepdim=True).clamp_min(eps))
        k = k * (self.scale / k.norm(p=2, dim=-1, keepdim=True).clamp_min(eps))
        return q, k * self.temp[None, :, None]


class CCAAttention(nn.Module):
    """`forward(x[T, H], backend) -> [T, H]`: CCA projection, qk-norm, partial RoPE, paged GQA."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: ParallelContext, rope: RotaryEmbedding):
        super().__init__()
        self.layer_id = layer_id
        self.kernels = bind_kernels()
        self.qkv_proj = CCAProjection(cfg, layer_id, tp)
        self.qk_norm = CCAQKNorm(cfg, tp)
        self.o_proj = RowParallelLinear(
            cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.attention_bias, tp
        )
        self.rope = rope
        self.scale = cfg.head_dim**-0.5

    def forward(self, x: torch.Tensor, backend: BaseStateBackend) -> torch.Tensor:
        q, k, v = self.qkv_proj(x, backend)
        q, k = self.qk_norm(q, k)
        md = backend.attention_metadata(self.layer_id)
        q, k = self.rope(md.step.positions, q, k)
        write_kv(k, v, md.k_cache, md.v_cache, md.step.slot_mapping)
        out = self.kernels.paged_attention(
            q, md.k_cache, md.v_cache, md.step, self.scale, md.scratch
        )
        return self.o_proj(out.reshape(x.shape[0], -1))
