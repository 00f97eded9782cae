"""The LoRA metrics follow what the adapters do: the resident gauge, loads, unloads, LRU
evictions, refusals by reason and requests by adapter name, read from the standalone
exporter over HTTP (prometheus_client's exposition, as Prometheus scrapes it)."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from lora_adapters import make_adapter
from prometheus_client.parser import text_string_to_metric_families

from shortconv import LLM, SamplingParams
from shortconv.lora.adapter import LoraError
from shortconv.metrics.defs import LORA_LOAD_REFUSALS
from shortconv.metrics.recorder import MetricsServer, serve_metrics

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


def _scrape(server: MetricsServer) -> dict[tuple[str, str], float]:
    """Every shortconv_lora_* sample: (name, its one label's value or "") -> value."""
    with urllib.request.urlopen(server.url, timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("shortconv_lora_") and not s.name.endswith("_created"):
                out[(s.name, next(iter(s.labels.values()), ""))] = s.value
    return out


def _run(llm: LLM, name: str | None) -> None:
    llm.engine.add_request([5, 9, 13], GREEDY, lora_name=name)
    while llm.engine.has_unfinished():
        llm.engine.step()


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LLM, MetricsServer, Path]]:
    from shortconv.tiny.checkpoint import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("lora-metrics")
    ckpt = make_tiny_checkpoint("lfm2", root / "base", seed=0)
    for i, rank in enumerate((4, 4, 16)):
        make_adapter("lfm2", root / f"a{i}", seed=i, rank=rank)
    llm = LLM(
        ckpt,
        dtype="float32",
        enable_lora=True,
        max_loras=1,
        max_lora_rank=8,
        lora_modules={"a0": str(root / "a0")},
    )
    server = serve_metrics(llm)
    yield llm, server, root
    server.close()
    llm.shutdown()


def test_lora_metrics_follow_loads_requests_evictions_and_unloads(
    env: tuple[LLM, MetricsServer, Path],
) -> None:
    llm, server, root = env
    m = _scrape(server)
    assert m[("shortconv_lora_adapters_resident", "")] == 1
    assert m[("shortconv_lora_loads_total", "")] == 1  # the YAML's / lora_modules' adapter
    assert m[("shortconv_lora_requests_total", "")] == 0  # the base, from start-up
    assert m[("shortconv_lora_requests_total", "a0")] == 0
    assert all(m[("shortconv_lora_load_refusals_total", r)] == 0 for r in LORA_LOAD_REFUSALS)

    llm.engine.load_lora("a1", str(root / "a1"))  # one slot: a0 is evicted for it
    m = _scrape(server)
    assert m[("shortconv_lora_loads_total", "")] == 2
    assert m[("shortconv_lora_evictions_total", "")] == 1
    assert m[("shortconv_lora_requests_total", "a1")] == 0  # its series exists from its load
    assert m[("shortconv_lora_adapters_resident", "")] == 1

    _run(llm, "a0")  # written back, a1 evicted
    _run(llm, "a0")
    _run(llm, None)
    m = _scrape(server)
    assert m[("shortconv_lora_requests_total", "a0")] == 2
    assert m[("shortconv_lora_requests_total", "")] == 1
    assert m[("shortconv_lora_requests_total", "a1")] == 0
    assert m[("shortconv_lora_evictions_total", "")] == 2
    # GREEDY's 3 tokens a request, under the adapter that generated them
    assert m[("shortconv_lora_generation_tokens_total", "a0")] == 6
    assert m[("shortconv_lora_generation_tokens_total", "")] == 3
    assert m[("shortconv_lora_generation_tokens_total", "a1")] == 0

    llm.engine.unload_lora("a0")
    m = _scrape(server)
    assert m[("shortconv_lora_unloads_total", "")] == 1
    assert m[("shortconv_lora_adapters_resident", "")] == 0
    assert m[("shortconv_lora_requests_total", "a0")] == 2  # a counter outlives the unload


@pytest.mark.parametrize(
    ("reason", "load"),
    [
        ("duplicate", lambda llm, root: llm.engine.load_lora("a1", str(root / "a1"))),
        ("rank", lambda llm, root: llm.engine.load_lora("big", str(root / "a2"))),
        ("files", lambda llm, root: llm.engine.load_lora("none", str(root / "missing"))),
    ],
)
def test_refusals_are_counted_by_reason(
    env: tuple[LLM, MetricsServer, Path], reason: str, load: object
) -> None:
    llm, server, root = env
    before = _scrape(server)
    with pytest.raises(LoraError):
        load(llm, root)  # type: ignore[operator]
    after = _scrape(server)
    for r in LORA_LOAD_REFUSALS:
        key = ("shortconv_lora_load_refusals_total", r)
        assert after[key] - before[key] == (1 if r == reason else 0), r
    assert after[("shortconv_lora_loads_total", "")] == before[("shortconv_lora_loads_total", "")]
