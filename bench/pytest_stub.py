"""A stand-in `pytest` module for running fixture-free tests where pytest is not installed.

It covers what test modules touch at import time (marks, params, skips) so `import test_x`
works; bench/gpu_runner.py reads the marks it records. It is installed only when the real
pytest is missing, and never in a process that runs the real suite.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


class Skipped(Exception):
    """Raised by `pytest.skip` / `pytest.importorskip` inside a test."""


@dataclass(frozen=True)
class Mark:
    """`pytest.mark.NAME`, `pytest.mark.NAME(*args, **kwargs)`, or either used as a decorator
    (a single callable argument and nothing else means "decorate", as in pytest)."""

    name: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            fn = args[0]
            fn.pytestmark = [*getattr(fn, "pytestmark", []), self]
            return fn
        return Mark(self.name, self.args + args, {**self.kwargs, **kwargs})


class _MarkGenerator:
    def __getattr__(self, name: str) -> Mark:
        if name.startswith("__"):
            raise AttributeError(name)
        return Mark(name)


@dataclass(frozen=True)
class Param:
    values: tuple[Any, ...]
    marks: tuple[Any, ...] = ()
    id: str | None = None


def param(*values: Any, marks: Any = (), id: str | None = None) -> Param:  # noqa: A002
    return Param(values, tuple(marks) if isinstance(marks, list | tuple) else (marks,), id)


def skip(reason: str = "", **_: Any) -> None:
    raise Skipped(reason)


skip.Exception = Skipped  # type: ignore[attr-defined]


def fail(reason: str = "", **_: Any) -> None:
    raise AssertionError(reason)


def importorskip(modname: str, minversion: str | None = None, reason: str | None = None) -> Any:
    try:
        return importlib.import_module(modname)
    except ImportError as exc:
        raise Skipped(reason or f"could not import {modname!r}: {exc}") from exc


@contextmanager
def raises(
    expected: type[BaseException] | tuple[type[BaseException], ...], match: str | None = None
) -> Iterator[None]:
    import re

    try:
        yield
    except expected as exc:
        if match is not None and not re.search(match, str(exc)):
            raise AssertionError(f"{exc!r} does not match {match!r}") from exc
        return
    raise AssertionError(f"DID NOT RAISE {expected}")


def fixture(*args: Any, **_: Any) -> Any:
    """Leaves the function as it is (the runner skips tests that ask for fixtures)."""
    if len(args) == 1 and callable(args[0]):
        return args[0]
    return lambda fn: fn


def build_stub() -> types.ModuleType:
    mod = types.ModuleType("pytest")
    mod.__doc__ = "stand-in pytest (bench/pytest_stub.py)"
    members: dict[str, Callable[..., Any] | object] = {
        "mark": _MarkGenerator(),
        "param": param,
        "skip": skip,
        "fail": fail,
        "importorskip": importorskip,
        "raises": raises,
        "fixture": fixture,
    }
    for name, value in members.items():
        setattr(mod, name, value)
    return mod


def install_pytest_stub() -> bool:
    """Install the stand-in as `pytest` if the real one does not import; True if installed."""
    try:
        import pytest  # noqa: F401
    except ImportError:
        sys.modules["pytest"] = build_stub()
        return True
    return False
