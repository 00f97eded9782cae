"""`serve run deployments/<model>.yaml` as a user runs it, answered through the `openai` client.

Each YAML runs in a `serve run` subprocess started from the repository root (nothing installed:
the import path `deployments.app:build` resolves from the working directory), with an empty
tiny-checkpoint cache, its own Ray temp dir and a free port patched into a copy of the YAML.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from ray_env import free_port

from deployments.app import parse_args

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 240.0


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to `serve run` (it shuts down the Ray it started), then SIGKILL its group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers of our own session only
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


def wait_ready(base: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(
                f"serve run exited ({proc.returncode}):\n{log.read_text()[-4000:]}"
            )
        try:
            if httpx.get(f"{base}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise AssertionError(f"no answer within {START_TIMEOUT_S:.0f}s:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("xdg-cache")  # empty: the first start builds the model


@pytest.fixture(params=["zaya1", "lfm2", "lfm2_moe"])
def served(request: pytest.FixtureRequest, cache_dir: Path, tmp_path: Path) -> Iterator[str]:
    name = request.param
    config = yaml.safe_load((ROOT / "deployments" / f"{name}.yaml").read_text())
    parse_args(config["applications"][0]["args"])  # the YAML's args are valid AppArgs
    port = free_port()
    config["http_options"]["port"] = port
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump(config, sort_keys=False))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    ray_tmp = tempfile.mkdtemp(prefix="scsv-run-")  # short: Ray's socket paths live under it
    env.update(RAY_TMPDIR=ray_tmp, XDG_CACHE_HOME=str(cache_dir))
    serve_bin = Path(sys.executable).parent / "serve"
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(serve_bin), "run", str(cfg)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc, log)
        yield base
    finally:
        stop(proc)
        shutil.rmtree(ray_tmp, ignore_errors=True)


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
