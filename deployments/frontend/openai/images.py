"""A chat request's images, fetched and decoded on the replica: every `image_url` part becomes
an RGB PIL image, or the request is refused with a 400 naming the part
(`messages.<i>.content.<j>.image_url`). Downloads run concurrently on the event loop; decoding
runs in a worker thread, so a large image never blocks the loop (nor the engine's thread)."""

from __future__ import annotations

import asyncio

import httpx
from PIL import Image

from deployments.frontend.images.decode import decode_image
from deployments.frontend.images.fetch import ImageError, fetch_image
from deployments.frontend.images.hosts import HostGuard
from deployments.frontend.images.limits import ImageLimits
from deployments.frontend.openai.content import ImageRef
from deployments.frontend.openai.errors import APIError


class ImageLoader:
    """Fetches and decodes a request's images within `limits`, over one shared http client."""

    def __init__(
        self,
        limits: ImageLimits,
        client: httpx.AsyncClient | None = None,
        guard: HostGuard | None = None,
    ) -> None:
        self.limits, self.guard = limits, guard or HostGuard.of(limits)
        # NOTE: no proxy from the environment (it would connect in our place, unchecked), and no
        # kept connections: httpx pools by the address it connected to, so a kept https connection
        # would carry another host's request under the first host's verified certificate.
        no_reuse = httpx.Limits(max_keepalive_connections=0)
        self.client = client or httpx.AsyncClient(trust_env=False, limits=no_reuse)

    async def load(self, refs: list[ImageRef]) -> list[Image.Image]:
        """The images in order; the first that fails refuses the request (the rest are
        cancelled)."""
        if len(refs) > self.limits.max_images:
            over = refs[self.limits.max_images]
            msg = f"{len(refs)} images in this request; at most {self.limits.max_images}"
            raise APIError(f"{over.param}: {msg}", param=over.param)
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._one(ref)) for ref in refs]
        except* APIError as errors:
            raise errors.exceptions[0] from None
        return [t.result() for t in tasks]

    async def _one(self, ref: ImageRef) -> Image.Image:
        try:
            data = await fetch_image(ref.url, self.limits, self.client, self.guard)
            return await asyncio.to_thread(decode_image, data, self.limits)
        except ImageError as exc:
            raise APIError(f"{ref.param}: {exc}", param=ref.param) from None

    async def aclose(self) -> None:
        await self.client.aclose()
