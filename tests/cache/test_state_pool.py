"""State pool tensors: shapes per spec, layer views, slot copies touch only the target slots."""

from __future__ import annotations

import torch

from shortconv.cache.state_pool import KVSpec, StatePool, StateSpec


def _pool() -> StatePool:
    specs = [StateSpec("conv", (0, 2, 5), (8, 2)), StateSpec("prev_state", (0, 2, 5), (6,))]
    kv = KVSpec((1, 3), num_kv_heads=2, head_dim=4, page_size=4, num_pages=5)
    return StatePool(specs, kv, num_slots=6, dtype=torch.float32, device=torch.device("cpu"))


def test_shapes_and_views():
    pool = _pool()
    assert pool.states["conv"].shape == (3, 6, 8, 2)
    assert pool.states["prev_state"].shape == (3, 6, 6)
    assert pool.state("conv", 2).shape == (6, 8, 2)
    k, v = pool.kv(3)
    assert k.shape == (20, 2, 4) and v.shape == (20, 2, 4)
    pool.state("conv", 5)[1].fill_(3.0)  # views alias the pool, each its own layer's
    assert pool.states["conv"][2, 1].eq(3.0).all() and not pool.states["conv"][:2].any()
    v[7].fill_(2.0)  # layer 3 is the second of its KV group
    caches = pool.kv_caches[0]
    assert caches is not None and caches[1][1, 7].eq(2.0).all() and not caches[1][0].any()
    assert not k.any()


def test_copy_slots_only_touches_destinations():
    pool = _pool()
    for t in pool.states.values():
        t.copy_(torch.randn_like(t))
    before = {k: v.clone() for k, v in pool.states.items()}
    pool.copy_slots(torch.tensor([1, 2]), torch.tensor([4, 5]))
    for name, t in pool.states.items():
        assert torch.equal(t[:, 4], before[name][:, 1]) and torch.equal(t[:, 5], before[name][:, 2])
        assert torch.equal(t[:, :4], before[name][:, :4])
