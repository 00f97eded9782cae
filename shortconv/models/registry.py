"""Architecture registry: the model class of each arch (config parsing is shortconv.configs.hf)."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias

from shortconv.errors import ConfigError

if TYPE_CHECKING:
    from shortconv.models.lfm2 import Lfm2ForCausalLM
    from shortconv.models.lfm2_vl import Lfm2VlForConditionalGeneration
    from shortconv.models.lfm3 import Lfm3ForCausalLM
    from shortconv.models.lfm3_vl import Lfm3VlForConditionalGeneration
    from shortconv.models.zaya1 import ZayaForCausalLM

# Every class `model_class` returns: each has `state_specs`, `extra_state_name` and the
# forward / embed / logits methods the runner calls.
ModelClass: TypeAlias = (
    "type[Lfm2ForCausalLM] | type[Lfm2VlForConditionalGeneration] | type[Lfm3ForCausalLM]"
    " | type[Lfm3VlForConditionalGeneration] | type[ZayaForCausalLM]"
)


def model_class(arch: str) -> ModelClass:
    if arch in ("lfm2", "lfm2_moe"):
        from shortconv.models.lfm2 import Lfm2ForCausalLM

        return Lfm2ForCausalLM
    if arch == "lfm2_vl":
        from shortconv.models.lfm2_vl import Lfm2VlForConditionalGeneration

        return Lfm2VlForConditionalGeneration
    if arch == "lfm3":
        from shortconv.models.lfm3 import Lfm3ForCausalLM

        return Lfm3ForCausalLM
    if arch == "lfm3_vl":
        from shortconv.models.lfm3_vl import Lfm3VlForConditionalGeneration

        return Lfm3VlForConditionalGeneration
    if arch == "zaya1":
        from shortconv.models.zaya1 import ZayaForCausalLM

        return ZayaForCausalLM
    raise ConfigError(f"no model class for arch {arch!r}")
