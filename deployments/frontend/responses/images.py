"""A stored conversation's images: kept once each, by digest, as bytes, not as data URLs.

A Responses turn's `input_image` parts reach the replica as chat `image_url` parts
(deployments/frontend/responses/convert.py). When the turn is stored, every data URL in its messages
is replaced by a reference (`sha256:<hex>` of the image's bytes) and the decoded bytes are kept
beside the messages under that digest, so a stored response holds each image once (a data
URL's base64 is a third larger, and a long conversation would repeat it in every turn's
entry). A later turn (`previous_response_id`) puts the data URLs back for the replica, which
fetches and processes the whole conversation's images again: the same bytes give the same
pixels, so the engine's image digests, and with them the session's kept state, match.
http(s) URLs stay URLs (fetched again on a later turn, within the replica's limits).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

REF_PREFIX = "sha256:"


@dataclass(frozen=True)
class StoredImage:
    """One image's decoded bytes and the media type its data URL named."""

    media_type: str
    data: bytes

    def data_url(self) -> str:
        return f"data:{self.media_type};base64,{base64.b64encode(self.data).decode('ascii')}"


def _stored(url: str) -> StoredImage | None:
    """A base64 data URL's image; None for any other URL (kept as it is)."""
    if not url.startswith("data:"):
        return None
    header, _, payload = url.partition(",")
    media, *params = header[len("data:") :].split(";")
    if "base64" not in (p.lower() for p in params):
        return None
    try:
        return StoredImage(media, base64.b64decode(payload, validate=True))
    except (binascii.Error, ValueError):
        return None  # NOTE: the replica refused it already; a stored turn never holds one


def _map_urls(messages: list[dict[str, Any]], swap: Any) -> list[dict[str, Any]]:
    """`messages` with every `image_url` part's URL replaced by `swap(url)` (copies only what
    changes: the messages given are not modified)."""
    out = []
    for msg in messages:
        content = msg.get("content")
        if isinstance(content, list):
            parts = [
                {**p, "image_url": {**p["image_url"], "url": swap(p["image_url"]["url"])}}
                if p.get("type") == "image_url"
                else p
                for p in content
            ]
            msg = {**msg, "content": parts}
        out.append(msg)
    return out


def stash(
    messages: list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], dict[str, StoredImage]]:
    """(the messages with each data URL replaced by its reference, the images by digest)."""
    images: dict[str, StoredImage] = {}

    def swap(url: str) -> str:
        image = _stored(url)
        if image is None:
            return url
        digest = hashlib.sha256(image.data).hexdigest()
        images[digest] = image
        return REF_PREFIX + digest

    return _map_urls(messages, swap), images


def restore(
    messages: list[dict[str, Any]], images: Mapping[str, StoredImage]
) -> list[dict[str, Any]]:
    """The messages as the replica takes them: each reference back to its data URL."""

    def swap(url: str) -> str:
        if url.startswith(REF_PREFIX) and url[len(REF_PREFIX) :] in images:
            return images[url[len(REF_PREFIX) :]].data_url()
        return url

    return _map_urls(messages, swap)
