"""Schema-driven fuzzing of the live service: schemathesis reads FastAPI's /openapi.json (the
request bodies are published there) and sends, per operation, a bounded number of requests that
fit the schema and as many that break it. Nothing may answer 5xx, hang, or return an error that
is not OpenAI-shaped.

Tiny LFM2 with a short context (64 tokens), so a valid request generates at most a few dozen
tokens; hypothesis is derandomised, so a CI run is repeatable.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from reliability_helpers import serve_app
from schemathesis import GenerationMode

# About 30 s alone on 2 cores, five minutes beside two other test workers; a hang is caught per
# request (REQUEST_TIMEOUT_S), so the whole run may take its time.
pytestmark = pytest.mark.timeout(600)

MAX_EXAMPLES = 40  # per operation and per mode (valid, invalid)
REQUEST_TIMEOUT_S = 60.0  # a hang fails the test instead of stalling it
ARGS = {"tiny_arch": "lfm2", "max_model_len": 64, "max_num_seqs": 4, "request_timeout_s": 30}


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serve_app(tmp_path_factory.mktemp("svc"), ARGS, num_replicas=1) as base:
        yield base


def check_response(case: schemathesis.Case, status: int, content: bytes) -> None:
    label = f"{case.method} {case.path} body={case.body!r}"[:600]
    assert status < 500, f"{status} for {label}: {content[:300]!r}"
    if status >= 400:
        err = json.loads(content)["error"]
        assert set(err) == {"message", "type", "param", "code"}, f"{label}: {err}"


def fuzz(op: schemathesis.APIOperation, mode: GenerationMode, base_url: str) -> Counter[int]:
    """Send up to MAX_EXAMPLES generated requests to `op`; returns their status codes."""
    statuses: Counter[int] = Counter()

    @given(case=op.as_strategy(generation_mode=mode))
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def run(case: schemathesis.Case) -> None:
        r = case.call(base_url=base_url, timeout=REQUEST_TIMEOUT_S)
        statuses[r.status_code] += 1
        check_response(case, r.status_code, r.content)

    run()
    return statuses


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_fuzzed_requests_never_5xx_or_hang(base_url: str, mode: GenerationMode) -> None:
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json", timeout=30)
    ops = [result.ok() for result in schema.get_all_operations()]
    paths = {op.path for op in ops}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"} <= paths
    assert {"/tokenize", "/detokenize", "/v1/responses"} <= paths
    body_ops = [op for op in ops if op.method.upper() == "POST"]
    assert all(op.body for op in body_ops), "the request bodies must be in the schema"
    sent: dict[str, Counter[int]] = {}
    for op in ops:
        if mode is GenerationMode.POSITIVE or op.method.upper() == "POST":  # GETs take no input
            sent[op.label] = fuzz(op, mode, base_url)
    posts = [c for label, c in sent.items() if label.startswith("POST")]
    assert len(posts) == 5 and all(c.total() >= 10 for c in posts), sent
    if mode is GenerationMode.POSITIVE:  # valid requests do reach the engine and answer
        assert all(c[200] >= 1 for c in posts), sent
    assert httpx.get(f"{base_url}/health", timeout=30).status_code == 200
