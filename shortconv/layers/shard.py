"""How a rank's parameter maps onto the full checkpoint tensor, and loading it from there."""

from __future__ import annotations

import torch
from torch import nn

from shortconv.errors import CheckpointError
from shortconv.execution.parallel import ParallelContext


def mark_shard(param: nn.Parameter, dim: int | None, parts: int = 1) -> nn.Parameter:
    """Record how the full checkpoint tensor maps onto this rank's parameter.

    dim=None: replicated. `parts` > 1: the full tensor packs `parts` equal blocks along `dim`
    (e.g. LFM2's in_proj = B‖C‖x) and each block is split separately.
    """
    param.shard_dim = dim  # type: ignore[attr-defined]
    param.shard_parts = parts  # type: ignore[attr-defined]
    return param


def mark_rows(param: nn.Parameter, dim: int, ranges: tuple[tuple[int, int], ...]) -> nn.Parameter:
    """This rank's parameter is the full tensor's [start, stop) slices `ranges` along `dim`,
    concatenated: for splits that equal blocks cannot describe (replicated KV heads, ZAYA1's
    current/previous value halves, the q‖k conv channels of a rank's heads)."""
    param.shard_dim = dim  # type: ignore[attr-defined]
    param.shard_ranges = tuple(ranges)  # type: ignore[attr-defined]
    return param


def rank_block(param: nn.Parameter, full: torch.Tensor, tp: ParallelContext) -> torch.Tensor:
    dim = getattr(param, "shard_dim", None)
    ranges = getattr(param, "shard_ranges", None)
    if ranges is not None:
        if max((stop for _, stop in ranges), default=0) > full.shape[dim]:
            return full.new_empty((0,))  # too short: reported as a shape mismatch
        return torch.cat([full.narrow(dim, a, b - a) for a, b in ranges], dim=dim)
    if dim is None or tp.size == 1:
        return full
    blocks = full.chunk(getattr(param, "shard_parts", 1), dim=dim)
    return torch.cat([b.chunk(tp.size, dim=dim)[tp.rank] for b in blocks], dim=dim)


def load_shard_(param: nn.Parameter, full: torch.Tensor, tp: ParallelContext, name: str) -> None:
    """Copy this rank's block of `full` into `param`, with a clear error on any shape mismatch."""
    t = rank_block(param, full, tp)
    if t.shape != param.shape:
        raise CheckpointError(
            f"checkpoint tensor {name!r} has shape {tuple(full.shape)}, expected "
            f"{_full_shape(param, tp)} for this model config"
        )
    with torch.no_grad():
        param.copy_(t.to(param.dtype))


def _full_shape(param: nn.Parameter, tp: ParallelContext) -> str:
    dim = getattr(param, "shard_dim", None)
    ranges = getattr(param, "shard_ranges", None)
    shape = list(param.shape)
    if ranges is not None:
        return f"rows {list(ranges)} of dim {dim} into {tuple(shape)}"
    if dim is not None:
        shape[dim] *= tp.size
    return str(tuple(shape))
