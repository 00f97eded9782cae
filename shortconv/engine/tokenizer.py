"""Tokenizer support: a byte-level tokenizer builder, the engine-facing wrapper, and an
incremental detokenizer with stop-string handling.

The byte-level tokenizer exists so tiny test checkpoints are self-contained (no hub access):
every UTF-8 byte is one token, so any text round-trips exactly, and multi-byte characters are
split across tokens -- which is exactly what the incremental detokenizer must cope with.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

# Specials come first so their ids are small and stable across vocab sizes; the eos is the
# end-of-turn marker so a chat reply ends generation (ChatML convention).
PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|im_end|>"
IM_START_TOKEN = "<|im_start|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN)
NUM_BYTE_TOKENS = 256
BYTE_TOKEN_OFFSET = len(SPECIAL_TOKENS)

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Files whose presence means a directory carries a tokenizer AutoTokenizer can load.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

# Decode-window sizes for IncrementalDetokenizer (in tokens). The window is cut back to
# _WINDOW_CONTEXT tokens once it exceeds twice that, so each push decodes O(new tokens).
_WINDOW_CONTEXT = 6
# A trailing run of U+FFFD may be an incomplete character and is held back, but a run this long
# (continuous invalid bytes) is garbage: release it and keep only the tail that could still
# complete (a UTF-8 character is at most 4 bytes, so at most the last 4 tokens).
_MAX_GARBAGE_WINDOW = 64
_GARBAGE_TAIL = 4
_REPLACEMENT_CHAR = "\ufffd"


def _bytes_to_unicode() -> dict[int, str]:
    """The printable-character alias of each byte used by byte-level BPE (GPT-2 scheme):
    printable Latin-1 bytes map to themselves, the rest to code points from 256 upwards."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\u00a1"), ord("\u00ac") + 1))
        + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    )
    mapping: dict[int, str] = {}
    extra = 0
    for b in range(NUM_BYTE_TOKENS):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(NUM_BYTE_TOKENS + extra)
            extra += 1
    return mapping


def build_byte_tokenizer(
    vocab_size: int,
    model_max_length: int = 2048,
    chat_template: str = CHAT_TEMPLATE,
    named_special: Sequence[str] = (),
) -> Any:
    """A `PreTrainedTokenizerFast` with ids: specials (0..3), the 256 bytes (4..259), then
    `named_special` (e.g. a family's tool-call markers) and `<|reserved_N|>` special tokens
    filling the rest up to `vocab_size` (so every id a model with that vocab can emit decodes,
    like Llama-3's reserved tokens)."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    min_size = BYTE_TOKEN_OFFSET + NUM_BYTE_TOKENS + len(named_special)
    if vocab_size < min_size:
        raise ValueError(
            f"vocab_size must be >= {min_size} (specials + 256 bytes + named), got {vocab_size}"
        )

    byte_chars = _bytes_to_unicode()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for b in range(NUM_BYTE_TOKENS):
        vocab[byte_chars[b]] = BYTE_TOKEN_OFFSET + b
    # No merges: every byte stays its own token, which keeps multi-byte characters split.
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    raw.decoder = decoders.ByteLevel()
    reserved = [f"<|reserved_{i}|>" for i in range(vocab_size - min_size)]
    specials = (*SPECIAL_TOKENS, *named_special, *reserved)
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    bos_id = SPECIAL_TOKENS.index(BOS_TOKEN)
    raw.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    assert raw.get_vocab_size(with_added_tokens=True) == vocab_size

    tok = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        # Clean-up would rewrite " ." to "." and break exact round trips.
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )
    tok.chat_template = chat_template
    return tok


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class Tokenizer:
    """Engine-facing wrapper over a Hugging Face tokenizer (`.hf`)."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf = hf_tokenizer

    @classmethod
    def load(cls, model_dir: str | Path) -> Tokenizer | None:
        """Load from a local directory; None when it holds no tokenizer files. A tokenizer slow
        to build is kept in the user's cache for the next start (tokenizer_cache.py); the
        class that builds it is chosen without torch where it can be (tokenizer_backend.py);
        its save-only copies are dropped (tokenizer_slim.py)."""
        from shortconv.engine.tokenizer_backend import build_hf_tokenizer
        from shortconv.engine.tokenizer_cache import load_or_build
        from shortconv.engine.tokenizer_slim import drop_save_only_copies

        path = Path(model_dir)
        if not any((path / name).is_file() for name in _TOKENIZER_FILES):
            return None
        return cls(drop_save_only_copies(load_or_build(path, lambda: build_hf_tokenizer(path))))

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def pad_token_id(self) -> int | None:
        return self.hf.pad_token_id

    @property
    def vocab_size(self) -> int:
        # len() counts added/special tokens too; HF's `.vocab_size` omits them, which would
        # make valid ids look out of range.
        return len(self.hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(
            list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        if not self.has_chat_template:
            raise ValueError(
                "this tokenizer has no chat template; send a plain prompt (completions) instead"
            )
        # Render then encode: the template already writes bos, so no special tokens are added,
        # and it sidesteps the version-dependent return type of tokenize=True.
        text = self.hf.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return self.encode(text, add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, with stop strings.

    Only a short window of recent ids is decoded per push (the window is re-based onto its
    last few tokens whenever it ends on a complete character), so a push costs O(new tokens)
    instead of re-decoding the whole sequence. `_emitted` counts the characters of the
    window's decoded text that were already released. A trailing run of U+FFFD is held back
    because it may be a multi-byte character whose remaining bytes are still to come; text
    that could be the start of a stop string is held back until decided.
    """

    def __init__(
        self,
        tokenizer: _Decoder,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        prompt_ids: Sequence[int] = (),
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.stop: tuple[str, ...] = tuple(s for s in stop if s)
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self._window: list[int] = []
        self._emitted = 0
        # Prompt context makes the first generated token decode as it would mid-sequence
        # (SentencePiece-style decoders drop the leading space of a sequence's first token).
        seed = list(prompt_ids[-_WINDOW_CONTEXT:])
        if seed:
            seed_text = self._decode(seed)
            # A prompt ending mid-character would misalign the window; go without context.
            if not seed_text.endswith(_REPLACEMENT_CHAR):
                self._window, self._emitted = seed, len(seed_text)
        self._held = ""  # finalised text withheld because it may begin a stop string
        self._out: list[str] = []
        self.stopped = False
        self.matched_stop: str | None = None

    @property
    def text(self) -> str:
        """All text returned so far."""
        return "".join(self._out)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def push(self, new_ids: Sequence[int]) -> str:
        """Feed newly generated ids; return the newly finalised text (may be empty)."""
        if self.stopped:
            return ""
        self._window.extend(int(i) for i in new_ids)
        full = self._decode(self._window)
        run = len(full) - len(full.rstrip(_REPLACEMENT_CHAR))
        safe_end = len(full) - run
        delta = full[self._emitted : safe_end] if safe_end > self._emitted else ""
        self._emitted = max(self._emitted, safe_end)
        if run == 0:
            if len(self._window) > 2 * _WINDOW_CONTEXT:
                # Ends on a complete character, so text decoded before this point can no
                # longer change: re-base the window onto its last few tokens.
                self._window = self._window[-_WINDOW_CONTEXT:]
                self._emitted = len(self._decode(self._window))
        elif len(self._window) > _MAX_GARBAGE_WINDOW:
            tail = self._window[-_GARBAGE_TAIL:]
            tail_text = self._decode(tail)
            tail_run = len(tail_text) - len(tail_text.rstrip(_REPLACEMENT_CHAR))
            delta += full[self._emitted : len(full) - tail_run]
            self._window, self._emitted = tail, len(tail_text) - tail_run
        return self._emit(delta, final=False)

    def flush(self) -> str:
        """End of stream: return everything still held back (stop strings still apply)."""
        if self.stopped:
            return ""
        full = self._decode(self._window) if self._window else ""
        tail = full[self._emitted :]
        self._window, self._emitted = [], 0
        return self._emit(tail, final=True)

    def _emit(self, delta: str, final: bool) -> str:
        text = self._held + delta
        self._held = ""
        if not text:
            return ""
        if self.stop:
            cut, which = self._find_stop(text)
            if which is not None:
                self.stopped, self.matched_stop = True, which
                text = text[:cut]
            elif not final:
                keep = self._stop_prefix_len(text)
                if keep:
                    text, self._held = text[:-keep], text[-keep:]
        if text:
            self._out.append(text)
        return text

    def _find_stop(self, text: str) -> tuple[int, str | None]:
        best, which = len(text) + 1, None
        for s in self.stop:
            pos = text.find(s)
            if pos != -1 and pos < best:
                best, which = pos, s
        return best, which

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for k in range(min(len(text), self._max_stop - 1), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0
