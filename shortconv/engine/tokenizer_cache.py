"""A loaded Hugging Face tokenizer kept on disk, so the next start of the same checkpoint
skips transformers' construction of it.

Why: constructing a tokenizer with many added tokens is seconds of Python (transformers
deep-copies its init kwargs and rebuilds the added-token maps more than once): 3.9-4.4 s for the
65k reserved tokens of the LFM2-350M-shaped bench checkpoint, where unpickling the built object
takes 0.5 s. In a replica that time is on the start-up's critical path, and it holds the GIL
while the weights load beside it (docs/serving_path.md, "Start-up").

The entry is keyed by the checkpoint directory's resolved path and the bytes of every
non-weight file in it, and by the transformers, tokenizers and Python versions, so any edit of
a tokenizer file, chat template or config, or an upgrade, builds anew. Only tokenizers whose
construction took at least `CACHE_MIN_BUILD_S` are kept (small ones gain nothing and would only
fill the cache). `SHORTCONV_TOKENIZER_CACHE=0` turns it off.

NOTE: the entry is a pickle, read back only from the user's own cache directory
(`cache_root` in shortconv/engine/user_cache.py), which already holds the CPU kernels this
process loads as native code: whoever can write there can run code as this user either way.
A file that fails to load is rebuilt and replaced.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CACHE_MIN_BUILD_S = 1.0
FORMAT = 1  # bump when what is stored changes
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl", ".gguf", ".npz")
_MAX_HASHED_BYTES = 64 << 20  # a larger non-weight file is no tokenizer file: skipped


def enabled() -> bool:
    return os.environ.get("SHORTCONV_TOKENIZER_CACHE", "1") != "0"


def cache_key(model_dir: Path) -> str:
    """Hex digest of what the tokenizer is built from (see the module's docstring)."""
    import tokenizers
    import transformers

    root = model_dir.resolve()
    h = hashlib.sha256()
    h.update(f"{FORMAT} {root} {transformers.__version__} {tokenizers.__version__}".encode())
    h.update(f" {sys.version_info[:2]}".encode())
    for f in sorted(root.iterdir()):
        if not f.is_file() or f.name.endswith(_WEIGHT_SUFFIXES) or "safetensors" in f.name:
            continue
        if f.stat().st_size > _MAX_HASHED_BYTES:
            continue
        h.update(f"\0{f.name}\0".encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:32]


def entries_dir() -> Path:
    from shortconv.engine.user_cache import cache_root  # NOTE: the one rule for the root

    return cache_root() / "tokenizers"


def entry_path(model_dir: Path) -> Path:
    return entries_dir() / f"{cache_key(model_dir)}.pkl"


def load_or_build(
    model_dir: Path, build: Callable[[], Any], min_build_s: float | None = None
) -> Any:
    """The tokenizer for `model_dir`: from its cache entry if there is one, else `build()`,
    stored for next time when it took at least `min_build_s` (default CACHE_MIN_BUILD_S)."""
    if not enabled():
        return build()
    path = entry_path(model_dir)
    if path.is_file():
        try:
            with path.open("rb") as f:
                return pickle.load(f)
        except Exception as exc:  # noqa: BLE001 - any unreadable entry is rebuilt, never fatal
            log.warning("tokenizer cache entry %s unreadable (%s): rebuilding it", path.name, exc)
    t0 = time.perf_counter()
    tok = build()
    took = time.perf_counter() - t0
    if took >= (CACHE_MIN_BUILD_S if min_build_s is None else min_build_s):
        _store(path, tok, took)
    return tok


def _store(path: Path, tok: Any, took: float) -> None:
    """Written beside its final name and renamed, so concurrent starts (replicas, TP ranks)
    never read half a file; a failure to write only costs the next start the build again."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                pickle.dump(tok, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except Exception as exc:  # noqa: BLE001 - an unpicklable tokenizer or a read-only cache
        log.warning("tokenizer not cached (%s); building it took %.1f s", exc, took)
        return
    log.info("tokenizer built in %.1f s, cached for the next start (%s)", took, path.name)
