"""Read and write one checkpoint's state on a rank's pool: its slot and its KV pages.

The export side of a state bundle (`cache.state_bundle`) gathers the listed slots (one per
checkpoint) of every state kind and the listed pages of every KV group into host tensors; the
import side scatters them into fresh slots and fresh pages. Names follow the bundle: a state
kind's own name, `kv{g}.k` and `kv{g}.v` for KV group g.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from shortconv.cache.state_pool import StatePool


def gather_state(
    pool: StatePool, slots: Sequence[int], pages: Sequence[Sequence[int]]
) -> dict[str, torch.Tensor]:
    """Host copies of `slots` (every state kind, `[layers, len(slots), *shape]`) and of
    `pages[g]` of every KV group g."""
    out = {name: t[:, _ids(slots, t)].to("cpu", copy=True) for name, t in pool.states.items()}
    for g, (k, v) in _groups(pool):
        idx = _ids(pages[g], k)
        for part, t in (("k", k), ("v", v)):
            out[f"kv{g}.{part}"] = _paged(pool, g, t)[:, idx].flatten(1, 2).to("cpu", copy=True)
    return out


def scatter_state(
    pool: StatePool,
    slots: Sequence[int],
    pages: Sequence[Sequence[int]],
    tensors: Mapping[str, torch.Tensor],
) -> None:
    """Write `tensors` (as `gather_state` made them) into `slots` and `pages[g]`.

    NOTE: every shape is checked before the first write, so a bad bundle writes nothing."""
    expected = state_shapes(pool, len(slots), [len(p) for p in pages])
    if set(tensors) != set(expected):
        raise ValueError(f"state kinds {sorted(tensors)} != this pool's {sorted(expected)}")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"{name}: shape {tuple(tensors[name].shape)} != {shape}")
    for name, t in pool.states.items():
        t[:, _ids(slots, t)] = tensors[name].to(device=t.device, dtype=t.dtype)
    for g, (k, v) in _groups(pool):
        idx = _ids(pages[g], k)
        ps = pool.kv_specs[g].page_size
        for part, t in (("k", k), ("v", v)):
            src = tensors[f"kv{g}.{part}"].to(device=t.device, dtype=t.dtype)
            _paged(pool, g, t)[:, idx] = src.unflatten(1, (len(pages[g]), ps))


def state_shapes(
    pool: StatePool, num_slots: int, num_pages: Sequence[int]
) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor that `num_slots` checkpoints over `num_pages[g]` pages per
    group export."""
    shapes = {name: (t.shape[0], num_slots, *t.shape[2:]) for name, t in pool.states.items()}
    for g, (k, _) in _groups(pool):
        ps = pool.kv_specs[g].page_size
        for part in ("k", "v"):
            shapes[f"kv{g}.{part}"] = (k.shape[0], num_pages[g] * ps, *k.shape[2:])
    return shapes


def _ids(ids: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(list(ids), dtype=torch.int64, device=like.device)


def _groups(pool: StatePool) -> list[tuple[int, tuple[torch.Tensor, torch.Tensor]]]:
    return [(g, c) for g, c in enumerate(pool.kv_caches) if c is not None]


def _paged(pool: StatePool, group: int, t: torch.Tensor) -> torch.Tensor:
    """`[layers, pages, page_size, Hk, d]` view of one group's flat K or V."""
    ps = pool.kv_specs[group].page_size
    return t.view(t.shape[0], -1, ps, *t.shape[2:])
