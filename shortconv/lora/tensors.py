"""One adapter module's A/B pair as an adapter's files describe it, and the error a refused
adapter raises: the pieces both the file reader (lora.adapter) and the `target_parameters`
naming (lora.adapter_params) build on."""

from __future__ import annotations

import math
from dataclasses import dataclass


class LoraError(ValueError):
    """An adapter that cannot be loaded, with the module or file and the reason. `reason` is
    its kind, one of `metrics.defs.LORA_LOAD_REFUSALS` (the refusal counter's label)."""

    def __init__(self, message: str, reason: str = "options") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class LoraTensors:
    """One module's A [r, in] and B [out, r] as the weights file holds them: keys and full
    shapes, no data (each rank reads only its own shard: lora.shard_read). A fused expert
    parameter's pair (PEFT's `target_parameters`: lora.adapter_params) stacks its `experts`
    experts' ranks: A [r * experts, in], B [out, r * experts]."""

    a_key: str
    b_key: str
    a_shape: tuple[int, int]
    b_shape: tuple[int, int]
    itemsize: int
    experts: int = 1

    @property
    def rank(self) -> int:
        return self.a_shape[0] // self.experts

    @property
    def nbytes(self) -> int:
        return (math.prod(self.a_shape) + math.prod(self.b_shape)) * self.itemsize
