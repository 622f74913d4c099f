"""Structural: no two modules of the package import each other (issue 24 §3).

The package's import graph is read from its source with `ast` (module-level imports and
the ones inside functions alike: a deferred import is still a dependency), and must be
acyclic: a cycle, however long, is reported by the modules it runs through. Nothing is
imported here, so this runs in milliseconds and sees modules whose dependencies (pystemd,
pynvml) are not installed.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

PACKAGE = "sglang_farm"
ROOT = Path(__file__).resolve().parent.parent / "agent" / PACKAGE


def module_name(path: Path, root: Path = ROOT) -> str:
    """`agent/sglang_farm/runtime/systemd.py` -> `sglang_farm.runtime.systemd`."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PACKAGE, *parts])


def imported_modules(
    tree: ast.AST, module: str, is_package: bool, known: Iterable[str]
) -> set[str]:
    """The package's own modules that `module` imports anywhere in its source.

    `from sglang_farm.x import y` counts as importing `sglang_farm.x.y` when that is a module
    of the package, else `sglang_farm.x`; relative imports are resolved against `module`.
    A package's `__init__` is not counted for the modules below it (Python runs it first
    anyway, so counting it would make every subpackage a cycle with its own `__init__`).
    """
    names = set(known)
    found: set[str] = set()
    base = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                target = f"{anchor}.{node.module}" if node.module else anchor
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in names else target)
    own = {name for name in found if name in names and name != module}
    return {name for name in own if not module.startswith(name + ".")}


@functools.cache
def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, for every module under `root` (read once
    per run: the tests only look)."""
    files = sorted(root.rglob("*.py"))
    known = {module_name(f, root) for f in files}
    return {
        module_name(f, root): imported_modules(
            ast.parse(f.read_text(), str(f)), module_name(f, root), f.name == "__init__.py", known
        )
        for f in files
    }


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The graph's strongly connected components of two or more modules (Tarjan), each
    sorted, plus any module importing itself; empty when the graph is acyclic."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component: list[str] = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def cycle_path(component: list[str], graph: Mapping[str, Iterable[str]]) -> list[str]:
    """A shortest closed walk through the component's first module, `a -> b -> a`, for
    the message."""
    members = set(component)
    start = component[0]
    came_from: dict[str, str] = {}
    queue = [start]
    for node in queue:
        for w in sorted(graph.get(node, ())):
            if w == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if w in members and w not in came_from:
                came_from[w] = node
                queue.append(w)
    raise ValueError(f"{component} is not a cycle of the graph")


# --- the rule on the package ----------------------------------------------------------


def test_the_package_has_no_import_cycle() -> None:
    graph = import_graph()
    found = cycles(graph)
    walks = "\n".join("  " + " -> ".join(cycle_path(c, graph)) for c in found)
    assert not found, (
        "import cycles (move what both modules need into a module of its own):\n" + walks
    )


def test_the_graph_covers_the_package() -> None:
    graph = import_graph()
    assert "sglang_farm.runtime.systemd" in graph
    assert "sglang_farm.workers.supervisor" in graph["sglang_farm.agent"]


# pystemd is imported by the systemd runtime's own modules only (docs/systemd.md).
PYSTEMD_IMPORTERS = {
    "sglang_farm.runtime.gateway_unit",
    "sglang_farm.runtime.systemd",
    "sglang_farm.runtime.systemd_bus",
    "sglang_farm.runtime.systemd_watch",
}


def external_importers(library: str, root: Path = ROOT) -> set[str]:
    """The package's modules that import `library` (or a module of it) anywhere."""
    found: set[str] = set()
    for f in root.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            if any(n == library or n.startswith(library + ".") for n in names):
                found.add(module_name(f, root))
    return found


def test_pystemd_stays_in_the_systemd_runtime() -> None:
    assert external_importers("pystemd") == PYSTEMD_IMPORTERS


def test_the_pure_unit_state_imports_none_of_the_runtimes_io() -> None:
    # Its own package's __init__ (the Runtime protocol and events) is all it needs.
    assert import_graph()["sglang_farm.runtime.unit_state"] == set()


# --- the reader and the cycle finder, on hand-built input --------------------------------


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import sglang_farm.gpus.nvml", {"sglang_farm.gpus.nvml"}),
        ("from sglang_farm import gpu", {"sglang_farm.gpus.nvml"}),
        ("from sglang_farm.gpus.nvml import FleetSnapshot", {"sglang_farm.gpus.nvml"}),
        ("def f():\n    from sglang_farm.sim import usage\n", {"sglang_farm.sim.usage"}),
        ("from . import usage", {"sglang_farm.sim.usage"}),
        ("from ..gpu import FleetSnapshot", {"sglang_farm.gpus.nvml"}),
        ("import json\nfrom httpx import Client", set()),
        # The module's own package: its __init__ runs first anyway, so not an edge.
        ("from sglang_farm.sim import FailMode", set()),
    ],
)
def test_imports_are_read_at_every_level(source: str, expected: set[str]) -> None:
    known = {"sglang_farm", "sglang_farm.gpus.nvml", "sglang_farm.sim", "sglang_farm.sim.usage"}
    got = imported_modules(ast.parse(source), "sglang_farm.sim.options", False, known)
    assert got == expected


def test_a_two_module_cycle_is_named() -> None:
    graph = {"a": {"b"}, "b": {"a", "c"}, "c": set()}
    assert cycles(graph) == [["a", "b"]]
    assert cycle_path(["a", "b"], graph) == ["a", "b", "a"]


def test_a_longer_cycle_is_found_and_a_chain_is_not() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert cycles({"a": {"a"}}) == [["a"]]
