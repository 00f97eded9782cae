"""Published checkpoints' shapes under tensor parallelism, built on the meta device (no weights).

For LFM2-350M, LFM2-1.2B, LFM2-2.6B, LFM2-8B-A1B and ZAYA1-8B (tests/published_configs.py) at
tp_size 1, 2, 4 and 8: every rank's shard shapes, state-pool shapes, bytes per slot, KV bytes
per page and the KV page count a rank gets from the default 1 GiB budget, against numbers
worked out by hand in the tables below (bf16, KV pages of 16 tokens). LFM3-1.7B: its rank
shard and conv-state shapes (its KV pool's layout is the window-aware pool's business).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from published_configs import LFM2_1_2B, LFM2_2_6B, LFM2_8B_A1B, LFM2_350M, LFM3_1_7B, ZAYA1_8B

from shortconv.cache.kv_groups import kv_specs
from shortconv.cache.state_pool import StatePool
from shortconv.configs.config import EngineConfig, ModelConfig
from shortconv.configs.support import check_support
from shortconv.errors import ConfigError
from shortconv.execution.parallel import ParallelContext
from shortconv.execution.worker_spec import plan_capacity
from shortconv.models.registry import model_class

BF16 = torch.bfloat16
ENGINE = EngineConfig()  # 1 GiB of KV per rank, 32 sequences, pages of 16 tokens
CPU = torch.device("cpu")
LFM2_MODELS = {
    "LFM2-350M": LFM2_350M,
    "LFM2-1.2B": LFM2_1_2B,
    "LFM2-2.6B": LFM2_2_6B,
    "LFM2-8B-A1B": LFM2_8B_A1B,
}

# Per rank: query rows (heads/tp * 64), KV heads (8/tp), conv channels (hidden/tp), dense MLP
# rows, vocab rows, state bytes per slot (conv layers * channels * 2 cached columns * 2 bytes),
# KV bytes per page (2 * attention layers * 16 tokens * KV heads * 64 * 2 bytes) and pages
# (2**30 // bytes per page). Dense MLP: 350M 6656 -> 2/3 -> 4437 -> up to 256s: 4608;
# 1.2B 12288 -> 8192; 2.6B 10752 -> 7168; 8B-A1B's dense layers take intermediate_size 7168.
LFM2_EXPECTED: dict[tuple[str, int], tuple[int, ...]] = {
    ("LFM2-350M", 1): (1024, 8, 1024, 4608, 65536, 40960, 196608, 5461),
    ("LFM2-350M", 2): (512, 4, 512, 2304, 32768, 20480, 98304, 10922),
    ("LFM2-350M", 4): (256, 2, 256, 1152, 16384, 10240, 49152, 21845),
    ("LFM2-350M", 8): (128, 1, 128, 576, 8192, 5120, 24576, 43690),
    ("LFM2-1.2B", 1): (2048, 8, 2048, 8192, 65536, 81920, 196608, 5461),
    ("LFM2-1.2B", 2): (1024, 4, 1024, 4096, 32768, 40960, 98304, 10922),
    ("LFM2-1.2B", 4): (512, 2, 512, 2048, 16384, 20480, 49152, 21845),
    ("LFM2-1.2B", 8): (256, 1, 256, 1024, 8192, 10240, 24576, 43690),
    ("LFM2-2.6B", 1): (2048, 8, 2048, 7168, 65536, 180224, 262144, 4096),
    ("LFM2-2.6B", 2): (1024, 4, 1024, 3584, 32768, 90112, 131072, 8192),
    ("LFM2-2.6B", 4): (512, 2, 512, 1792, 16384, 45056, 65536, 16384),
    ("LFM2-2.6B", 8): (256, 1, 256, 896, 8192, 22528, 32768, 32768),
    ("LFM2-8B-A1B", 1): (2048, 8, 2048, 7168, 65536, 147456, 196608, 5461),
    ("LFM2-8B-A1B", 2): (1024, 4, 1024, 3584, 32768, 73728, 98304, 10922),
    ("LFM2-8B-A1B", 4): (512, 2, 512, 1792, 16384, 36864, 49152, 21845),
    ("LFM2-8B-A1B", 8): (256, 1, 256, 896, 8192, 18432, 24576, 43690),
}

# ZAYA1-8B per rank: q_proj rows (the query heads of the rank's KV group: all 8 at tp 1, the 4
# of one group above), k_proj rows, v_proj_current rows, v_proj_delayed rows, conv channels
# ((own query heads + KV heads) * 128), previous-token width, o_proj columns, state bytes per
# slot (40 layers * (conv channels * 2 columns + previous width) * 2 bytes). KV head 0 (current
# token) lives on the first half of the ranks, KV head 1 (previous token) on the second half.
ZAYA_CURRENT = {1: (1024, 256, 128, 128, 1280, 128, 1024, 215040)}
ZAYA_CURRENT |= {
    2: (512, 128, 128, 0, 640, 0, 512, 102400),
    4: (512, 128, 128, 0, 384, 0, 256, 61440),
    8: (512, 128, 128, 0, 256, 0, 128, 40960),
}
ZAYA_PREVIOUS = {
    2: (512, 128, 0, 128, 640, 128, 512, 112640),
    4: (512, 128, 0, 128, 384, 128, 256, 71680),
    8: (512, 128, 0, 128, 256, 128, 128, 51200),
}
# KV bytes per page: 2 * 40 layers * 16 tokens * KV heads (2, then 1 per rank) * 128 * 2 bytes.
ZAYA_PAGE = {1: (655360, 1638), 2: (327680, 3276), 4: (327680, 3276), 8: (327680, 3276)}


def build_rank(cfg: ModelConfig, tp: int, rank: int) -> tuple[dict[str, tuple[int, ...]], Any]:
    """(parameter shapes, model class) of one rank, built on the meta device."""
    cls = model_class(cfg.arch)
    with torch.device("meta"):
        model = cls(cfg, ParallelContext(rank, tp))
    return {n: tuple(p.shape) for n, p in model.named_parameters()}, cls


def pool_bytes(cfg: ModelConfig, cls: Any, tp: int, rank: int) -> tuple[int, int, StatePool]:
    """(state bytes per slot, KV bytes per page, a meta-device pool of 3 slots and 4 pages)."""
    tp_ctx = ParallelContext(rank, tp)
    specs = cls.state_specs(cfg, tp_ctx)
    (kv,) = kv_specs(cfg, tp_ctx, ENGINE.kv_page_size, 4)  # one KV group: no sliding window
    pool = StatePool(specs, kv, 3, BF16, torch.device("meta"))
    per_slot = sum(s.bytes_per_slot(BF16.itemsize) for s in specs)
    per_page = kv.bytes_per_page(BF16.itemsize)
    assert pool.nbytes() == 3 * per_slot + 4 * per_page
    return per_slot, per_page, pool


def pages(cfg: ModelConfig, tp: int) -> int:
    return plan_capacity(cfg, ENGINE, cfg.max_model_len, BF16, tp).num_pages


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("name", list(LFM2_MODELS))
def test_lfm2_rank_shapes(name: str, tp: int) -> None:
    cfg = ModelConfig.from_hf_dict(LFM2_MODELS[name])
    check_support(cfg, CPU, tp)
    q_rows, hk, conv, mlp, vocab, slot_bytes, page_bytes, n_pages = LFM2_EXPECTED[(name, tp)]
    attn, h = cfg.attention_layer_ids[0], cfg.hidden_size
    for rank in (0, tp - 1):
        shapes, cls = build_rank(cfg, tp, rank)
        a = f"layers.{attn}.self_attn"
        assert shapes[f"{a}.q_proj.weight"] == (q_rows, h)
        assert shapes[f"{a}.k_proj.weight"] == shapes[f"{a}.v_proj.weight"] == (hk * 64, h)
        assert shapes[f"{a}.out_proj.weight"] == (h, q_rows)
        assert shapes["layers.0.conv.in_proj.weight"] == (3 * conv, h)
        assert shapes["layers.0.conv.conv_weight"] == (conv, 3)
        assert shapes["layers.0.feed_forward.w1.weight"] == (mlp, h)
        assert shapes["layers.0.feed_forward.w2.weight"] == (h, mlp)
        assert shapes["embed_tokens.weight"] == (vocab, h)
        per_slot, per_page, pool = pool_bytes(cfg, cls, tp, rank)
        assert (per_slot, per_page) == (slot_bytes, page_bytes)
        n_conv, n_attn = len(cfg.conv_layer_ids), len(cfg.attention_layer_ids)
        assert pool.states["conv"].shape == (n_conv, 3, conv, 2)
        assert pool.k_cache is not None and pool.k_cache.shape == (n_attn, 4 * 16, hk, 64)
    assert pages(cfg, tp) == n_pages


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_lfm2_8b_a1b_expert_shards(tp: int) -> None:
    cfg = ModelConfig.from_hf_dict(LFM2_8B_A1B)
    shapes, _ = build_rank(cfg, tp, tp - 1)
    assert "layers.1.feed_forward.experts.gate_up_proj" not in shapes  # dense layers 0, 1
    experts = "layers.2.feed_forward.experts"
    assert shapes[f"{experts}.gate_up_proj"] == (32, 2 * 1792 // tp, 2048)
    assert shapes[f"{experts}.down_proj"] == (32, 2048, 1792 // tp)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_zaya1_8b_rank_shapes(tp: int) -> None:
    cfg = ModelConfig.from_hf_dict(ZAYA1_8B)
    check_support(cfg, CPU, tp)
    page_bytes, n_pages = ZAYA_PAGE[tp]
    for rank in range(tp):
        table = ZAYA_CURRENT if rank < max(1, tp // 2) else ZAYA_PREVIOUS
        q, k, v_cur, v_prev, conv, prev, o_cols, slot_bytes = table[tp]
        shapes, cls = build_rank(cfg, tp, rank)
        p = "layers.7.self_attn"
        assert shapes[f"{p}.qkv_proj.q_proj.weight"] == (q, 2048)
        assert shapes[f"{p}.qkv_proj.k_proj.weight"] == (k, 2048)
        assert shapes[f"{p}.qkv_proj.v_proj_current.weight"] == (v_cur, 2048)
        assert shapes[f"{p}.qkv_proj.v_proj_delayed.weight"] == (v_prev, 2048)
        assert shapes[f"{p}.qkv_proj.conv_qk_depthwise.weight"] == (conv, 2)
        assert shapes[f"{p}.qkv_proj.conv_qk_grouped.weight"] == (conv, 128, 2)
        assert shapes[f"{p}.qk_norm.temp"] == (k // 128,)
        assert shapes[f"{p}.o_proj.weight"] == (2048, o_cols)
        assert shapes["layers.7.mlp.experts.gate_up_proj"] == (16, 4096 // tp, 2048)
        assert shapes["layers.7.mlp.experts.down_proj"] == (16, 2048, 2048 // tp)
        assert shapes["embed_tokens.weight"] == (262272 // tp, 2048)
        per_slot, per_page, pool = pool_bytes(cfg, cls, tp, rank)
        assert (per_slot, per_page) == (slot_bytes, page_bytes)
        assert pool.states["conv"].shape == (40, 3, conv, 2)
        assert pool.states["prev_state"].shape == (40, 3, prev)
        assert pool.k_cache is not None and pool.k_cache.shape == (40, 64, k // 128, 128)
    assert pages(cfg, tp) == n_pages


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_lfm3_1_7b_rank_shapes(tp: int) -> None:
    """16 q / 4 KV heads: tp 2 and 4 split the KV heads, tp 8 holds each on two ranks; the
    gate shards with the query heads; conv state is [13 layers, slots, 2048 / tp, 6]."""
    cfg = ModelConfig.from_hf_dict(LFM3_1_7B)
    check_support(cfg, CPU, tp)
    assert (len(cfg.conv_layer_ids), len(cfg.sliding_layer_ids)) == (13, 5)
    q_rows, kv_rows, h = 16 * 128 // tp, max(1, 4 // tp) * 128, 2048
    for rank in (0, tp - 1):
        shapes, cls = build_rank(cfg, tp, rank)
        for layer in (2, 4):  # full, sliding
            a = f"layers.{layer}.self_attn"
            assert shapes[f"{a}.q_proj.weight"] == (q_rows, h)
            assert shapes[f"{a}.k_proj.weight"] == shapes[f"{a}.v_proj.weight"] == (kv_rows, h)
            assert shapes[f"{a}.g_proj.weight"] == (16 // tp, h)
            assert shapes[f"{a}.out_proj.weight"] == (h, q_rows)
            assert shapes[f"{a}.q_layernorm.weight"] == (128,)
        assert shapes["layers.0.conv.conv_weight"] == (h // tp, 7)
        assert shapes["layers.0.post_operator_norm.weight"] == (h,)
        assert shapes["layers.4.feed_forward.w1.weight"] == (7680 // tp, h)
        assert shapes["embed_tokens.weight"] == (128000 // tp, h)
        conv = cls.state_specs(cfg, ParallelContext(rank, tp))[0]
        assert (conv.layer_ids, conv.shape) == (cfg.conv_layer_ids, (h // tp, 6))


def test_lfm2_350m_at_tp16_replicates_each_kv_head_on_two_ranks() -> None:
    cfg = ModelConfig.from_hf_dict(LFM2_350M)  # 16 query / 8 KV heads
    check_support(cfg, CPU, 16)
    for rank in (0, 1, 15):
        shapes, cls = build_rank(cfg, 16, rank)
        assert shapes["layers.2.self_attn.q_proj.weight"] == (64, 1024)  # one query head
        assert shapes["layers.2.self_attn.k_proj.weight"] == (64, 1024)  # its KV head, whole
        assert pool_bytes(cfg, cls, 16, rank)[1] == 24576  # one KV head's page, as at tp 8


@pytest.mark.parametrize(
    ("raw", "tp", "dimension"),
    [
        (LFM2_350M, 3, "attention heads (num_attention_heads) = 16"),
        (LFM2_350M, 32, "attention heads (num_attention_heads) = 16"),
        (LFM2_8B_A1B, 64, "attention heads (num_attention_heads) = 32"),
        (ZAYA1_8B, 16, "attention heads (num_attention_heads) = 8"),
        (ZAYA1_8B, 3, "attention heads (num_attention_heads) = 8"),
    ],
)
def test_tp_sizes_that_cannot_split_published_shapes_are_refused(raw, tp, dimension) -> None:
    cfg = ModelConfig.from_hf_dict(raw)
    with pytest.raises(ConfigError, match=re.escape(f"tp_size={tp} does not divide {dimension}")):
        check_support(cfg, CPU, tp)
