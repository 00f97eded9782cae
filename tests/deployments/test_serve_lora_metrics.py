"""The LoRA metrics through the real service: one replica under `serve.run` (tiny LFM2, one
YAML adapter, runtime loads on), its Ray metrics export port scraped by a real Prometheus.
The series follow a runtime load, requests under an adapter and the base, a refused load
and an unload, and `/v1/internal/stats` carries the same numbers."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from lora_adapters import make_adapter
from prom_server import PromServer, free_port, prometheus_binary
from ray_env import private_ray

from deployments.serve.app import build_app, deployment_options, parse_args

pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        prometheus_binary() is None,
        reason="the prometheus binary is not installed (Debian: apt-get install -y prometheus)",
    ),
]

APP = "sclm"
BASE = "tiny-lfm2-base"
SEL = f'deployment="LLMServer",application="{APP}"'


@dataclass
class Stack:
    prom: PromServer
    http: httpx.Client
    root: Path


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    pytest.importorskip("ray")
    from ray import serve

    from shortconv.tiny.checkpoint import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("serve-lora-metrics")
    ckpt = make_tiny_checkpoint("lfm2", root / "base", seed=0)
    for seed, name in enumerate(("alpha", "gamma"), start=1):
        make_adapter("lfm2", root / name, seed=seed)
    metrics_port, http_port = free_port(), free_port()
    system = {"metrics_report_interval_ms": 1000}  # NOTE: fresh values within a second
    with private_ray("sclm-", {}, 2, _metrics_export_port=metrics_port, _system_config=system):
        prom = PromServer([f"127.0.0.1:{metrics_port}"], tmp_path_factory.mktemp("prom"))
        try:
            prom.start()
            serve.start(http_options={"host": "127.0.0.1", "port": http_port})
            args = parse_args(
                {
                    "model": str(ckpt),
                    "served_model_name": BASE,
                    "dtype": "float32",
                    "enable_lora": True,
                    "max_loras": 1,  # a second adapter in a slot evicts the first
                    "max_lora_rank": 8,
                    "lora_modules": {"alpha": str(root / "alpha")},
                    "runtime_lora_updating": True,
                }
            )
            actor = deployment_options(args)["ray_actor_options"]
            serve.run(build_app(args, num_replicas=1, ray_actor_options=actor), name=APP)
            with httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=120) as http:
                yield Stack(prom, http, root)
        finally:
            prom.stop()
            serve.shutdown()


def _series(name: str, labels: str = "") -> str:
    """`name` summed over Ray's per-process series of this app's replica."""
    return f"sum(ray_shortconv_{name}{{{SEL}{',' + labels if labels else ''}}})"


def _complete(http: httpx.Client, model: str) -> None:
    body = {"model": model, "prompt": [5, 9, 13], "max_tokens": 3, "temperature": 0.0}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text


def _post(http: httpx.Client, route: str, body: dict[str, Any]) -> httpx.Response:
    return http.post(f"/v1/{route}", json=body)


def _stats(http: httpx.Client) -> dict[str, Any]:
    r = http.get("/v1/internal/stats")
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_lora_metrics_follow_load_requests_refusal_and_unload(stack: Stack) -> None:
    prom, http = stack.prom, stack.http
    # From the replica's start: the YAML adapter resident and loaded once, nothing else.
    prom.wait_value(_series("lora_adapters_resident"), lambda v: v == 1, timeout_s=60)
    prom.wait_value(_series("lora_loads_total"), lambda v: v == 1)
    prom.wait_value(_series("lora_requests_total", 'lora="alpha"'), lambda v: v == 0)
    prom.wait_value(_series("lora_load_refusals_total", 'reason="files"'), lambda v: v == 0)

    load = {"lora_name": "gamma", "lora_path": str(stack.root / "gamma")}
    assert _post(http, "load_lora_adapter", load).status_code == 200
    prom.wait_value(_series("lora_loads_total"), lambda v: v == 2)
    prom.wait_value(_series("lora_evictions_total"), lambda v: v == 1)  # one slot: alpha out

    for model in ("gamma", "gamma", BASE):
        _complete(http, model)
    prom.wait_value(_series("lora_requests_total", 'lora="gamma"'), lambda v: v == 2)
    prom.wait_value(_series("lora_requests_total", 'lora=""'), lambda v: v == 1)

    bad = {"lora_name": "broken", "lora_path": str(stack.root / "missing")}
    assert _post(http, "load_lora_adapter", bad).status_code == 400
    prom.wait_value(_series("lora_load_refusals_total", 'reason="files"'), lambda v: v == 1)

    assert _post(http, "unload_lora_adapter", {"lora_name": "gamma"}).status_code == 200
    prom.wait_value(_series("lora_unloads_total"), lambda v: v == 1)
    prom.wait_value(_series("lora_adapters_resident"), lambda v: v == 0)
    prom.wait_value(_series("lora_requests_total", 'lora="gamma"'), lambda v: v == 2)

    stats = _stats(http)
    assert stats["lora_adapters_resident"] == 0
    assert (stats["lora_loads"], stats["lora_unloads"], stats["lora_evictions"]) == (2, 1, 1)
    assert stats["lora_requests"] == {"": 1, "alpha": 0, "gamma": 2}
    assert stats["lora_load_refusals"]["files"] == 1
