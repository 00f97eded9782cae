"""The replica's GIL switch interval: shortened only where the engine shares its GIL."""

from __future__ import annotations

import pytest

from deployments.frontend.config.args import AppArgs
from deployments.serve.server import THREAD_ENGINE_GIL_MS, gil_interval_ms


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({}, None),  # the core process runs the engine: Python's own interval stays
        ({"engine_process": False}, THREAD_ENGINE_GIL_MS),  # the engine on this thread
        ({"engine_process": False, "gil_switch_interval_ms": 2.0}, 2.0),  # set outright
        ({"gil_switch_interval_ms": 0.5}, 0.5),
    ],
)
def test_gil_interval_follows_where_the_engine_runs(changes: dict, expected: float | None) -> None:
    args = AppArgs.model_validate({"model": "lfm2", **changes})
    assert gil_interval_ms(args) == expected
