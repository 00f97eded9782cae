"""A real Prometheus server for tests: loopback only, temp storage, 1 s scrapes, stopped by PID.

    with PromServer(["127.0.0.1:8001"], tmp_path) as prom:
        prom.wait_value('shortconv_num_requests_running', lambda v: v == 0)

Needs the `prometheus` binary (Debian: `apt-get install -y prometheus`); `prometheus_binary()`
returns None when it is missing so tests can skip with a reason.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from ray_env import free_port

SCRAPE_INTERVAL_S = 1


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


def _config(targets: Sequence[str]) -> str:
    # NOTE: scrape_timeout must not exceed the interval (Prometheus refuses the config).
    return json.dumps(  # JSON is valid YAML: no YAML writer needed
        {
            "global": {
                "scrape_interval": f"{SCRAPE_INTERVAL_S}s",
                "scrape_timeout": f"{SCRAPE_INTERVAL_S}s",
                "evaluation_interval": f"{SCRAPE_INTERVAL_S}s",
            },
            "scrape_configs": [{"job_name": "shortconv", "static_configs": [{"targets": targets}]}],
        },
        indent=1,
    )


class PromServer:
    """One `prometheus` process scraping `targets` (host:port, path /metrics)."""

    def __init__(self, targets: Sequence[str], work_dir: Path, ready_timeout_s: float = 30.0):
        binary = prometheus_binary()
        if binary is None:
            raise RuntimeError("the prometheus binary is not installed")
        self.binary, self.targets, self.work_dir = binary, list(targets), Path(work_dir)
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> PromServer:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        cfg = self.work_dir / "prometheus.yml"
        cfg.write_text(_config(self.targets))
        for _ in range(3):  # a free port can be taken between probing and binding: retry
            self.port = free_port()
            log = open(self.work_dir / "prometheus.log", "ab")  # the child keeps its own copy
            self.proc = subprocess.Popen(
                [
                    self.binary,
                    f"--config.file={cfg}",
                    f"--storage.tsdb.path={self.work_dir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            log.close()
            if self._wait_ready():
                return self
            self.stop()
        raise RuntimeError(f"prometheus did not become ready; see {self.work_dir}/prometheus.log")

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"{self.base}/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return True
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        return False

    def stop(self) -> None:
        """Terminate our own process (by its PID), then kill it if it lingers."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        self.proc = None

    def __enter__(self) -> PromServer:
        return self.start()

    def __exit__(
        self, tp: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # ---- queries ------------------------------------------------------------------------
    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query via /api/v1/query; returns the result vector."""
        url = f"{self.base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.load(resp)
        if body.get("status") != "success":
            raise RuntimeError(f"query {expr!r} failed: {body}")
        return body["data"]["result"]

    def value(self, expr: str) -> float | None:
        """The single sample of `expr`, or None when the vector is empty."""
        result = self.query(expr)
        if not result:
            return None
        if len(result) > 1:
            raise AssertionError(f"{expr!r} returned {len(result)} series: {result}")
        return float(result[0]["value"][1])

    def wait_value(
        self, expr: str, pred: Callable[[float], bool], timeout_s: float = 90.0
    ) -> float:
        """Poll `expr` until its value satisfies `pred`; fails with the last value seen.
        NOTE: 90 s, because a value crosses the replica's metrics push, Ray's export period and
        the scrape; on a loaded 2-core machine that once took longer than 30 s."""
        deadline, last = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline:
            last = self.value(expr)
            if last is not None and pred(last):
                return last
            time.sleep(0.25)
        raise AssertionError(f"{expr!r}: timed out after {timeout_s:.0f}s (last value {last})")
