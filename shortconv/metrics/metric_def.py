"""One metric's definition, and the constructor every table of them uses (shortconv.metrics.defs,
lora_metrics). No torch: Ray's sink and the docs read these too."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["counter", "gauge", "histogram"]
Labels = Mapping[str, str]


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


def metric(kind: Kind, name: str, source: str, help: str, label: str = "", **kw: Any) -> MetricDef:
    """`shortconv_<name>`, with at most one label (`values`: its values from start-up)."""
    values = kw.pop("values", ())
    labels = (label,) if label else ()
    return MetricDef(f"shortconv_{name}", kind, help, labels, source, label_values=values, **kw)
