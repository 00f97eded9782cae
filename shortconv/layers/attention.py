"""LFM2/LFM3 grouped-query attention: per-head q/k RMSNorm, RoPE and paged KV; LFM3 adds a
sliding window (its `sliding_attention` layers), a per-kind RoPE and a per-head sigmoid gate."""

from __future__ import annotations

import torch
from torch import nn

from shortconv.configs.config import ModelConfig
from shortconv.execution.backend import BaseStateBackend
from shortconv.execution.head_shard import head_shard
from shortconv.execution.parallel import ParallelContext
from shortconv.kernels import write_kv
from shortconv.kernels.bound import bind_kernels
from shortconv.layers.linear import ColumnParallelLinear, ColumnSliceLinear, RowParallelLinear
from shortconv.layers.norm import RMSNorm
from shortconv.layers.rotary import RotaryEmbedding


class Lfm2Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: ParallelContext, rope: RotaryEmbedding):
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = d = cfg.head_dim
        heads = head_shard(cfg.num_heads, cfg.num_kv_heads, tp.size, tp.rank)
        self.num_heads, self.num_kv_heads = heads.num_q, heads.num_kv
        self.scale = d**-0.5
        h = cfg.hidden_size
        bias = cfg.attention_bias
        self.q_proj = ColumnParallelLinear(h, cfg.num_heads * d, bias, tp)
        # The KV heads this rank's query heads use (several ranks hold one when replicated).
        self.k_proj = ColumnSliceLinear(h, heads.kv_rows(d), bias)
        self.v_proj = ColumnSliceLinear(h, heads.kv_rows(d), bias)
        self.out_proj = RowParallelLinear(cfg.num_heads * d, h, bias, tp)
        self.q_layernorm = RMSNorm(d, cfg.norm_eps)
        self.k_layernorm = RMSNorm(d, cfg.norm_eps)
        # One gate logit per query head: column-parallel, so it shards with the q heads.
        self.g_proj = (
            ColumnParallelLinear(h, cfg.num_heads, False, tp) if cfg.attention_gate else None
        )
        self.window = cfg.window_of(layer_id)
        self.rope = rope
        self.kernels = bind_kernels()

    def forward(self, x: torch.Tensor, backend: BaseStateBackend) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_layernorm(self.q_proj(x).view(t, self.num_heads, self.head_dim))
        k = self.k_layernorm(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        md = backend.attention_metadata(self.layer_id)
        q, k = self.rope(md.step.positions, q, k)
        write_kv(k, v, md.k_cache, md.v_cache, md.step.slot_mapping)
        out = self.kernels.paged_attention(
            q, md.k_cache, md.v_cache, md.step, self.scale, md.scratch, window=self.window
        )
        if self.g_proj is not None:
            out = out * torch.sigmoid(self.g_proj(x)).unsqueeze(-1)
        return self.out_proj(out.reshape(t, -1))
