"""Compiled grammars, cached per spec (xgrammar imported on first use only).

The tokenizer info marks every special added token (reserved, control, tool markers) as
special, so no grammar ever lets one into JSON: the detokenizer drops special tokens from the
text, and a string that grew by one the client never sees could break `maxLength` or a pattern.
Tokens holding a raw control character are refused the same way (see `build_tokenizer_info`).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

from shortconv.sampling.grammar.schema_check import find_unsupported
from shortconv.sampling.grammar.spec import GrammarError, GrammarSpec

MAX_CACHED = 256  # compiled grammars kept (LRU); a schema is a few KB compiled
_JSON_OBJECT = '{"type":"object"}'
_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise GrammarError(
            "structured output needs the xgrammar package (pip install xgrammar)"
        ) from None
    return xgrammar


# Byte patterns xgrammar's strings admit that are not UTF-8 (surrogates ED A0.., code points
# past U+10FFFF F4 90.., overlong E0 80.. / F0 80.., bytes never used: C0 C1 F5..FF): the text
# would decode to U+FFFD and break `maxLength` or a pattern. A token ending in one of the lead
# bytes could start such a pattern, so it goes too; those characters can still be written as
# JSON \u escapes.
_BAD_UTF8 = re.compile(
    rb"[\xc0\xc1\xf5-\xff]|\xed[\xa0-\xbf]|\xf4[\x90-\xbf]|\xe0[\x80-\x9f]|\xf0[\x80-\x8f]"
)
_RISKY_END = (0xE0, 0xED, 0xF0, 0xF4)


def _bad_utf8(raw: bytes) -> bool:
    return bool(_BAD_UTF8.search(raw)) or (bool(raw) and raw[-1] in _RISKY_END)


def build_tokenizer_info(hf_tokenizer: Any, vocab_size: int, stop_ids: list[int]) -> Any:
    """xgrammar's view of the tokenizer, `vocab_size` wide (the model's, which may exceed the
    tokenizer's), with special added tokens blanked (blank = special to xgrammar)."""
    xgr = _xgrammar()
    detected = xgr.TokenizerInfo.from_huggingface(
        hf_tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids
    )
    encoded = [""] * vocab_size
    for token, idx in hf_tokenizer.get_vocab().items():
        if idx < vocab_size:
            encoded[idx] = token
    for idx, added in hf_tokenizer.added_tokens_decoder.items():
        if added.special and idx < vocab_size:
            encoded[idx] = ""
    # xgrammar's JSON strings admit raw control characters, which JSON forbids (json.loads
    # refuses them); every grammar here is compact JSON, which never needs one outside a
    # string either, so tokens holding one are never allowed.
    for idx, raw in enumerate(detected.decoded_vocab[:vocab_size]):
        if encoded[idx] and (any(b < 0x20 for b in raw) or _bad_utf8(raw)):
            encoded[idx] = ""
    return xgr.TokenizerInfo(
        encoded,
        detected.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=stop_ids,
        add_prefix_space=detected.add_prefix_space,
    )


class GrammarCache:
    """Compiles a GrammarSpec once (thread-safe: validation compiles off the engine thread)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_ids: list[int]) -> None:
        self._hf, self.vocab_size, self.stop_ids = hf_tokenizer, vocab_size, list(stop_ids)
        self._compiler: Any = None
        self._cache: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, spec: GrammarSpec) -> Any:
        """The CompiledGrammar for `spec`; GrammarError (naming the schema) when it has none."""
        with self._lock:
            if spec in self._cache:
                self.hits += 1
                self._cache.move_to_end(spec)
                return self._cache[spec]
            self.misses += 1
            compiled = self._compile(spec)
            self._cache[spec] = compiled
            if len(self._cache) > MAX_CACHED:
                self._cache.popitem(last=False)
            return compiled

    def _compile(self, spec: GrammarSpec) -> Any:
        if spec.kind == "json_schema":
            bad = find_unsupported(json.loads(spec.schema or "null"))
            if bad is not None:
                raise GrammarError(f"{bad[0]}: {bad[1]}", param=bad[0])
        if self._compiler is None:
            xgr = _xgrammar()
            info = build_tokenizer_info(self._hf, self.vocab_size, self.stop_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        text = spec.schema if spec.kind == "json_schema" else _JSON_OBJECT
        try:
            # NOTE: compact JSON, no free whitespace: a model (a random one above all) could
            # otherwise spend every token on spaces and newlines.
            return self._compiler.compile_json_schema(text, any_whitespace=False)
        except RuntimeError as exc:  # xgrammar's message says what it could not convert
            raise GrammarError(
                f"the schema cannot be compiled to a grammar: {_reason(exc)}"
            ) from None


def _reason(exc: Exception) -> str:
    """xgrammar's message without its "[time] file.cc:line:" prefix."""
    lines = [ln for ln in str(exc).splitlines() if ln.strip()]
    return _PREFIX.sub("", lines[0]) if lines else type(exc).__name__
