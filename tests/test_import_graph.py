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
import re
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
        ("from sglang_farm.gpus import nvml", {"sglang_farm.gpus.nvml"}),
        ("from sglang_farm.gpus.nvml import FleetSnapshot", {"sglang_farm.gpus.nvml"}),
        ("def f():\n    from sglang_farm.sim import usage\n", {"sglang_farm.sim.usage"}),
        ("from . import usage", {"sglang_farm.sim.usage"}),
        ("from ..gpus.nvml import FleetSnapshot", {"sglang_farm.gpus.nvml"}),
        ("import json\nfrom httpx import Client", set()),
        # The module's own package: its __init__ runs first anyway, so not an edge.
        ("from sglang_farm.sim import FailMode", set()),
    ],
)
def test_imports_are_read_at_every_level(source: str, expected: set[str]) -> None:
    known = {
        *("sglang_farm", "sglang_farm.gpus", "sglang_farm.gpus.nvml"),
        *("sglang_farm.sim", "sglang_farm.sim.usage"),
    }
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


# --- the folders' ladder, and pure above no I/O (issue 32 §3) -----------------------------

ARCHITECTURE = ROOT.parent.parent / "docs" / "ARCHITECTURE.md"
LADDER_START, LADDER_END = "<!-- ladder -->", "<!-- /ladder -->"


def folder_of(module: str) -> str:
    """The folder a module stands in: `sglang_farm.workers.supervisor` -> `workers`; a
    top-level module is a folder of its own (`sglang_farm.spec` -> `spec`), the package's
    own `__init__` is `__init__`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def ladder_rungs(text: str) -> list[list[str]]:
    """The folders' rungs written between the ladder markers, lowest first.

    Each rung is a numbered line, `3. `sglang`, `gpus`: what it holds`: the folders are
    the backticked names before the first colon; the lines must count 1, 2, 3... Raises
    ValueError on missing markers, a gap in the count or a rung without a folder.
    """
    start, end = text.find(LADDER_START), text.find(LADDER_END)
    if start < 0 or end < start:
        raise ValueError(f"no {LADDER_START} ... {LADDER_END} block")
    rungs: list[list[str]] = []
    for line in text[start + len(LADDER_START) : end].splitlines():
        numbered = re.match(r"\s*(\d+)\.\s+(.*)", line)
        if numbered is None:
            continue
        if int(numbered[1]) != len(rungs) + 1:
            raise ValueError(f"rung {numbered[1]} follows rung {len(rungs)}: {line!r}")
        names = re.findall(r"`([^`]+)`", numbered[2].split(":", 1)[0])
        if not names:
            raise ValueError(f"rung {numbered[1]} names no folder: {line!r}")
        rungs.append(names)
    return rungs


def folder_graph(graph: Mapping[str, Iterable[str]]) -> dict[str, set[str]]:
    """Folder -> the other folders its modules import (every folder a key)."""
    folders: dict[str, set[str]] = {folder_of(m): set() for m in graph}
    for module, imported in graph.items():
        for other in imported:
            if folder_of(other) != folder_of(module):
                folders[folder_of(module)].add(folder_of(other))
    return folders


def rung_violations(graph: Mapping[str, Iterable[str]], rungs: list[list[str]]) -> list[str]:
    """Each import of a module from a folder on a higher rung than its own, as
    `a.b (rung 2) -> c.d (rung 5)`; a folder on no rung is left to the coverage test."""
    rung = {folder: n for n, names in enumerate(rungs, 1) for folder in names}
    found = []
    for module in sorted(graph):
        for other in sorted(graph[module]):
            low, high = rung.get(folder_of(module)), rung.get(folder_of(other))
            if low is not None and high is not None and high > low:
                found.append(f"{module} (rung {low}) -> {other} (rung {high})")
    return found


def module_kind(docstring: str | None) -> str | None:
    """`pure` for a module whose docstring's first word is `Pure:`, `io` for `I/O:` (or a
    bare `I/O`, as in "I/O shell over a pure judge"), None for anything else (a package's
    map of its modules)."""
    words = (docstring or "").split(maxsplit=1)
    first = words[0] if words else ""
    return "pure" if first == "Pure:" else "io" if first in ("I/O:", "I/O") else None


@functools.cache
def module_kinds(root: Path = ROOT) -> dict[str, str | None]:
    """Module -> its kind (`module_kind`), for every module under `root`."""
    return {
        module_name(f, root): module_kind(ast.get_docstring(ast.parse(f.read_text(), str(f))))
        for f in sorted(root.rglob("*.py"))
    }


def pure_imports_of_io(
    graph: Mapping[str, Iterable[str]], kinds: Mapping[str, str | None]
) -> list[str]:
    """Each import of an I/O module by a pure one, as `pure -> io`."""
    return [
        f"{module} -> {other}"
        for module in sorted(graph)
        if kinds.get(module) == "pure"
        for other in sorted(graph[module])
        if kinds.get(other) == "io"
    ]


def test_every_folder_stands_on_exactly_one_rung() -> None:
    rungs = ladder_rungs(ARCHITECTURE.read_text())
    placed = [folder for names in rungs for folder in names]
    twice = sorted({f for f in placed if placed.count(f) > 1})
    assert not twice, f"folders on more than one rung of docs/ARCHITECTURE.md: {twice}"
    folders = set(folder_graph(import_graph()))
    assert sorted(folders - set(placed)) == [], "folders on no rung: add them to the ladder"
    assert sorted(set(placed) - folders) == [], "rungs name folders the package lacks"


def test_no_module_imports_a_folder_on_a_higher_rung() -> None:
    found = rung_violations(import_graph(), ladder_rungs(ARCHITECTURE.read_text()))
    assert not found, (
        "imports up the ladder of docs/ARCHITECTURE.md (move the module to the folder it "
        "belongs to, or what both need one rung down):\n  " + "\n  ".join(found)
    )


def test_the_folders_import_each_other_in_no_circle() -> None:
    folders = folder_graph(import_graph())
    pairs = sorted(f"{a} <-> {b}" for a in folders for b in folders[a] if a < b and a in folders[b])
    assert not pairs, "folders that import each other:\n  " + "\n  ".join(pairs)
    found = cycles(folders)
    walks = "\n".join("  " + " -> ".join(cycle_path(c, folders)) for c in found)
    assert not found, "folders importing each other around a circle:\n" + walks


def test_a_pure_module_imports_no_io_module() -> None:
    found = pure_imports_of_io(import_graph(), module_kinds())
    assert not found, (
        "modules whose docstring says Pure: importing one that says I/O: (move what the "
        "pure one needs into a pure module, or say what it is):\n  " + "\n  ".join(found)
    )


def test_the_kinds_are_read_for_most_modules() -> None:
    kinds = module_kinds()
    assert kinds["sglang_farm.workers.supervisor"] == "pure"
    assert kinds["sglang_farm.runtime.systemd"] == "io"
    assert sum(k is not None for k in kinds.values()) > 150


# --- the ladder's reader, on hand-built input ---------------------------------------------

LADDER_DOC = f"""
# Modules
1. `a`: not a rung, outside the markers
{LADDER_START}
The folders, lowest first:

1. `errors`, `host`: the machine
2. `spec`: the farm's shape, over `host`
{LADDER_END}
"""


def test_the_rungs_are_read_between_the_markers() -> None:
    assert ladder_rungs(LADDER_DOC) == [["errors", "host"], ["spec"]]


@pytest.mark.parametrize(
    "text",
    [
        "1. `a`",
        f"{LADDER_START}\n1. `a`\n3. `b`\n{LADDER_END}",
        f"{LADDER_START}\n1. `a`\n2. nothing named\n{LADDER_END}",
    ],
)
def test_a_ladder_without_markers_a_gap_or_an_empty_rung_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        ladder_rungs(text)


def test_an_import_up_the_ladder_is_named_and_one_down_is_not() -> None:
    graph = {
        "sglang_farm.top": {"sglang_farm.low.a"},
        "sglang_farm.low.a": set(),
        "sglang_farm.low.b": {"sglang_farm.top", "sglang_farm.low.a"},
    }
    rungs = [["low"], ["top"]]
    assert rung_violations(graph, rungs) == [
        "sglang_farm.low.b (rung 1) -> sglang_farm.top (rung 2)"
    ]
    assert folder_graph(graph) == {"top": {"low"}, "low": {"top"}}
    assert cycles(folder_graph(graph)) == [["low", "top"]]


def test_folders_of_modules() -> None:
    assert folder_of("sglang_farm.workers.supervisor") == "workers"
    assert folder_of("sglang_farm.spec") == "spec"
    assert folder_of("sglang_farm") == "__init__"


@pytest.mark.parametrize(
    ("docstring", "kind"),
    [
        ("Pure: the OOM ladder.", "pure"),
        ("I/O: probes of a worker's HTTP API.", "io"),
        ("I/O shell over a pure judge: ...", "io"),
        ("Pure (a map, no code): the batch service", None),
        ("workers: the pure core", None),
        (None, None),
        ("", None),
    ],
)
def test_a_module_kind_is_its_docstring_first_word(docstring: str | None, kind: str | None) -> None:
    assert module_kind(docstring) == kind


def test_a_pure_module_importing_an_io_one_is_named() -> None:
    graph = {"p": {"q", "r"}, "q": set(), "r": set(), "s": {"q"}}
    kinds = {"p": "pure", "q": "io", "r": "pure", "s": "io"}
    assert pure_imports_of_io(graph, kinds) == ["p -> q"]
