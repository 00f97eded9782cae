"""Block-aligned sort of MoE routes by expert, with static shapes and no host sync.

The grouped GEMMs of `moe_triton` take BLOCK_M routed rows at a time, all of one expert. This
step lays the T*k routes out sorted by expert, each expert's group padded up to a multiple of
BLOCK_M, in a buffer whose length depends only on (T, k, E, BLOCK_M): every op below is a
fixed-size device op (no bincount, nonzero or boolean indexing, which size their output from
the data and so read it on the host), so the step can be recorded into a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MoeAlignment:
    """`sorted_route_ids` [padded_len]: route index t*k + j, or the sentinel T*k for padding;
    `expert_of_block` [padded_len // BLOCK_M]: the expert of each block, -1 for unused blocks;
    `num_used_blocks` [1]: how many leading blocks hold routes (device tensor)."""

    sorted_route_ids: torch.Tensor
    expert_of_block: torch.Tensor
    num_used_blocks: torch.Tensor
    block_m: int


def padded_length(num_routes: int, num_experts: int, block_m: int) -> int:
    """Longest possible padded layout: every expert wastes at most BLOCK_M - 1 slots."""
    worst = num_routes + num_experts * (block_m - 1)
    return -(-worst // block_m) * block_m


def align_routes(
    ids: torch.Tensor, weights: torch.Tensor, num_experts: int, block_m: int
) -> MoeAlignment:
    """Sort the routes of ids [T, k] by expert into BLOCK_M-aligned groups.

    Routes with id outside [0, E) (E is the skip route) or with a zero weight need no GEMM
    work: they sort last and land in no block. Output shapes depend on (T, k, E, BLOCK_M) only.
    """
    n = ids.numel()
    dev = ids.device
    flat = ids.reshape(-1).to(torch.int64)
    live = (flat >= 0) & (flat < num_experts) & (weights.reshape(-1) != 0)
    flat = torch.where(live, flat, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    sorted_e = flat[order]
    # Rank of each sorted route inside its expert's group, then its slot in the padded layout.
    group_start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(n, device=dev) - group_start[sorted_e]
    padded_start = torch.cat([padded_end.new_zeros(1), padded_end])  # [E + 1]; skip → total
    length = padded_length(n, num_experts, block_m)
    # Skip routes go to one extra trash slot past the end, which is cut off below.
    dest = torch.where(sorted_e < num_experts, padded_start[sorted_e] + rank, length)
    sorted_route_ids = torch.full((length + 1,), n, dtype=torch.int32, device=dev)
    sorted_route_ids.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(0, length, block_m, device=dev)
    expert = torch.searchsorted(padded_end, block_start, right=True)
    expert_of_block = torch.where(expert < num_experts, expert, -1).to(torch.int32)
    return MoeAlignment(
        sorted_route_ids=sorted_route_ids[:length],
        expert_of_block=expert_of_block,
        num_used_blocks=(padded_end[-1:] // block_m).to(torch.int32),
        block_m=block_m,
    )
