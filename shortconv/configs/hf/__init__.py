"""config.json → the fields of our ModelConfig, read through transformers' own config classes.

Each architecture's config.json is loaded with its transformers config class (from the dict,
never remote code), so every default, alias and legacy key (`tie_embedding`, `block_ff_dim`,
`full_attn_idxs`, a top-level `rope_theta`, ...) resolves exactly as it does in transformers;
our mappers then read the resolved object and refuse what the engine cannot serve.

NOTE: this package imports nothing of the engine but `shortconv.errors` (config.py imports
it, never the other way), so parsing a config never pulls in the model registry or layers.
"""

from __future__ import annotations

from typing import Any

from shortconv.configs.hf.arch import resolve_arch
from shortconv.configs.hf.lfm2 import lfm2_fields
from shortconv.configs.hf.lfm2_vl import lfm2_vl_fields
from shortconv.configs.hf.lfm3 import lfm3_fields
from shortconv.configs.hf.lfm3_vl import lfm3_vl_fields
from shortconv.configs.hf.zaya1 import zaya1_fields
from shortconv.errors import ConfigError

__all__ = ["model_fields", "resolve_arch"]


def model_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments of `ModelConfig` (all but `raw`) for a config.json dict."""
    arch = resolve_arch(raw)
    try:
        if arch in ("lfm2", "lfm2_moe"):
            return lfm2_fields(raw, arch)
        if arch == "lfm2_vl":
            return lfm2_vl_fields(raw, arch)
        if arch == "lfm3":
            return lfm3_fields(raw, arch)
        if arch == "lfm3_vl":
            return lfm3_vl_fields(raw, arch)
        return zaya1_fields(raw, arch)
    except (KeyError, TypeError) as exc:
        raise ConfigError(f"config.json for {arch} is malformed: {exc!r}") from exc
