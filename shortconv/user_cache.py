"""The per-user cache directory of the engine's own derived files (built CPU kernels, loaded
tokenizers): `$SHORTCONV_CACHE`, else `$XDG_CACHE_HOME/shortconv`, else `~/.cache/shortconv`.

Everything under it is derived from inputs it is keyed by, so deleting it only costs the next
start the time to rebuild.

NOTE: the CPU kernels' build cache (`shortconv/kernels/cpu_gemm.py`, `cache_dir`) resolves the
same root with its own copy of this rule, since the kernels import nothing outside
`shortconv.kernels` (tests/repo/test_import_direction.py).
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    explicit = os.environ.get("SHORTCONV_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "shortconv"
