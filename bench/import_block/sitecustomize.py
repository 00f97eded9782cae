"""Hide installed packages, for checking that a code path runs where they are missing.

    SHORTCONV_HIDE_IMPORTS=ray,pydantic PYTHONPATH=bench/import_block:. python ...

Python imports `sitecustomize` at start-up from the first sys.path entry that has one. This one
swaps the standard path finder for one that does not see the listed top-level names, so both
`import ray` (ModuleNotFoundError) and `importlib.util.find_spec("ray")` (None) behave exactly
as if the package were not installed. Without the variable it changes nothing.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys

HIDDEN = frozenset(n.strip() for n in os.environ.get("SHORTCONV_HIDE_IMPORTS", "").split(",") if n)


class _HidingPathFinder(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, fullname: str, path=None, target=None):  # noqa: ANN001, ANN206
        if fullname.partition(".")[0] in HIDDEN:
            return None
        return super().find_spec(fullname, path, target)


if HIDDEN:
    sys.meta_path[:] = [
        _HidingPathFinder if f is importlib.machinery.PathFinder else f for f in sys.meta_path
    ]
