"""Engine metrics: the definitions, a per-step recorder and a prometheus_client exporter.

vLLM's names with a `shortconv_` prefix (Ray's export port adds its `ray_` namespace). The engine
calls `MetricsRecorder` on its thread: O(1) bookkeeping per request and token, one push to the
sink per step (gauges set, counters as deltas of the cumulative EngineStats/GraphStats, the
step's histogram samples), so a sink (Ray's: deployments.metrics_sink) is never called per token.
No Ray import here: `serve_metrics` exports a plain `LLM` over HTTP. Docs: docs/metrics.md.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from shortconv.graph_runner import GraphStats
    from shortconv.outputs import RequestOutput
    from shortconv.plan import StepPlan
    from shortconv.stats import EngineStats

Kind = Literal["counter", "gauge", "histogram"]
Labels = Mapping[str, str]

# Label values that exist from start-up. The graph reasons mirror graph_runner.FAILURE_PHASES
# and FALLBACK_REASONS (a test keeps them equal; importing them here would pull in torch).
REPLAY_FAILURE_REASONS = ("prepare", "replay")
FALLBACK_REASONS = ("no_bucket", "replay_error")
FINISHED_REASONS = ("stop", "length", "abort", "error")
STEP_PHASES = ("decode", "extend", "mixed")
_LABEL_VALUES = {"finished_reason": FINISHED_REASONS, "phase": STEP_PHASES}

# vLLM's ladders; ITL and step time get sub-10 ms buckets since a short-conv decode step is fast.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                10.0)  # fmt: skip


@dataclass(frozen=True)
class MetricDef:
    """One metric. Counters' names end in `_total`; gauges and counters are read each step from
    `source` (`engine.<EngineStats attr>` or `graphs.<GraphStats attr>`; a dict fills the label)."""

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    source: str = ""
    buckets: tuple[float, ...] = ()
    label_values: tuple[str, ...] = ()  # the one label's values that exist from start-up


def _m(kind: Kind, name: str, source: str, help: str, label: str = "", **kw: Any) -> MetricDef:
    values = kw.pop("values", _LABEL_VALUES.get(label, ()))
    labels = (label,) if label else ()
    return MetricDef(f"shortconv_{name}", kind, help, labels, source, label_values=values, **kw)


METRICS: tuple[MetricDef, ...] = (
    _m("gauge", "state_slots_used", "engine.slots_used", "State-pool slots in use (running "
       "requests + kept session checkpoints); pools share slot ids and counts.", "pool"),
    _m("gauge", "state_slots_total", "engine.slots_total", "State-pool slots requests can use "
       "(the scratch slot excluded).", "pool"),
    _m("gauge", "kv_cache_usage_perc", "engine.kv_cache_usage", "Fraction of attention "
       "KV-cache pages in use (1 = full)."),
    _m("counter", "graph_replays_total", "graphs.replays", "Decode steps run as a replay of a "
       "captured graph."),
    _m("counter", "graph_replay_failures_total", "graphs.replay_failures", "Failed graph "
       "replays (state restored), by phase: prepare (metadata refresh) or replay (the forward).",
       "reason", values=REPLAY_FAILURE_REASONS),
    _m("counter", "graph_eager_fallbacks_total", "graphs.eager_fallbacks", "Decode steps run "
       "eagerly: no_bucket (beyond the largest bucket) or replay_error (after a failed replay).",
       "reason", values=FALLBACK_REASONS),
    _m("counter", "session_cache_hits_total", "engine.session_hits", "Session turns resumed "
       "from kept state."),
    _m("counter", "session_cache_misses_total", "engine.session_misses", "Session turns that "
       "found no reusable kept state."),
    _m("counter", "session_cache_evictions_total", "engine.session_evictions", "Kept session "
       "checkpoints evicted (TTL or pressure)."),
    _m("gauge", "sessions_held", "engine.sessions_held", "Sessions whose state is kept on this "
       "engine."),
    _m("counter", "prefix_cached_tokens_total", "engine.cached_tokens_total", "Prompt tokens "
       "resumed from session state instead of prefilled."),
    _m("gauge", "num_requests_running", "engine.num_running", "Requests in the running batch."),
    _m("gauge", "num_requests_waiting", "engine.num_waiting", "Requests waiting to be scheduled."),
    _m("counter", "prompt_tokens_total", "engine.prompt_tokens_total", "Prompt tokens of "
       "requests that produced a first token."),
    _m("counter", "generation_tokens_total", "engine.generation_tokens_total", "Generated tokens."),
    _m("counter", "request_success_total", "engine.finished_by_reason", "Finished requests, by "
       "finish reason.", "finished_reason"),
    _m("histogram", "time_to_first_token_seconds", "", "Time from a request's arrival to its "
       "first token.", buckets=TTFT_BUCKETS),
    _m("histogram", "inter_token_latency_seconds", "", "Time between consecutive tokens of a "
       "request.", buckets=ITL_BUCKETS),
    _m("histogram", "e2e_request_latency_seconds", "", "Time from arrival to the last token of "
       "a request that finished normally (stop or length).", buckets=E2E_BUCKETS),
    _m("histogram", "step_duration_seconds", "", "Engine step time (schedule to emit) by phase: "
       "decode (all rows one token), extend (none), mixed.", "phase", buckets=STEP_BUCKETS),
)  # fmt: skip
BY_NAME: dict[str, MetricDef] = {m.name: m for m in METRICS}
_TTFT, _ITL, _E2E, _STEP = METRICS[-4:]  # the histograms, in table order


def initial_series(pools: Sequence[str]) -> Iterator[tuple[MetricDef, dict[str, str]]]:
    """Every series that exists from start-up (label `pool` takes the engine's pools)."""
    for m in METRICS:
        if not m.labels:
            yield m, {}
        for value in pools if m.labels == ("pool",) else m.label_values:
            yield m, {m.labels[0]: value}


def read_source(
    m: MetricDef, stats: EngineStats, graphs: GraphStats | None
) -> Iterator[tuple[tuple[tuple[str, str], ...], float]]:
    """(labels, value) pairs of a gauge or counter now; nothing while its source is absent."""
    obj = stats if m.source.startswith("engine.") else graphs
    if obj is None:  # graphs off, or held by remote TP workers: the series stay at 0
        return
    value = getattr(obj, m.source.partition(".")[2])
    if isinstance(value, dict):
        yield from ((((m.labels[0], key),), v) for key, v in value.items())
    else:  # the only label a scalar source can have is `pool`: every pool shares the value
        yield from (((("pool", p),), value) for p in stats.pools) if m.labels else [((), value)]


class BaseMetricsSink(ABC):
    """Where the recorder pushes values: `create` makes a series exist at 0 before any event;
    `observe` adds one step's samples. Called on the engine thread, once per series per step."""

    @abstractmethod
    def create(self, metric: MetricDef, labels: Labels) -> None: ...
    @abstractmethod
    def inc(self, metric: MetricDef, labels: Labels, value: float) -> None: ...
    @abstractmethod
    def set(self, metric: MetricDef, labels: Labels, value: float) -> None: ...
    @abstractmethod
    def observe(self, metric: MetricDef, labels: Labels, values: Sequence[float]) -> None: ...


def step_phase(plan: StepPlan) -> str:
    """decode: every row is one token resuming state; extend: no such row; mixed: both."""
    decode = sum(1 for s in plan.seqs if s.num_tokens == 1 and s.start_pos > 0)
    return "decode" if decode == len(plan.seqs) else "extend" if decode == 0 else "mixed"


class MetricsRecorder:
    """Engine events -> sink updates (module docstring); engine thread only. `graph_stats`
    returns the graph runner's cumulative counters, or None where there are none."""

    def __init__(
        self,
        sink: BaseMetricsSink,
        initial: EngineStats,
        graph_stats: Callable[[], GraphStats | None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.sink, self.pools, self._clock = sink, initial.pools, clock
        self._graph_stats = graph_stats or (lambda: None)
        self._arrival: dict[str, float] = {}
        self._last_token: dict[str, float] = {}
        self._ttft: list[float] = []
        self._itl: list[float] = []
        self._e2e: list[float] = []
        self._prev: dict[tuple[str, tuple], float] = {}
        for metric, labels in initial_series(self.pools):
            sink.create(metric, labels)
        self.record(initial)

    def request_added(self, request_id: str) -> None:  # O(1), no sink call (so is `token`)
        self._arrival[request_id] = self._clock()

    def request_dropped(self, request_id: str) -> None:
        self._arrival.pop(request_id, None)
        self._last_token.pop(request_id, None)

    def token(self, request_id: str, now: float, finished: bool, normal: bool = True) -> None:
        """One new token at `now`; `normal` marks a stop/length finish (counted in e2e)."""
        last = self._last_token.get(request_id)
        arrival = self._arrival.get(request_id)
        if last is not None:
            self._itl.append(now - last)
        elif arrival is not None:
            self._ttft.append(now - arrival)
        if finished:
            if normal and arrival is not None:
                self._e2e.append(now - arrival)
            self.request_dropped(request_id)
        else:
            self._last_token[request_id] = now

    def step_done(
        self, stats: EngineStats, plan: StepPlan, outputs: Sequence[RequestOutput], seconds: float
    ) -> None:
        """The engine's hook: one step's outputs (one token each, or a failure) and timing."""
        now = self._clock()
        for out in outputs:
            if out.error is not None:  # the step failed: no token was produced
                self.request_dropped(out.request_id)
            else:
                normal = out.finish_reason in ("stop", "length")
                self.token(out.request_id, now, out.finished, normal)
        self.sink.observe(_STEP, {"phase": step_phase(plan)}, (seconds,))
        self.record(stats)

    def record(self, stats: EngineStats) -> None:
        """Refresh gauges, push counter deltas and pending samples (also usable when idle)."""
        graphs = self._graph_stats()
        for m in METRICS:
            if m.kind == "gauge":
                for labels, value in read_source(m, stats, graphs):
                    self.sink.set(m, dict(labels), value)
            elif m.kind == "counter":
                for labels, total in read_source(m, stats, graphs):
                    delta = total - self._prev.get((m.name, labels), 0)
                    self._prev[(m.name, labels)] = total
                    if delta > 0:  # NOTE: a smaller total (its source restarted) only rebases
                        self.sink.inc(m, dict(labels), delta)
        for m, samples in ((_TTFT, self._ttft), (_ITL, self._itl), (_E2E, self._e2e)):
            if samples:
                self.sink.observe(m, {}, tuple(samples))
                samples.clear()


class MetricsSource(Protocol):
    """What the recorder reads: the engine's stats snapshots (no engine import here, so the
    engine can import this module). `metrics` is where the engine looks for its recorder."""

    metrics: MetricsRecorder | None

    def stats(self) -> EngineStats: ...
    def graph_stats(self) -> GraphStats | None: ...


def attach_metrics(engine: MetricsSource, sink: BaseMetricsSink) -> MetricsRecorder:
    """Create every series in `sink` and have `engine` report to it from now on."""
    recorder = MetricsRecorder(sink, engine.stats(), engine.graph_stats)
    engine.metrics = recorder
    return recorder


class PrometheusClientSink(BaseMetricsSink):
    """prometheus_client metrics in a registry of their own (several engines per process)."""

    def __init__(self, registry: Any = None) -> None:
        import prometheus_client as pc

        self.registry = registry if registry is not None else pc.CollectorRegistry()
        kinds = {"counter": pc.Counter, "gauge": pc.Gauge, "histogram": pc.Histogram}
        self._metrics: dict[str, Any] = {
            m.name: kinds[m.kind](m.name, m.help, m.labels, registry=self.registry,
                                  **({"buckets": m.buckets} if m.buckets else {}))
            for m in METRICS
        }  # fmt: skip

    def _series(self, metric: MetricDef, labels: Labels) -> Any:
        m = self._metrics[metric.name]
        return m.labels(**labels) if metric.labels else m

    def create(self, metric: MetricDef, labels: Labels) -> None:
        self._series(metric, labels)  # a labelled child starts at 0; an unlabelled one exists

    def inc(self, metric: MetricDef, labels: Labels, value: float) -> None:
        self._series(metric, labels).inc(value)

    def set(self, metric: MetricDef, labels: Labels, value: float) -> None:
        self._series(metric, labels).set(value)

    def observe(self, metric: MetricDef, labels: Labels, values: Sequence[float]) -> None:
        series = self._series(metric, labels)
        for v in values:
            series.observe(v)


class MetricsServer:
    """A running standalone exporter (GET `url`); `close()` stops it and detaches the engine."""

    def __init__(self, engine: MetricsSource, port: int, host: str) -> None:
        from prometheus_client import start_http_server

        self.engine, self.host, self.sink = engine, host, PrometheusClientSink()
        self.recorder = attach_metrics(engine, self.sink)
        self._httpd, _ = start_http_server(port, addr=host, registry=self.sink.registry)
        self.port: int = self._httpd.server_address[1]
        self.url = f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        if self.engine.metrics is self.recorder:
            self.engine.metrics = None


def serve_metrics(target: Any, port: int = 0, host: str = "127.0.0.1") -> MetricsServer:
    """Export an `LLM`'s (or `LLMEngine`'s) metrics on host:port (0: a free port; see .port)."""
    return MetricsServer(getattr(target, "engine", target), port, host)
