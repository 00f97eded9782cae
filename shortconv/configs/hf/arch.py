"""Which of our architectures a config.json describes."""

from __future__ import annotations

from typing import Any

from shortconv.errors import ConfigError

# Architectures we serve, keyed by the `architectures[0]` / `model_type` of config.json.
ARCH_BY_MODEL_TYPE = {
    "lfm2": "lfm2",
    "lfm2_moe": "lfm2_moe",
    "zaya": "zaya1",
    "lfm3": "lfm3",
    "lfm2_vl": "lfm2_vl",
    "lfm3_vl": "lfm3_vl",
}
ARCH_BY_CLASS = {
    "Lfm2ForCausalLM": "lfm2",
    "Lfm2MoeForCausalLM": "lfm2_moe",
    "ZayaForCausalLM": "zaya1",
    "Lfm3ForCausalLM": "lfm3",
    "Lfm2VlForConditionalGeneration": "lfm2_vl",
    "Lfm3VlForConditionalGeneration": "lfm3_vl",
}


def resolve_arch(raw: dict[str, Any]) -> str:
    """Map config.json's `architectures`/`model_type` to one of our arch names, or refuse."""
    for cls in raw.get("architectures") or []:
        if cls in ARCH_BY_CLASS:
            return ARCH_BY_CLASS[cls]
    model_type = raw.get("model_type")
    if model_type in ARCH_BY_MODEL_TYPE:
        return ARCH_BY_MODEL_TYPE[model_type]
    supported = ", ".join(sorted(ARCH_BY_CLASS))
    raise ConfigError(
        f"unsupported architecture {raw.get('architectures')!r} (model_type={model_type!r}); "
        f"supported: {supported}"
    )
