"""What LFM2-VL and LFM3-VL share: a language model behind a vision encoder and a projector.

The subclass builds `language_model`, `vision_tower` and `multi_modal_projector` and says how a
step's images encode (`encode_images`, on what its image kind batches: engine.images); the
language model's forward takes the runner's `inputs_embeds` (image rows over the placeholders)
and decode is the language model's own, so state and logits are its.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from shortconv.cache.state_pool import StateSpec
from shortconv.configs.config import ModelConfig
from shortconv.execution.backend import BaseStateBackend
from shortconv.execution.parallel import ParallelContext

if TYPE_CHECKING:
    from shortconv.execution.shard_rows import Rows


class VisionLanguageModel(nn.Module):
    """`forward(input_ids[T], backend, inputs_embeds=None) -> hidden[T, H]` (the text model's)."""

    extra_state_name: str | None = None
    multimodal = True
    language_class: type  # the text model: its forward, state and logits

    def __init__(self, cfg: ModelConfig, tp: ParallelContext):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.language_model = self.language_class(cfg, tp)

    def forward(
        self,
        input_ids: torch.Tensor,
        backend: BaseStateBackend,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.language_model(input_ids, backend, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    @classmethod
    def state_specs(cls, cfg: ModelConfig, tp: ParallelContext) -> list[StateSpec]:
        return cls.language_class.state_specs(cfg, tp)

    @classmethod
    def state_rows(cls, cfg: ModelConfig, tp: ParallelContext) -> dict[str, Rows]:
        return cls.language_class.state_rows(cfg, tp)
