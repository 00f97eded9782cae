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


Ranges = tuple[tuple[int, int], ...]


def shard_ranges(param: nn.Parameter, length: int, tp: ParallelContext) -> Ranges | None:
    """This rank's [start, stop) slices, in order, along `param.shard_dim` of a full tensor
    `length` long there; None: the whole tensor (replicated, or one rank). A range may run
    past `length` (a full tensor too short for this layer): callers report a shape mismatch.
    Readers that slice a file (LoRA adapters: safetensors' get_slice) use this directly."""
    ranges = getattr(param, "shard_ranges", None)
    if ranges is not None:
        return tuple(ranges)
    if getattr(param, "shard_dim", None) is None or tp.size == 1:
        return None
    blocks = _chunks(0, length, getattr(param, "shard_parts", 1))
    return tuple(_chunks(start, stop, tp.size)[tp.rank] for start, stop in blocks)


def _chunks(start: int, stop: int, n: int) -> list[tuple[int, int]]:
    """torch.chunk's split of [start, stop) into n pieces (trailing ones may be empty)."""
    size = -(-(stop - start) // n)
    return [(min(start + i * size, stop), min(start + (i + 1) * size, stop)) for i in range(n)]


def rank_block(param: nn.Parameter, full: torch.Tensor, tp: ParallelContext) -> torch.Tensor:
    dim = getattr(param, "shard_dim", None)
    ranges = None if dim is None else shard_ranges(param, full.shape[dim], tp)
    if ranges is None:
        return full
    if max((stop for _, stop in ranges), default=0) > full.shape[dim]:
        return full.new_empty((0,))  # too short: reported as a shape mismatch
    return torch.cat([full.narrow(dim, a, b - a) for a, b in ranges], dim=dim)


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
