"""Run `serve run` on a Serve config as a child process, as a user would, for tests and benchmarks.

The config (a parsed YAML) is written with a free loopback port patched in; the process gets its
own session (process group) and its own short `RAY_TMPDIR`, so stopping it ends only what it
started. Ready = `GET /v1/models` answers 200.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[2]


class ServeRunError(RuntimeError):
    """`serve run` exited or did not answer in time; the message ends with its log's tail."""


def free_port() -> int:
    """A loopback TCP port free right now (the caller binds it moments later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Ray gives a starting node a fixed 30 s to register (ray/_private/node.py); on a loaded machine
# a start can miss it. Such a start is tried once more.
RAY_START_TIMED_OUT = "timed out during startup"


@contextmanager
def serve_run(
    config: dict[str, Any],
    timeout_s: float,
    env: dict[str, str] | None = None,
    graceful: bool = False,
) -> Iterator[tuple[str, Path]]:
    """Yields (base URL, log path); `env` adds to the inherited environment (RAY_ADDRESS is
    dropped so the child starts its own Ray). The temp dir (config, log, Ray's) is removed.
    `graceful` stops it as Ctrl-C does (see `stop`)."""
    port = free_port()
    config = {
        **config,
        "http_options": {**config.get("http_options", {}), "host": "127.0.0.1", "port": port},
    }
    tmp = Path(tempfile.mkdtemp(prefix="scsr-"))  # short: Ray's socket paths live under it
    cfg, log = tmp / "serve.yaml", tmp / "serve.log"
    cfg.write_text(yaml.safe_dump(config, sort_keys=False))
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    child_env.update(RAY_TMPDIR=str(tmp), **(env or {}))
    url = f"http://127.0.0.1:{port}"
    try:
        proc = _start_ready(cfg, log, child_env, url, timeout_s)
        try:
            yield url, log
        finally:
            stop(proc, graceful)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _start_ready(
    cfg: Path, log: Path, env: dict[str, str], url: str, timeout_s: float
) -> subprocess.Popen[bytes]:
    """`serve run cfg`, answering at `url`; a start that missed Ray's limit is tried again."""
    for attempt in (1, 2):
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [str(Path(sys.executable).parent / "serve"), "run", str(cfg)],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            _wait_ready(url, proc, log, timeout_s)
            return proc
        except ServeRunError as exc:
            stop(proc)
            if attempt == 2 or RAY_START_TIMED_OUT not in str(exc):
                raise
    raise AssertionError("unreachable")


def _wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServeRunError(f"serve run exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise ServeRunError(f"no answer within {timeout_s:.0f}s:\n{log.read_text()[-4000:]}")


def stop(proc: subprocess.Popen[bytes], graceful: bool = False) -> None:
    """SIGTERM to `serve run` (it shuts down the Ray it started), then SIGKILL its group.
    `graceful` sends SIGINT first: only on Ctrl-C does `serve run` call `serve.shutdown()`,
    which runs each replica's shutdown (its engine's: sessions spill to a session store);
    SIGTERM ends Ray under the replicas and the group's SIGKILL follows."""
    if graceful and proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers of this process group only
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)
