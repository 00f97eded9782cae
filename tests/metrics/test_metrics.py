"""MetricsRecorder on fake snapshots (deltas, start-up zeros, labels, timings), the docs table,
and a standalone LLM whose prometheus_client exporter is fetched over HTTP and linted by
promtool."""

from __future__ import annotations

import re
import shutil
import subprocess
import urllib.request
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from shortconv.engine.stats import EngineStats, GraphStats
from shortconv.execution import graph_runner
from shortconv.metrics.defs import (
    BY_NAME,
    FALLBACK_REASONS,
    METRICS,
    REPLAY_FAILURE_REASONS,
    Labels,
    MetricDef,
)
from shortconv.metrics.recorder import (
    BaseMetricsSink,
    MetricsRecorder,
    PrometheusClientSink,
    serve_metrics,
    step_phase,
)
from shortconv.tiny.checkpoint import make_tiny_checkpoint

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
IDLE = EngineStats(("conv",), 0, 8, 0, 16, 0, 0, 0, 0, 0, 0, 0, 0, 0)


@pytest.fixture(scope="module")
def tiny_lfm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint("lfm2", tmp_path_factory.mktemp("lfm2"), seed=1)


class FakeSink(BaseMetricsSink):
    """Keeps every call: series values by (name, labels) and the calls themselves."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, frozenset], float] = {}
        self.samples: dict[tuple[str, frozenset], list[float]] = defaultdict(list)
        self.incs: list[tuple[str, dict[str, str], float]] = []

    def create(self, metric: MetricDef, labels: Labels) -> None:
        key = (metric.name, frozenset(labels.items()))
        assert key not in self.values, f"{key} created twice"
        self.values[key] = 0.0

    def inc(self, metric: MetricDef, labels: Labels, value: float) -> None:
        assert value > 0, "Ray's Counter.inc refuses values <= 0"
        key = (metric.name, frozenset(labels.items()))
        self.values[key] = self.values.get(key, 0.0) + value
        self.incs.append((metric.name, dict(labels), value))

    def set(self, metric: MetricDef, labels: Labels, value: float) -> None:
        self.values[(metric.name, frozenset(labels.items()))] = value

    def observe(self, metric: MetricDef, labels: Labels, values: list[float]) -> None:
        self.samples[(metric.name, frozenset(labels.items()))].extend(values)

    def get(self, name: str, **labels: str) -> float:
        return self.values[(name, frozenset(labels.items()))]


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _graphs(replays: int = 0, **kw: dict[str, int]) -> GraphStats:
    failures = dict.fromkeys(REPLAY_FAILURE_REASONS, 0) | kw.get("failures", {})
    fallbacks = dict.fromkeys(FALLBACK_REASONS, 0) | kw.get("fallbacks", {})
    return GraphStats(3, 0.1, replays, failures, fallbacks)


def _plan(*rows: tuple[int, int]) -> SimpleNamespace:
    """A plan-like object: rows of (num_tokens, start_pos)."""
    seqs = [SimpleNamespace(num_tokens=n, start_pos=p) for n, p in rows]
    return SimpleNamespace(seqs=seqs)


def _out(
    rid: str, reason: str | None = None, error: str | None = None, index: int = 0
) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=rid, index=index, finish_reason=reason, error=error, finished=reason is not None
    )


def test_graph_label_values_match_the_graph_runner() -> None:
    assert REPLAY_FAILURE_REASONS == graph_runner.FAILURE_PHASES
    assert FALLBACK_REASONS == graph_runner.FALLBACK_REASONS


def test_names_follow_the_conventions() -> None:
    for m in METRICS:
        assert re.fullmatch(r"shortconv_[a-z0-9_]+", m.name), m.name
        if m.kind == "counter":  # Ray appends `_total` to a counter name that lacks it
            assert m.name.endswith("_total"), m.name
        elif m.name.endswith("_total"):  # the documented name of a gauge; see ACCEPTED_LINT
            assert m.name == "shortconv_state_slots_total", m.name
        assert (m.kind == "histogram") == bool(m.buckets), m.name
        if m.name != "shortconv_spec_decode_accepted_length":  # a count of tokens, not a time
            assert (m.kind == "histogram") == m.name.endswith("_seconds"), m.name
        assert list(m.buckets) == sorted(set(m.buckets)), m.name
        assert m.kind == "histogram" or m.source.split(".")[0] in ("engine", "graphs"), m.name


@pytest.mark.parametrize("pools", [("conv",), ("conv", "prev_state")])
def test_every_series_exists_at_start(pools: tuple[str, ...]) -> None:
    sink = FakeSink()
    MetricsRecorder(sink, replace(IDLE, pools=pools))
    for pool in pools:
        assert sink.get("shortconv_state_slots_used", pool=pool) == 0
        assert sink.get("shortconv_state_slots_total", pool=pool) == 8
    pool_series = {k for k in sink.values if k[0] == "shortconv_state_slots_used"}
    assert pool_series == {("shortconv_state_slots_used", frozenset({("pool", p)})) for p in pools}
    for reason in REPLAY_FAILURE_REASONS:
        assert sink.get("shortconv_graph_replay_failures_total", reason=reason) == 0
    for reason in FALLBACK_REASONS:
        assert sink.get("shortconv_graph_eager_fallbacks_total", reason=reason) == 0
    for reason in ("stop", "length", "abort", "error"):
        assert sink.get("shortconv_request_success_total", finished_reason=reason) == 0
    for phase in ("decode", "extend", "mixed"):
        assert sink.get("shortconv_step_duration_seconds", phase=phase) == 0
    unlabelled = [m.name for m in METRICS if not m.labels]
    assert all(sink.get(name) == 0 for name in unlabelled)
    assert sink.incs == [] and not sink.samples


def test_counters_are_recorded_as_deltas() -> None:
    sink, graphs = FakeSink(), [None]
    rec = MetricsRecorder(sink, IDLE, graph_stats=lambda: graphs[0])
    busy = replace(
        IDLE,
        slots_used=3,
        kv_pages_used=4,
        num_running=2,
        num_waiting=1,
        session_hits=2,
        generation_tokens_total=10,
        finished_by_reason={"stop": 1},
        kv_pages_used_by_kind={"full": 4, "sliding": 3},
    )
    rec.record(busy)
    assert sink.get("shortconv_kv_pages_used", kind="sliding") == 3
    assert sink.get("shortconv_state_slots_used", pool="conv") == 3
    assert sink.get("shortconv_kv_cache_usage_perc") == 0.25
    assert sink.get("shortconv_num_requests_waiting") == 1
    graphs[0] = _graphs(5, failures={"replay": 1}, fallbacks={"replay_error": 1, "no_bucket": 2})
    rec.record(replace(busy, session_hits=5, finished_by_reason={"stop": 1, "unknown": 1}))
    assert sink.incs == [
        ("shortconv_session_cache_hits_total", {}, 2),
        ("shortconv_generation_tokens_total", {}, 10),
        ("shortconv_request_success_total", {"finished_reason": "stop"}, 1),
        ("shortconv_graph_replays_total", {}, 5),
        ("shortconv_graph_replay_failures_total", {"reason": "replay"}, 1),
        ("shortconv_graph_eager_fallbacks_total", {"reason": "no_bucket"}, 2),
        ("shortconv_graph_eager_fallbacks_total", {"reason": "replay_error"}, 1),
        ("shortconv_session_cache_hits_total", {}, 3),
        ("shortconv_request_success_total", {"finished_reason": "unknown"}, 1),
    ]
    n = len(sink.incs)
    rec.record(replace(busy, session_hits=5, finished_by_reason={"stop": 1, "unknown": 1}))
    graphs[0] = None  # the runner went away (shut down): counters keep their last value
    rec.record(replace(busy, session_hits=1))  # a smaller total rebases, never goes negative
    assert len(sink.incs) == n
    assert sink.get("shortconv_graph_replays_total") == 5
    rec.record(replace(busy, session_hits=4))
    assert sink.get("shortconv_session_cache_hits_total") == 8


def test_request_timings_and_step_phases() -> None:
    sink, clock = FakeSink(), Clock()
    rec = MetricsRecorder(sink, IDLE, clock=clock)
    for rid in ("a", "b", "c"):
        rec.request_added(rid)
    clock.t = 0.5
    rec.step_done(IDLE, _plan((3, 0), (2, 0), (4, 0)), [_out("a"), _out("b"), _out("c")], 0.4)
    clock.t = 0.75
    rec.step_done(
        IDLE,
        _plan((1, 3), (1, 2), (1, 4)),
        [_out("a"), _out("b", "stop"), _out("c", error="boom")],
        0.2,
    )
    rec.request_added("d")
    clock.t = 1.5
    rec.step_done(IDLE, _plan((1, 4), (5, 0)), [_out("a", "length"), _out("d", "abort")], 0.1)
    ttft = sink.samples[("shortconv_time_to_first_token_seconds", frozenset())]
    itl = sink.samples[("shortconv_inter_token_latency_seconds", frozenset())]
    e2e = sink.samples[("shortconv_e2e_request_latency_seconds", frozenset())]
    assert ttft == [0.5, 0.5, 0.5, 0.75]  # d's first token was also its (aborted) last
    assert itl == [0.25, 0.25, 0.75]  # c failed: no token, no interval
    assert e2e == [0.75, 1.5]  # b and a; d was aborted
    steps = {k[1]: v for k, v in sink.samples.items() if k[0] == "shortconv_step_duration_seconds"}
    assert steps == {
        frozenset({("phase", "extend")}): [0.4],
        frozenset({("phase", "decode")}): [0.2],
        frozenset({("phase", "mixed")}): [0.1],
    }
    assert rec._live == {}  # nothing leaks per request


def test_forks_time_their_own_gaps_and_the_request_once() -> None:
    """n = 3: the forks' first tokens come in one step (one prefill); TTFT is counted once, ITL
    per fork (never the 0 s between two forks of one step), e2e once, at the last fork's end."""
    sink, clock = FakeSink(), Clock()
    rec = MetricsRecorder(sink, IDLE, clock=clock)
    rec.request_added("f", n=3)
    clock.t = 0.5
    rec.step_done(IDLE, _plan((4, 0)), [_out("f", index=i) for i in range(3)], 0.4)
    clock.t = 0.75  # fork 1 stops; fork 2 fails (a grammar fault): no token, no interval
    outs = [_out("f", index=0), _out("f", "stop", index=1), _out("f", error="x", index=2)]
    rec.step_done(IDLE, _plan((1, 4), (1, 4), (1, 4)), outs, 0.2)
    assert rec._live["f"].open == 1
    clock.t = 1.0
    rec.step_done(IDLE, _plan((1, 5)), [_out("f", "length", index=0)], 0.2)
    ttft = sink.samples[("shortconv_time_to_first_token_seconds", frozenset())]
    itl = sink.samples[("shortconv_inter_token_latency_seconds", frozenset())]
    e2e = sink.samples[("shortconv_e2e_request_latency_seconds", frozenset())]
    assert (ttft, itl, e2e) == ([0.5], [0.25, 0.25, 0.25], [1.0])
    assert rec._live == {}


def test_dropped_request_leaves_no_state() -> None:
    rec = MetricsRecorder(FakeSink(), IDLE, clock=Clock())
    rec.request_added("x", n=2)
    rec.token("x", 0, 0.1, finished=False)
    rec.request_dropped("x")
    assert rec._live == {}


def test_step_phase_matches_plan_is_decode() -> None:
    assert step_phase(_plan((1, 5))) == "decode"
    assert step_phase(_plan((1, 0))) == "extend"  # a one-token prompt has no state to resume
    assert step_phase(_plan((1, 5), (7, 0))) == "mixed"


def markdown_table() -> str:
    """docs/metrics.md's table, generated from METRICS (the test below prints it when stale)."""
    rows = ["| Name | Type | Labels | Help |", "|---|---|---|---|"]
    for m in METRICS:
        labels = ", ".join(f"`{lb}`" for lb in m.labels) or "-"
        if m.label_values:
            labels += " (" + " \\| ".join(m.label_values) + ")"
        elif m.labels == ("pool",):
            labels += " (conv \\| prev_state, ZAYA1 only)"
        elif m.labels == ("position",):
            labels += " (0 .. k - 1)"
        elif m.labels == ("lora",):
            labels += ' (adapter name; "" = the base)'
        rows.append(f"| `{m.name}` | {m.kind} | {labels} | {m.help} |")
    return "\n".join(rows) + "\n"


def test_docs_list_exactly_the_defined_metrics() -> None:
    text = DOCS.read_text()
    assert markdown_table() in text, (
        "docs/metrics.md is out of date; paste this table:\n" + markdown_table()
    )
    documented = set(re.findall(r"^\| `(shortconv_[a-z0-9_]+)`", text, flags=re.M))
    assert documented == set(BY_NAME)


# promtool's naming lint flags a gauge ending in `_total`; docs/metrics.md, the Helm dashboard and
# its test all use this name, so it is the one finding accepted (a rename breaks dashboards).
ACCEPTED_LINT = {'shortconv_state_slots_total non-counter metrics should not have "_total" suffix'}


def _promtool(exposition: bytes) -> None:
    """promtool exits 1 on a parse error and 3 on lint findings (printed one per line)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian: apt-get install -y prometheus)")
    res = subprocess.run([promtool, "check", "metrics"], input=exposition, capture_output=True)
    out = (res.stdout + res.stderr).decode()
    findings = {line.strip() for line in out.splitlines() if line.strip()}
    assert res.returncode in (0, 3) and findings <= ACCEPTED_LINT, out


def test_prometheus_client_sink_exposition_passes_promtool() -> None:
    import prometheus_client as pc

    sink = PrometheusClientSink()
    MetricsRecorder(sink, replace(IDLE, pools=("conv", "prev_state")))
    body = pc.generate_latest(sink.registry)
    assert b'shortconv_state_slots_used{pool="prev_state"} 0.0' in body
    assert b'shortconv_step_duration_seconds_count{phase="mixed"} 0.0' in body
    _promtool(body)


def test_standalone_llm_exports_over_http(tiny_lfm2: Path) -> None:
    from shortconv.llm import LLM
    from shortconv.sampling.sampling_params import SamplingParams

    llm = LLM(
        tiny_lfm2,
        dtype="float32",
        max_num_seqs=4,
        enable_graphs=True,
        graph_batch_sizes=(1, 2, 4),
        graph_context_sizes=(32,),
    )
    server = serve_metrics(llm)  # port 0: a free port
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        llm.generate(prompt_token_ids=[[5, 9, 13], [7, 8], [1, 2, 3, 4]], sampling_params=params)
        with urllib.request.urlopen(server.url, timeout=10) as resp:
            body = resp.read()
    finally:
        server.close()
        llm.shutdown()
    text = body.decode()
    for m in METRICS:
        assert f"# TYPE {m.name} {m.kind}" in text, m.name
    assert "shortconv_time_to_first_token_seconds_count 3.0" in text
    assert "shortconv_e2e_request_latency_seconds_count 3.0" in text
    assert "shortconv_inter_token_latency_seconds_count 9.0" in text
    assert 'shortconv_request_success_total{finished_reason="length"} 3.0' in text
    assert "shortconv_generation_tokens_total 12.0" in text
    assert "shortconv_prompt_tokens_total 9.0" in text
    # Every slot still used after the run is a prefix-cache checkpoint (3 prompts: 3 ends of
    # prompt and 3 ends of generation), and the cache's lookups were counted.
    assert 'shortconv_state_slots_used{pool="conv"} 6.0' in text
    assert "shortconv_prefix_cache_checkpoints 6.0" in text
    assert "shortconv_prefix_cache_queries_total 9.0" in text
    assert re.search(r"^shortconv_prefix_cache_checkpoint_bytes [1-9]", text, flags=re.M)
    assert re.search(r"^shortconv_graph_replays_total [1-9]", text, flags=re.M)
    assert llm.engine.metrics is None  # close() detached the recorder
    _promtool(body)
