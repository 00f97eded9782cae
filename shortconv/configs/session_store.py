"""`session_store`: where sessions' kept state outlives the engine (docs/session_store.md)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from shortconv.errors import ConfigError


@dataclass(frozen=True)
class SessionStoreConfig:
    """`path`: a directory (a PVC in the chart) shared by every engine that may resume the
    sessions. `ttl_s`: a file older than this is removed, never resumed. `max_bytes`: the
    directory's cap; the oldest files go first."""

    path: str
    ttl_s: float = 86400.0
    max_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if not self.path:
            raise ConfigError("session_store.path must name a directory")
        if not self.ttl_s > 0:
            raise ConfigError(f"session_store.ttl_s must be > 0, got {self.ttl_s}")
        if self.max_bytes < 1:
            raise ConfigError(f"session_store.max_bytes must be >= 1, got {self.max_bytes}")

    @classmethod
    def parse(
        cls, value: SessionStoreConfig | Mapping[str, Any] | None
    ) -> SessionStoreConfig | None:
        """A config from a mapping (YAML, `LLM(session_store={...})`), unknown keys refused."""
        if value is None or isinstance(value, SessionStoreConfig):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"session_store must be a mapping, got {type(value).__name__}")
        unknown = sorted(set(value) - {f.name for f in fields(cls)})
        if unknown:
            raise ConfigError(f"unknown session_store key(s) {unknown}")
        return cls(**value)
