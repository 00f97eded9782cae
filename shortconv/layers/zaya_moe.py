"""ZAYA1 MoE: an MLP router with cross-layer router state, top-1 over experts + a skip class.

The router reads `down_proj(x)` plus (from layer 1 on) the previous layer's router hidden state
of the same token, scaled per channel; that sum is also what it hands to the next layer. The
state lives only within one forward (per token of the step), never across steps. Top-1 picks
on softmax probs + `balancing_biases`; the mixing weight is the raw prob. Class `num_experts`
is the skip route: the block outputs zeros for that token (the reference masks its weight to 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shortconv.configs.config import ModelConfig
from shortconv.configs.hf.zaya1 import expert_activation_name
from shortconv.errors import ConfigError
from shortconv.execution.parallel import ParallelContext
from shortconv.layers.experts import FusedExperts
from shortconv.layers.linear import ReplicatedLinear, mark_shard
from shortconv.layers.norm import RMSNorm


class ZayaRouterMLP(nn.Module):
    """RMSNorm → fc1 → GELU (exact) → fc2 → GELU → out_proj (num_experts + 1 classes)."""

    def __init__(self, dim: int, num_classes: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(dim, eps)
        self.fc1 = ReplicatedLinear(dim, dim, True)
        self.fc2 = ReplicatedLinear(dim, dim, True)
        self.out_proj = ReplicatedLinear(dim, num_classes, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.fc1(self.norm(x)))
        return self.out_proj(F.gelu(self.fc2(x)))


class ZayaRouter(nn.Module):
    """`forward(x[T, H], prev[T, R] | None) -> (weights[T, 1], ids[T, 1], state[T, R])`."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        r, e = cfg.router_hidden_size, cfg.num_experts
        self.num_experts = e
        self.down_proj = ReplicatedLinear(cfg.hidden_size, r, True)
        # Layer 0 has no previous layer, hence no scale (the checkpoint has none either).
        self.router_states_scale = (
            mark_shard(nn.Parameter(torch.empty(r)), None) if layer_id != 0 else None
        )
        self.router_mlp = ZayaRouterMLP(r, e + 1, cfg.norm_eps)
        # A parameter (not a buffer) so the weight loader fills it; last entry = skip class.
        self.balancing_biases = mark_shard(
            nn.Parameter(torch.empty(e + 1, dtype=torch.float32), requires_grad=False), None
        )

    def forward(
        self, x: torch.Tensor, prev: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.down_proj(x)
        if self.router_states_scale is not None and prev is not None:
            h = h + prev * self.router_states_scale
        probs = torch.softmax(self.router_mlp(h), dim=-1)
        biased = probs.float() + self.balancing_biases.float()
        _, ids = torch.topk(biased, 1, dim=-1)
        return torch.gather(probs, 1, ids), ids, h


class ZayaMoE(nn.Module):
    """`forward(x[T, H], router_state) -> (out[T, H], next router_state)`; skip-routed tokens
    get zeros (FusedExperts treats id == num_experts as a no-op)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: ParallelContext):
        super().__init__()
        if cfg.num_experts_per_tok != 1:
            raise ConfigError(
                f"ZAYA1 routes each token to one expert; num_experts_per_tok = "
                f"{cfg.num_experts_per_tok} is not supported"
            )
        self.gate = ZayaRouter(cfg, layer_id)
        self.experts = FusedExperts(
            cfg.num_experts,
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            tp,
            activation=expert_activation_name(cfg.hidden_act),
        )

    def forward(
        self, x: torch.Tensor, router_state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids, state = self.gate(x, router_state)
        return self.experts(x, ids, weights), state
