"""An image URL's bytes: a `data:` URL decoded, or an http(s) URL downloaded, within the limits.

Downloads are async (httpx, on the replica's event loop): the body streams in and is cut off
past `max_bytes`, the whole fetch (redirects included) runs under one `fetch_timeout_s`, and
redirects are followed by hand so that each hop's scheme is checked and counted, and each hop's
host is checked and connected to at its checked address (deployments/frontend/images/hosts.py).
Every
refusal is an `ImageError` whose message a client can act on; the caller names the content part.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from urllib.parse import urljoin, urlsplit

import httpx

from deployments.frontend.images.hosts import HostGuard
from deployments.frontend.images.limits import ImageError, ImageLimits

MEDIA_TYPES = ("image/png", "image/jpeg", "image/webp")


def scheme_of(url: str, limits: ImageLimits) -> str:
    scheme = urlsplit(url).scheme.lower()
    if scheme not in limits.schemes:
        allowed = ", ".join(f"{s}:" for s in limits.schemes)
        raise ImageError(f"URL scheme {scheme or 'none'!r} is not allowed (allowed: {allowed})")
    return scheme


def decode_data_url(url: str, limits: ImageLimits) -> bytes:
    """`data:image/png;base64,...` -> the image's bytes (base64 only: images are binary)."""
    header, comma, payload = url.partition(",")
    if not comma:
        raise ImageError("data URL has no ',' before its data")
    media, *params = header[len("data:") :].split(";")
    if media.lower() not in MEDIA_TYPES:
        raise ImageError(f"unsupported image type {media!r} (supported: {', '.join(MEDIA_TYPES)})")
    if "base64" not in (p.lower() for p in params):
        raise ImageError("data URL must be base64-encoded (';base64,')")
    if len(payload) > 4 * (limits.max_bytes // 3 + 1):  # NOTE: before decoding a huge payload
        raise ImageError(f"image is larger than {limits.max_bytes} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("data URL's data is not valid base64") from None
    if len(data) > limits.max_bytes:
        raise ImageError(f"image is larger than {limits.max_bytes} bytes")
    return data


async def fetch_image(
    url: str, limits: ImageLimits, client: httpx.AsyncClient, guard: HostGuard | None = None
) -> bytes:
    """The bytes of an allowed `data:` or http(s) URL, or ImageError; `guard` defaults to
    `limits`' own (tests inject one)."""
    if scheme_of(url, limits) == "data":
        return decode_data_url(url, limits)
    try:
        async with asyncio.timeout(limits.fetch_timeout_s):  # NOTE: DNS included
            return await _download(url, limits, client, guard or HostGuard.of(limits))
    except TimeoutError:
        raise ImageError(f"fetching the image took over {limits.fetch_timeout_s:g} s") from None
    except httpx.HTTPError as exc:
        raise ImageError(f"image URL is unreachable: {type(exc).__name__}: {exc}") from None


async def _download(
    url: str, limits: ImageLimits, client: httpx.AsyncClient, guard: HostGuard
) -> bytes:
    for _ in range(limits.max_redirects + 1):
        to = await guard.pin(url)  # NOTE: every hop: a redirect may point inside
        get = client.stream(
            "GET", to.url, headers=to.headers, extensions=to.extensions, follow_redirects=False
        )
        async with get as resp:
            if resp.is_redirect:
                url = urljoin(url, resp.headers.get("location", ""))
                if scheme_of(url, limits) == "data":
                    raise ImageError("image URL redirects to a data: URL")
                continue
            if resp.status_code != 200:
                raise ImageError(f"image URL answered HTTP {resp.status_code}")
            return await _body(resp, limits.max_bytes)
    raise ImageError(f"image URL redirects more than {limits.max_redirects} times")


async def _body(resp: httpx.Response, max_bytes: int) -> bytes:
    """The body, refused as soon as it (or its announced length) passes `max_bytes`."""
    too_big = ImageError(f"image is larger than {max_bytes} bytes")
    length = resp.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise too_big
    chunks, size = [], 0
    async for chunk in resp.aiter_bytes():
        size += len(chunk)
        if size > max_bytes:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)
