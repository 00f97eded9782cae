"""LFM2's gated short convolution: out_proj(C * conv(B * x)), state kept in the pool."""

from __future__ import annotations

import torch
from torch import nn

from shortconv.configs.config import ModelConfig
from shortconv.execution.backend import BaseStateBackend, ShortConvMetadata
from shortconv.execution.parallel import ParallelContext
from shortconv.execution.state_checkpoints import checkpoint_state
from shortconv.kernels.bound import bind_kernels
from shortconv.kernels.conv1d_verify_cpu import verify_conv1d_cpu
from shortconv.layers.linear import ColumnParallelLinear, RowParallelLinear, mark_shard


class ShortConv(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: ParallelContext):
        super().__init__()
        self.layer_id = layer_id
        self.kernels = bind_kernels()  # for the device built on (see kernels.bound)
        h = cfg.hidden_size
        dim = tp.shard(h, "conv channels (hidden_size)")
        self.in_proj = ColumnParallelLinear(h, 3 * h, cfg.conv_bias, tp, parts=3)
        self.out_proj = RowParallelLinear(h, h, cfg.conv_bias, tp)
        # HF stores the depthwise kernel as [dim, 1, width]; the loader squeezes it.
        self.conv_weight = mark_shard(nn.Parameter(torch.empty(dim, cfg.conv_width)), 0)
        self.conv_bias = mark_shard(nn.Parameter(torch.empty(dim)), 0) if cfg.conv_bias else None

    def forward(self, x: torch.Tensor, backend: BaseStateBackend) -> torch.Tensor:
        b, c, u = self.in_proj(x).chunk(3, dim=-1)
        bu = b * u  # [T, dim]
        md = backend.conv_state_metadata(self.layer_id)
        if md.is_decode:
            y = self.kernels.causal_conv1d_update(
                bu, md.conv_state, self.conv_weight, self.conv_bias, md.cache_indices
            )
        else:
            y = self._extend(bu.transpose(0, 1), md).transpose(0, 1)
        return self.out_proj(c * y)

    def _extend(self, x: torch.Tensor, md: ShortConvMetadata) -> torch.Tensor:
        """A prefill or verify step's conv of x [dim, T], its checkpoints written."""
        w, b, state = self.conv_weight, self.conv_bias, md.conv_state
        if (rows := md.step.verify) is not None and self.kernels.fused_verify:
            # A verify step resolved once (`StepTensors.verify`): no per-layer row checks, and
            # its checkpoints and state in one scatter.
            slots = md.cache_indices
            return verify_conv1d_cpu(x, w, b, state, slots, rows.width, rows.state_slots)
        checkpoint_state(x, state, md.step)
        return self.kernels.causal_conv1d_fn(
            x, w, b, state, md.query_start_loc, md.cache_indices, md.has_initial_state
        )
