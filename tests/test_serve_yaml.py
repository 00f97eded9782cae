"""`serve run deployments/<model>.yaml` as a user runs it, answered through the `openai` client.

Each YAML runs in a `serve run` subprocess started from the repository root (nothing installed:
the import path `deployments.app:build` resolves from the working directory), with an empty
tiny-checkpoint cache, its own Ray temp dir and a free port patched into a copy of the YAML.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from deployments.app import parse_args
from deployments.serve_run import serve_run

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 240.0


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("xdg-cache")  # empty: the first start builds the model


@pytest.fixture(params=["zaya1", "lfm2", "lfm2_moe"])
def served(request: pytest.FixtureRequest, cache_dir: Path) -> Iterator[str]:
    name = request.param
    config = yaml.safe_load((ROOT / "deployments" / f"{name}.yaml").read_text())
    parse_args(config["applications"][0]["args"])  # the YAML's args are valid AppArgs
    with serve_run(config, START_TIMEOUT_S, env={"XDG_CACHE_HOME": str(cache_dir)}) as (base, _):
        yield base


def test_serve_run_yaml_answers_openai_client(served: str) -> None:
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="unused", max_retries=0, timeout=60)
    (model,) = [m.id for m in client.models.list().data]
    messages = [{"role": "user", "content": "Hello! Who are you?"}]
    r = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=8,
        temperature=0.0,  # type: ignore[arg-type]
    )
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage is not None
    assert 1 <= r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 0
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=8,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == r.choices[0].message.content  # greedy: the same answer either way
    assert (
        chunks[-1].usage is not None
        and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    )
    assert httpx.get(f"{served}/health", timeout=30).status_code == 200
    bad = httpx.post(f"{served}/v1/chat/completions", json={"model": model, "messages": [], "n": 2})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    # A second turn of a session resumes from the first one's kept state.
    session = {"x-session-id": "yaml-session"}
    turn = [{"role": "user", "content": "Remember me."}]
    first = client.chat.completions.create(
        model=model,
        messages=turn,
        max_tokens=4,
        temperature=0.0,
        extra_headers=session,  # type: ignore[arg-type]
    )
    turn += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "And now?"},
    ]
    second = client.chat.completions.create(
        model=model,
        messages=turn,
        max_tokens=4,
        temperature=0.0,
        extra_headers=session,  # type: ignore[arg-type]
    )
    details = second.usage.prompt_tokens_details if second.usage else None
    assert details is not None and (details.cached_tokens or 0) > 0
