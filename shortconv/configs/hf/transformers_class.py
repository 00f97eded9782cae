"""Load a config.json dict with transformers' own config class for its model type."""

from __future__ import annotations

import copy
from typing import Any

from shortconv.configs.hf.availability import transformers_lacks
from shortconv.errors import ConfigError


def transformers_config(model_type: str, raw: dict[str, Any]) -> Any | None:
    """transformers' config object for `raw`, or None when the installed transformers does not
    know `model_type` (the caller decides whether it has a fallback).

    Built with `from_dict` on a deep copy: no remote code, and some classes edit nested dicts
    in place (ZayaConfig drops a stray `rope_parameters.rope_type`)."""
    if transformers_lacks(model_type) is not None:
        return None
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    try:
        return cls.from_dict(copy.deepcopy(raw))
    except Exception as exc:  # strict-dataclass and validation errors have no common base
        raise ConfigError(f"config.json is refused by transformers' {cls.__name__}: {exc}") from exc


def require_transformers_config(model_type: str, raw: dict[str, Any]) -> Any:
    """`transformers_config`, refusing (with the reason) where transformers cannot read it."""
    cfg = transformers_config(model_type, raw)
    if cfg is None:
        raise ConfigError(
            f"cannot read a {model_type!r} config.json: {transformers_lacks(model_type)}"
        )
    return cfg
