"""Metrics across the core-process boundary: the core's recorder writes to a `RelaySink`,
whose updates ride on each step's message; the replica replays them into Ray's sink.

Why: Ray's metric export lives in the replica (a Ray worker); the core process is a plain
child with no Ray runtime. The recorder already batches one update per series per step, so
relaying its calls costs one small list per step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from deployments.frontend.engine.core_messages import MetricOp
from shortconv.metrics.defs import METRICS, Labels, MetricDef
from shortconv.metrics.recorder import BaseMetricsSink

_BY_NAME = {m.name: m for m in METRICS}


class RelaySink(BaseMetricsSink):
    """Keeps the recorder's calls until `take()` (the core's loop, once per message)."""

    def __init__(self) -> None:
        self._ops: list[MetricOp] = []

    def create(self, metric: MetricDef, labels: Labels) -> None:
        self._ops.append(("create", metric.name, dict(labels), None))

    def inc(self, metric: MetricDef, labels: Labels, value: float) -> None:
        self._ops.append(("inc", metric.name, dict(labels), value))

    def set(self, metric: MetricDef, labels: Labels, value: float) -> None:
        self._ops.append(("set", metric.name, dict(labels), value))

    def observe(self, metric: MetricDef, labels: Labels, values: Sequence[float]) -> None:
        self._ops.append(("observe", metric.name, dict(labels), tuple(values)))

    @property
    def pending(self) -> bool:
        return bool(self._ops)

    def take(self) -> tuple[MetricOp, ...]:
        ops, self._ops = tuple(self._ops), []
        return ops


def replay(sink: BaseMetricsSink, ops: Iterable[MetricOp]) -> None:
    """Apply the core's updates to `sink`, in order."""
    for op, name, labels, value in ops:
        metric = _BY_NAME[name]
        if op == "create":
            sink.create(metric, labels)
        elif op == "inc":
            sink.inc(metric, labels, value)
        elif op == "set":
            sink.set(metric, labels, value)
        else:
            sink.observe(metric, labels, value)
