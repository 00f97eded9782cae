"""Where the engine keeps its derived files for the next start, read without torch: a replica
that runs no model still reads its tokenizer from here.

NOTE: shortconv/kernels/cpu_gemm.py has the same rule (`cache_root`) for its builds: kernels
import no engine module, and that one imports torch. tests/engine/test_tokenizer_backend.py
holds the two equal."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """The per-user cache of the engine's derived files (the CPU kernels' builds,
    shortconv/kernels/cpu_gemm.py, and the tokenizers of shortconv/engine/tokenizer_cache.py):
    `$SHORTCONV_CACHE`, else `$XDG_CACHE_HOME/shortconv`, else `~/.cache/shortconv`. Everything
    under it is keyed by what it is derived from, so deleting it only costs the next start a
    rebuild."""
    root = os.environ.get("SHORTCONV_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "shortconv"
    )
    return Path(root)
