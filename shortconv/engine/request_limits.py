"""RequestLimits: the checks a request must pass before it is queued, as plain data.

Split from LLMEngine so that a process without the engine (the Serve replica, when the engine
runs in its own core process) refuses a bad request at once, with the engine's own words, and
only the grammar check needs a tokenizer-bound runtime of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shortconv.engine.images import AnyImage, ImageSpec, PlacedImage, place_images
from shortconv.sampling.sampling_params import InvalidRequest, SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """What the engine accepts: prompt length, vocabulary, forks, stop strings, images."""

    arch: str
    vocab_size: int
    max_model_len: int
    max_n: int
    has_tokenizer: bool
    image_spec: ImageSpec | None  # None: a text-only model

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequest naming the field; the grammar is checked by the caller."""
        if params.n > self.max_n:
            msg = f"n={params.n} is above this server's maximum of {self.max_n}"
            raise InvalidRequest(msg, "n")
        if not prompt_token_ids:
            raise InvalidRequest("prompt is empty: at least one token is required", "prompt")
        vocab = self.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            msg = f"token id {bad[0]!r} is outside the vocabulary [0, {vocab})"
            raise InvalidRequest(msg, "prompt")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequest(
                f"prompt has {len(prompt_token_ids)} tokens but the maximum model length is "
                f"{self.max_model_len} (including at least one generated token)",
                "prompt",
            )
        outside = [t for t, _ in params.logit_bias if t >= vocab]
        if outside:
            msg = f"logit_bias token id {outside[0]} is outside the vocabulary [0, {vocab})"
            raise InvalidRequest(msg, "logit_bias")
        if params.stop and not self.has_tokenizer:
            raise InvalidRequest("stop strings need a tokenizer; this checkpoint has none", "stop")

    def place_images(
        self, prompt_token_ids: list[int], images: Sequence[AnyImage], n: int = 1
    ) -> tuple[PlacedImage, ...]:
        """Each image's placeholders in the prompt, or InvalidRequest naming what is wrong."""
        if not images:
            return ()
        if self.image_spec is None:
            raise InvalidRequest(f"{self.arch} is a text-only model", "images")
        if n > 1:  # forks copy the parent's state but not its images (engine.forks)
            raise InvalidRequest("n > 1 with images is not supported yet", "n")
        return place_images(prompt_token_ids, images, self.image_spec)
