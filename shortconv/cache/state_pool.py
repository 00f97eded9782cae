"""Device tensors holding every request's recurrent state and KV pages (one TP rank's shard)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateSpec:
    """One kind of per-slot state, e.g. conv state or ZAYA1's previous-token state.

    `shape` is per slot and per layer, already this rank's shard.
    """

    name: str
    layer_ids: tuple[int, ...]
    shape: tuple[int, ...]

    def bytes_per_slot(self, itemsize: int) -> int:
        """What one slot of this state costs this rank, over all its layers."""
        return len(self.layer_ids) * math.prod(self.shape) * itemsize


@dataclass(frozen=True)
class KVSpec:
    layer_ids: tuple[int, ...]
    num_kv_heads: int  # this rank's shard
    head_dim: int
    page_size: int
    num_pages: int

    def bytes_per_page(self, itemsize: int) -> int:
        """What one KV page (K and V, every attention layer) costs this rank."""
        return (
            2 * len(self.layer_ids) * self.page_size * self.num_kv_heads * self.head_dim * itemsize
        )


class StatePool:
    """`states[name]` is `[n_layers, n_slots, *shape]`; KV is `[n_attn_layers, pages*page, Hk, d]`.

    NOTE: slot 0 and page 0 are scratch: padded rows read and write there, never a live slot.
    """

    def __init__(
        self,
        specs: list[StateSpec],
        kv: KVSpec | None,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_slots = num_slots
        self.specs = {s.name: s for s in specs}
        self.states: dict[str, torch.Tensor] = {}
        self._layer_pos: dict[str, dict[int, int]] = {}
        for spec in specs:
            self.states[spec.name] = torch.zeros(
                (len(spec.layer_ids), num_slots, *spec.shape), dtype=dtype, device=device
            )
            self._layer_pos[spec.name] = {lid: i for i, lid in enumerate(spec.layer_ids)}
        self.kv_spec = kv
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self._kv_pos: dict[int, int] = {}
        if kv is not None and kv.layer_ids:
            shape = (len(kv.layer_ids), kv.num_pages * kv.page_size, kv.num_kv_heads, kv.head_dim)
            self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
            self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
            self._kv_pos = {lid: i for i, lid in enumerate(kv.layer_ids)}

    def state(self, name: str, layer_id: int) -> torch.Tensor:
        """`[n_slots, *shape]` view of one layer's state of kind `name`."""
        return self.states[name][self._layer_pos[name][layer_id]]

    def kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat `[pages*page_size, Hk, d]` K and V views of one attention layer."""
        assert self.k_cache is not None and self.v_cache is not None
        pos = self._kv_pos[layer_id]
        return self.k_cache[pos], self.v_cache[pos]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every state kind from slots `src` to slots `dst` (int64 device tensors)."""
        for t in self.states.values():
            t[:, dst] = t[:, src]

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole KV pages `src` to `dst` (int64 device tensors) in every attention layer."""
        if self.k_cache is None or self.v_cache is None or self.kv_spec is None:
            return
        ps = self.kv_spec.page_size
        for t in (self.k_cache, self.v_cache):
            paged = t.view(t.shape[0], -1, ps, *t.shape[2:])
            paged[:, dst] = paged[:, src]

    def nbytes(self) -> int:
        total = sum(t.numel() * t.element_size() for t in self.states.values())
        for t in (self.k_cache, self.v_cache):
            if t is not None:
                total += t.numel() * t.element_size()
        return total
