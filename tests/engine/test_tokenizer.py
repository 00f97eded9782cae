"""Byte-level tokenizer, the engine wrapper, and the incremental detokenizer."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from shortconv.engine.tokenizer import (
    BYTE_TOKEN_OFFSET,
    IncrementalDetokenizer,
    Tokenizer,
    build_byte_tokenizer,
)

VOCAB = 512
TEXTS = [
    "",
    "hello world",
    "  leading spaces, tabs\tand\nnewlines .",
    "emoji 😀👍🏽 and flags 🇫🇷",
    "CJK 世界你好, Cyrillic Привет, Arabic مرحبا, Hindi नमस्ते",
    "literal replacement char \ufffd inside",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    build_byte_tokenizer(VOCAB).save_pretrained(str(d))
    return d


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> Tokenizer:
    t = Tokenizer.load(tok_dir)
    assert t is not None
    return t


def _bytes_ids(text: str) -> list[int]:
    return [BYTE_TOKEN_OFFSET + b for b in text.encode("utf-8")]


class CountingDecoder:
    """Wraps a tokenizer to record the longest id window ever decoded."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.longest = 0

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.longest = max(self.longest, len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def _stream(det: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    deltas = [det.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(det.flush())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_is_exact(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == _bytes_ids(text)  # one token per UTF-8 byte
    assert tok.decode(ids) == text
    with_bos = tok.encode(text)
    assert with_bos[0] == tok.bos_token_id
    assert tok.decode(with_bos) == text


def test_ids_and_vocab(tok: Tokenizer) -> None:
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.vocab_size == VOCAB
    # Reserved ids fill the vocab and are special: skipped when decoding.
    assert tok.decode([BYTE_TOKEN_OFFSET + ord("a"), VOCAB - 1]) == "a"
    with pytest.raises(ValueError):
        build_byte_tokenizer(100)


def test_chat_template(tok: Tokenizer) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀"}]
    ids = tok.apply_chat_template(msgs)
    expected = (
        "<|bos|><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi 😀<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.decode(ids, skip_special_tokens=False) == expected
    assert ids.count(tok.bos_token_id) == 1  # the template's bos only, none added on top
    no_prompt = tok.apply_chat_template(msgs, add_generation_prompt=False)
    assert tok.decode(no_prompt, skip_special_tokens=False).endswith("Hi 😀<|im_end|>\n")


def test_no_chat_template_raises(tok_dir: Path) -> None:
    t = Tokenizer.load(tok_dir)
    assert t is not None
    t.hf.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        t.apply_chat_template([{"role": "user", "content": "x"}])


def test_load_without_tokenizer_files(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert Tokenizer.load(tmp_path) is None


def test_multibyte_split_across_tokens(tok: Tokenizer) -> None:
    text = "a😀b世"
    det = IncrementalDetokenizer(tok)
    deltas = _stream(det, _bytes_ids(text))
    # 'a', three held bytes then the emoji, 'b', two held bytes then the CJK char, flush.
    assert deltas == ["a", "", "", "", "😀", "b", "", "", "世", ""]
    assert det.text == text


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_stream_matches_full_decode(tok: Tokenizer, chunk: int) -> None:
    text = "héllo wörld 😀 世界 " * 20
    det = IncrementalDetokenizer(tok)
    assert "".join(_stream(det, tok.encode(text), chunk)) == text


def test_random_ids_including_invalid_utf8(tok: Tokenizer) -> None:
    # Random bytes and specials: invalid sequences must come out exactly as a full decode.
    rng = random.Random(0)
    for _ in range(100):
        ids = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 60))]
        det = IncrementalDetokenizer(tok)
        assert "".join(_stream(det, ids, rng.randrange(1, 4))) == tok.decode(ids)


def test_long_garbage_run_then_valid(tok: Tokenizer) -> None:
    ids = [BYTE_TOKEN_OFFSET + 0x80] * 100 + _bytes_ids("😀 ok")
    counter = CountingDecoder(tok)
    det = IncrementalDetokenizer(counter)
    assert "".join(_stream(det, ids)) == tok.decode(ids)
    assert counter.longest <= 70  # bounded even while the tail stays invalid


def test_decode_window_is_bounded(tok: Tokenizer) -> None:
    ids = tok.encode("abc 😀 世界 " * 200, add_special_tokens=False)
    counter = CountingDecoder(tok)
    det = IncrementalDetokenizer(counter)
    _stream(det, ids)
    assert counter.longest <= 16  # not O(sequence length)


def test_prompt_context(tok: Tokenizer) -> None:
    prompt = tok.encode("Say: ")
    gen = tok.encode("ok 😀", add_special_tokens=False)
    det = IncrementalDetokenizer(tok, prompt_ids=prompt)
    assert "".join(_stream(det, gen)) == "ok 😀"


def test_stop_string_across_tokens(tok: Tokenizer) -> None:
    det = IncrementalDetokenizer(tok, stop=("STOP",))
    deltas = _stream(det, _bytes_ids("hello STOP world"))
    assert "".join(deltas) == "hello "
    assert det.stopped and det.matched_stop == "STOP"
    # 'S', 'T', 'O' were held back as a possible stop start, never released.
    assert all("S" not in d for d in deltas)
    assert det.push(_bytes_ids("more")) == "" and det.flush() == ""


def test_stop_false_start_is_released(tok: Tokenizer) -> None:
    det = IncrementalDetokenizer(tok, stop=("abc",))
    deltas = _stream(det, _bytes_ids("xababx"))
    assert deltas[:2] == ["x", ""]  # 'a' held
    assert "".join(deltas) == "xababx"
    assert not det.stopped and det.matched_stop is None


def test_stop_held_text_released_on_flush(tok: Tokenizer) -> None:
    det = IncrementalDetokenizer(tok, stop=("\n\n",))
    assert det.push(_bytes_ids("line\n")) == "line"
    assert det.flush() == "\n"
    assert det.text == "line\n"


def test_stop_with_multibyte_and_earliest_match(tok: Tokenizer) -> None:
    det = IncrementalDetokenizer(tok, stop=("世界", "😀!"))
    out = "".join(_stream(det, _bytes_ids("hi 😀! then 世界")))
    assert out == "hi " and det.matched_stop == "😀!"
    det = IncrementalDetokenizer(tok, stop=("cd", "bcd"))
    assert "".join(_stream(det, _bytes_ids("abcde"), chunk=5)) == "a"
    assert det.matched_stop == "bcd"


def test_stop_inside_one_chunk(tok: Tokenizer) -> None:
    det = IncrementalDetokenizer(tok, stop=("<end>",))
    assert det.push(_bytes_ids("answer<end>junk")) == "answer"
    assert det.stopped


def test_special_tokens_skipped(tok: Tokenizer) -> None:
    ids = [tok.bos_token_id, *_bytes_ids("hi"), tok.eos_token_id]
    assert "".join(_stream(IncrementalDetokenizer(tok), ids)) == "hi"
    kept = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(_stream(kept, ids)) == "<|bos|>hi<|im_end|>"
