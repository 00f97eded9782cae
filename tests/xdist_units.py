"""How `make test` splits the suite over pytest-xdist workers (used by tests/conftest.py).

A module that starts Ray belongs to one of two units, each run by one worker, module after
module, so at most two Ray clusters start at once (on 2 cores more of them miss Ray's fixed 30 s
start-up limit). `RAY_A` lists the modules of the first unit, chosen so the two take about the
same time (`--durations=0`); any other module that starts Ray is in the second. Every other
module is a unit of its own (xdist's `loadfile`), so its module fixtures are built once, on one
worker. The Ray units go first: they are the longest, and the file units fill the other workers
around them.

NOTE: xdist's own `--dist loadgroup` cannot do this here: it renames `item._nodeid`, which pytest
9.2 no longer reads (nodeids come from `item._id`), so its groups are silently ignored.

A worker running a file unit lowers its CPU priority (`yield_cpu_unless_ray`): the Ray units are
the suite's critical path, and their clusters' many processes lose to the file units' busy
torch threads on 2 cores; niced, the file units take what the Ray units leave idle.
"""

from __future__ import annotations

import os
import re
from functools import cache
from pathlib import Path
from typing import Any

import pytest

UNIT_A, UNIT_B = "ray-a", "ray-b"
RAY_A = frozenset(
    f"test_serve_{name}.py"
    for name in (
        "yaml",
        "structured",
        "responses",
        "openai_api",
        "forks",
        "prefix_routing",
        "tp",
        "metrics",
        "images",
    )
)
_STARTS_RAY = re.compile(
    r"serve_run\(|yaml_app\(|private_ray\(|reliability_helpers|ray\.init\(|serve\.run\("
    r"|importorskip\(.ray.\)"
)


@cache
def unit_of(path: Path) -> str | None:
    """The Ray unit of a test module, or None for a module that starts no Ray."""
    if not _STARTS_RAY.search(path.read_text()):
        return None
    return UNIT_A if path.name in RAY_A else UNIT_B


FILE_UNIT_NICE = 10  # CFS weight 110 against 1024 at nice 0: idle time, mostly


def yield_cpu_unless_ray(path: Path) -> None:
    """Before a test: a worker in a file unit runs at FILE_UNIT_NICE, every thread of it (Linux
    nice is per thread, and torch's pool already exists), and so does what it starts; back at 0
    for a Ray unit where the OS lets it (root)."""
    if not os.path.isdir("/proc/self/task"):
        return  # not Linux: no per-thread nice to set
    nice = 0 if unit_of(path) else FILE_UNIT_NICE
    for tid in os.listdir("/proc/self/task"):
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)
        except OSError:  # the thread ended, or lowering niceness is not allowed here
            continue


def ray_first(items: list[pytest.Item]) -> None:
    """Reorder in place: the Ray units' modules first (stable otherwise)."""
    order = {UNIT_A: 0, UNIT_B: 1, None: 2}
    items.sort(key=lambda item: order[unit_of(Path(item.fspath))])


def make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's load-by-scope scheduler with our units as its scopes, in collection order."""
    from xdist.scheduler import LoadScopeScheduling

    root = config.rootpath

    class Units(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return unit_of(root / path) or path

    config.option.loadscopereorder = False  # keep `ray_first`'s order: the Ray units lead
    return Units(config, log)
