"""Engine metrics: a per-step recorder and a prometheus_client exporter (definitions:
shortconv.metrics.defs).

vLLM's names with a `shortconv_` prefix (Ray's export port adds its `ray_` namespace). The engine
calls `MetricsRecorder` on its thread: O(1) bookkeeping per request and token, one push to the
sink per step (gauges set, counters as deltas of the cumulative EngineStats/GraphStats, the
step's histogram samples), so a sink (Ray's: deployments.serve.metrics_sink) is never called per
token. No Ray import here: `serve_metrics` exports a plain `LLM` over HTTP. Docs: docs/metrics.md.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from shortconv.engine.outputs import FinishReason
from shortconv.metrics.defs import (
    BY_NAME,
    METRICS,
    Labels,
    MetricDef,
    initial_series,
    read_source,
)

if TYPE_CHECKING:
    from shortconv.engine.outputs import RequestOutput
    from shortconv.engine.plan import StepPlan
    from shortconv.engine.stats import EngineStats, GraphStats

_TTFT, _ITL, _E2E, _STEP = METRICS[-4:]  # the histograms, in table order
_ACCEPTED_LENGTH = BY_NAME["shortconv_spec_decode_accepted_length"]


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


@dataclass
class _Timing:
    """One live request's clock: its arrival, its forks not yet ended, each fork's last token."""

    arrival: float
    open: int
    started: bool = False
    last: dict[int, float] = field(default_factory=dict)


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
        self._live: dict[str, _Timing] = {}
        self._ttft: list[float] = []
        self._itl: list[float] = []
        self._e2e: list[float] = []
        self._prev: dict[tuple[str, tuple], float] = {}
        self._prev_lengths: tuple[int, ...] = ()
        positions = tuple(initial.spec_decode_num_accepted_tokens_per_pos)
        for metric, labels in initial_series(self.pools, positions):
            sink.create(metric, labels)
            if metric.kind == "counter":
                self._prev[(metric.name, tuple(labels.items()))] = 0
        self.record(initial)

    def request_added(self, request_id: str, n: int = 1) -> None:  # O(1), no sink call
        self._live[request_id] = _Timing(self._clock(), n)

    def request_dropped(self, request_id: str) -> None:
        self._live.pop(request_id, None)

    def token(
        self, request_id: str, index: int, now: float, finished: bool, normal: bool = True
    ) -> None:
        """Fork `index`'s new token at `now`; `normal` marks a stop/length finish. TTFT is the
        request's first token (of any fork), ITL each fork's own gaps, e2e the request's last
        fork finishing normally (as vLLM counts a request with n > 1)."""
        timing = self._live.get(request_id)
        if timing is None:
            return
        last = timing.last.pop(index, None)
        if last is not None:
            self._itl.append(now - last)
        elif not timing.started:
            self._ttft.append(now - timing.arrival)
            timing.started = True
        if not finished:
            timing.last[index] = now
        elif self._fork_ended(request_id, timing) and normal:
            self._e2e.append(now - timing.arrival)

    def _fork_ended(self, request_id: str, timing: _Timing) -> bool:
        """One fork ended (finished or failed); True when it was the request's last."""
        timing.open -= 1
        if timing.open > 0:
            return False
        del self._live[request_id]
        return True

    def step_done(
        self, stats: EngineStats, plan: StepPlan, outputs: Sequence[RequestOutput], seconds: float
    ) -> None:
        """The engine's hook: one step's outputs (one token each, or a failure) and timing."""
        now = self._clock()
        for out in outputs:
            if out.error is not None:  # the step failed: no token was produced
                timing = self._live.get(out.request_id)
                if timing is not None:
                    timing.last.pop(out.index, None)
                    self._fork_ended(out.request_id, timing)
            else:
                normal = out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
                self.token(out.request_id, out.index, now, out.finished, normal)
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
                    if (m.name, labels) not in self._prev:  # a label value new since start-up
                        self.sink.create(m, dict(labels))  # (a LoRA adapter's name) at 0
                    delta = total - self._prev.get((m.name, labels), 0)
                    self._prev[(m.name, labels)] = total
                    if delta > 0:  # NOTE: a smaller total (its source restarted) only rebases
                        self.sink.inc(m, dict(labels), delta)
        for m, samples in ((_TTFT, self._ttft), (_ITL, self._itl), (_E2E, self._e2e)):
            if samples:
                self.sink.observe(m, {}, tuple(samples))
                samples.clear()
        self._observe_accepted_lengths(stats.spec_decode_accepted_lengths)

    def _observe_accepted_lengths(self, counts: tuple[int, ...]) -> None:
        """The verify rows since the last push, one sample each, from the cumulative
        counts by accepted length (the engine keeps counts, not a list of rows)."""
        prev = self._prev_lengths
        if len(prev) != len(counts):  # first push, or its source restarted: rebase
            prev = (0,) * len(counts) if not prev else counts
        new = [
            float(n)
            for n, (c, p) in enumerate(zip(counts, prev, strict=True))
            for _ in range(c - p)
        ]
        self._prev_lengths = counts
        if new:
            self.sink.observe(_ACCEPTED_LENGTH, {}, tuple(new))


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
            m.name: kinds[m.kind](
                m.name,
                m.help,
                m.labels,
                registry=self.registry,
                **({"buckets": m.buckets} if m.buckets else {}),
            )
            for m in METRICS
        }

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
