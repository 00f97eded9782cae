"""The tokenizer built without `AutoTokenizer` (shortconv/engine/tokenizer_backend.py) is the
one `AutoTokenizer` builds: same class, ids, decoding, chat template and specials, on the tiny
checkpoints; and the facts about transformers' registry that the shortcut rests on hold."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer
from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

from shortconv.engine import tokenizer_backend
from shortconv.engine.tokenizer import Tokenizer
from shortconv.engine.user_cache import cache_root
from shortconv.kernels.cpu_gemm import cache_root as kernels_cache_root
from shortconv.tiny.checkpoint import make_tiny_checkpoint

TEXTS = [
    "hello world",
    " leading space and\ttabs\n\nnewlines",
    "emoji 😀, CJK 世界, accents café",
    "<|im_start|>user\nspecials inline<|im_end|>",
    "<|tool_call_start|>[f(a=1)]<|tool_call_end|>",
    "",
]
MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "weather in Paris? 😀"},
]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def _behaviour(hf: Any) -> tuple[object, ...]:
    tok = Tokenizer(hf)
    ids = [tok.encode(t) for t in TEXTS]
    every = list(range(tok.vocab_size))
    return (
        type(hf),
        ids,
        [tok.encode(t, add_special_tokens=False) for t in TEXTS],
        [tok.decode(i) for i in ids],
        [tok.decode(i, skip_special_tokens=False) for i in ids],
        tok.decode(every, skip_special_tokens=False),
        tok.decode(every),
        tok.apply_chat_template(MESSAGES),
        tok.apply_chat_template(MESSAGES, tools=TOOLS),
        {i: (t.content, t.special) for i, t in hf.added_tokens_decoder.items()},
        (tok.vocab_size, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id),
        hf.chat_template,
    )


@pytest.mark.parametrize(
    ("arch", "direct"), [("lfm2", True), ("lfm2_moe", True), ("lfm3", True), ("zaya1", False)]
)
def test_same_tokenizer_as_auto_tokenizer(tmp_path: Path, arch: str, direct: bool) -> None:
    ckpt = make_tiny_checkpoint(arch, tmp_path / arch, seed=3)
    assert tokenizer_backend.uses_generic_backend(ckpt) is direct  # the shortcut is taken
    ours = tokenizer_backend.build_hf_tokenizer(ckpt)
    auto = AutoTokenizer.from_pretrained(str(ckpt), local_files_only=True)
    assert _behaviour(ours) == _behaviour(auto)


def test_the_model_types_have_no_tokenizer_of_their_own() -> None:
    """What `AutoTokenizer` would consult besides `tokenizer_class`: a model type's own class."""
    generic = (None, "TokenizersBackend", "PreTrainedTokenizerFast")
    for model_type in tokenizer_backend.GENERIC_MODEL_TYPES:
        assert TOKENIZER_MAPPING_NAMES.get(model_type) in generic, model_type
    assert TOKENIZER_MAPPING_NAMES.get("zaya") not in generic  # why ZAYA1 is not among them


def test_a_declared_specific_class_or_remote_code_goes_through_auto(tmp_path: Path) -> None:
    ckpt = make_tiny_checkpoint("lfm2", tmp_path / "lfm2", seed=3)
    cfg = ckpt / "tokenizer_config.json"
    text = cfg.read_text()
    cfg.write_text(text.replace('"TokenizersBackend"', '"LlamaTokenizer"'))
    assert not tokenizer_backend.uses_generic_backend(ckpt)
    cfg.write_text(text.replace("{", '{"auto_map": {"AutoTokenizer": ["x.Y", null]},', 1))
    assert not tokenizer_backend.uses_generic_backend(ckpt)


@pytest.mark.parametrize(
    "env",
    [
        {"SHORTCONV_CACHE": "/c/a"},
        {"XDG_CACHE_HOME": "/c/xdg"},
        {},
    ],
)
def test_the_two_cache_roots_agree(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for name in ("SHORTCONV_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cache_root() == kernels_cache_root()
