"""The suite's two Ray units (tests/xdist_units.py): every Ray module in exactly one, dealt so
that the units' measured seconds differ by at most the longest module's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))

import xdist_units  # noqa: E402


def test_every_ray_module_is_in_one_unit_and_the_units_balance() -> None:
    units = xdist_units.ray_units()
    ray = {str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py") if xdist_units.starts_ray(p)}
    assert set(units) == ray and len(ray) > 10
    known = json.loads(xdist_units.SECONDS_FILE.read_text())
    median = sorted(known.values())[len(known) // 2]
    load = {xdist_units.UNIT_A: 0.0, xdist_units.UNIT_B: 0.0}
    for mod, unit in units.items():
        load[unit] += known.get(mod, median)
    longest = max(known.get(m, median) for m in units)
    assert abs(load[xdist_units.UNIT_A] - load[xdist_units.UNIT_B]) <= longest, load
    # NOTE: a module that starts no Ray is a unit of its own
    assert xdist_units.unit_of(Path(__file__).resolve()) is None


def test_seconds_are_summed_per_module_from_junit(tmp_path: Path) -> None:
    xml = tmp_path / "j.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.deployments.test_serve_drain" name="a" time="2.5"/>'
        '<testcase classname="tests.deployments.test_serve_drain" name="b" time="1.5"/>'
        '<testcase classname="tests.workers.test_tp.TestX" name="c" time="3"/>'
        "</testsuite></testsuites>"
    )
    got = xdist_units.seconds_from_junit(xml)
    assert got == {"deployments/test_serve_drain.py": 4.0, "workers/test_tp.py": 3.0}
