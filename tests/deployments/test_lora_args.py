"""The YAML's LoRA keys: validated at the edge and passed to the engine's config."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from deployments.frontend.config.args import AppArgs


def test_lora_keys_reach_engine_config() -> None:
    args = AppArgs.model_validate(
        {
            "enable_lora": True,
            "max_loras": 3,
            "max_lora_rank": 16,
            "lora_modules": {"a": "/adapters/a"},
            "runtime_lora_updating": True,
        }
    )
    cfg = args.engine_config()
    assert (cfg.enable_lora, cfg.max_loras, cfg.max_lora_rank) == (True, 3, 16)
    assert cfg.lora_modules == {"a": "/adapters/a"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"lora_modules": {"a": "/x"}}, "lora_modules needs enable_lora"),
        ({"runtime_lora_updating": True}, "runtime_lora_updating needs enable_lora"),
        ({"enable_lora": True, "max_loras": 0}, "max_loras"),
        ({"enable_lora": True, "lora_modules": ["/x"]}, "lora_modules"),
    ],
)
def test_bad_lora_keys_are_refused(args: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        AppArgs.model_validate(args)
