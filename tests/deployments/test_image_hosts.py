"""The SSRF table: image URLs may not reach private or local networks unless
`images.allow_private_networks`, and only `images.allowed_hosts` when that is set; each redirect
hop is checked again and the fetch connects to the address that was checked.

Every fetch here goes through `LoopbackOnly`, which refuses to open a connection to anything but
a loopback IP, so even with the guard broken no test sends a packet to a private network (the
private rows then fail as "unreachable" instead of naming the network). Then the simple rows
through the ingress app and a replica over a fake engine: a 400 naming the content part.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, cast

import httpx
import pytest
from image_server import image_bytes, image_server
from test_serve_api import MODEL, FakeEngine

from deployments.frontend.engine.async_engine import AsyncEngine
from deployments.frontend.images.chat_images import ChatImages
from deployments.frontend.images.hosts import HostGuard, IPAddress, is_public
from deployments.frontend.images.limits import ImageLimits
from deployments.frontend.openai.api import ApiConfig, OpenAIReplica
from deployments.frontend.openai.errors import APIError
from deployments.frontend.openai.images import ImageLoader
from deployments.frontend.openai.protocol import ChatCompletionRequest
from deployments.serve.ingress import IngressConfig, build_ingress_app

PNG = image_bytes((8, 8), "png")
PART = "messages.0.content.1.image_url"
PRIVATE = "private or local network"
FAKE_PUBLIC = ipaddress.ip_address("127.0.0.2")  # a loopback address the redirect rows call public


class LoopbackOnly(httpx.AsyncHTTPTransport):
    """A transport that connects to loopback IPs only: the test's own safety net."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:  # a name: only `localhost` (an unpinned URL: private networks allowed)
            loopback = host == "localhost"
        if not loopback:
            raise httpx.ConnectError(f"the test refuses to connect to {host}")
        return await super().handle_async_request(request)


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    with image_server({"a.png": PNG}) as url:
        yield url


@pytest.fixture(scope="module")
def public_base() -> Iterator[str]:
    """A second server on 127.0.0.2, which `fake_public` guards treat as a public address."""
    with image_server({"a.png": PNG}, host=str(FAKE_PUBLIC)) as url:
        yield url


def body(url: str) -> dict[str, Any]:
    parts = [{"type": "text", "text": "?"}, {"type": "image_url", "image_url": {"url": url}}]
    return {"messages": [{"role": "user", "content": parts}]}


def chat(url: str) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(body(url))


def fake_public(limits: ImageLimits, **seams: Any) -> HostGuard:
    """`limits`' guard, with 127.0.0.2 counted as public and any other `seams` replaced."""

    def public(ip: IPAddress) -> bool:
        return ip == FAKE_PUBLIC or is_public(ip)

    return replace(HostGuard.of(limits), public=public, **seams)


def load(url: str, limits: ImageLimits, guard: HostGuard | None = None) -> list[Any]:
    async def run() -> list[Any]:
        client = httpx.AsyncClient(transport=LoopbackOnly(), trust_env=False)
        loader = ImageLoader(limits, client, guard)
        try:
            return await loader.load(chat(url).image_refs())
        finally:
            await loader.aclose()

    return asyncio.run(run())


def refusal(url: str, limits: ImageLimits, guard: HostGuard | None = None) -> str:
    with pytest.raises(APIError) as info:
        load(url, limits, guard)
    assert info.value.status == 400 and info.value.param == PART, info.value.message
    return info.value.message


DEFAULT = ImageLimits()
REFUSED_BY_DEFAULT = {  # case -> URL (`{base}`: the loopback image server, which does serve it)
    "loopback": "{base}/img/a.png",
    "loopback-name": "{base}/img/a.png".replace("127.0.0.1", "localhost"),
    "loopback-decimal": "{base}/img/a.png".replace("127.0.0.1", "2130706433"),
    "loopback-v6": "http://[::1]/a.png",
    "loopback-v4-mapped": "http://[::ffff:127.0.0.1]/a.png",
    "unspecified": "http://0.0.0.0/a.png",
    "private-10": "http://10.1.2.3/a.png",
    "private-192-168": "https://192.168.0.1/a.png",
    "private-172-16": "http://172.16.5.4/a.png",
    "private-v4-mapped": "http://[::ffff:10.0.0.1]/a.png",
    "link-local-metadata": "http://169.254.169.254/latest/meta-data/",
    "link-local-v6": "http://[fe80::1]/a.png",
    "cgnat": "http://100.64.0.1/a.png",
    "unique-local-v6": "http://[fd00::1]/a.png",
    "multicast": "http://224.0.0.1/a.png",
}


@pytest.mark.parametrize("case", sorted(REFUSED_BY_DEFAULT))
def test_private_and_local_addresses_are_refused_by_default(base: str, case: str) -> None:
    url = REFUSED_BY_DEFAULT[case].format(base=base)
    assert PRIVATE in refusal(url, DEFAULT)


def test_the_same_loopback_url_is_served_when_private_networks_are_allowed(base: str) -> None:
    (image,) = load(f"{base}/img/a.png", ImageLimits(allow_private_networks=True))
    assert image.size == (8, 8)


def test_a_host_answering_any_private_address_is_refused(public_base: str) -> None:
    port = httpx.URL(public_base).port

    async def mixed(host: str, port: int) -> list[IPAddress]:  # one public, one private answer
        return [FAKE_PUBLIC, ipaddress.ip_address("10.0.0.7")]

    guard = fake_public(DEFAULT, resolver=mixed)
    assert PRIVATE in refusal(f"http://images.test:{port}/img/a.png", DEFAULT, guard)


def test_the_fetch_connects_to_the_checked_address(public_base: str) -> None:
    # `images.test` resolves only through the injected resolver: served means httpx connected
    # to the address the guard checked (sending the name as Host), never resolving it again.
    port = httpx.URL(public_base).port

    async def pinned(host: str, port: int) -> list[IPAddress]:
        assert host == "images.test"
        return [FAKE_PUBLIC]

    (image,) = load(
        f"http://images.test:{port}/img/a.png", DEFAULT, fake_public(DEFAULT, resolver=pinned)
    )
    assert image.size == (8, 8)


def test_a_redirect_from_a_public_host_to_loopback_is_refused(base: str, public_base: str) -> None:
    guard = fake_public(DEFAULT)
    assert load(f"{public_base}/img/a.png", DEFAULT, guard)  # the first hop alone is served
    netloc = httpx.URL(base).netloc.decode()
    for target in (netloc, netloc.replace("127.0.0.1", "localhost")):
        assert PRIVATE in refusal(f"{public_base}/elsewhere/{target}/a.png", DEFAULT, guard)


def test_allowed_hosts_restricts_every_hop(base: str) -> None:
    limits = ImageLimits(allow_private_networks=True, allowed_hosts=("LocalHost",))
    port = httpx.URL(base).port
    assert load(f"http://LOCALHOST:{port}/img/a.png", limits)  # case-insensitive
    assert "not in allowed_hosts" in refusal(f"{base}/img/a.png", limits)  # 127.0.0.1
    only_ip = ImageLimits(allow_private_networks=True, allowed_hosts=("127.0.0.1",))
    away = f"{base}/elsewhere/localhost:{port}/a.png"
    assert "not in allowed_hosts" in refusal(away, only_ip)
    # An allowed host is still checked for its address unless private networks are allowed.
    assert PRIVATE in refusal(f"{base}/img/a.png", ImageLimits(allowed_hosts=("127.0.0.1",)))


def test_limits_default_to_the_guard_on() -> None:
    assert not DEFAULT.allow_private_networks and DEFAULT.allowed_hosts is None
    assert ImageLimits.model_validate({"allowed_hosts": ["A.example"]}).allowed_hosts == (
        "a.example",
    )
    with pytest.raises(ValueError):
        ImageLimits.model_validate({"allowed_hosts": []})


class _NoPrompt:
    """A vision model's prompt builder that these requests must never reach."""

    def build(self, *args: object) -> object:
        raise AssertionError("the image was fetched")


def test_refusals_through_the_http_path(base: str) -> None:
    # Loopback targets only: this path fetches with the replica's own client (no LoopbackOnly).
    images = ChatImages(DEFAULT, cast(Any, _NoPrompt()))
    urls = [f"{base}/img/a.png", f"{base}/img/a.png".replace("127.0.0.1", "localhost")]

    async def main() -> None:
        eng = AsyncEngine(FakeEngine(), admission_limit=4)
        eng.start()
        try:
            replica = OpenAIReplica(eng, ApiConfig(model_name=MODEL), images)
            app = build_ingress_app(lambda _sid: replica, IngressConfig(model_name=MODEL))
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                for url, stream in [(u, s) for u in urls for s in (False, True)]:
                    req = {**body(url), "model": MODEL, "max_tokens": 2, "stream": stream}
                    r = await http.post("/v1/chat/completions", json=req)
                    assert r.status_code == 400, (url, r.text)
                    err = r.json()["error"]
                    assert err["param"] == PART and err["message"].startswith(f"{PART}: ")
                    assert PRIVATE in err["message"], err
        finally:
            eng.shutdown()

    asyncio.run(main())
