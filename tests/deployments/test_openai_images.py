"""A chat request's image parts: parsing, fetching (a loopback HTTP server: redirects, slow and
large bodies), the limits and decoding, each refusal a 400 naming the content part. No model."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from image_server import data_url, image_bytes, image_server

from deployments.frontend.images.chat_images import ChatImages
from deployments.frontend.images.limits import ImageLimits
from deployments.frontend.openai.errors import APIError
from deployments.frontend.openai.images import ImageLoader
from deployments.frontend.openai.protocol import ChatCompletionRequest

PNG = image_bytes((24, 16), "png")
BODIES = {
    "a.png": PNG,
    "b.jpeg": image_bytes((8, 30), "jpeg", seed=2),
    "c.gif": image_bytes((4, 4), "gif"),
}
# NOTE: the image server is on loopback, which the replica refuses by default (SSRF guard:
# tests/deployments/test_image_hosts.py), so these limits allow private networks explicitly.
LIMITS = ImageLimits(
    max_images=3,
    max_bytes=64 << 10,
    max_pixels=64 * 64,
    fetch_timeout_s=1.0,
    allow_private_networks=True,
)


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with image_server(BODIES) as base:
        yield base


def chat(*urls: str, detail: str | None = None) -> ChatCompletionRequest:
    parts: list[dict[str, Any]] = [{"type": "text", "text": "what is this?"}]
    for url in urls:
        image = {"url": url, **({"detail": detail} if detail else {})}
        parts.append({"type": "image_url", "image_url": image})
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": parts}]})


def load(req: ChatCompletionRequest, limits: ImageLimits = LIMITS) -> list[Any]:
    async def run() -> list[Any]:
        loader = ImageLoader(limits)
        try:
            return await loader.load(req.image_refs())
        finally:
            await loader.aclose()

    return asyncio.run(run())


def refused(req: ChatCompletionRequest, limits: ImageLimits = LIMITS) -> APIError:
    with pytest.raises(APIError) as info:
        load(req, limits)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize("fmt", ["png", "jpeg", "webp"])
def test_data_urls_decode_to_rgb(fmt: str) -> None:
    (image,) = load(chat(data_url(image_bytes((20, 12), fmt), fmt), detail="low"))
    assert image.mode == "RGB" and image.size == (20, 12)


def test_urls_and_redirects_in_order(server: str) -> None:
    urls = [f"{server}/img/b.jpeg", f"{server}/redirect/3/a.png", data_url(PNG)]
    images = load(chat(*urls, detail="high"))
    assert [im.size for im in images] == [(8, 30), (24, 16), (24, 16)]


def test_images_across_messages_name_their_part() -> None:
    msgs = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(PNG)}}]},
        {"role": "assistant", "content": "a square"},
        {"role": "user", "content": [{"type": "text", "text": "and"},
                                     {"type": "image_url", "image_url": {"url": "data:,x"}}]},
    ]  # fmt: skip
    req = ChatCompletionRequest.model_validate({"messages": msgs})
    assert [r.param for r in req.image_refs()] == [
        "messages.0.content.0.image_url",
        "messages.2.content.1.image_url",
    ]
    assert refused(req).param == "messages.2.content.1.image_url"
    rendered = req.multimodal_messages()
    assert rendered[0]["content"] == [{"type": "image"}]
    assert rendered[1]["content"] == "a square"
    assert rendered[2]["content"] == [{"type": "text", "text": "and"}, {"type": "image"}]


def test_malformed_parts_name_the_field() -> None:
    no_url = {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
    with pytest.raises(APIError) as info:
        ChatCompletionRequest.model_validate(no_url).image_refs()
    assert info.value.param == "messages.0.content.0.image_url"
    audio = {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}
    with pytest.raises(APIError) as info:
        ChatCompletionRequest.model_validate(audio).image_refs()
    assert info.value.param == "messages.0.content.0.type"
    with pytest.raises(APIError) as info:  # the text-only path (e.g. /tokenize) refuses images
        chat(data_url(PNG)).chat_messages()
    assert info.value.param == "messages.0.content.1"


BAD_DATA = {
    "corrupt": data_url(b"\x89PNG\r\n\x1a\n" + b"garbage" * 20),
    "truncated": data_url(PNG[: len(PNG) // 2]),
    "not-an-image": data_url(b"hello world, no image here"),
    "gif": data_url(image_bytes((4, 4), "gif"), "gif"),
    "text-type": "data:text/plain;base64," + base64.b64encode(PNG).decode(),
    "not-base64": "data:image/png;base64,!!!!",
    "plain-data": "data:image/png," + "x" * 10,
    "too-many-pixels": data_url(image_bytes((65, 64))),
    "too-many-bytes": data_url(b"\0" * (LIMITS.max_bytes + 1)),
    "file-scheme": "file:///etc/passwd",
    "ftp-scheme": "ftp://127.0.0.1/a.png",
}


@pytest.mark.parametrize("case", sorted(BAD_DATA))
def test_bad_data_is_a_400_naming_the_part(case: str) -> None:
    err = refused(chat(data_url(PNG), BAD_DATA[case]))
    assert err.param == "messages.0.content.2.image_url", err.message
    assert err.message.startswith("messages.0.content.2.image_url: ")


BAD_URLS = {  # path -> words of the message
    "/redirect/4/a.png": "redirects more than 3",
    "/file": "scheme 'file'",
    "/slow/a.png": "over 1 s",
    "/big": "larger than",
    "/404": "HTTP 404",
    "/img/c.gif": "PNG, JPEG or WebP",
}


@pytest.mark.parametrize("path", sorted(BAD_URLS))
def test_bad_urls_are_a_400_naming_the_part(server: str, path: str) -> None:
    err = refused(chat(f"{server}{path}"))
    assert err.param == "messages.0.content.1.image_url"
    assert BAD_URLS[path] in err.message, err.message


def test_unreachable_host_and_refused_http() -> None:
    err = refused(chat("http://127.0.0.1:9/a.png"))  # the discard port: nothing listens
    assert "unreachable" in err.message and err.param == "messages.0.content.1.image_url"
    only_data = ImageLimits(schemes=("data",))
    assert "not allowed" in refused(chat("https://example.com/a.png"), only_data).message


def test_too_many_images_names_the_first_past_the_limit() -> None:
    err = refused(chat(*[data_url(PNG)] * 4))
    assert err.param == "messages.0.content.4.image_url" and "at most 3" in err.message
    assert len(load(chat(*[data_url(PNG)] * 3))) == 3


def test_limits_defaults_and_no_file_scheme() -> None:
    d = ImageLimits()
    assert (d.max_images, d.max_bytes, d.max_pixels) == (8, 10 << 20, 4096 * 4096)
    assert (d.fetch_timeout_s, d.max_redirects, d.schemes) == (10.0, 3, ("data", "http", "https"))
    assert not d.allow_private_networks and d.allowed_hosts is None
    with pytest.raises(ValueError):
        ImageLimits.model_validate({"schemes": ["file"]})


def test_a_text_only_model_refuses_images_before_fetching() -> None:
    req = chat("http://127.0.0.1:9/never-fetched.png")
    for images in (
        ChatImages(LIMITS, None),
        ChatImages.for_engine(SimpleNamespace(image_spec=None), LIMITS),
    ):
        with pytest.raises(APIError) as info:
            asyncio.run(images.prompt(req, req.image_refs(), None))
        assert info.value.param == "messages.0.content.1.image_url"
        assert "text only" in info.value.message


def test_a_processor_that_cannot_load_refuses_images_saying_why(tmp_path: Path) -> None:
    engine = SimpleNamespace(image_spec=object(), model_dir=tmp_path)  # no processor there
    images = ChatImages.for_engine(engine, LIMITS)
    req = chat(data_url(PNG))
    with pytest.raises(APIError) as info:
        asyncio.run(images.prompt(req, req.image_refs(), None))
    assert "cannot preprocess images" in info.value.message and info.value.status == 400
