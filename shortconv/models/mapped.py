"""Adopt a memory-mapped checkpoint tensor as a parameter's storage instead of copying it.

Why: safetensors' `get_tensor` on CPU returns a view of the file's private (copy-on-write)
mapping, no copy. Copying it into a freshly allocated parameter read the file's pages and wrote
1.4 GB of new anonymous pages for the LFM2-350M shape (2-6 s of a replica's start on the 2-core
machine, docs/serving_path.md "Start-up") and kept two copies in memory (the page cache's and
the parameter's). Adopted, the parameter *is* the page cache's copy: shared by every process
that maps the file, dropped under memory pressure and read back on demand.

NOTE: the mapping is MAP_PRIVATE, so a later in-place write (quantization, a LoRA merge) copies
the pages it touches and never reaches the file. Truncating the file in place while a replica
serves it is undefined (SIGBUS on the next read); replacing it by rename is safe.
"""

from __future__ import annotations

import torch
from torch import nn

from shortconv.execution.parallel import ParallelContext


def can_adopt(param: nn.Parameter, tensor: torch.Tensor, tp: ParallelContext) -> bool:
    """`tensor` can become `param`'s storage as it is: the whole tensor is this rank's (no TP
    split, row ranges that are the whole tensor in order), on the CPU, in the parameter's dtype
    and shape, and contiguous."""
    return (
        tp.size == 1
        and _whole(param, tensor)
        and param.device.type == "cpu"
        and tensor.device.type == "cpu"
        and tensor.dtype == param.dtype
        and tensor.shape == param.shape
        and tensor.is_contiguous()
    )


def _whole(param: nn.Parameter, tensor: torch.Tensor) -> bool:
    """No row ranges, or ranges that tile the whole of their dim in order (e.g. every KV head
    at tp_size=1): anything else reorders or drops rows, and is copied."""
    ranges = getattr(param, "shard_ranges", None)
    if ranges is None:
        return True
    ends = [0, *(stop for _, stop in ranges)]
    starts = [start for start, _ in ranges]
    dim = param.shard_dim  # type: ignore[attr-defined]
    return starts == ends[:-1] and tensor.dim() > dim and ends[-1] == tensor.shape[dim]


def adopt_(param: nn.Parameter, tensor: torch.Tensor) -> None:
    """`param` now holds `tensor`'s storage (its own allocation is freed)."""
    with torch.no_grad():
        param.data = tensor
