"""A random target that its own first layers can draft for: the layers past the first N have
their residual branches scaled down, so they refine the residual stream instead of rewriting it.

Re-randomised weights (`shortconv.tiny.rerandomize`) give every layer a unit-scale output, so
the argmax after 4 of 16 layers is unrelated to the argmax after 16: a draft cut to the
target's first layers accepts nothing (bench/RESULTS.md). A trained model's later layers mostly
refine, which is why early-exit drafts work on real checkpoints. Scaling the output projection
of each residual branch (conv/attention `out_proj`, feed-forward `w2`) of the deep layers by
`scale` makes a random target behave that way, with an acceptance that `scale` sets, while its
shapes, and so every step's cost, stay those of the checkpoint it came from.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from shortconv.tiny.truncate import layer_index, truncated_checkpoint

# The parameter names that end a residual branch, per model type (LFM2-MoE's experts and its
# dense layers both end in `w2`). Other families are refused rather than silently left whole.
_BRANCH_OUTPUTS: dict[str, tuple[str, ...]] = {
    "lfm2": ("out_proj", "w2"),
    "lfm2_moe": ("out_proj", "w2"),
}


def damped_checkpoint(ckpt: Path, first_layers: int, scale: float, out: Path) -> Path:
    """`ckpt` with the residual-branch outputs of layers >= `first_layers` multiplied by
    `scale`, written to `out` (which must not exist)."""
    cfg = json.loads((ckpt / "config.json").read_text())
    outputs = _BRANCH_OUTPUTS.get(cfg["model_type"])
    if outputs is None:
        raise ValueError(
            f"damped_checkpoint supports {sorted(_BRANCH_OUTPUTS)}, not {cfg['model_type']!r}"
        )
    if not 0 < first_layers < cfg["num_hidden_layers"]:
        raise ValueError(
            f"first_layers must be in 1..{cfg['num_hidden_layers'] - 1}, got {first_layers}"
        )
    out.mkdir()
    for f in ckpt.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copyfile(f, out / f.name)
    for shard in sorted(ckpt.glob("*.safetensors")):
        tensors = load_file(shard)
        for key, value in tensors.items():
            if _damped(key, first_layers, outputs):
                tensors[key] = value * torch.tensor(scale, dtype=value.dtype)
        save_file(tensors, out / shard.name, metadata={"format": "pt"})
    return out


def early_exit_pair(ckpt: Path, num_layers: int, scale: float, out_dir: Path) -> tuple[Path, Path]:
    """(target, draft) under `out_dir`: `ckpt` damped past `num_layers` layers, and that target
    cut to its first `num_layers` (the same embedding, norm and head). `out_dir` is made if
    missing; its `target` and `draft` must not exist."""
    out_dir.mkdir(parents=True, exist_ok=True)
    target = damped_checkpoint(ckpt, num_layers, scale, out_dir / "target")
    return target, truncated_checkpoint(target, num_layers, out_dir / "draft")


def _damped(key: str, first_layers: int, outputs: tuple[str, ...]) -> bool:
    index = layer_index(key)
    parts = key.split(".")
    return index is not None and index >= first_layers and len(parts) > 1 and parts[-2] in outputs
