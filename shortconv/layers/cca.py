"""ZAYA1 Compressed Convolutional Attention: conv-mixed q/k, previous-token values, paged GQA.

Tensor parallelism. ZAYA1's value vector is [current-token half ‖ previous-token half] of
Hk*d channels viewed as Hk heads, so KV heads 0..Hk/2-1 carry current-token values and the rest
previous-token values. Each rank therefore takes block r of the first half of the KV heads AND
block r of the second half (with their query heads), which makes every projection a plain
"two packed parts" split and gives every rank an equal share of the previous-token state.
q/k channels of one head stay together, and the conv weights follow the same head blocks.
"""

from __future__ import annotations

import torch
from torch import nn

from shortconv.backend import BaseStateBackend
from shortconv.config import ModelConfig
from shortconv.kernels import (
    cca_conv_fn,
    cca_conv_update,
    cca_prev_value_fn,
    cca_prev_value_update,
    paged_attention,
    write_kv,
)
from shortconv.layers.linear import ColumnParallelLinear, RowParallelLinear, mark_shard
from shortconv.layers.rotary import RotaryEmbedding
from shortconv.parallel import ParallelContext


def cca_state_dims(cfg: ModelConfig, tp: ParallelContext) -> tuple[int, int, int]:
    """(conv channels, conv state width K, previous-token state width) of one rank's shard."""
    hq = tp.shard(cfg.num_heads, "attention heads (num_attention_heads)")
    hk = tp.shard(cfg.num_kv_heads, "KV heads (num_key_value_heads)")
    k = (cfg.cca_time0 - 1) + (cfg.cca_time1 - 1)
    return (hq + hk) * cfg.head_dim, k, hk * cfg.head_dim // 2


def local_qk_channels(full: torch.Tensor, q_channels: int, tp: ParallelContext) -> torch.Tensor:
    """This rank's rows of a tensor whose dim 0 packs [q (q_channels) ‖ k] channels: for q and
    for k, block r of each half (see the module docstring)."""
    if tp.size == 1:
        return full
    parts = []
    for block in (full[:q_channels], full[q_channels:]):
        parts += [half.chunk(tp.size, dim=0)[tp.rank] for half in block.chunk(2, dim=0)]
    return torch.cat(parts, dim=0)


class _ConvParams(nn.Module):
    """Holds one conv stage's weight and bias under the checkpoint's names.

    NOTE: replicated marks because ZayaForCausalLM.load_weights hands over the rank's rows
    already (the q‖k packing has unequal parts, which mark_shard cannot describe).
    """

    def __init__(self, channels: int, shape: tuple[int, ...]):
        super().__init__()
        self.weight = mark_shard(nn.Parameter(torch.empty(channels, *shape)), None)
        self.bias = mark_shard(nn.Parameter(torch.empty(channels)), None)


class CCAProjection(nn.Module):
    """x [T, H] → q [T, hq, d], k [T, hk, d], v [T, hk, d]; reads and updates the slot state
    ("conv": last K raw q‖k columns; "prev_state": the last token's delayed value)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: ParallelContext):
        super().__init__()
        self.layer_id = layer_id
        d, h = cfg.head_dim, cfg.hidden_size
        self.head_dim = d
        self.num_heads = tp.shard(cfg.num_heads, "attention heads (num_attention_heads)")
        self.num_kv_heads = tp.shard(cfg.num_kv_heads, "KV heads (num_key_value_heads)")
        self.groups = self.num_heads // self.num_kv_heads
        parts = 2 if tp.size > 1 else 1
        bias = cfg.attention_bias
        self.q_proj = ColumnParallelLinear(h, cfg.num_heads * d, bias, tp, parts=parts)
        self.k_proj = ColumnParallelLinear(h, cfg.num_kv_heads * d, bias, tp, parts=parts)
        self.v_proj_current = ColumnParallelLinear(h, cfg.num_kv_heads * d // 2, bias, tp)
        self.v_proj_delayed = ColumnParallelLinear(h, cfg.num_kv_heads * d // 2, bias, tp)
        chans, _, _ = cca_state_dims(cfg, tp)
        self.conv_qk_depthwise = _ConvParams(chans, (cfg.cca_time0,))
        self.conv_qk_grouped = _ConvParams(chans, (d, cfg.cca_time1))

    def forward(
        self, x: torch.Tensor, backend: BaseStateBackend
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t, d, hq, hk = x.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
        q0, k0 = self.q_proj(x), self.k_proj(x)
        # Residual paths: q_res = (q + its KV head's k) / 2; k_res = mean of its group's q_res.
        k_rep = k0.view(t, hk, 1, d).expand(t, hk, self.groups, d).reshape(t, hq, d)
        q_res = (q0.view(t, hq, d) + k_rep) * 0.5
        k_res = q_res.view(t, hk, self.groups, d).mean(dim=-2)

        md = backend.conv_state_metadata(self.layer_id)
        assert md.extra_state is not None, "ZAYA1 needs the prev_state pool (extra_state_name)"
        qk = torch.cat([q0, k0], dim=-1)
        dw, gw = self.conv_qk_depthwise, self.conv_qk_grouped
        delayed = self.v_proj_delayed(x)
        if md.is_decode:
            conv = cca_conv_update(
                qk, md.conv_state, dw.weight, dw.bias, gw.weight, gw.bias, md.cache_indices
            )
            prev = cca_prev_value_update(delayed, md.extra_state, md.cache_indices)
        else:
            conv = cca_conv_fn(
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
            # A fresh sequence's first token sees v_proj_delayed(0), which is the bias.
            prev = cca_prev_value_fn(
                delayed,
                md.extra_state,
                self.v_proj_delayed.bias,
                md.query_start_loc,
                md.cache_indices,
                md.has_initial_state,
            )
        q = conv[:, : hq * d].reshape(t, hq, d) + q_res
        k = conv[:, hq * d :].reshape(t, hk, d) + k_res
        v = torch.cat([self.v_proj_current(x), prev], dim=-1).view(t, hk, d)
        return q, k, v


class CCAQKNorm(nn.Module):
    """q, k ← sqrt(d)·x/‖x‖ per head; k also scaled by a learned per-KV-head `temp`."""

    def __init__(self, cfg: ModelConfig, tp: ParallelContext):
        super().__init__()
        self.scale = cfg.head_dim**0.5
        hk = tp.shard(cfg.num_kv_heads, "KV heads (num_key_value_heads)")
        self.temp = mark_shard(nn.Parameter(torch.empty(hk)), 0, parts=2 if tp.size > 1 else 1)

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
        self.qkv_proj = CCAProjection(cfg, layer_id, tp)
        self.qk_norm = CCAQKNorm(cfg, tp)
        self.o_proj = RowParallelLinear(
            cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.attention_bias, tp
        )
        if tp.size > 1:
            mark_shard(self.o_proj.weight, 1, parts=2)  # columns follow the two head halves
        self.rope = rope
        self.scale = cfg.head_dim**-0.5

    def forward(self, x: torch.Tensor, backend: BaseStateBackend) -> torch.Tensor:
        q, k, v = self.qkv_proj(x, backend)
        q, k = self.qk_norm(q, k)
        md = backend.attention_metadata(self.layer_id)
        q, k = self.rope(md.step.positions, q, k)
        write_kv(k, v, md.k_cache, md.v_cache, md.step.slot_mapping)
        out = paged_attention(q, md.k_cache, md.v_cache, md.step, self.scale, md.scratch)
        return self.o_proj(out.reshape(x.shape[0], -1))
