"""The OpenAI API surface applications and tools use, through `serve run deployments/lfm2.yaml`
(one app for the module) with the official `openai` client and raw bodies: completions
batches and echo, penalties and logit_bias, vLLM's tokenizer routes and request extensions,
the fields SDKs send, and the request bodies guidellm 0.8.1 sends."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from serve_apps import yaml_app

PROMPTS = ["The sky is", "Once upon a time", "def main():", "1, 2, 3,"]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with yaml_app("lfm2", tmp_path_factory, max_replicas=1) as url:  # one engine: comparisons
        yield url


@pytest.fixture(scope="module")
def http(base: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base, timeout=120) as c:
        yield c


def _greedy(client: openai.OpenAI, model: str, prompt: Any, **kw: Any) -> Any:
    kw = {"max_tokens": 6, "temperature": 0.0, **kw}
    return client.completions.create(model=model, prompt=prompt, **kw)


def _sse(r: httpx.Response) -> list[dict[str, Any]]:
    assert r.status_code == 200, r.text
    events = [e[len("data: ") :] for e in r.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# ---- completions batches and echo -----------------------------------------------------------


def test_a_batch_of_4_prompts_is_one_request_with_4_choices(
    client: openai.OpenAI, http: httpx.Client, model: str
) -> None:
    ignore = {"extra_body": {"ignore_eos": True}}
    alone = [_greedy(client, model, p, **ignore) for p in PROMPTS]
    batch = _greedy(client, model, PROMPTS, **ignore)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 4 * 6
    ids = http.post("/tokenize", json={"prompt": PROMPTS[0]}).json()
    by_ids = _greedy(client, model, [ids["tokens"], ids["tokens"]], **ignore)
    assert [c.text for c in by_ids.choices] == [alone[0].choices[0].text] * 2


def test_a_streamed_batch_interleaves_its_choices(client: openai.OpenAI, model: str) -> None:
    chunks = list(
        client.completions.create(
            model=model,
            prompt=PROMPTS,
            max_tokens=5,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text: dict[int, str] = {}
    finished = set()
    for c in chunks[:-1]:
        (choice,) = c.choices
        text[choice.index] = text.get(choice.index, "") + choice.text
        if choice.finish_reason:
            finished.add(choice.index)
    assert finished == {0, 1, 2, 3}
    whole = _greedy(client, model, PROMPTS, max_tokens=5, extra_body={"ignore_eos": True})
    assert [text[i] for i in range(4)] == [c.text for c in whole.choices]
    assert chunks[-1].usage.completion_tokens == 20 and not chunks[-1].choices


def test_echo_puts_the_prompt_in_front(client: openai.OpenAI, model: str) -> None:
    plain = _greedy(client, model, PROMPTS[:2])
    echoed = _greedy(client, model, PROMPTS[:2], echo=True)
    for p, a, b in zip(PROMPTS, plain.choices, echoed.choices, strict=False):
        assert b.text == p + a.text
    with pytest.raises(openai.BadRequestError) as err:
        _greedy(client, model, "x", echo=True, logprobs=1)
    assert err.value.body["param"] == "echo"  # type: ignore[index]


# ---- sampling controls --------------------------------------------------------------------


def test_penalties_and_bias_are_accepted_and_a_plus_100_bias_forces_its_token(
    client: openai.OpenAI, http: httpx.Client, model: str
) -> None:
    tok = http.post("/tokenize", json={"prompt": "zebra", "add_special_tokens": False}).json()[
        "tokens"
    ][-1]
    forced = _greedy(
        client, model, "hello", logit_bias={str(tok): 100}, extra_body={"ignore_eos": True}
    )
    want = http.post("/detokenize", json={"tokens": [tok] * 6}).json()["prompt"]
    assert forced.choices[0].text == want
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        presence_penalty=1.2,
        frequency_penalty=-0.5,
        seed=3,
        extra_body={"repetition_penalty": 1.3, "min_tokens": 4, "top_k": 20},
    )
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 4


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"logit_bias": {"5": 100.5}}, "logit_bias"),
        ({"logit_bias": {"5x": 1}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),  # outside the vocabulary
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"frequncy_penalty": 0.5}, "frequncy_penalty"),  # misspelt
    ],
)
def test_bad_fields_are_a_400_naming_them(http: httpx.Client, extra: dict, param: str) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param), r.json()


def test_fields_that_change_nothing_are_accepted(http: httpx.Client) -> None:
    ignored = {
        "metadata": {"team": "a"},
        "store": False,
        "service_tier": "auto",
        "user": "u-1",
        "modalities": ["text"],
        "reasoning_effort": "low",
        "prompt_cache_key": "k",
    }
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **ignored}
    assert http.post("/v1/chat/completions", json=body).status_code == 200


# ---- tokenizer routes -----------------------------------------------------------------------


def test_tokenize_and_detokenize_round_trip(
    client: openai.OpenAI, http: httpx.Client, model: str
) -> None:
    r = http.post(
        "/tokenize", json={"model": model, "prompt": "Hello there", "return_token_strs": True}
    )
    body = r.json()
    assert r.status_code == 200 and body["count"] == len(body["tokens"]) > 0
    assert body["max_model_len"] > 0 and len(body["token_strs"]) == body["count"]
    back = http.post("/detokenize", json={"model": model, "tokens": body["tokens"]}).json()
    assert back["prompt"].endswith("Hello there")
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    chat = http.post("/tokenize", json={"messages": messages}).json()
    used = client.chat.completions.create(model=model, messages=messages, max_tokens=1)  # type: ignore[arg-type]
    assert chat["count"] == used.usage.prompt_tokens
    bad = http.post("/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = http.post("/tokenize", json={"prompt": "a", "messages": messages})
    assert both.status_code == 400


# ---- what guidellm 0.8.1 sends --------------------------------------------------------------
# Its OpenAI HTTP backend (guidellm/backends/openai/request_handlers.py): fixed output lengths
# as max_tokens / max_completion_tokens with stop=None and ignore_eos=True; a streamed request
# always asks for usage in every chunk; chat content as a list of text parts.


def _guidellm_completion(model: str, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model}
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    body.update(max_tokens=8, stop=None, ignore_eos=True, prompt="a b c d e f g h")
    return body


def _guidellm_chat(model: str, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model}
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    body.update(max_completion_tokens=8, stop=None, ignore_eos=True)
    body["messages"] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "a b c d e f g h"}]},
    ]
    return body


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_guidellm_bodies_not_streamed(http: httpx.Client, model: str, route: str) -> None:
    if route == "chat":
        r = http.post("/v1/chat/completions", json=_guidellm_chat(model, False))
    else:
        r = http.post("/v1/completions", json=_guidellm_completion(model, False))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_guidellm_bodies_streamed_get_usage_in_every_chunk(
    http: httpx.Client, model: str, route: str
) -> None:
    if route == "chat":
        chunks = _sse(http.post("/v1/chat/completions", json=_guidellm_chat(model, True)))
    else:
        chunks = _sse(http.post("/v1/completions", json=_guidellm_completion(model, True)))
    usages = [c["usage"] for c in chunks]
    assert all(u is not None for u in usages)
    done = [u["completion_tokens"] for u in usages]
    assert done == sorted(done) and done[-1] == 8
    assert len({u["prompt_tokens"] for u in usages}) == 1 and usages[0]["prompt_tokens"] > 0
    assert chunks[-1]["choices"] == []  # the last chunk: usage only
