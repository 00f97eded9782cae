"""A loaded tokenizer drops transformers' save-only copy of its added tokens
(shortconv/engine/tokenizer_slim.py) and behaves exactly as before; on a checkpoint with many
added tokens (the bench's LFM2-350M shape has 65k) that copy was most of its memory."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

from shortconv.engine.tokenizer import Tokenizer
from shortconv.engine.tokenizer_backend import build_hf_tokenizer
from shortconv.tiny.checkpoint import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
TEXTS = ["hello <|r7|> world<|im_end|>", "<|im_start|>user\nhi<|r19999|>", "café 😀"]
MESSAGES = [{"role": "user", "content": "weather in Paris?"}]


def _with_added_tokens(tmp_path: Path, count: int) -> Path:
    """The tiny LFM2 checkpoint with `count` more special tokens, as the bench's has."""
    ckpt = make_tiny_checkpoint("lfm2", tmp_path / "ckpt", seed=3)
    path = ckpt / "tokenizer.json"
    tok = json.loads(path.read_text())
    first = max(t["id"] for t in tok["added_tokens"]) + 1
    tok["added_tokens"] += [
        {"id": first + i, "content": f"<|r{i}|>", "single_word": False, "lstrip": False,
         "rstrip": False, "normalized": False, "special": True}
        for i in range(count)
    ]  # fmt: skip
    path.write_text(json.dumps(tok))
    return ckpt


def _behaviour(tok: Tokenizer) -> tuple[object, ...]:
    ids = [tok.encode(t) for t in TEXTS]
    return (
        ids,
        [tok.decode(i) for i in ids],
        [tok.decode(i, skip_special_tokens=False) for i in ids],
        tok.apply_chat_template(MESSAGES),
        (tok.vocab_size, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id),
        {i: (t.content, t.special) for i, t in tok.hf.added_tokens_decoder.items()},
        sorted(tok.hf.all_special_ids),
    )


def test_slim_tokenizer_behaves_as_the_full_one_and_pickles(tmp_path: Path) -> None:
    ckpt = _with_added_tokens(tmp_path, 20_000)
    full = Tokenizer(build_hf_tokenizer(ckpt))
    assert "added_tokens_decoder" in full.hf.init_kwargs  # what is dropped exists to drop
    slim = Tokenizer.load(ckpt)
    assert slim is not None
    assert "added_tokens_decoder" not in slim.hf.init_kwargs
    expected: Any = _behaviour(full)
    assert _behaviour(slim) == expected
    # an injected engine's core sends its tokenizer pickled across the pipe
    assert _behaviour(Tokenizer(pickle.loads(pickle.dumps(slim.hf)))) == expected


_MEASURE = """
import ctypes, gc, sys
import tokenizers
import transformers.tokenization_utils_tokenizers  # its import is not the tokenizer's memory
from shortconv.engine.tokenizer import Tokenizer
libc = ctypes.CDLL("libc.so.6")
def anon():
    gc.collect(); libc.malloc_trim(0)
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("Anonymous:"):
            return int(line.split()[1]) * 1024
a0 = anon()
rust = tokenizers.Tokenizer.from_file(sys.argv[1] + "/tokenizer.json")
a1 = anon()
tok = Tokenizer.load(sys.argv[1])
print(a1 - a0, anon() - a1)
"""


def test_a_loaded_tokenizer_holds_little_beyond_its_rust_tokenizer(tmp_path: Path) -> None:
    """Anonymous memory of `Tokenizer.load` in a fresh process, against the Rust tokenizer's
    own: with the save-only copy kept it was 4.7x on the bench checkpoint, without it 1.1x."""
    ckpt = _with_added_tokens(tmp_path, 40_000)
    env = {**os.environ, "SHORTCONV_TOKENIZER_CACHE": "0", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(ckpt)],
        env=env, capture_output=True, text=True, check=True, timeout=300,
    )  # fmt: skip
    rust, loaded = (int(x) for x in out.stdout.split())
    assert loaded < 2 * rust + 4 * 2**20, (rust, loaded)
