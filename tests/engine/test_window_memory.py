"""KV memory that follows the window, through the engine (the tiny LFM3: window 8 here, pages
of 4 tokens): one request decoded to 8x the window holds at most ceil(w / page) + 1 pages in
its sliding group at every step and gives them all back; the pools are sized per group; the
KV-capped max_model_len is set by the full-attention group alone."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from oracle import assert_matches_oracle, oracle_greedy
from published_configs import LFM3_1_7B

from shortconv import SamplingParams
from shortconv.cache.kv_groups import kv_groups, window_page_bound
from shortconv.configs.config import EngineConfig, ModelConfig
from shortconv.configs.hf.availability import transformers_lacks
from shortconv.execution.worker_spec import plan_capacity, plan_worker_spec
from shortconv.llm import build_engine
from shortconv.tiny.checkpoint import build_hf_model

pytestmark = pytest.mark.skipif(
    transformers_lacks("lfm3") is not None, reason=str(transformers_lacks("lfm3"))
)
PAGE = 4


@pytest.fixture(scope="module")
def lfm3(tmp_path_factory):
    hf = build_hf_model("lfm3", seed=5)
    path = tmp_path_factory.mktemp("lfm3")
    hf.save_pretrained(str(path))
    return hf, path


def test_one_request_to_eight_windows_holds_the_window_and_frees_the_rest(lfm3) -> None:
    hf, path = lfm3
    eng = build_engine(
        path,
        dtype="float32",
        engine_config=EngineConfig(kv_page_size=PAGE, enable_prefix_caching=False),
    )
    cfg, cm = eng.model_cfg, eng.scheduler.cache_manager
    w = cfg.sliding_window
    bound = window_page_bound(w, PAGE)
    (window,) = cm.windows
    assert window.window == w and len(kv_groups(cfg)) == 2
    shapes = eng.executor.state_shapes()[0]  # per layer kind: full layers, then sliding ones
    assert shapes["kv"][0] == len(kv_groups(cfg)[0].layer_ids) == 1
    assert shapes["kv1"][:2] == (len(cfg.sliding_layer_ids), window.pages.num_pages * PAGE)
    prompt = [5, 9, 23, 7, 11]
    rid = eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=8 * w - 5))
    req, most, out = eng.scheduler.requests[rid], 0, None
    while out is None:
        for o in eng.step():
            out = o if o.finished else None
        if out is None:
            assert window.pages.num_used == len([p for p in req.window_pages[0] if p]) <= bound
            assert cm.pages.num_used == len(req.pages) == -(-req.num_computed // PAGE)
            most = max(most, window.pages.num_used)
            stats = eng.stats()  # what the metrics' kv_pages_used{kind} gauges read
            assert stats.kv_pages_used_by_kind == {
                "full": cm.pages.num_used,
                "sliding": window.pages.num_used,
            }
    assert len(prompt) + len(out.token_ids) == 8 * w
    assert most == bound  # a window straddling pages holds one more, never two
    assert window.pages.num_used == 0 and window.pages.num_free == window.pages.capacity
    assert cm.pages.num_used == 0 and cm.pages.num_free == cm.pages.capacity
    idle = eng.stats()
    assert idle.kv_pages_used_by_kind == {"full": 0, "sliding": 0}
    assert idle.kv_pages_total_by_kind == {
        "full": cm.pages.capacity,
        "sliding": window.pages.capacity,
    }
    assert_matches_oracle(out.token_ids, oracle_greedy(hf, prompt, len(out.token_ids)), "8x")


def _engine_cfg(**kw: object) -> EngineConfig:
    return EngineConfig(**{"kv_page_size": PAGE, "max_num_seqs": 4, **kw})  # type: ignore[arg-type]


def test_pools_are_sized_per_group(lfm3) -> None:
    """The sliding group gets its windows (live rows, a step's chunks, sessions' spare slots);
    an explicit num_kv_pages is the full group's; LFM2's single group is sized as before."""
    _, path = lfm3
    cfg = ModelConfig.from_dir(path)
    eng = _engine_cfg(max_num_batched_tokens=64)
    bound = window_page_bound(cfg.sliding_window, PAGE)
    cap = plan_capacity(cfg, eng, 1024, torch.float32)
    assert cap.window_pages == (1 + 4 * (bound + 1) + 64 // PAGE + 4 * bound,)
    assert cap.num_pages == 1 + 4 * 1024 // PAGE  # the full group: every position of every row
    explicit = plan_capacity(
        cfg, _engine_cfg(max_num_batched_tokens=64, num_kv_pages=50), 1024, torch.float32
    )
    assert explicit.num_pages == 50 and explicit.window_pages == cap.window_pages
    full_only = dataclasses.replace(cfg, layer_types=_unslid(cfg), sliding_window=0)
    old = plan_capacity(full_only, eng, 1024, torch.float32)
    assert old.window_pages == () and old.num_pages == cap.num_pages


def test_max_model_len_is_capped_by_the_full_group_only(lfm3) -> None:
    """A byte budget pays the sliding group's share first; what is left is the full group's,
    and only the full group caps the length (a sliding layer never holds a whole context)."""
    _, path = lfm3
    cfg = ModelConfig.from_dir(path)
    hk, d = cfg.num_kv_heads, cfg.head_dim
    per_layer_page = 2 * PAGE * hk * d * 4  # K and V, fp32
    eng = _engine_cfg(max_num_batched_tokens=16)
    (n_window,) = plan_capacity(cfg, eng, 1024, torch.float32).window_pages
    window_bytes = n_window * len(cfg.sliding_layer_ids) * per_layer_page
    budget = window_bytes + 11 * per_layer_page  # 11 pages of the one full layer
    spec = plan_worker_spec(path, _engine_cfg(max_num_batched_tokens=16, kv_cache_bytes=budget))
    assert spec.capacity.num_pages == 11 and spec.capacity.window_pages == (n_window,)
    assert spec.max_model_len == 10 * PAGE  # page 0 is scratch
    # A sliding group far smaller than a whole context does not cap the length.
    roomy = plan_worker_spec(path, _engine_cfg(max_num_batched_tokens=16))
    assert roomy.max_model_len == cfg.max_model_len == 1024
    assert roomy.capacity.window_pages == (n_window,) and n_window * PAGE < 1024 // 4


def _unslid(cfg: ModelConfig) -> tuple[str, ...]:
    return tuple("attention" if t == "sliding_attention" else t for t in cfg.layer_types)


def test_lfm3_1_7b_kv_per_request_and_pool_split_as_documented() -> None:
    """docs/kv_memory.md's numbers, from the published shape: 6 full and 5 sliding layers (w
    256), 4 KV heads of 128, bf16, pages of 16; the default 1 GiB pool's split."""
    cfg = ModelConfig.from_hf_dict(LFM3_1_7B)
    full, sliding = kv_groups(cfg)
    assert (len(full.layer_ids), sliding.window, len(sliding.layer_ids)) == (6, 256, 5)
    per_token_layer = 2 * 4 * 128 * 2  # K and V, bf16: 2 KiB
    ctx, bound = 32768, window_page_bound(256, 16)
    without = (6 + 5) * ctx * per_token_layer
    with_window = 6 * ctx * per_token_layer + 5 * bound * 16 * per_token_layer
    assert (without / 2**20, round(with_window / 2**20, 1)) == (704, 386.7)
    cap = plan_capacity(cfg, EngineConfig(), 32768, torch.bfloat16)
    assert cap.window_pages == (1153,) and cap.num_pages == 4500
    unwindowed = dataclasses.replace(cfg, layer_types=_unslid(cfg), sliding_window=0)
    assert plan_capacity(unwindowed, EngineConfig(), 32768, torch.bfloat16).num_pages == 2978
