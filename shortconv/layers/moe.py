"""LFM2-MoE sparse block: sigmoid router, expert_bias for selection only, top-k renormalised."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shortconv.configs.config import ModelConfig
from shortconv.execution.parallel import ParallelContext
from shortconv.layers.experts import FusedExperts
from shortconv.layers.linear import mark_shard


class SigmoidTopKMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: ParallelContext):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.scaling = cfg.routed_scaling_factor
        e, h = cfg.num_experts, cfg.hidden_size
        self.gate_weight = mark_shard(nn.Parameter(torch.empty(e, h)), None)
        self.expert_bias = (
            mark_shard(nn.Parameter(torch.zeros(e, dtype=torch.float32)), None)
            if cfg.use_expert_bias
            else None
        )
        self.experts = FusedExperts(e, h, cfg.moe_intermediate_size, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.gate_weight)
        probs = logits.sigmoid()
        if self.expert_bias is not None:
            # NOTE: the bias only chooses experts; the mixing weights stay the raw sigmoid.
            _, ids = torch.topk(probs + self.expert_bias, k=self.top_k, dim=-1)
            weights = torch.gather(probs, 1, ids).type_as(logits)
        else:
            weights, ids = torch.topk(probs, k=self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
        return self.experts(x, ids, weights * self.scaling)
