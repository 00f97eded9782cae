"""How `make test` splits the suite over pytest-xdist workers (used by tests/conftest.py).

A module that starts Ray belongs to one of two units, each run by one worker, module after
module, so at most two Ray clusters start at once (on 2 cores more of them miss Ray's fixed 30 s
start-up limit). The modules are dealt to the two units longest first, each to the unit with
less time so far, by the seconds each took in a measured run (`ray_unit_seconds.json`; a module
not in it counts as the median). Regenerate that file after adding or growing a Ray module:
`python tests/xdist_units.py JUNIT_XML`, from a `pytest --junitxml` run of the Ray modules.
Every other module is a unit of its own (xdist's `loadfile`), so its module fixtures are built
once, on one worker. The Ray units go first: they are the longest, and the file units fill the
other workers around them.

NOTE: xdist's own `--dist loadgroup` cannot do this here: it renames `item._nodeid`, which pytest
9.2 no longer reads (nodeids come from `item._id`), so its groups are silently ignored.

A worker running a file unit lowers its CPU priority (`yield_cpu_unless_ray`): the Ray units are
the suite's critical path, and their clusters' many processes lose to the file units' busy
torch threads on 2 cores; niced, the file units take what the Ray units leave idle.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
import xml.etree.ElementTree as ET
from functools import cache
from pathlib import Path
from typing import Any

import pytest

UNIT_A, UNIT_B = "ray-a", "ray-b"
HERE = Path(__file__).resolve().parent
SECONDS_FILE = HERE / "ray_unit_seconds.json"
_STARTS_RAY = re.compile(
    r"serve_run\(|yaml_app\(|private_ray\(|reliability_helpers|ray\.init\(|serve\.run\("
    r"|importorskip\(.ray.\)"
)


@cache
def starts_ray(path: Path) -> bool:
    return bool(_STARTS_RAY.search(path.read_text()))


@cache
def ray_units() -> dict[str, str]:
    """Ray module path (relative to tests/) -> its unit: longest first, to the lighter unit."""
    mods = sorted(str(p.relative_to(HERE)) for p in HERE.rglob("test_*.py") if starts_ray(p))
    known = json.loads(SECONDS_FILE.read_text()) if SECONDS_FILE.exists() else {}
    median = statistics.median(known.values()) if known else 1.0
    load = {UNIT_A: 0.0, UNIT_B: 0.0}
    units = {}
    for mod in sorted(mods, key=lambda m: (-known.get(m, median), m)):
        unit = min(load, key=lambda u: (load[u], u))
        units[mod] = unit
        load[unit] += known.get(mod, median)
    return units


@cache
def unit_of(path: Path) -> str | None:
    """The Ray unit of a test module, or None for a module that starts no Ray."""
    if not starts_ray(path):
        return None
    try:
        return ray_units()[str(path.resolve().relative_to(HERE))]
    except (KeyError, ValueError):  # outside tests/ (a temporary module): the second unit
        return UNIT_B


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


def seconds_from_junit(xml_path: Path) -> dict[str, float]:
    """Module path (relative to tests/) -> the seconds its tests took, from a junit XML."""
    totals: dict[str, float] = {}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        mod = case.get("classname", "").split(".")
        # NOTE: classname is the dotted module path, plus a class name for tests in a class
        while mod and not (HERE.parent / Path(*mod)).with_suffix(".py").exists():
            mod = mod[:-1]
        if mod:
            key = str((HERE.parent / Path(*mod)).with_suffix(".py").relative_to(HERE))
            totals[key] = totals.get(key, 0.0) + float(case.get("time", 0.0))
    return totals


if __name__ == "__main__":
    measured = seconds_from_junit(Path(sys.argv[1]))
    ray = {m: round(t, 1) for m, t in sorted(measured.items()) if starts_ray(HERE / m)}
    SECONDS_FILE.write_text(json.dumps(ray, indent=1) + "\n")
    print(f"{len(ray)} Ray modules, {sum(ray.values()):.0f} s -> {SECONDS_FILE.name}")
