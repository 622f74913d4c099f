"""The test tree's shape (issue 32 §5): no test file imports another test module, and no
file imports a fixture function by hand.

A helper two test modules share lives in a support module named for what it is; a fixture
they share is in conftest.py, which pytest gives every module below it. An import of a
fixture (`from farmproc import tmp_fixture  # noqa: F401`) registers it by a side effect
a linter flags and a reader misses; an import of a test module runs its module-level code
and, under xdist's `--dist loadfile`, ties two files' tests together.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _is_fixture(node: ast.expr) -> bool:
    """`@pytest.fixture`, `@pytest.fixture(...)`, `@fixture`, `@fixture(...)`."""
    target = node.func if isinstance(node, ast.Call) else node
    if isinstance(target, ast.Attribute):
        return target.attr == "fixture"
    return isinstance(target, ast.Name) and target.id == "fixture"


def fixtures_of(tree: ast.Module) -> set[str]:
    """The names of the module's top-level fixture functions."""
    return {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and any(_is_fixture(d) for d in node.decorator_list)
    }


def violations(files: Iterable[Path]) -> list[str]:
    """`file:line: what` for each import of a test_* module and each by-hand import (or
    `module.fixture` reference) of a fixture function defined in one of `files`."""
    trees = {f: ast.parse(f.read_text(), filename=str(f)) for f in sorted(files)}
    fixtures = {f.stem: fixtures_of(t) for f, t in trees.items()}
    found: list[str] = []
    for f, tree in trees.items():
        aliases: dict[str, str] = {}  # a name bound to one of the tree's modules -> that module
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0].startswith("test_"):
                        found.append(f"{f.name}:{node.lineno}: imports the test module {a.name}")
                    if a.name in fixtures:
                        aliases[a.asname or a.name] = a.name
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module.split(".")[0].startswith("test_"):
                    found.append(
                        f"{f.name}:{node.lineno}: imports from the test module {node.module}"
                    )
                for a in node.names:
                    if a.name in fixtures.get(node.module, set()):
                        found.append(
                            f"{f.name}:{node.lineno}: imports the fixture {a.name} from"
                            f" {node.module} (share it through conftest.py)"
                        )
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr in fixtures[aliases[node.value.id]]
            ):
                module = aliases[node.value.id]
                found.append(
                    f"{f.name}:{node.lineno}: takes the fixture {node.attr} from {module}"
                    " by hand (share it through conftest.py)"
                )
    return sorted(found)


def test_no_test_file_imports_a_test_module_or_a_fixture_by_hand() -> None:
    assert violations(TESTS.glob("*.py")) == []


def test_the_check_finds_a_test_module_import_and_a_fixture_taken_by_hand(tmp_path: Path) -> None:
    (tmp_path / "harness.py").write_text(
        "import pytest\n\n@pytest.fixture(name='tmp')\ndef tmp_fixture(): ...\n\n"
        "@pytest.fixture\ndef box(): ...\n\ndef helper(): ...\n"
    )
    (tmp_path / "test_a.py").write_text(
        "from harness import helper, tmp_fixture  # noqa: F401\n"
        "import harness\n"
        "box = harness.box\n"
        "def test_x():\n    from test_b import thing\n    import test_c\n"
    )
    (tmp_path / "test_ok.py").write_text("from harness import helper\nimport harness\n")
    assert violations(tmp_path.glob("*.py")) == [
        "test_a.py:1: imports the fixture tmp_fixture from harness (share it through conftest.py)",
        "test_a.py:3: takes the fixture box from harness by hand (share it through conftest.py)",
        "test_a.py:5: imports from the test module test_b",
        "test_a.py:6: imports the test module test_c",
    ]
