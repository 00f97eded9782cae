"""Bad input gets a clear Python exception at the API, never a crash deep inside."""

from __future__ import annotations

import json
import shutil

import pytest

from shortconv import LLM, SamplingParams
from shortconv.errors import CheckpointError, ConfigError
from shortconv.tiny.checkpoint import make_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("lfm2", tmp_path_factory.mktemp("ok"), seed=1)


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(model=ckpt, dtype="float32")


def _copy(ckpt, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(ckpt, dst)
    return dst


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_unknown_architecture(ckpt, tmp_path):
    bad = _copy(ckpt, tmp_path)
    _edit_config(bad, architectures=["LlamaForCausalLM"], model_type="llama")
    with pytest.raises(ConfigError, match="unsupported architecture.*Lfm2ForCausalLM"):
        LLM(model=bad)


def test_missing_weights_file(ckpt, tmp_path):
    bad = _copy(ckpt, tmp_path)
    for f in bad.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        LLM(model=bad)


def test_pickle_weights_refused(ckpt, tmp_path):
    bad = _copy(ckpt, tmp_path)
    for f in bad.glob("*.safetensors"):
        f.rename(f.with_suffix(".bin"))
    with pytest.raises(CheckpointError, match="pickle"):
        LLM(model=bad)


def test_mismatched_shapes(ckpt, tmp_path):
    bad = _copy(ckpt, tmp_path)
    _edit_config(bad, intermediate_size=96)
    with pytest.raises(CheckpointError, match="shape"):
        LLM(model=bad)


def test_missing_directory(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        LLM(model=tmp_path / "nope")


def test_bad_dtype_and_device(ckpt):
    with pytest.raises(ConfigError, match="dtype"):
        LLM(model=ckpt, dtype="float8")
    with pytest.raises(ConfigError, match="device"):
        LLM(model=ckpt, device="meta")


G = SamplingParams(temperature=0.0, max_tokens=2)


@pytest.mark.parametrize(
    "prompts, match",
    [
        ([[]], "empty"),
        ([[1, 2, 10_000]], "outside the vocabulary"),
        ([[-1]], "outside the vocabulary"),
        ([[3] * 1024], "maximum model length"),
    ],
)
def test_bad_prompts_rejected_and_nothing_queued(llm, prompts, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt_token_ids=[[5, 6]] + prompts, sampling_params=G)
    assert not llm.engine.has_unfinished()
    # Nothing is held but the prefix cache's checkpoints and pages (evictable at any time).
    s = llm.engine.stats()
    assert (s.slots_used, s.kv_pages_used) == (s.prefix_cache_checkpoints, s.prefix_cache_pages)
    # The engine still serves good requests afterwards.
    assert len(llm.generate(prompt_token_ids=[[5, 6]], sampling_params=G)[0].token_ids) == 2


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -1.0},
        {"temperature": float("nan")},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"min_p": 2.0},
        {"max_tokens": 0},
        {"stop": ["x"] * 100},
        {"logprobs": 1000},
    ],
)
def test_invalid_sampling_values(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


def test_text_prompt_without_tokenizer(ckpt, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ckpt.iterdir():
        if f.name in ("config.json", "generation_config.json") or f.suffix == ".safetensors":
            shutil.copy(f, bare / f.name)
    llm = LLM(model=bare, dtype="float32")
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate(prompts=["hello"], sampling_params=G)
    assert len(llm.generate(prompt_token_ids=[[5]], sampling_params=G)[0].token_ids) == 2


def test_unknown_engine_option(ckpt):
    with pytest.raises(ValueError, match="unknown LLM option.*max_num_seq"):
        LLM(model=ckpt, max_num_seq=4)


def test_max_model_len_must_fit_the_kv_pool(ckpt):
    with pytest.raises(ConfigError, match="KV pages"):
        LLM(model=ckpt, max_model_len=512, num_kv_pages=4, kv_page_size=16)
    capped = LLM(model=ckpt, num_kv_pages=5, kv_page_size=16)  # 4 usable pages = 64 tokens
    assert capped.engine.max_model_len == 64
    with pytest.raises(ValueError, match="maximum model length is 64"):
        capped.generate(prompt_token_ids=[[5] * 64], sampling_params=G)
