"""RayMetricsSink: the engine's metrics through Ray's metrics export port.

Built on `ray.serve.metrics`, which tags every series with application/deployment/replica inside
a Serve replica (and adds nothing in a plain actor). Ray exports each under its own `ray_`
namespace: `shortconv_graph_replays_total` is scraped as `ray_shortconv_graph_replays_total`.

Start-up zeros: Ray 2.60's `Counter.inc(0)` raises, so `record_zero` records the 0 through the
metric's record path (`_record`, where `inc` and `set` both end), which exports the series at 0.
Histograms are the exception: a recorded 0 is an observation (count 1), so a histogram series
appears with its first real sample. Ray's agent also rebuilds histogram sums from bucket
midpoints, so `_sum` here is approximate while `_count` and the buckets are exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ray.serve import metrics as serve_metrics

from shortconv.metrics.defs import METRICS, Labels, MetricDef
from shortconv.metrics.recorder import (
    BaseMetricsSink,
    MetricsRecorder,
    MetricsSource,
    attach_metrics,
)

RayMetric = serve_metrics.Counter | serve_metrics.Gauge | serve_metrics.Histogram


def record_zero(metric: RayMetric, tags: Labels) -> None:
    """Export a counter or gauge series at 0 before its first event (see the module docstring)."""
    if isinstance(metric, serve_metrics.Histogram):
        return  # NOTE: any record would count as an observation
    metric._record(0, tags=dict(tags))  # inc(0) raises; _record is the path inc ends in


def _make(m: MetricDef) -> RayMetric:
    if m.kind == "counter":
        return serve_metrics.Counter(m.name, m.help, tag_keys=m.labels)
    if m.kind == "gauge":
        return serve_metrics.Gauge(m.name, m.help, tag_keys=m.labels)
    return serve_metrics.Histogram(m.name, m.help, boundaries=list(m.buckets), tag_keys=m.labels)


class RayMetricsSink(BaseMetricsSink):
    """One Ray metric object per definition; the recorder calls it once per series per step."""

    def __init__(self) -> None:
        self._metrics: dict[str, Any] = {m.name: _make(m) for m in METRICS}

    def create(self, metric: MetricDef, labels: Labels) -> None:
        record_zero(self._metrics[metric.name], labels)

    def inc(self, metric: MetricDef, labels: Labels, value: float) -> None:
        self._metrics[metric.name].inc(value, tags=dict(labels))

    def set(self, metric: MetricDef, labels: Labels, value: float) -> None:
        self._metrics[metric.name].set(value, tags=dict(labels))

    def observe(self, metric: MetricDef, labels: Labels, values: Sequence[float]) -> None:
        # NOTE: Ray has no batch observe; these are in-process records, aggregated into buckets by
        # the core worker before export, once per step from the engine thread.
        hist, tags = self._metrics[metric.name], dict(labels)
        for v in values:
            hist.observe(v, tags=tags)


def attach_ray_metrics(engine: MetricsSource) -> MetricsRecorder:
    """Report `engine`'s metrics through Ray from now on."""
    return attach_metrics(engine, RayMetricsSink())
