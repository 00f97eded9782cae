"""Run the fixture-free `gpu` tests without pytest (the GPU machine may not have it).

    PYTHONPATH=. python bench/gpu_runner.py [--dry-run] [--deadline S] [tests/gpu/test_x.py ...]

Imports each test module (default: every tests/gpu/test_*.py), then calls its `test_*`
functions one by one, printing PASS/FAIL/SKIP per test as it goes (a run cut short still shows
what finished). When pytest is missing, a small stand-in module is installed first that covers
what test modules use at import time: `pytest.mark.<any>` (bare, called, or as a decorator),
`pytest.param`, `pytest.skip`, `pytest.importorskip`, `pytest.fail`, `pytest.raises`,
`pytest.fixture`. Marks are honoured like the suite's conftest: `skip`, `skipif(cond)`, and `gpu`
without CUDA skip; `parametrize` is expanded; a test that needs any other argument (a fixture)
is skipped. `--dry-run` imports every module and lists what would run, running nothing.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import itertools
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "gpu")]

from pytest_stub import install_pytest_stub  # noqa: E402

Case = tuple[str, Callable[..., Any], dict[str, Any]]


def _marks(obj: Any) -> list[Any]:
    """Marks as (name, args, kwargs) holders, for real pytest MarkDecorators and the stub's."""
    raw = getattr(obj, "pytestmark", [])
    raw = raw if isinstance(raw, list) else [raw]
    return [getattr(m, "mark", m) for m in raw]


def skip_reason(marks: list[Any], cuda: bool) -> str | None:
    for m in marks:
        if m.name == "skip":
            return m.kwargs.get("reason", "skip mark")
        if m.name == "skipif" and m.args and m.args[0]:
            return m.kwargs.get("reason", "skipif")
        if m.name == "gpu" and not cuda:
            return "needs a CUDA device"
    return None


def _param_values(value: Any) -> tuple[tuple[Any, ...], list[Any]]:
    """(values, marks) of one parametrize entry (plain value, tuple, or pytest.param)."""
    if hasattr(value, "values") and hasattr(value, "marks"):
        return tuple(value.values), [getattr(m, "mark", m) for m in value.marks]
    return (value,), []


def expand(name: str, fn: Callable[..., Any]) -> Iterator[tuple[Case, list[Any]]]:
    """One case per combination of the function's parametrize marks (stacked = product)."""
    axes = []
    for m in _marks(fn):
        if m.name != "parametrize":
            continue
        names = m.args[0].split(",") if isinstance(m.args[0], str) else list(m.args[0])
        names = [n.strip() for n in names]
        rows = []
        for v in m.args[1]:
            vals, marks = _param_values(v)
            vals = vals if len(names) == 1 else tuple(vals[0]) if len(vals) == 1 else vals
            rows.append((dict(zip(names, vals, strict=True)), marks))
        axes.append(rows)
    for i, combo in enumerate(itertools.product(*axes)):
        kwargs = {k: v for kw, _ in combo for k, v in kw.items()}
        marks = [m for _, ms in combo for m in ms]
        yield (f"{name}[{i}]" if axes else name, fn, kwargs), marks


def collect(path: Path, cuda: bool) -> Iterator[tuple[Case, str | None]]:
    """(case, skip reason or None) for every test in the module at `path`."""
    if str(path.resolve().parent) not in sys.path:
        sys.path.insert(0, str(path.resolve().parent))
    mod = importlib.import_module(path.stem)
    mod_marks = _marks(mod)
    for name in sorted(n for n in dir(mod) if n.startswith("test_")):
        fn = getattr(mod, name)
        if not callable(fn):
            continue
        for case, marks in expand(name, fn):
            reason = skip_reason(mod_marks + _marks(fn) + marks, cuda)
            missing = set(inspect.signature(fn).parameters) - set(case[2])
            if reason is None and missing:
                reason = f"needs pytest fixtures {sorted(missing)}"
            yield (f"{path.stem}::{case[0]}", case[1], case[2]), reason


def run_case(case: Case) -> tuple[str, str]:
    """('PASS'|'FAIL'|'SKIP', detail)."""
    _, fn, kwargs = case
    skipped = sys.modules["pytest"].skip.Exception
    try:
        fn(**kwargs)
    except skipped as exc:
        return "SKIP", str(exc)
    except Exception:  # noqa: BLE001 - a test failure of any kind is reported, not raised
        return "FAIL", traceback.format_exc()
    return "PASS", ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="*", type=Path)
    p.add_argument("--dry-run", action="store_true", help="import and list; run nothing")
    p.add_argument("--deadline", type=float, default=0.0, help="start no test after S seconds")
    args = p.parse_args(argv)
    stub = install_pytest_stub()
    import torch

    cuda = torch.cuda.is_available()
    paths = args.paths or sorted((ROOT / "tests" / "gpu").glob("test_*.py"))
    print(f"# plain runner: pytest {'stand-in' if stub else 'installed'}, cuda {cuda}", flush=True)
    counts = dict.fromkeys(("PASS", "FAIL", "SKIP", "NOT RUN"), 0)
    t0 = time.perf_counter()
    for path in paths:
        try:
            cases = list(collect(path, cuda))
        except Exception:  # noqa: BLE001
            counts["FAIL"] += 1
            print(f"FAIL import {path.stem}\n{traceback.format_exc()}", flush=True)
            continue
        for case, reason in cases:
            status, detail, t1 = "SKIP", reason or "", time.perf_counter()
            if args.dry_run and reason is None:
                status, detail = "WOULD RUN", ""
            elif args.deadline and t1 - t0 > args.deadline and reason is None:
                status, detail = "NOT RUN", f"past the {args.deadline:.0f} s deadline"
            elif reason is None:
                status, detail = run_case(case)
            counts[status] = counts.get(status, 0) + 1
            print(f"{status} {case[0]} ({time.perf_counter() - t1:.1f}s) {detail}", flush=True)
    print(
        f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped, "
        f"{counts['NOT RUN']} not run in {time.perf_counter() - t0:.1f}s (plain runner)"
    )
    return 1 if counts["FAIL"] or counts["NOT RUN"] else 0


if __name__ == "__main__":
    sys.exit(main())
