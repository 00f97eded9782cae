"""The shard map that re-slices a state bundle across TP degrees, against the pools' own shapes.

Each rank's cut of an unsharded tensor must have exactly the shape that rank's pool holds
(`state_specs`, `kv_specs`: what the layers really allocate), and gathering the cuts must give
the tensor back: at TP 2 (KV heads split) and TP 4 (each KV head on two ranks). The engines'
greedy equality across degrees is tests/workers/test_tp_state_move.py.
"""

from __future__ import annotations

import pytest
import torch

from shortconv.cache.kv_groups import kv_specs
from shortconv.configs.config import ModelConfig
from shortconv.configs.hf.availability import transformers_lacks
from shortconv.execution.parallel import ParallelContext
from shortconv.execution.state_shards import state_shards
from shortconv.models.registry import model_class
from shortconv.tiny.checkpoint import make_tiny_checkpoint

HEADS = {"num_attention_heads": 8, "num_key_value_heads": 2}


@pytest.fixture(scope="module", params=["lfm2", "lfm2_moe", "lfm3", "zaya1"])
def cfg(request, tmp_path_factory) -> ModelConfig:
    arch = request.param
    model_type = {"zaya1": "zaya", "lfm3": "lfm3"}.get(arch)
    if model_type and (reason := transformers_lacks(model_type)):
        pytest.skip(reason)
    over = HEADS if arch in ("lfm2", "zaya1") else None
    out = make_tiny_checkpoint(arch, tmp_path_factory.mktemp(arch), over, with_tokenizer=False)
    return ModelConfig.from_dir(out)


def rank_shapes(cfg: ModelConfig, tp: ParallelContext) -> dict[str, tuple[int, ...]]:
    """The per-layer shape of every bundle tensor on this rank, dims 2.. of the bundle's."""
    shapes = {s.name: s.shape for s in model_class(cfg.arch).state_specs(cfg, tp)}
    for g, spec in enumerate(kv_specs(cfg, tp, 4, 8)):
        shapes[f"kv{g}.k"] = shapes[f"kv{g}.v"] = (spec.num_kv_heads, spec.head_dim)
    return shapes


@pytest.mark.parametrize("tp_size", [2, 4])
def test_each_rank_gets_its_pools_shape_and_gather_undoes_scatter(cfg, tp_size):
    whole = rank_shapes(cfg, ParallelContext(0, 1))
    full = {name: torch.randn(3, 2, *shape) for name, shape in whole.items()}
    shards = state_shards(cfg, tp_size)
    parts = shards.scatter(full)
    for rank, part in enumerate(parts):
        mine = rank_shapes(cfg, ParallelContext(rank, tp_size))
        assert {n: tuple(t.shape[2:]) for n, t in part.items()} == mine
    assert any(parts[0][n].shape != full[n].shape for n in full)  # something is sharded
    back = shards.gather(parts)
    assert all(torch.equal(back[n], full[n]) for n in full)


def test_a_tensor_of_another_width_is_refused(cfg):
    shards = state_shards(cfg, 2)
    conv = torch.zeros(1, 1, shards.sizes["conv"] + 1, 2)
    with pytest.raises(ValueError, match="dim 2"):
        shards.scatter({"conv": conv})
    with pytest.raises(ValueError, match="not one of"):
        shards.scatter({"nope": conv})
