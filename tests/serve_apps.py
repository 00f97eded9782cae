"""`serve run` of a shipped YAML for a test module: the app and an `openai` client on it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from ray_env import model_cache

from deployments.serve.serve_run import serve_run

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def yaml_app(
    name: str, tmp_path_factory: pytest.TempPathFactory, graceful: bool = False, **args: Any
) -> Iterator[str]:
    """Serve deployments/<name>.yaml (its first app's args updated by `args`); yields the base
    URL. Each app gets a cache of its own (the tiny checkpoint is built into it). `graceful`:
    stopped as Ctrl-C stops `serve run` (replicas shut down; deployments/serve/serve_run.py)."""
    config = yaml.safe_load((ROOT / "deployments" / f"{name}.yaml").read_text())
    config["applications"][0]["args"].update(args)
    env = {"XDG_CACHE_HOME": str(model_cache(tmp_path_factory.getbasetemp()))}
    with serve_run(config, 240.0, env=env, graceful=graceful) as (url, _):
        yield url


def openai_client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def second_turn_cached_tokens(client: openai.OpenAI, model: str, session_id: str) -> int:
    """Two greedy chat turns of one `x-session-id`; the second turn's `cached_tokens` (what it
    resumed from the first turn's kept state)."""
    session = {"x-session-id": session_id}
    turn: list[Any] = [{"role": "user", "content": "Remember me."}]
    first = client.chat.completions.create(
        model=model, messages=turn, max_tokens=4, temperature=0.0, extra_headers=session
    )
    turn += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "And now?"},
    ]
    second = client.chat.completions.create(
        model=model, messages=turn, max_tokens=4, temperature=0.0, extra_headers=session
    )
    details = second.usage.prompt_tokens_details if second.usage else None
    assert details is not None
    return details.cached_tokens or 0
