"""farmctl names no worker state (issue 32 §1): the agent sends the facts (whether a
worker has a process, whether its failure is its news, whether a phase ends a wait, its
release command, whether the farm settled or what holds it) and farmctl renders them, so
a phase added or renamed in the supervisor cannot leave farmctl judging by a stale list.

Parses cli/farmctl.py and every module of its verbs (cli/ctl/) and fails on any string
constant equal to a worker phase's wire value, the values taken from the supervisor's own
`Phase`. A key of the agent's JSON (the first argument of `.get`, or a subscript) is a
field's name, not a state: the `ready` and `quarantined` fields are facts (a bool, a list
of ids), so they are allowed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import sglang_farm.cli.ctl as ctl
import sglang_farm.cli.farmctl as farmctl
from sglang_farm.workers.phase import Phase

_PHASES = frozenset(str(p) for p in Phase)


def _field_names(tree: ast.AST) -> set[int]:
    """The ids of the constants that name a field: `x.get("k", ...)`, `x["k"]`."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and node.args
        ):
            out.add(id(node.args[0]))
        elif isinstance(node, ast.Subscript):
            out.add(id(node.slice))
    return out


def _hits(source: str) -> list[str]:
    tree = ast.parse(source)
    fields = _field_names(tree)
    found = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value in _PHASES
        and id(node) not in fields
    ]
    found.sort(key=lambda n: (n.lineno, n.col_offset))
    return [f"line {n.lineno}: {n.value!r}" for n in found]


def _farmctl_sources() -> list[Path]:
    """cli/farmctl.py and the modules of its verbs: the group and every verb."""
    return [Path(farmctl.__file__), *sorted(Path(ctl.__file__).parent.glob("*.py"))]


def test_farmctl_has_no_string_equal_to_a_worker_phase() -> None:
    sources = _farmctl_sources()
    assert len(sources) > 10  # the verbs' modules are seen, not only the group's
    hits = {p.name: _hits(p.read_text()) for p in sources}
    assert {name: h for name, h in hits.items() if h} == {}


def test_the_check_sees_a_phase_name_wherever_it_is_not_a_field_name() -> None:
    source = (
        'x = w.get("state") in ("ready", "failed")\n'
        'y = {"draining": 1}.get(s) or s == "stopped"\n'
        'z = r.get("ready") and r["quarantined"]\n'
    )
    assert _hits(source) == [
        "line 1: 'ready'",
        "line 1: 'failed'",
        "line 2: 'draining'",
        "line 2: 'stopped'",
    ]
