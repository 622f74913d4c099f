"""Issue 32 §1: only the agent calls the supervisor. Everything else hands the core a
command through the agent's one entry (`Agent.submit`) and reads what the agent gives
it (`states()`, `policy`, `view()`), so no caller can forget to apply the actions or to
publish the view."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "agent" / "sglang_farm"
AGENT = PACKAGE / "agent.py"
# The names the agent keeps its supervisor under.
SUPERVISOR_ATTRS = frozenset({"supervisor", "_supervisor"})
# Where the class itself may be named: its own folder, and the agent that owns it.
MAY_NAME_THE_CLASS = frozenset({AGENT})


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p != AGENT)


def _where(path: Path, node: ast.AST, package: Path = PACKAGE) -> str:
    return f"{path.relative_to(package.parent)}:{getattr(node, 'lineno', '?')}"


def supervisor_uses(path: Path, package: Path = PACKAGE) -> list[str]:
    """Each read, write or call of an attribute named like the agent's supervisor
    (`h.supervisor`, `farm.supervisor.workers`, `self._supervisor = ...`), file:line."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    hits = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr in SUPERVISOR_ATTRS
    ]
    return [_where(path, n, package) for n in sorted(hits, key=lambda n: n.lineno)]


def class_imports(path: Path) -> list[str]:
    """Each import of the `Supervisor` class, file:line."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return [
        _where(path, node)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and any(a.name == "Supervisor" for a in node.names)
    ]


def test_no_module_but_the_agent_touches_the_supervisor() -> None:
    found = [hit for p in _modules() for hit in supervisor_uses(p)]
    assert not found, (
        "only agent.py calls the supervisor; hand the core a command through "
        f"Agent.submit and read Agent.states() / view() instead: {found}"
    )


def test_no_module_outside_the_core_and_the_agent_imports_the_supervisor_class() -> None:
    found = [
        hit
        for p in _modules()
        if p not in MAY_NAME_THE_CLASS and "workers" not in p.relative_to(PACKAGE).parts[:1]
        for hit in class_imports(p)
    ]
    assert not found, f"the Supervisor is the agent's own: {found}"


def test_the_check_finds_a_supervisor_call_and_names_its_line(tmp_path: Path) -> None:
    """The check itself: the shapes the issue names are found, with file:line."""
    src = tmp_path / "sglang_farm" / "caller.py"
    src.parent.mkdir()
    src.write_text(
        "def f(farm, h, self):\n"
        "    farm.apply_actions(farm.supervisor.start([0], 0.0))\n"
        "    h.supervisor.workers[0]\n"
        "    self._supervisor = None\n"
        "    farm.submit(0)\n",
        encoding="utf-8",
    )
    hits = supervisor_uses(src, src.parent)
    assert hits == [f"sglang_farm/caller.py:{n}" for n in (2, 3, 4)]
