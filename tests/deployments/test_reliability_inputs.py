"""Bad input at the HTTP boundary of the real service: every row of the table gets its OpenAI-style
error and status, none reaches the engine (its counters do not move), none is a 500; then good
requests still succeed, a full replica queue answers 503 + Retry-After, and checkpoints cannot
come from outside `model_root` or run code.

One module-scoped service: tiny LFM2, one replica, API key from $SHORTCONV_API_KEY.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from reliability_helpers import SESSION_HEADER, serve_app, sse_data

from deployments.frontend.config.model_source import resolve_model
from deployments.serve.app import deployment_options, parse_args

MODEL = "tiny-lfm2"
KEY = "sk-reliability-test"
AUTH = {"authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 128
MAX_BYTES = 8192
ENGINE_COUNTERS = ("prompt_tokens_total", "generation_tokens_total", "finished_by_reason")
ARGS = {
    "tiny_arch": "lfm2",
    "max_model_len": MAX_MODEL_LEN,
    "max_num_seqs": 2,
    "max_waiting_requests": 2,  # 4 requests in flight per replica; the 5th is refused
    "max_request_bytes": MAX_BYTES,
}


@pytest.fixture(scope="module")
def http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    env = {"SHORTCONV_API_KEY": KEY}
    # Serve's bounds well above the replica's own, so the replica's queue is what refuses.
    opts = {"num_replicas": 1, "max_ongoing_requests": 32, "max_queued_requests": 64}
    with serve_app(tmp_path_factory.mktemp("svc"), ARGS, env, **opts) as base:
        with httpx.Client(base_url=base, timeout=60, headers=AUTH) as client:
            assert client.get("/health").status_code == 200
            yield client


def cmpl(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hello", "max_tokens": 4, **kw}


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}


C, CH = "/v1/completions", "/v1/chat/completions"
BAD = "invalid_request_error"
# (route, body: dict | bytes, extra headers, status, error type, param prefix or code)
TABLE = {
    "malformed-json": (C, b'{"model": "tiny-lfm2", "prompt": ', {}, 400, BAD, None),
    "not-an-object": (C, b"[1, 2, 3]", {}, 400, BAD, None),
    "invalid-utf8": (C, b'{"prompt": "\xff\xfe\xfd"}', {}, 400, BAD, None),
    "lone-surrogate": (C, b'{"prompt": "ab\\ud800"}', {}, 400, BAD, "prompt"),
    "nan": (C, b'{"prompt": "hi", "temperature": NaN}', {}, 400, BAD, None),
    "infinity": (CH, b'{"messages": [], "top_p": Infinity}', {}, 400, BAD, None),
    "deep-nesting": (C, b"[" * 4000 + b"]" * 4000, {}, 400, BAD, None),
    "huge-int": (C, b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}", {}, 400, BAD, None),
    "type-max_tokens-str": (C, cmpl(max_tokens="16"), {}, 400, BAD, "max_tokens"),
    "type-max_tokens-bool": (C, cmpl(max_tokens=True), {}, 400, BAD, "max_tokens"),
    "type-stream-str": (C, cmpl(stream="yes"), {}, 400, BAD, "stream"),
    "type-temperature-str": (CH, chat(temperature="0.5"), {}, 400, BAD, "temperature"),
    "type-messages-str": (CH, chat(messages="hi"), {}, 400, BAD, "messages"),
    "type-prompt-int": (C, cmpl(prompt=12), {}, 400, BAD, "prompt"),
    "type-stop-ints": (C, cmpl(stop=[1, 2]), {}, 400, BAD, "stop"),
    "unknown-field": (C, cmpl(bogus=1), {}, 400, BAD, "bogus"),
    "unknown-message-field": (
        CH,
        chat(messages=[{"role": "user", "content": "x", "foo": 1}]),
        {},
        400,
        BAD,
        "messages.0.foo",
    ),
    "unknown-role": (
        CH,
        chat(messages=[{"role": "wizard", "content": "x"}]),
        {},
        400,
        BAD,
        "messages",
    ),
    "missing-prompt": (C, {"model": MODEL}, {}, 400, BAD, "prompt"),
    "empty-prompt": (C, cmpl(prompt=""), {}, 400, BAD, "prompt"),
    "empty-token-prompt": (C, cmpl(prompt=[]), {}, 400, BAD, "prompt"),
    "empty-messages": (CH, chat(messages=[]), {}, 400, BAD, "messages"),
    "empty-prompt-in-batch": (C, cmpl(prompt=["a", ""]), {}, 400, BAD, "prompt.1"),
    "too-many-prompts": (C, cmpl(prompt=["a"] * 65), {}, 400, BAD, "prompt"),
    "mixed-prompt-batch": (C, cmpl(prompt=["a", [5]]), {}, 400, BAD, "prompt"),
    "prompt-over-context": (C, cmpl(prompt="x" * (2 * MAX_MODEL_LEN)), {}, 400, BAD, "prompt"),
    "chat-over-context": (
        CH,
        chat(messages=[{"role": "user", "content": "y" * 300}]),
        {},
        400,
        BAD,
        "prompt",
    ),
    "token-outside-vocab": (C, cmpl(prompt=[5, 1_000_000]), {}, 400, BAD, "prompt"),
    "negative-token": (C, cmpl(prompt=[5, -1]), {}, 400, BAD, "prompt"),
    "max_tokens-0": (C, cmpl(max_tokens=0), {}, 400, BAD, "max_tokens"),
    "max_tokens-negative": (C, cmpl(max_tokens=-5), {}, 400, BAD, "max_tokens"),
    "max_completion_tokens-0": (CH, chat(max_completion_tokens=0), {}, 400, BAD, "max_completion"),
    "max_tokens-over-context": (C, cmpl(max_tokens=MAX_MODEL_LEN), {}, 400, BAD, "max_tokens"),
    "max_tokens-huge": (CH, chat(max_tokens=10**12), {}, 400, BAD, "max_tokens"),
    "temperature-negative": (C, cmpl(temperature=-0.1), {}, 400, BAD, "temperature"),
    "temperature-high": (CH, chat(temperature=2.5), {}, 400, BAD, "temperature"),
    "top_p-0": (C, cmpl(top_p=0), {}, 400, BAD, "top_p"),
    "top_p-high": (C, cmpl(top_p=1.5), {}, 400, BAD, "top_p"),
    "top_k-negative": (C, cmpl(top_k=-2), {}, 400, BAD, "top_k"),
    "top_k-huge": (C, cmpl(top_k=2**40), {}, 400, BAD, "top_k"),
    "min_p-high": (C, cmpl(min_p=1.5), {}, 400, BAD, "min_p"),
    "min_p-negative": (CH, chat(min_p=-0.1), {}, 400, BAD, "min_p"),
    "seed-over-int64": (C, cmpl(seed=2**64), {}, 400, BAD, "seed"),
    "n-0": (C, cmpl(n=0), {}, 400, BAD, "n"),
    "n-above-max_n": (CH, chat(n=17), {}, 400, BAD, "n"),  # the engine's max_n is 16
    "best_of-2": (C, cmpl(best_of=2), {}, 400, BAD, "best_of"),
    "too-many-stops": (C, cmpl(stop=[f"s{i}" for i in range(17)]), {}, 400, BAD, "stop"),
    "empty-stop": (C, cmpl(stop=[""]), {}, 400, BAD, "stop"),
    "stop_token_ids-negative": (C, cmpl(stop_token_ids=[-3]), {}, 400, BAD, "stop_token_ids"),
    "logprobs-21": (C, cmpl(logprobs=21), {}, 400, BAD, "logprobs"),
    "top_logprobs-21": (CH, chat(logprobs=True, top_logprobs=21), {}, 400, BAD, "top_logprobs"),
    "top_logprobs-without-logprobs": (CH, chat(top_logprobs=2), {}, 400, BAD, "top_logprobs"),
    "stream_options-without-stream": (
        C,
        cmpl(stream_options={"include_usage": True}),
        {},
        400,
        BAD,
        "stream_options",
    ),
    "penalty": (CH, chat(frequency_penalty=2.5), {}, 400, BAD, "frequency_penalty"),
    "logit_bias": (C, cmpl(logit_bias={"5": 100.5}), {}, 400, BAD, "logit_bias"),
    "logit_bias-key": (C, cmpl(logit_bias={"x5": 1.0}), {}, 400, BAD, "logit_bias"),
    "tools": (CH, chat(tools=[{"type": "function"}]), {}, 400, BAD, "tools"),
    "image-part": (
        CH,
        chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
        {},
        400,
        BAD,
        "messages.0.content",
    ),
    "session-id-too-long": (C, cmpl(), {SESSION_HEADER: "s" * 300}, 400, BAD, SESSION_HEADER),
    "unknown-model": (C, cmpl(model="gpt-9"), {}, 404, BAD, "model_not_found"),
    "body-over-limit": (C, cmpl(prompt="z" * MAX_BYTES), {}, 413, BAD, "request_too_large"),
    "no-api-key": (
        C,
        cmpl(),
        {"authorization": ""},
        401,
        "authentication_error",
        "invalid_api_key",
    ),
    "wrong-api-key": (
        CH,
        chat(),
        {"authorization": "Bearer sk-wrong"},
        401,
        "authentication_error",
        "invalid_api_key",
    ),
}


def check_error(r: httpx.Response, status: int, kind: str, where: str | None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert err["type"] == kind, err
    if where is not None:
        assert (err["param"] or "").startswith(where) or err["code"] == where, err


def engine_counters(http: httpx.Client) -> dict[str, Any]:
    stats = http.get("/v1/internal/stats").json()
    return {k: stats[k] for k in ENGINE_COUNTERS}


@pytest.fixture(scope="module")
def before(http: httpx.Client) -> dict[str, Any]:
    return engine_counters(http)


@pytest.mark.parametrize("case", list(TABLE))
def test_bad_input_is_refused_at_the_edge(http: httpx.Client, before: Any, case: str) -> None:
    route, body, headers, status, kind, where = TABLE[case]
    if isinstance(body, bytes):
        r = http.post(route, content=body, headers={"content-type": "application/json", **headers})
    else:
        r = http.post(route, json=body, headers=headers)
    check_error(r, status, kind, where)


def test_oversized_chunked_body_and_routes(http: httpx.Client, before: Any) -> None:
    # No Content-Length: the limit is enforced while the body streams in.
    chunks = (b'{"prompt": "' + b"q" * 1024 for _ in range(16))
    check_error(http.post(C, content=chunks), 413, BAD, "request_too_large")
    check_error(http.get("/v1/nope"), 404, "not_found_error", None)
    check_error(http.get(C), 405, BAD, None)
    bare = {"authorization": ""}
    check_error(http.get("/v1/models", headers=bare), 401, "authentication_error", None)
    check_error(http.get("/v1/internal/stats", headers=bare), 401, "authentication_error", None)
    # Probes and the schema need no key.
    assert http.get("/health", headers=bare).status_code == 200
    assert http.get("/openapi.json", headers=bare).status_code == 200


def test_nothing_reached_the_engine_and_good_requests_succeed(
    http: httpx.Client, before: Any
) -> None:
    assert engine_counters(http) == before
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [MODEL]
    r = http.post(C, json=cmpl(temperature=0.0))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    r = http.post(CH, json=chat(stream=True, stream_options={"include_usage": True}))
    events = sse_data(r.text)
    assert r.status_code == 200 and events[-1] == "[DONE]", r.text
    assert json.loads(events[-2])["usage"]["completion_tokens"] >= 1
    after = engine_counters(http)
    assert after["finished_by_reason"] != before["finished_by_reason"]


def test_full_replica_queue_is_503_with_retry_after(http: httpx.Client) -> None:
    results: list[httpx.Response] = []
    body = cmpl(max_tokens=64, ignore_eos=True, prompt="fill the queue")

    def one() -> None:
        results.append(http.post(C, json=body))

    threads = [threading.Thread(target=one) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    codes = sorted(r.status_code for r in results)
    assert len(codes) == 12 and set(codes) <= {200, 503}, codes
    refused = [r for r in results if r.status_code == 503]
    assert refused and codes.count(200) >= 2, codes
    for r in refused:
        assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "overloaded"
    assert http.post(C, json=cmpl()).status_code == 200  # and it recovers


def test_proxy_queue_is_bounded_too() -> None:
    opts = deployment_options(parse_args({"max_waiting_requests": 7}))
    assert opts["max_queued_requests"] == 32 + 7  # the replica's admission limit
    assert opts["backpressure_config"].retry_after_s == 1


def test_model_root_cannot_be_escaped(tmp_path: Path) -> None:
    root, outside = tmp_path / "models", tmp_path / "elsewhere"
    for d in (root / "ok", outside / "secret"):
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
    (root / "link").symlink_to(outside / "secret")
    args = {"model_root": str(root)}
    assert resolve_model(parse_args({**args, "model": "ok"})) == (root / "ok").resolve()
    for model in ("../elsewhere/secret", "ok/../../elsewhere/secret", "link", str(outside)):
        with pytest.raises(ValueError, match="outside model_root"):
            resolve_model(parse_args({**args, "model": model}))


def test_checkpoint_code_is_never_run(tmp_path: Path) -> None:
    """auto_map + a Python file in the checkpoint: loaded with our own classes, file not run."""
    from shortconv.llm import build_engine
    from shortconv.tiny.checkpoint import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint("lfm2", tmp_path / "ckpt", seed=1)
    marker = tmp_path / "pwned"
    (ckpt / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\nclass Evil: pass\n")
    for name in ("config.json", "tokenizer_config.json"):
        cfg = json.loads((ckpt / name).read_text())
        cfg["auto_map"] = {
            "AutoModelForCausalLM": "evil.Evil",
            "AutoTokenizer": ["evil.Evil", None],
        }
        (ckpt / name).write_text(json.dumps(cfg))
    engine = build_engine(ckpt, dtype="float32")
    try:
        assert engine.tokenizer is not None and not marker.exists()
    finally:
        engine.shutdown()
