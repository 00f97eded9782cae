"""Images through `serve run deployments/lfm2_vl.yaml` and `deployments/lfm3_vl.yaml` and the
openai client, every check for both models: chat `image_url` parts as data URLs and as URLs of a
loopback HTTP server in this test, streamed and not, greedy tokens equal to the offline engine
fed the same processor outputs, a session whose second turn resumes after the image, a
prefix-cache hit on the same image (and a miss on another), a json_schema answer about an
image, Responses `input_image` parts (a `previous_response_id` turn resuming after the image),
and every bad input a 400 naming the part followed by a good request, the replica holding
nothing afterwards.

One `serve run` per model for the module (its tiny checkpoint, built on first start into an
empty cache); pytest runs one model's tests, then the other's.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from image_server import data_url, image_bytes, image_server

from deployments.frontend.config.model_source import tiny_checkpoint
from deployments.frontend.images.decode import decode_image
from deployments.frontend.images.mm_prompt import PromptBuilder
from deployments.serve.app import parse_args
from deployments.serve.serve_run import serve_run
from shortconv.llm import LLM
from shortconv.sampling.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 300.0
MODELS = ("lfm2_vl", "lfm3_vl")  # deployments/<name>.yaml
# The app's `images` args, for both models.
IMAGE_ARGS = {
    "max_images": 3,
    "max_bytes": 48 << 10,
    "max_pixels": 200 * 200,
    "fetch_timeout_s": 2,
    # NOTE: the image server is on loopback, refused by default (the SSRF guard); the host list
    # then refuses `localhost` (the "host-not-allowed" row) through serve run.
    "allow_private_networks": True,
    "allowed_hosts": ["127.0.0.1"],
}
RED = image_bytes((40, 24), "png", seed=1)
BLUE = image_bytes((16, 56), "jpeg", seed=2)
WIDE = image_bytes((64, 32), "webp", seed=3)


@dataclass(frozen=True)
class Served:
    client: openai.OpenAI
    base: str
    model: str
    model_dir: Path
    images: str  # the loopback image server's base URL


@pytest.fixture(scope="module", params=MODELS)
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    cache = tmp_path_factory.mktemp("xdg-cache")
    config = yaml.safe_load((ROOT / "deployments" / f"{request.param}.yaml").read_text())
    args = config["applications"][0]["args"]
    # NOTE: prefix caching on (off in the YAMLs) so that a request without a session can hit an
    # earlier one's image (test_the_same_image_hits_the_prefix_cache).
    args.update(images=IMAGE_ARGS, replica_num_cpus=1, enable_prefix_caching=True)
    env = {"XDG_CACHE_HOME": str(cache)}
    bodies = {"red.png": RED, "blue.jpeg": BLUE, "wide.webp": WIDE}
    with image_server(bodies) as images, serve_run(config, START_TIMEOUT_S, env=env) as (base, _):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        app = parse_args(args)
        model_dir = tiny_checkpoint(app.tiny_arch, app.seed, cache / "shortconv-serve")
        yield Served(client, base, client.models.list().data[0].id, model_dir, images)


def image_part(url: str, detail: str | None = None) -> dict[str, Any]:
    return {
        "type": "image_url",
        "image_url": {"url": url, **({"detail": detail} if detail else {})},
    }


def user(*parts: str | dict[str, Any]) -> dict[str, Any]:
    content = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
    return {"role": "user", "content": content}


def ask(s: Served, messages: list[dict[str, Any]], **kw: Any) -> Any:
    kw = {"max_tokens": 8, "temperature": 0.0, **kw}
    return s.client.chat.completions.create(model=s.model, messages=messages, **kw)


def test_data_and_loopback_urls_stream_as_they_answer(served: Served) -> None:
    blue = image_part(f"{served.images}/img/blue.jpeg", "high")
    messages = [
        user("Compare", image_part(data_url(RED), "low"), "with", blue),
        {"role": "assistant", "content": "Two images."},
        user(image_part(f"{served.images}/redirect/2/wide.webp"), "And this one?"),
    ]  # fmt: skip
    whole = ask(served, messages)
    assert whole.usage.prompt_tokens > 3 * 4  # three images of 4+ tokens each
    chunks = list(ask(served, messages, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_one_image_equals_the_offline_engine(served: Served) -> None:
    messages = [user("What is in the picture?", image_part(data_url(RED)))]
    r = ask(served, messages, max_tokens=12, logprobs=True)
    llm = LLM(served.model_dir)
    builder = PromptBuilder.load(served.model_dir, llm.engine.image_spec)
    template = [{"role": "user", "content": [{"type": "text", "text": "What is in the picture?"},
                                             {"type": "image"}]}]  # fmt: skip
    mm = builder.build(template, [decode_image(RED, parse_args({}).images)], True)
    assert r.usage.prompt_tokens == len(mm.token_ids)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    (out,) = llm.generate(prompt_token_ids=[mm.token_ids], sampling_params=params,
                          images=[list(mm.images)])  # fmt: skip
    assert r.choices[0].message.content == out.text
    assert r.usage.completion_tokens == len(out.token_ids)
    # Token by token: each served token's text is the offline token's.
    texts = [llm.tokenizer.decode([t], skip_special_tokens=False) for t in out.token_ids]
    assert [t.token for t in r.choices[0].logprobs.content] == texts


def test_session_next_turn_resumes_after_the_image(served: Served) -> None:
    session = {"x-session-id": "image-session"}
    turn = [user("Describe", image_part(f"{served.images}/img/red.png"))]
    first = ask(served, turn, extra_headers=session)
    turn += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        user("Say more."),
    ]
    second = ask(served, turn, extra_headers=session)
    cached = second.usage.prompt_tokens_details.cached_tokens or 0
    assert cached >= first.usage.prompt_tokens, (cached, first.usage)  # the image included


def test_the_same_image_hits_the_prefix_cache(served: Served) -> None:
    """No session: a later conversation that starts with an earlier one (its image, its text and
    its answer) resumes from the earlier one's kept state; the same text behind another image
    misses from that image on."""
    first = [user("Prefix check: what is it?", image_part(data_url(WIDE, "webp")))]
    a = ask(served, first)
    more = [{"role": "assistant", "content": a.choices[0].message.content or ""}, user("Why?")]
    hit = ask(served, first + more)
    other = [user("Prefix check: what is it?", image_part(data_url(BLUE, "jpeg")))]
    miss = ask(served, other + more)
    cached = lambda r: r.usage.prompt_tokens_details.cached_tokens or 0  # noqa: E731
    assert cached(hit) >= a.usage.prompt_tokens, (cached(hit), a.usage)
    assert cached(miss) < a.usage.prompt_tokens, (cached(miss), a.usage)


def test_json_schema_about_an_image(served: Served) -> None:
    schema = {
        "type": "object",
        "properties": {"color": {"type": "string", "maxLength": 6}},
        "required": ["color"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}}
    r = ask(served, [user("Its color, as JSON.", image_part(data_url(BLUE, "jpeg")))],
            max_tokens=48, response_format=fmt)  # fmt: skip
    assert r.choices[0].finish_reason == "stop"
    assert set(json.loads(r.choices[0].message.content or "")) == {"color"}


def _bad(served: Served) -> dict[str, tuple[list[dict[str, Any]], dict[str, Any], str]]:
    """case -> (messages, extra body, the param the 400 names)"""
    img = served.images
    part = "messages.0.content.1.image_url"
    one = lambda url: [user("Look", image_part(url))]  # noqa: E731
    return {
        "corrupt": (one(data_url(b"\x89PNG\r\n\x1a\n" + b"junk" * 30)), {}, part),
        "truncated": (one(data_url(RED[: len(RED) // 2])), {}, part),
        "unsupported-type": (one(data_url(image_bytes((8, 8), "gif"), "gif")), {}, part),
        "too-many-images": ([user("Look", *[image_part(data_url(RED))] * 4)], {},
                            "messages.0.content.4.image_url"),
        "too-many-pixels": (one(data_url(image_bytes((201, 200)))), {}, part),
        "too-many-bytes": (one(f"{img}/big"), {}, part),
        "unreachable": (one("http://127.0.0.1:9/red.png"), {}, part),
        "host-not-allowed": (one(img.replace("127.0.0.1", "localhost") + "/img/red.png"), {},
                             part),
        "file-scheme": (one("file:///etc/hostname"), {}, part),
        "redirect-to-file": (one(f"{img}/file"), {}, part),
        "too-many-redirects": (one(f"{img}/redirect/4/red.png"), {}, part),
        "slow": (one(f"{img}/slow/red.png"), {}, part),
        "http-404": (one(f"{img}/404"), {}, part),
        "no-image_url": ([user("Look", {"type": "image_url"})], {}, part),
        "n-2": (one(data_url(RED)), {"n": 2}, "n"),
    }  # fmt: skip


async def _idle(client: httpx.AsyncClient) -> tuple[int, int, int]:
    """Slots, pages and sessions held outside the prefix cache once the replica is idle."""
    for _ in range(100):
        s = (await client.get("/v1/internal/stats")).json()
        if s["num_active_requests"] == 0 and s["num_running"] == 0 and s["num_waiting"] == 0:
            held = s["slots_used"] - s["prefix_cache_checkpoints"]
            return held, s["kv_pages_used"] - s["prefix_cache_pages"], s["sessions_held"]
        await asyncio.sleep(0.1)
    raise AssertionError(f"the replica did not go idle: {s}")


def _input_image(url: str) -> dict[str, Any]:
    return {"type": "input_image", "image_url": url, "detail": "auto"}


def test_responses_input_image_and_a_later_turn(served: Served) -> None:
    """`input_image` parts answer as chat's `image_url` parts do (greedy: the same text); a turn
    naming the stored response resumes after its image (cached) and answers as the whole
    conversation sent again in full."""
    kw: dict[str, Any] = {"model": served.model, "temperature": 0.0, "max_output_tokens": 8}
    red, blue = data_url(RED), f"{served.images}/img/blue.jpeg"
    content = [{"type": "input_text", "text": "Compare"}, _input_image(red), _input_image(blue)]
    first = served.client.responses.create(
        input=[{"role": "user", "content": content}],
        **kw,  # type: ignore[list-item]
    )
    chat = ask(served, [user("Compare", image_part(red), image_part(blue))], max_tokens=8)
    assert first.output_text == chat.choices[0].message.content
    assert first.usage and first.usage.input_tokens == chat.usage.prompt_tokens
    then = served.client.responses.create(input="Say more.", previous_response_id=first.id, **kw)
    assert then.usage and then.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    history = [
        {"role": "user", "content": content},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Say more."},
    ]
    full = served.client.responses.create(input=history, store=False, **kw)  # type: ignore[arg-type]
    assert then.output_text == full.output_text
    assert full.usage and then.usage.input_tokens == full.usage.input_tokens


def test_bad_inputs_are_400s_naming_the_part(served: Served) -> None:
    good = {"model": served.model, "max_tokens": 2,
            "messages": [user("Look", image_part(data_url(WIDE, "webp")))]}  # fmt: skip

    async def run() -> None:
        async with httpx.AsyncClient(base_url=served.base, timeout=120) as http:
            before = await _idle(http)
            for case, (messages, extra, param) in _bad(served).items():
                body = {"model": served.model, "messages": messages, "max_tokens": 2, **extra}
                for stream in (False, True):
                    r = await http.post("/v1/chat/completions", json={**body, "stream": stream})
                    assert r.status_code == 400, (case, r.text)
                    err = r.json()["error"]
                    assert err["param"] == param and err["type"] == "invalid_request_error", (
                        case,
                        err,
                    )
                ok = await http.post("/v1/chat/completions", json=good)
                assert ok.status_code == 200, (case, ok.text)
            assert await _idle(http) == before

    asyncio.run(run())
