"""LFM3-VL: the LFM3-VL vision encoder (gated 2D short convs and axial-RoPE attention over each
image's patch grid) and its merge projector in front of LFM3.

`encode_images` turns a step's images (their patch rows, concatenated) into LFM3 input
embeddings, one row per image placeholder; the runner places them over the placeholders
(execution.encoder_cache) and the language model runs as LFM3 does, with 1D positions (as
transformers' Lfm3VlModel). Decode never sees an image, so it is LFM3's decode.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from shortconv.configs.config import ModelConfig
from shortconv.configs.hf.lfm3_vl import vision_config
from shortconv.execution.parallel import ParallelContext
from shortconv.layers.lfm3_vision_encoder import Lfm3VisionEncoder
from shortconv.layers.lfm3_vision_projector import MergeProjector
from shortconv.models.lfm3 import Lfm3ForCausalLM
from shortconv.models.vision_language import VisionLanguageModel
from shortconv.models.weights import WeightLoader

# Checkpoint prefixes → ours; transformers' in-memory names (a model saved by an older
# transformers) → the checkpoint's (`q_norm` → `q_layernorm` is among LFM3's own renames).
_PREFIXES = {
    "model.language_model.": "language_model.model.",
    "model.vision_tower.": "vision_tower.",
    "model.multi_modal_projector.": "multi_modal_projector.",
    ".patch_embed.": ".patchifier.",
}
_LFM3 = Lfm3ForCausalLM.hf_to_ours()


class Lfm3VlForConditionalGeneration(VisionLanguageModel):
    language_class = Lfm3ForCausalLM

    def __init__(self, cfg: ModelConfig, tp: ParallelContext):
        super().__init__(cfg, tp)
        self.vision_cfg = vision_config(cfg.raw)
        self.vision_tower = Lfm3VisionEncoder(self.vision_cfg)
        self.multi_modal_projector = MergeProjector(self.vision_cfg)

    def encode_images(self, pixels: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        """Patch rows `[sum of h * w, patch_dim]` of images with patch grids `grids` → their
        tokens `[sum of h * w / merge**2, text hidden]`, image after image."""
        return self.multi_modal_projector(self.vision_tower(pixels, grids))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        WeightLoader(self, self.tp, self.hf_to_ours()).load(self._used(weights))

    @staticmethod
    def hf_to_ours() -> dict[str, str]:
        """Rename rules: HF checkpoint name fragment → ours (LoRA adapters' module names go
        through them too: the language model's projections are adaptable)."""
        return _PREFIXES | _LFM3

    def _used(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """A tied lm_head's copy is dropped; an untied one is the language model's."""
        for name, tensor in weights:
            if name == "lm_head.weight":
                if not self.cfg.tie_word_embeddings:
                    yield "language_model.lm_head.weight", tensor
                continue
            yield name, tensor
