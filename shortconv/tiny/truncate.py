"""A checkpoint cut to its first layers: a draft model for speculative decoding that shares
the target's embedding, norm and head (and so its vocabulary), for tests and benchmarks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

_INDEX = "model.safetensors.index.json"


def truncated_checkpoint(ckpt: Path, num_layers: int, out: Path) -> Path:
    """`ckpt` with layers 0..num_layers-1 only, written to `out` (which must not exist)."""
    cfg = json.loads((ckpt / "config.json").read_text())
    if not 0 < num_layers <= cfg["num_hidden_layers"]:
        raise ValueError(f"num_layers must be in 1..{cfg['num_hidden_layers']}, got {num_layers}")
    out.mkdir()
    for f in ckpt.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != _INDEX:
            shutil.copyfile(f, out / f.name)
    weight_map: dict[str, str] = {}
    for shard in sorted(ckpt.glob("*.safetensors")):
        kept = {k: v for k, v in load_file(shard).items() if _kept(k, num_layers)}
        save_file(kept, out / shard.name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(kept, shard.name))
    if (ckpt / _INDEX).is_file():
        (out / _INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg["num_hidden_layers"] = num_layers
    if "layer_types" in cfg:
        cfg["layer_types"] = cfg["layer_types"][:num_layers]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def layer_index(key: str) -> int | None:
    """The decoder layer a parameter name belongs to (`...layers.{i}...`), or None."""
    parts = key.split(".")
    return int(parts[parts.index("layers") + 1]) if "layers" in parts else None


def _kept(key: str, num_layers: int) -> bool:
    index = layer_index(key)
    return index is None or index < num_layers
