"""Read and write one checkpoint's state on a rank's pool: its slot and its KV pages.

The export side of a state bundle (`cache.state_bundle`) gathers a slot of every state kind and
the listed pages of every KV group into host tensors; the import side scatters them into a
fresh slot and fresh pages. Names follow the bundle: a state kind's own name, `kv{g}.k` and
`kv{g}.v` for KV group g.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from shortconv.cache.state_pool import StatePool


def gather_state(
    pool: StatePool, slot: int, pages: Sequence[Sequence[int]]
) -> dict[str, torch.Tensor]:
    """Host copies of `slot` (every state kind) and of `pages[g]` of every KV group g."""
    out = {name: t[:, slot].to("cpu", copy=True) for name, t in pool.states.items()}
    for g, (k, v) in _groups(pool):
        idx = torch.tensor(list(pages[g]), dtype=torch.int64, device=k.device)
        for part, t in (("k", k), ("v", v)):
            out[f"kv{g}.{part}"] = _paged(pool, g, t)[:, idx].flatten(1, 2).to("cpu", copy=True)
    return out


def scatter_state(
    pool: StatePool, slot: int, pages: Sequence[Sequence[int]], tensors: Mapping[str, torch.Tensor]
) -> None:
    """Write `tensors` (as `gather_state` made them) into `slot` and `pages[g]`.

    NOTE: every shape is checked before the first write, so a bad bundle writes nothing."""
    expected = state_shapes(pool, [len(p) for p in pages])
    if set(tensors) != set(expected):
        raise ValueError(f"state kinds {sorted(tensors)} != this pool's {sorted(expected)}")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"{name}: shape {tuple(tensors[name].shape)} != {shape}")
    for name, t in pool.states.items():
        t[:, slot] = tensors[name].to(device=t.device, dtype=t.dtype)
    for g, (k, v) in _groups(pool):
        idx = torch.tensor(list(pages[g]), dtype=torch.int64, device=k.device)
        ps = pool.kv_specs[g].page_size
        for part, t in (("k", k), ("v", v)):
            src = tensors[f"kv{g}.{part}"].to(device=t.device, dtype=t.dtype)
            _paged(pool, g, t)[:, idx] = src.unflatten(1, (len(pages[g]), ps))


def state_shapes(pool: StatePool, num_pages: Sequence[int]) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor a checkpoint of `num_pages[g]` pages per group exports."""
    shapes = {name: (t.shape[0], *t.shape[2:]) for name, t in pool.states.items()}
    for g, (k, _) in _groups(pool):
        ps = pool.kv_specs[g].page_size
        for part in ("k", "v"):
            shapes[f"kv{g}.{part}"] = (k.shape[0], num_pages[g] * ps, *k.shape[2:])
    return shapes


def _groups(pool: StatePool) -> list[tuple[int, tuple[torch.Tensor, torch.Tensor]]]:
    return [(g, c) for g, c in enumerate(pool.kv_caches) if c is not None]


def _paged(pool: StatePool, group: int, t: torch.Tensor) -> torch.Tensor:
    """`[layers, pages, page_size, Hk, d]` view of one group's flat K or V."""
    ps = pool.kv_specs[group].page_size
    return t.view(t.shape[0], -1, ps, *t.shape[2:])
