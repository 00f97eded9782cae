"""Where a replica's checkpoint comes from: `model:` (optionally under `model_root`), or a tiny
random checkpoint built once per machine into a cache directory."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from deployments.frontend.config.args import AppArgs


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "shortconv-serve"


def tiny_checkpoint(arch: str, seed: int, root: Path | None = None) -> Path:
    """The tiny `arch` checkpoint for `seed`, built on first use.

    NOTE: built in a private temp dir and renamed into place, so replicas starting together never
    see a half-written checkpoint; the loser of the rename race drops its copy and uses the
    winner's. The name carries a hash of the generator's sources (its chat templates and tokenizer
    included), so a changed generator never reuses a stale cache.
    """
    from shortconv import tiny
    from shortconv.engine import tokenizer
    from shortconv.tiny import checkpoint

    root = root or cache_root()
    # NOTE: every module of the generator package, so a new one (a new arch) is never missed.
    sources = [*sorted(Path(tiny.__file__).parent.glob("*.py")), Path(tokenizer.__file__)]
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in sources))
    digest = digest.hexdigest()[:10]
    final = root / f"tiny-{arch}-{seed}-{digest}"
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tiny-{arch}-", dir=root))
    try:
        checkpoint.make_tiny_checkpoint(arch, tmp, seed=seed)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def resolve_model(args: AppArgs) -> Path:
    """The checkpoint directory to load; ValueError with the reason when there is none."""
    if args.model is None:
        return tiny_checkpoint(args.tiny_arch, args.seed)
    path = Path(args.model).expanduser()
    if args.model_root is not None:
        # A relative `model` is looked up under `model_root`, and nothing may escape it (the
        # YAML/Helm values may come from a less trusted place than the image).
        root = Path(args.model_root).expanduser().resolve()
        path = (root / path).resolve()
        if not path.is_relative_to(root):
            raise ValueError(f"model {args.model!r} is outside model_root {str(root)!r}")
    if not (path / "config.json").is_file():
        raise ValueError(f"model {str(path)!r} is not a checkpoint directory (no config.json)")
    return path


def served_model_name(args: AppArgs) -> str:
    if args.served_model_name:
        return args.served_model_name
    if args.model is None:
        return f"tiny-{args.tiny_arch}"
    return Path(args.model).name or str(args.model)
