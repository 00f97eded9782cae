"""The direction of dependencies, read statically from the source with `ast` (nothing imported).

  * no module of `shortconv/` imports `workers`, `deployments` or `ray`, but for one edge: the
    LLM facade (`shortconv/llm.py`) names `workers.ray_executor` for tp_size > 1. The engine
    receives its executor, the facade picks it; tp_size = 1 runs on shortconv/ alone;
  * in `deployments/`, only the Serve layer (`deployments/serve/`) imports Ray, and nothing
    else there imports the Serve layer: the frontend is usable, and testable, without Ray (also
    checked by importing every frontend module in a process where `ray` cannot be imported);
  * `workers/` does not import `deployments/`;
  * kernels take plain tensors: `shortconv/kernels/` imports nothing else of `shortconv/`;
  * `deployments/` holds the engine only as an `EngineLike`: it imports the engine's public
    surface (facade, configs, sampling parameters, outputs, tokenizer, grammar, metrics, tiny
    checkpoints), never its scheduler, caches, execution, layers, models or kernels;
  * the modules of `shortconv/`, `workers/` and `deployments/` import each other without cycles.

What counts as an import: every `import` / `from ... import` statement anywhere in a module,
module level, inside a function or under `if TYPE_CHECKING:`. A lazy (function-level) import
still makes one module depend on the other; putting it in a function only hides a cycle from the
interpreter until the function runs. A type-only import names a type of the other module, so the
two modules still know each other: it counts for cycles and direction alike.
`from pkg import name` is an edge to the module `pkg.name` when that is a module, else to
`pkg`. Importing `a.b.c` also runs `a/__init__.py` and `a/b/__init__.py`; those implicit edges
are left out (`shortconv/__init__.py` re-exports the facade, so counting them would put every
module on a cycle with the facade without any module naming it).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from probe import run_probe

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("shortconv", "workers", "deployments")
FACADE = "shortconv.llm"


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    lineno: int
    type_only: bool  # under `if TYPE_CHECKING:`

    def __str__(self) -> str:
        kind = " (TYPE_CHECKING)" if self.type_only else ""
        return f"{self.src}:{self.lineno} imports {self.dst}{kind}"


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the three packages."""
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, type_only: bool = False) -> Iterator[tuple[ast.stmt, bool]]:
    """Every import statement under `tree`, with whether a TYPE_CHECKING guard covers it."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, type_only
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                yield from _imports(ast.Module(body=[child], type_ignores=[]), True)
            for child in node.orelse:
                yield from _imports(ast.Module(body=[child], type_ignores=[]), type_only)
        else:
            yield from _imports(node, type_only)


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def edges_of(module: str, path: Path, known: set[str]) -> list[Edge]:
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    edges = []
    for node, type_only in _imports(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = _absolute(module, is_package, node)
            subs = [f"{base}.{a.name}" for a in node.names]
            targets = [s if s in known else base for s in subs]
        edges += [Edge(module, t, node.lineno, type_only) for t in dict.fromkeys(targets)]
    return edges


@pytest.fixture(scope="module")
def edges() -> list[Edge]:
    mods = module_files()
    return [e for mod, path in mods.items() for e in edges_of(mod, path, set(mods))]


def _top(name: str) -> str:
    return name.split(".")[0]


# The one edge from shortconv/ upward: the facade's Ray executor, picked only for tp_size > 1.
FACADE_EXECUTOR = "workers.ray_executor"
SERVE = "deployments.serve"


def test_the_engine_imports_no_workers_deployments_or_ray(edges: list[Edge]) -> None:
    bad = [
        str(e)
        for e in edges
        if _top(e.src) == "shortconv"
        and _top(e.dst) in ("workers", "deployments", "ray")
        and (e.src, e.dst) != (FACADE, FACADE_EXECUTOR)
    ]
    assert not bad, "shortconv/ must not depend on the layers above it:\n" + "\n".join(bad)


def _in_serve(module: str) -> bool:
    return module == SERVE or module.startswith(SERVE + ".")


def test_only_the_serve_layer_of_deployments_imports_ray(edges: list[Edge]) -> None:
    bad = [
        str(e)
        for e in edges
        if _top(e.src) == "deployments" and not _in_serve(e.src) and _top(e.dst) == "ray"
    ]
    assert not bad, "only deployments/serve/ may import Ray:\n" + "\n".join(bad)


def test_nothing_below_the_serve_layer_imports_it(edges: list[Edge]) -> None:
    bad = [str(e) for e in edges if not _in_serve(e.src) and _in_serve(e.dst)]
    assert not bad, "deployments/serve/ is the top: nothing imports it:\n" + "\n".join(bad)


# Imports every module it is given in this one process with `ray` unimportable (None in
# sys.modules makes `import ray` and `import ray.x` raise); prints those that failed.
_BLOCKED_RAY_PROBE = """
import importlib, sys, traceback
sys.modules["ray"] = None
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception:
        print(name, traceback.format_exc(limit=-3).replace("\\n", " | "))
"""


def test_the_frontend_imports_without_ray() -> None:
    """What the AST test reads, run: every module of deployments/ but the Serve layer imports
    where Ray cannot be, so no import of theirs reaches Ray through another package."""
    frontend = sorted(m for m in module_files() if _top(m) == "deployments" and not _in_serve(m))
    assert "deployments.frontend.openai.api" in frontend  # the walk found the frontend
    stdout = run_probe(_BLOCKED_RAY_PROBE, *frontend)
    assert stdout.strip() == "", "frontend modules that need Ray:\n" + stdout


def test_workers_do_not_import_deployments(edges: list[Edge]) -> None:
    bad = [str(e) for e in edges if _top(e.src) == "workers" and _top(e.dst) == "deployments"]
    assert not bad, "workers/ must not depend on deployments/:\n" + "\n".join(bad)


def import_graph(edges: list[Edge]) -> dict[str, set[str]]:
    """Imports among the modules of the three packages, lazy and TYPE_CHECKING ones included."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        if _top(e.src) in PACKAGES and _top(e.dst) in PACKAGES and e.src != e.dst:
            graph.setdefault(e.src, set()).add(e.dst)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Tarjan's algorithm (iterative); components of more than one module are cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[frozenset[str]] = []
    nodes = sorted(set(graph) | {d for ds in graph.values() for d in ds})
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = set()
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        comp.add(top)
                        if top == node:
                            break
                    if len(comp) > 1:
                        out.append(frozenset(comp))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return out


def _describe(comp: frozenset[str], edges: list[Edge]) -> str:
    inside = [e for e in edges if e.src in comp and e.dst in comp]
    return "\n".join(f"  {e}" for e in sorted(inside, key=str))


def test_no_import_cycles_anywhere(edges: list[Edge]) -> None:
    cycles = strongly_connected(import_graph(edges))
    assert not cycles, "import cycles among the project's modules:\n" + "\n\n".join(
        _describe(c, edges) for c in cycles
    )


def test_kernels_import_nothing_of_the_engine(edges: list[Edge]) -> None:
    bad = [
        str(e)
        for e in edges
        if e.src.startswith("shortconv.kernels")
        and _top(e.dst) in PACKAGES
        and not e.dst.startswith("shortconv.kernels")
    ]
    assert not bad, "kernels take plain tensors and import no engine module:\n" + "\n".join(bad)


# What deployments/ may import of the engine: the facade that builds it, and the types and helpers
# that describe requests and results. The engine object itself is held as an EngineLike.
ENGINE_SURFACE = (
    "shortconv.llm",
    "shortconv.errors",
    "shortconv.configs.config",
    "shortconv.sampling.sampling_params",
    "shortconv.sampling.grammar",
    "shortconv.engine.outputs",
    "shortconv.engine.stats",
    "shortconv.engine.tokenizer",
    "shortconv.engine.request_limits",  # a request's checks, run where the engine is not
    "shortconv.engine.images",  # a request's images (`add_request(images=...)`), as offline
    "shortconv.configs.hf.processors",  # the checkpoint's own processor, for chat images
    "shortconv.metrics",
    "shortconv.tiny",
)


def _in_surface(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in ENGINE_SURFACE)


def test_deployments_use_the_engine_only_through_its_surface(edges: list[Edge]) -> None:
    bad = [
        str(e)
        for e in edges
        if _top(e.src) == "deployments" and _top(e.dst) == "shortconv" and not _in_surface(e.dst)
    ]
    assert not bad, "deployments/ reaches into engine internals:\n" + "\n".join(bad)


def test_the_checker_sees_lazy_relative_and_guarded_imports(tmp_path: Path) -> None:
    """The parser itself: function-level, relative and TYPE_CHECKING imports are all found."""
    pkg = tmp_path / "shortconv"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from shortconv.b import B\n"
        "def f():\n    import ray\n    from . import b\n    from .c import x\n"
    )
    for name in ("b", "c"):
        (pkg / f"{name}.py").write_text("")
    known = {"shortconv", "shortconv.a", "shortconv.b", "shortconv.c"}
    got = {(e.dst, e.type_only) for e in edges_of("shortconv.a", pkg / "a.py", known)}
    assert got == {
        ("typing", False),
        ("shortconv.b", True),
        ("ray", False),
        ("shortconv.b", False),
        ("shortconv.c", False),
    }
    assert strongly_connected({"x": {"y"}, "y": {"z", "x"}, "z": set()}) == [frozenset({"x", "y"})]
