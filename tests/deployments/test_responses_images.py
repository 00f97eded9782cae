"""Responses `input_image` parts at the ingress, with a fake replica that records what it is
asked: they reach the replica as chat `image_url` parts; a stored response keeps each data URL's
image once, by digest, as bytes (never the data URL string); a later turn naming it by
`previous_response_id` gives the replica the whole conversation, the earlier image included.
The real replicas (LFM2-VL and LFM3-VL) under `serve run`: test_serve_images.py."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import pytest
from image_server import data_url, image_bytes

from deployments.frontend.openai.errors import APIError
from deployments.frontend.openai.protocol import ChatCompletionRequest
from deployments.frontend.openai.replica import Reply, RequestContext
from deployments.frontend.responses.api import ResponsesService
from deployments.frontend.responses.images import REF_PREFIX, restore, stash
from deployments.frontend.responses.protocol import ResponsesRequest
from deployments.frontend.responses.store import LocalStore, ResponseStore

PNG = image_bytes((40, 24), "png", seed=1)
URL = data_url(PNG)


def _no_transport_errors(exc: BaseException) -> APIError:
    """The fake replica has no transport to fail: any error reaching here is the test's bug."""
    raise AssertionError(f"unexpected replica failure: {exc!r}") from exc


class _Recorder:
    """A replica that answers "ok" and keeps every chat request it gets."""

    def __init__(self) -> None:
        self.seen: list[ChatCompletionRequest] = []

    async def chat(self, request: ChatCompletionRequest, ctx: RequestContext) -> Reply:
        self.seen.append(request)
        message = {"role": "assistant", "content": "ok"}
        body = {"choices": [{"message": message, "finish_reason": "stop"}], "usage": {}}
        return Reply("r0", body)


def _image_turn(text: str, url: str) -> list[dict[str, Any]]:
    content = [{"type": "input_text", "text": text},
               {"type": "input_image", "image_url": url, "detail": "auto"}]  # fmt: skip
    return [{"type": "message", "role": "user", "content": content}]


def _urls(request: ChatCompletionRequest) -> list[str]:
    return [ref.url for ref in request.image_refs()]


def test_stash_keeps_bytes_by_digest_and_restore_gives_the_url_back() -> None:
    http = "http://example.test/a.png"
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "two"},
        {"type": "image_url", "image_url": {"url": URL, "detail": "low"}},
        {"type": "image_url", "image_url": {"url": http}},
    ]}]  # fmt: skip
    kept, images = stash(messages)
    digest = hashlib.sha256(PNG).hexdigest()
    assert set(images) == {digest} and images[digest].data == PNG
    assert URL not in repr(kept) and f"{REF_PREFIX}{digest}" in repr(kept)
    assert http in repr(kept)  # an http(s) URL is kept as it is
    assert restore(kept, images) == messages
    assert messages[0]["content"][1]["image_url"]["url"] == URL  # the input is not modified


def test_a_stored_turn_holds_digests_and_the_next_turn_sees_the_image() -> None:
    store, replica = ResponseStore(ttl_s=60.0, max_entries=8), _Recorder()
    service = ResponsesService(lambda sid: replica, LocalStore(store), "m", _no_transport_errors)  # type: ignore[arg-type, return-value]

    async def run() -> None:
        first = await service.create(ResponsesRequest(input=_image_turn("what?", URL)))
        entry = store.get(first.body["id"])
        held = repr(entry)
        assert URL not in held and URL.split(",")[1] not in held  # no data URL, no base64
        assert [img.data for img in entry.images.values()] == [PNG]
        follow = ResponsesRequest(input="and then?", previous_response_id=first.body["id"])
        second = await service.create(follow)
        assert URL not in repr(store.get(second.body["id"]))

    asyncio.run(run())
    assert [_urls(r) for r in replica.seen] == [[URL], [URL]]  # the image, again, on turn 2
    assert replica.seen[1].messages[-1].content == "and then?"


@pytest.mark.parametrize(
    ("part", "param"),
    [
        ({"type": "input_image"}, "input.0.content.0.image_url"),
        ({"type": "input_image", "file_id": "file_1"}, "input.0.content.0.image_url"),
        ({"type": "input_file", "file_id": "file_1"}, "input.0.content.0.type"),
    ],
)
def test_image_parts_without_a_url_are_refused_naming_them(
    part: dict[str, Any], param: str
) -> None:
    service = ResponsesService(
        lambda sid: _Recorder(), LocalStore(ResponseStore(60.0, 8)), "m", _no_transport_errors
    )  # type: ignore[arg-type, return-value]
    body = ResponsesRequest(input=[{"type": "message", "role": "user", "content": [part]}])
    with pytest.raises(APIError) as info:
        asyncio.run(service.plan(body))
    assert info.value.param == param
