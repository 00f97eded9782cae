"""What the vision-language configs (LFM2-VL, LFM3-VL) read alike: the text model's
ModelConfig fields under the VL architecture."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shortconv.errors import ConfigError


def vl_text_fields(
    c: Any,
    arch: str,
    text_type: str,
    text_fields: Callable[[dict[str, Any], str], dict[str, Any]],
    family: str,
) -> dict[str, Any]:
    """The text model's fields (it must be `text_type`) under `arch`, tied as the VL config."""
    text = dict(c.text_config)
    model_type = text.get("model_type", text_type)
    if model_type != text_type:
        raise ConfigError(
            f"{family} with a {model_type!r} text model is not supported (only {text_type})"
        )
    # NOTE: the top-level flag ties lm_head to the language model's embeddings (as HF does).
    tied = bool(c.tie_word_embeddings)
    return text_fields(text, text_type) | {"arch": arch, "tie_word_embeddings": tied}
