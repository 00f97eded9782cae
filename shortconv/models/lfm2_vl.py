"""LFM2-VL: the SigLIP2 NaFlex encoder and pixel-unshuffle projector in front of LFM2.

`encode_images` turns a batch of image tiles into LFM2 input embeddings (one row per image
placeholder token); the runner places them over the placeholders (execution.encoder_cache) and
the language model runs as LFM2 does. Decode never sees an image, so it is LFM2's decode.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from shortconv.configs.config import ModelConfig
from shortconv.configs.hf.lfm2_vl import vision_config
from shortconv.execution.parallel import ParallelContext
from shortconv.layers.vision_encoder import VisionEncoder
from shortconv.layers.vision_projector import PixelUnshuffleProjector
from shortconv.models.lfm2 import LFM2_RENAMES, Lfm2ForCausalLM
from shortconv.models.vision_language import VisionLanguageModel
from shortconv.models.weights import WeightLoader

# Checkpoint prefixes → ours; older checkpoints nest the encoder under `vision_model.`.
_PREFIXES = {
    "model.language_model.": "language_model.",
    "model.vision_tower.vision_model.": "vision_tower.",
    "model.vision_tower.": "vision_tower.",
    "model.multi_modal_projector.": "multi_modal_projector.",
    "lm_head.": "language_model.lm_head.",
}
_LAYER_RENAMES = {k: v for k, v in LFM2_RENAMES.items() if not k.startswith("model.")}


class Lfm2VlForConditionalGeneration(VisionLanguageModel):
    language_class = Lfm2ForCausalLM

    def __init__(self, cfg: ModelConfig, tp: ParallelContext):
        super().__init__(cfg, tp)
        self.vision_cfg = vision_config(cfg.raw)
        self.vision_tower = VisionEncoder(self.vision_cfg)
        self.multi_modal_projector = PixelUnshuffleProjector(self.vision_cfg)

    def encode_images(self, pixels: torch.Tensor, shapes: list[tuple[int, int]]) -> torch.Tensor:
        """Tiles `[N, L, channels*p*p]` with patch grids `shapes` → their tokens `[sum of
        (h/f)(w/f), text hidden]`, tile after tile."""
        return self.multi_modal_projector(self.vision_tower(pixels, shapes), shapes)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        WeightLoader(self, self.tp, self.hf_to_ours()).load(self._used(weights))

    @staticmethod
    def hf_to_ours() -> dict[str, str]:
        """Rename rules: HF checkpoint name fragment → ours (LoRA adapters' module names go
        through them too: the language model's projections are adaptable)."""
        return _PREFIXES | _LAYER_RENAMES

    def _used(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Drop what this model never reads: a tied lm_head's copy, the encoder's pooling head
        (SigLIP2's, unused by LFM2-VL)."""
        for name, tensor in weights:
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            if ".head." in name and "vision_tower" in name:
                continue
            yield name, tensor
