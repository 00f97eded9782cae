"""Read a Hugging Face checkpoint directory: safetensors only (sharded or not), never pickle."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from shortconv.errors import CheckpointError

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    root = Path(model_dir)
    if not root.is_dir():
        raise CheckpointError(f"model path {str(root)!r} is not a directory")
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index.name} is malformed: {exc}") from exc
        files = sorted({root / f for f in weight_map.values()})
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise CheckpointError(f"{index.name} lists missing shard files: {absent[:5]}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if files:
        return files
    pickles = [p.name for p in root.iterdir() if p.suffix in _PICKLE_SUFFIXES]
    if pickles:
        raise CheckpointError(
            f"{root} only has pickle weights ({pickles[:3]}); they can run arbitrary code and are "
            "refused. Convert them to safetensors first."
        )
    raise CheckpointError(f"no *.safetensors weights file in {root}")


def iter_checkpoint(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from every safetensors file, lazily (one tensor in memory at a time)."""
    for path in checkpoint_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (OSError, ValueError, RuntimeError) as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(f"cannot read {path.name}: {exc}") from exc
