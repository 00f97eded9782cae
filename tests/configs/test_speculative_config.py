"""`speculative_config`: vLLM's keys, parsed and checked at start-up with clear errors."""

from __future__ import annotations

import pytest
import torch

from shortconv.configs.config import EngineConfig, ModelConfig
from shortconv.configs.speculative import SpeculativeConfig
from shortconv.errors import ConfigError
from shortconv.execution.worker_spec import plan_capacity
from shortconv.tiny.checkpoint import make_tiny_checkpoint


def test_a_mapping_becomes_a_frozen_config() -> None:
    eng = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    spec = eng.speculative_config
    assert isinstance(spec, SpeculativeConfig)
    assert (spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == (
        3,
        2,
        4,
    )
    assert eng.num_speculative_tokens == 3
    assert EngineConfig().num_speculative_tokens == 0
    draft = SpeculativeConfig.parse({"method": "draft_model", "model": "d"})
    assert draft is not None and (draft.method, draft.model) == ("draft_model", "d")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"method": "draft_model"}, "speculative_config.model (the draft checkpoint) is required"),
        ({"method": "ngram", "model": "x"}, "taken by no other; method='ngram'"),
        ({"method": "eagle"}, "must be one of"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min (3) must be <="),
        ({"prompt_lookup_max": True}, "prompt_lookup_max must be an integer"),
        ({"num_speculative_token": 4}, "unknown speculative_config key(s)"),
        ("ngram", "must be a mapping"),
    ],
)
def test_refused_with_the_reason(value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(speculative_config=value)  # type: ignore[arg-type]


def test_each_running_request_gets_k_spec_slots(tmp_path) -> None:
    """k slots per running request on top, and no more sliding-window pages for them."""
    cfg = ModelConfig.from_dir(make_tiny_checkpoint("lfm3", tmp_path, with_tokenizer=False))
    kw = {"max_num_seqs": 4, "num_kv_pages": 64, "enable_prefix_caching": False}
    base = plan_capacity(cfg, EngineConfig(**kw), 256, torch.float32)  # type: ignore[arg-type]
    spec = EngineConfig(**kw, speculative_config={"num_speculative_tokens": 3})  # type: ignore[arg-type]
    got = plan_capacity(cfg, spec, 256, torch.float32)
    assert got.num_slots - base.num_slots == 4 * 3
    assert got.window_pages == base.window_pages
