"""The engine core's loop gives the C heap back (workers/heap_trim.py) once each time its
engine goes idle, not at every step nor at every idle wake-up: driven over a real pipe with a
scripted engine, no process or model."""

from __future__ import annotations

from multiprocessing import Pipe
from types import SimpleNamespace
from typing import Any

import pytest

from deployments.frontend.engine import engine_core
from deployments.frontend.engine.metrics_relay import RelaySink


class _ScriptedEngine:
    """Busy for `steps` steps after each `wake()`, idle otherwise."""

    def __init__(self) -> None:
        self.left = 0
        self.sessions = SimpleNamespace(evict_idle=lambda: None, session_ids=lambda: ())

    def has_unfinished(self) -> bool:
        return self.left > 0

    def step(self) -> list[Any]:
        self.left -= 1
        return []

    def refresh_metrics(self) -> None:
        return None

    def stats(self) -> None:
        return None


def test_the_core_trims_the_heap_once_per_busy_to_idle_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(engine_core, "_IDLE_WAIT_S", 0.0)
    ours, theirs = Pipe()
    engine = _ScriptedEngine()
    trims: list[int] = []
    idle_turns = 0

    def handle(self: engine_core.EngineCore, wait_s: float) -> int:
        nonlocal idle_turns
        if not engine.has_unfinished():
            idle_turns += 1
            if idle_turns in (3, 6):  # a burst of work after some idle wake-ups
                engine.left = 4
            if idle_turns == 9:
                raise engine_core._Stop()
        return 0

    monkeypatch.setattr(engine_core.EngineCore, "_handle", handle)
    core = engine_core.EngineCore(ours, engine, RelaySink(), lambda: trims.append(engine.left))
    with pytest.raises(engine_core._Stop):
        core.run()
    assert trims == [0, 0]  # two bursts, each trimmed once, after its last step
    theirs.close()
