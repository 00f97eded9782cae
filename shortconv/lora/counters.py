"""What the adapters did since start-up, for the metrics (`metrics.defs`, `lora_*`) and
`/v1/internal/stats`. Mutated on the engine thread only; `EngineStats` takes copies."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from shortconv.metrics.defs import LORA_LOAD_REFUSALS

BASE = ""  # the `lora` label of requests without an adapter
OTHER = "_other"  # the `lora` label once MAX_NAMED names have their own series
# NOTE: runtime loads can bring any number of names over a replica's life; each name's
# counter must outlive its unload (a counter never goes down), so the label set is capped.
MAX_NAMED = 64


@dataclass
class LoraCounters:
    """Adapter loads, unloads, LRU evictions and load refusals (by reason), and requests by
    adapter name (`BASE` for none): every refusal reason present from the start, at 0."""

    loads: int = 0
    unloads: int = 0
    evictions: int = 0
    refused: Counter[str] = field(
        default_factory=lambda: Counter(dict.fromkeys(LORA_LOAD_REFUSALS, 0))
    )
    requests: Counter[str] = field(default_factory=lambda: Counter({BASE: 0}))
    tokens: Counter[str] = field(default_factory=lambda: Counter({BASE: 0}))

    def named(self, name: str) -> None:
        """Give `name` its own series at 0 (at its load), while there is room."""
        if name not in self.requests and len(self.requests) <= MAX_NAMED:
            self.requests[name] = self.tokens[name] = 0

    def request(self, name: str | None) -> None:
        self.requests[self._label(name)] += 1

    def generated(self, name: str | None, n: int) -> None:
        """`n` tokens generated under `name` (None: the base)."""
        self.tokens[self._label(name)] += n

    def _label(self, name: str | None) -> str:
        label = BASE if name is None else name
        return label if label in self.requests else OTHER
