"""Device tensors holding every request's recurrent state and KV pages (one TP rank's shard)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
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
    """One KV group's pages (`cache.kv_groups`): its layers, shard and page count."""

    layer_ids: tuple[int, ...]
    num_kv_heads: int  # this rank's shard
    head_dim: int
    page_size: int
    num_pages: int
    window: int = 0  # the group's attention window (0: the whole context)

    def bytes_per_page(self, itemsize: int) -> int:
        """What one KV page (K and V, every layer of the group) costs this rank."""
        return (
            2 * len(self.layer_ids) * self.page_size * self.num_kv_heads * self.head_dim * itemsize
        )


class StatePool:
    """`states[name]` is `[n_layers, n_slots, *shape]`; each KV group's K and V are
    `[n_group_layers, pages*page, Hk, d]` (`cache.kv_groups`: group 0 full, then one per window).

    NOTE: slot 0 and page 0 of every group are scratch: padded rows read and write there, never
    a live slot.
    """

    def __init__(
        self,
        specs: list[StateSpec],
        kv: KVSpec | Sequence[KVSpec] | None,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_slots = num_slots
        self.specs = {s.name: s for s in specs}
        self.states: dict[str, torch.Tensor] = {}
        self._layer_pos: dict[str, dict[int, int]] = {}
        for spec in specs:
            self.states[spec.name] = lazy_zeros(
                (len(spec.layer_ids), num_slots, *spec.shape), dtype, device
            )
            self._layer_pos[spec.name] = {lid: i for i, lid in enumerate(spec.layer_ids)}
        self.kv_specs: tuple[KVSpec, ...] = (kv,) if isinstance(kv, KVSpec) else tuple(kv or ())
        # Per group: (K, V), or None for a group without layers.
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        self._kv_pos: dict[int, tuple[int, int]] = {}  # layer -> (group, index in the group)
        for g, kv_spec in enumerate(self.kv_specs):
            layers = kv_spec.layer_ids
            self.kv_caches.append(_kv_tensors(kv_spec, dtype, device) if layers else None)
            self._kv_pos.update({lid: (g, i) for i, lid in enumerate(layers)})
        # NOTE: every layer's views, made once here: a decode step asks for each of them, and
        # a `select` per layer per step was a measurable share of a batch-1 CPU step. The
        # pool's tensors are never reallocated, so the views stay valid.
        self._state_views = {
            name: {lid: t[i] for lid, i in self._layer_pos[name].items()}
            for name, t in self.states.items()
        }
        self._kv_views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for lid, (g, i) in self._kv_pos.items():
            caches = self.kv_caches[g]
            assert caches is not None
            self._kv_views[lid] = (caches[0][i], caches[1][i])

    @property
    def kv_spec(self) -> KVSpec | None:
        """Group 0's spec (the full-attention group)."""
        return self.kv_specs[0] if self.kv_specs else None

    @property
    def k_cache(self) -> torch.Tensor | None:
        """Group 0's K (every layer of a model without sliding windows)."""
        return self.kv_caches[0][0] if self.kv_caches and self.kv_caches[0] else None

    @property
    def v_cache(self) -> torch.Tensor | None:
        return self.kv_caches[0][1] if self.kv_caches and self.kv_caches[0] else None

    def state(self, name: str, layer_id: int) -> torch.Tensor:
        """`[n_slots, *shape]` view of one layer's state of kind `name`."""
        return self._state_views[name][layer_id]

    def kv_group_of(self, layer_id: int) -> int:
        """The KV group an attention layer's pages belong to."""
        return self._kv_pos[layer_id][0]

    def kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat `[pages*page_size, Hk, d]` K and V views of one attention layer (its group's)."""
        return self._kv_views[layer_id]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every state kind from slots `src` to slots `dst` (int64 device tensors)."""
        for t in self.states.values():
            t[:, dst] = t[:, src]

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor, group: int = 0) -> None:
        """Copy whole KV pages `src` to `dst` (int64 device tensors) of one group, every layer."""
        caches = self.kv_caches[group] if group < len(self.kv_caches) else None
        if caches is None:
            return
        ps = self.kv_specs[group].page_size
        for t in caches:
            paged = t.view(t.shape[0], -1, ps, *t.shape[2:])
            paged[:, dst] = paged[:, src]

    def nbytes(self) -> int:
        total = sum(t.numel() * t.element_size() for t in self.states.values())
        for caches in self.kv_caches:
            for t in caches or ():
                total += t.numel() * t.element_size()
        return total


def _kv_tensors(
    spec: KVSpec, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (len(spec.layer_ids), spec.num_pages * spec.page_size, spec.num_kv_heads, spec.head_dim)
    return lazy_zeros(shape, dtype, device), lazy_zeros(shape, dtype, device)


# Byte alignment of a CPU pool tensor's start (a cache line, and AVX-512's vector width).
_CPU_ALIGN = 64


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on CPU one whose untouched pages cost no resident memory.

    Why: `torch.zeros` writes every byte, so a 1 GiB KV pool was resident from the start however
    few pages were ever used. calloc (numpy's zeros) takes large blocks straight from mmap,
    whose pages the OS zero-fills on first touch; the contents are zeros either way, so every
    reader sees exactly what `torch.zeros` gave it (no kernel may rely on less)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    raw = torch.from_numpy(np.zeros(nbytes + _CPU_ALIGN, dtype=np.uint8))
    skip = -raw.data_ptr() % _CPU_ALIGN
    return raw[skip : skip + nbytes].view(dtype).view(shape)
