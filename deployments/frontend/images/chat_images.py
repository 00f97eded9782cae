"""The one seam between the chat path and images: a chat request with `image_url` parts comes
here for its prompt (a text-only request never does, and keeps the tokenizer's chat template).

Fetching and decoding (deployments/frontend/openai/images.py) run on the replica's event loop and in
worker threads, the processor (deployments/frontend/images/mm_prompt.py) in a worker thread: none of
it on the
engine's step thread, so a large image never stalls other requests' decoding. What they give
the engine is token ids with placeholders and one engine image per image.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from deployments.frontend.engine.engine_types import EngineLike
from deployments.frontend.images.limits import ImageLimits
from deployments.frontend.images.mm_prompt import MultimodalPrompt, PromptBuilder, PromptError
from deployments.frontend.openai.content import ImageRef
from deployments.frontend.openai.errors import APIError
from deployments.frontend.openai.images import ImageLoader
from deployments.frontend.openai.protocol import ChatCompletionRequest

log = logging.getLogger(__name__)
TEXT_ONLY = "this model takes no images (text only)"


class ChatImages:
    """Images for one replica's chat requests: refused with `why_not` when it has no builder."""

    def __init__(
        self, limits: ImageLimits, builder: PromptBuilder | None, why_not: str = TEXT_ONLY
    ) -> None:
        self.limits, self.builder, self.why_not = limits, builder, why_not
        self._loader: ImageLoader | None = None

    @staticmethod
    def for_engine(engine: EngineLike, limits: ImageLimits) -> ChatImages:
        """The engine's own processor for a vision model; a processor that cannot be built
        (LFM2-VL's where torchvision does not import) leaves text chat working and refuses
        images with a 400 saying why."""
        spec = engine.image_spec
        if spec is None:
            return ChatImages(limits, None)
        try:
            return ChatImages(limits, PromptBuilder.load(engine.model_dir, spec))
        except Exception as exc:
            why = f"this server cannot preprocess images: {type(exc).__name__}: {exc}"
            log.warning("%s", why)
            return ChatImages(limits, None, why[:500])

    async def prompt(
        self, req: ChatCompletionRequest, refs: list[ImageRef], tools: list[dict[str, Any]] | None
    ) -> MultimodalPrompt:
        """The request's prompt and images, or APIError (400) naming the part or field."""
        if self.builder is None:
            raise APIError(f"{refs[0].param}: {self.why_not}", param=refs[0].param)
        messages = req.multimodal_messages()  # NOTE: malformed messages fail before fetching
        if self._loader is None:  # NOTE: its http client binds to the replica's event loop
            self._loader = ImageLoader(self.limits)
        images = await self._loader.load(refs)
        try:
            return await asyncio.to_thread(
                self.builder.build, messages, images, req.add_generation_prompt, tools
            )
        except PromptError as exc:
            raise APIError(str(exc), param="messages") from None
