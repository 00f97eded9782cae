"""One rank's shard of an adapter's A and B, read from the weights file and nothing more.

A column-parallel base (its weight split by output rows) takes B's rows of its shard; a
row-parallel base (split by input columns) takes A's columns; a replicated one takes both
whole. The slices are the base weight's own (`layers.shard.shard_ranges`), read with
safetensors' `get_slice`, so a rank never materializes another rank's part of the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from shortconv.layers.shard import Ranges
from shortconv.lora.adapter import LoraAdapter, LoraError, LoraTensors, file_stamp

_Pair = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class ShardPlan:
    """Which part of one module's tensors a rank reads: A's column ranges and B's row
    ranges (None: the whole dimension)."""

    a_cols: Ranges | None = None
    b_rows: Ranges | None = None

    def local_shapes(self, t: LoraTensors) -> tuple[tuple[int, int], tuple[int, int]]:
        """(A, B) shapes this rank gets; a range past the tensor's end counts as 0 wide (the
        caller's shape check then refuses it)."""
        a_in = _width(self.a_cols, t.a_shape[1])
        b_out = _width(self.b_rows, t.b_shape[0])
        return (t.a_shape[0], a_in), (b_out, t.b_shape[1])


def read_shards(adapter: LoraAdapter, plans: dict[str, ShardPlan]) -> dict[str, _Pair]:
    """{module: (A, B)} of `plans`' modules, each sliced as planned; LoraError ("files") when
    the file is unreadable or changed since `adapter` was read."""
    file = adapter.weights_file
    try:
        changed = file_stamp(file) != adapter.stamp
        if not changed:
            with safe_open(str(file), "pt", device="cpu") as f:
                return {m: _read_pair(f, adapter.modules[m], p) for m, p in plans.items()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise LoraError(f"{file}: not a readable safetensors file ({exc})", "files") from exc
    msg = f"{file}: changed on disk since the adapter was loaded; unload and load it again"
    raise LoraError(msg, "files")


def _read_pair(f: Any, t: LoraTensors, plan: ShardPlan) -> _Pair:
    return _read(f, t.a_key, 1, plan.a_cols), _read(f, t.b_key, 0, plan.b_rows)


def _read(f: Any, key: str, dim: int, ranges: Ranges | None) -> torch.Tensor:
    sl = f.get_slice(key)
    if ranges is None:
        return sl[:]
    parts = [sl[a:b] if dim == 0 else sl[:, a:b] for a, b in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _width(ranges: Ranges | None, length: int) -> int:
    if ranges is None:
        return length
    if max((stop for _, stop in ranges), default=0) > length:
        return 0
    return sum(stop - start for start, stop in ranges)
