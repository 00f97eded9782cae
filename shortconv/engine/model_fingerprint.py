"""A model's identity for state bundles: a digest of its config.json and its weight files.

State computed by one checkpoint is garbage to another with the same shapes (a fine-tune, a
re-randomised tiny model), so a bundle carries this digest and an import refuses any other.
The weights are hashed whole: a size or a modification time would call two copies of the same
checkpoint different (a PVC filled on another node) or two fine-tunes of one size the same.
It is computed once, on the first export or import, not at start-up (a session store that
is never used costs nothing).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
_CHUNK = 8 << 20


@functools.cache
def model_fingerprint(model_dir: Path) -> str:
    """Hex digest of config.json and every weight file's name and bytes (sorted by name)."""
    root = Path(model_dir)
    h = hashlib.sha256()
    config = root / "config.json"
    h.update(config.read_bytes() if config.is_file() else b"")
    for f in sorted(p for p in root.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES)):
        h.update(f"\0{f.name}\0".encode())
        with f.open("rb") as fh:
            while chunk := fh.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()[:32]
