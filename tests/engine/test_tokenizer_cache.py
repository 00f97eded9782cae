"""The on-disk tokenizer cache: a hit behaves as a fresh load, any edit of the checkpoint's
tokenizer files builds anew, a broken entry is rebuilt, small tokenizers are not kept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from shortconv.engine import tokenizer_cache
from shortconv.engine.tokenizer import Tokenizer, build_byte_tokenizer

TEXTS = ["hello world", "emoji 😀 and CJK 世界", ""]
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def ckpt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SHORTCONV_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SHORTCONV_TOKENIZER_CACHE", raising=False)
    d = tmp_path / "ckpt"
    build_byte_tokenizer(600).save_pretrained(str(d))
    (d / "model.safetensors").write_bytes(b"not hashed: weights never key a tokenizer")
    return d


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every real construction by transformers, recorded; caching every build (threshold 0)."""
    calls: list[str] = []
    real = transformers.AutoTokenizer.from_pretrained

    def counted(path: str, *args: object, **kwargs: object) -> object:
        calls.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", counted)
    monkeypatch.setattr(tokenizer_cache, "CACHE_MIN_BUILD_S", 0.0)
    return calls


def _behaviour(tok: Tokenizer) -> tuple[object, ...]:
    ids = [tok.encode(t) for t in TEXTS]
    return (
        ids,
        [tok.decode(i) for i in ids],
        tok.decode(list(range(tok.vocab_size)), skip_special_tokens=False),
        tok.apply_chat_template(MESSAGES),
        (tok.vocab_size, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id),
    )


def _entries() -> list[Path]:
    return sorted(tokenizer_cache.entries_dir().glob("*.pkl"))


def test_second_load_is_a_cache_hit_and_behaves_the_same(ckpt: Path, builds: list[str]) -> None:
    first = Tokenizer.load(ckpt)
    assert first is not None and len(builds) == 1 and len(_entries()) == 1
    second = Tokenizer.load(ckpt)
    assert second is not None and len(builds) == 1  # not built again
    assert _behaviour(second) == _behaviour(first)


def test_an_edited_tokenizer_file_builds_anew(ckpt: Path, builds: list[str]) -> None:
    assert Tokenizer.load(ckpt) is not None
    cfg_path = ckpt / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = "EDITED{% for m in messages %}{{ m['content'] }}{% endfor %}"
    cfg_path.write_text(json.dumps(cfg))
    (ckpt / "chat_template.jinja").unlink(missing_ok=True)  # the template may live here instead
    edited = Tokenizer.load(ckpt)
    assert edited is not None and len(builds) == 2 and len(_entries()) == 2
    assert edited.decode(edited.apply_chat_template(MESSAGES)).startswith("EDITED")


def test_weights_do_not_key_the_entry(ckpt: Path, builds: list[str]) -> None:
    assert Tokenizer.load(ckpt) is not None
    (ckpt / "model.safetensors").write_bytes(b"other weights")
    assert Tokenizer.load(ckpt) is not None and len(builds) == 1


def test_an_unreadable_entry_is_rebuilt_and_replaced(ckpt: Path, builds: list[str]) -> None:
    assert Tokenizer.load(ckpt) is not None
    (entry,) = _entries()
    entry.write_bytes(b"\x80\x05 truncated")
    again = Tokenizer.load(ckpt)
    assert again is not None and len(builds) == 2
    assert Tokenizer.load(ckpt) is not None and len(builds) == 2  # the rewritten entry loads


def test_fast_builds_are_not_kept(
    ckpt: Path, builds: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tokenizer_cache, "CACHE_MIN_BUILD_S", 60.0)
    assert Tokenizer.load(ckpt) is not None and Tokenizer.load(ckpt) is not None
    assert len(builds) == 2 and _entries() == []


def test_turned_off(ckpt: Path, builds: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHORTCONV_TOKENIZER_CACHE", "0")
    assert Tokenizer.load(ckpt) is not None and Tokenizer.load(ckpt) is not None
    assert len(builds) == 2 and _entries() == []
