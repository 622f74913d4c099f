"""I/O: `python -m bench mutants`: mutation testing of the pure core (issue 27).

Each mutant is one small semantic edit of one module, made on its syntax tree (`ast`): a
comparison's boundary or sense, `and`/`or`, a dropped `not`, an arithmetic or set
operator, a number or a boolean, `min`/`max`, `any`/`all`, a dropped call statement,
`break`/`continue`, a dropped `case` guard, a negated condition. Strings are mutated
only where they are compared (their other uses are messages and table data). Type
annotations (with `from __future__ import annotations` they are text) and decorators
(`@dataclass(frozen=True, slots=True)`: declarations) are never mutated.

Each mutant runs against its module's fast tests (MODULES) in a child forked from this
process: the child forgets the farm's modules and the tests' modules, imports the
mutated module in place of the real one (nothing is written to disk), and runs pytest
with `-x`. The mutant is killed when a test fails (or errors, or runs past the time
limit), and survives when every test passes. Forking from a process that has already
imported pytest and the third-party libraries makes a mutant cost a fraction of a
second, which is why this runner exists rather than mutmut or cosmic-ray
(docs/testing.md says what each did here).

A survivor is answered either by a test that kills it, or by a row in docs/testing.md's
table of equivalent mutants (module, mutant id, why the behaviour is the same). The run
prints each module's score (killed / non-equivalent mutants) and every unanswered
survivor, and exits 1 naming each module under the floor (95 %); a listed equivalent
that is killed (or no longer exists) is reported too, so the table stays true.

Options: `--module NAME` (repeatable; default every module), `--list` (the mutants,
not run), `--jobs N` (children at once, default 1), `--out PATH` (the results as JSON).
Run it under `nice -n 15` on a shared machine.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import re
import select
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import CodeType, ModuleType

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "testing.md"
FLOOR = 0.95

# test_staging.py less its tests of real processes, locks and other users (seconds each).
_STAGING_FAST = (
    "not lock and not killed and not process_started and not another_user "
    "and not symlink and not cancel and not real_mount"
)

_CONFIG_TESTS = (
    "tests/test_config.py",
    "tests/test_staging_config.py",
    "tests/test_mutation_config.py",
    "tests/test_endpoint.py",
)

# The supervisor's own tests first, then the real Agent on a virtual clock over the fake
# runtime (no processes, sockets or sleeps): drains, the gateway, adoption, quarantine.
# Issue 32 §3 split the supervisor into modules; each is run against all of them.
_SUPERVISOR_TESTS = (
    "tests/test_supervisor.py",
    "tests/test_mutation_supervisor.py",
    "tests/test_supervisor_gate.py",
    "tests/test_supervisor_commands.py",
    "tests/test_canary_rollout.py",
    "tests/test_agent_canary.py",
    "tests/test_agent_hostdrain.py",
    "tests/test_port_taken.py",
    "tests/test_state.py",
    "tests/test_agent.py",
    "tests/test_agent_frontdoor.py",
    "tests/test_agent_gpu_health.py",
    "tests/test_agent_hardening.py",
)

# module (as docs/testing.md names it) -> (import name, pytest's arguments: its fast tests)
MODULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "supervisor": ("sglang_farm.workers.supervisor", _SUPERVISOR_TESTS),
    "machine": ("sglang_farm.workers.machine", _SUPERVISOR_TESTS),
    "budgets": ("sglang_farm.workers.budgets", _SUPERVISOR_TESTS),
    "records": ("sglang_farm.workers.records", _SUPERVISOR_TESTS),
    "events": ("sglang_farm.workers.events", _SUPERVISOR_TESTS),
    "actions": ("sglang_farm.workers.actions", _SUPERVISOR_TESTS),
    "ladder": (
        "sglang_farm.sglang.ladder",
        ("tests/test_ladder.py", "tests/test_mutation_ladder.py"),
    ),
    "xid": ("sglang_farm.gpus.xid", ("tests/test_xid.py",)),
    "gpu_health": (
        "sglang_farm.workers.gpu_health",
        ("tests/test_mutation_gpu_health.py", "tests/test_gpu_health_events.py"),
    ),
    "sglang_flags": (
        "sglang_farm.sglang.flags",
        ("tests/test_mutation_sglang_flags.py", "tests/test_config.py"),
    ),
    "classify": (
        "sglang_farm.sglang.classify",
        ("tests/test_classify.py", "tests/test_mutation_classify.py"),
    ),
    "reload_plan": ("sglang_farm.workers.reload_plan", ("tests/test_mutation_reload_plan.py",)),
    # The config package, module by module, each against all of the config's tests.
    **{
        f"config.{name}": (f"sglang_farm.config.{name}", _CONFIG_TESTS)
        for name in (
            "lines",
            "problems",
            "printable",
            "values",
            "flags",
            "reader",
            "sections",
            "oom",
            "workers",
            "checks",
            "load",
        )
    },
    "staging.plan": (
        "sglang_farm.staging.plan",
        ("tests/test_staging.py", "tests/test_mutation_staging.py", "-k", _STAGING_FAST),
    ),
    "staging.manifest": (
        "sglang_farm.staging.manifest",
        ("tests/test_staging.py", "tests/test_mutation_staging.py", "-k", _STAGING_FAST),
    ),
    "staging.state": ("sglang_farm.staging.state", ("tests/test_staging_state.py",)),
    "staging.stale": ("sglang_farm.staging.stale", ("tests/test_staging_stale.py",)),
    "workers.loading": ("sglang_farm.workers.loading", ("tests/test_staging_stale.py",)),
    # Issue 26: several gateways' combined word, against its pure tests and the agent over
    # two in-memory gateways (virtual time).
    "gateway.membership": (
        "sglang_farm.gateway.membership",
        ("tests/test_gateway_multi.py",),
    ),
    "control.auth": (
        "sglang_farm.control.auth",
        ("tests/test_control_auth.py", "tests/test_mutation_control_auth.py"),
    ),
    # The canary's pure core (issue 23), each against the pure tests that call it: no
    # processes, sockets or agent (test_agent_canary, the e2e tests and the eval runs
    # against simulators are left out; they take seconds, not milliseconds).
    "canary.verdict": (
        "sglang_farm.canary.verdict",
        (
            "tests/test_canary_verdict.py",
            "tests/test_mutation_canary_verdict.py",
            "tests/test_canary_rollout.py",
        ),
    ),
    "canary.figures": (
        "sglang_farm.canary.figures",
        (
            "tests/test_canary_figures.py",
            "tests/test_mutation_canary_figures.py",
            "tests/test_canary_verdict.py",
        ),
    ),
    "canary.promtext": (
        "sglang_farm.canary.promtext",
        ("tests/test_canary_figures.py", "tests/test_mutation_canary_promtext.py"),
    ),
    "canary.record": (
        "sglang_farm.canary.record",
        ("tests/test_canary_record.py", "tests/test_canary_rollout.py"),
    ),
    "canary.startchoice": (
        "sglang_farm.canary.startchoice",
        ("tests/test_canary_startchoice.py",),
    ),
    "canary.evalset": (
        "sglang_farm.canary.evalset",
        ("tests/test_canary_evalset.py", "tests/test_mutation_canary_evalset.py"),
    ),
    "canary.rollout": (
        "sglang_farm.canary.rollout",
        ("tests/test_canary_rollout.py", "tests/test_mutation_canary_rollout.py"),
    ),
    "canary.plan": (
        "sglang_farm.canary.plan",
        ("tests/test_canary_plan.py",),
    ),
}


# ---- mutants ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Mutant:
    module: str
    id: str  # "<qualname>/<edit>#<n>": stable while the function's code is unchanged
    line: int
    edit: str
    node_index: int  # the node's position in ast.walk order
    variant: int


_CMP_SWAPS: dict[type[ast.cmpop], tuple[type[ast.cmpop], ...]] = {
    ast.Lt: (ast.LtE, ast.GtE),
    ast.LtE: (ast.Lt, ast.Gt),
    ast.Gt: (ast.GtE, ast.LtE),
    ast.GtE: (ast.Gt, ast.Lt),
    ast.Eq: (ast.NotEq,),
    ast.NotEq: (ast.Eq,),
    ast.Is: (ast.IsNot,),
    ast.IsNot: (ast.Is,),
    ast.In: (ast.NotIn,),
    ast.NotIn: (ast.In,),
}
_BIN_SWAPS: dict[type[ast.operator], type[ast.operator]] = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Div,
    ast.Div: ast.Mult,
    ast.FloorDiv: ast.Mult,
    ast.Mod: ast.FloorDiv,
    ast.BitOr: ast.BitAnd,
    ast.BitAnd: ast.BitOr,
    ast.Pow: ast.Mult,
    ast.LShift: ast.RShift,
    ast.RShift: ast.LShift,
}
_CALL_SWAPS = {"min": "max", "max": "min", "any": "all", "all": "any"}


def _name(op: type[ast.AST]) -> str:
    return op.__name__


def _edits(node: ast.AST, parent: ast.AST | None) -> list[str]:
    """The edits this runner makes at `node`, each a short name (the mutant id's middle)."""
    out: list[str] = []
    match node:
        case ast.Compare(ops=ops):
            for i, op in enumerate(ops):
                out += [f"{_name(type(op))}->{_name(t)}@{i}" for t in _CMP_SWAPS[type(op)]]
        case ast.BoolOp(op=op):
            out.append("And->Or" if isinstance(op, ast.And) else "Or->And")
        case ast.UnaryOp(op=ast.Not()):
            out.append("not-dropped")
        case ast.UnaryOp(op=ast.USub()):
            out.append("minus-dropped")
        case ast.BinOp(op=op) | ast.AugAssign(op=op) if type(op) in _BIN_SWAPS:
            out.append(f"{_name(type(op))}->{_name(_BIN_SWAPS[type(op)])}")
        case ast.Constant(value=bool() as b):
            out.append(f"{b}->{not b}")
        case ast.Constant(value=int() | float() as n):
            out.append(f"{n!r}->{n + 1!r}")
        case ast.Constant(value=str() as s) if isinstance(parent, ast.Compare):
            out.append(f"str {s[:12]!r}->'XX'")
        case ast.Call(func=ast.Name(id=fn)) if fn in _CALL_SWAPS:
            out.append(f"{fn}->{_CALL_SWAPS[fn]}")
        case ast.Expr(value=ast.Call()):
            out.append("call-dropped")
        case ast.Break():
            out.append("break->continue")
        case ast.Continue():
            out.append("continue->break")
        case ast.match_case(guard=g) if g is not None:
            out.append("guard-dropped")
        case ast.If(test=t) | ast.While(test=t) | ast.IfExp(test=t) if not isinstance(
            t, ast.Compare | ast.BoolOp | ast.UnaryOp
        ):
            out.append("test-negated")
    return out


def _apply(node: ast.AST, variant: int, edit: str) -> ast.AST | None:
    """Make `edit` at `node` (in place); a replacement node for the parent, or None."""
    match node:
        case ast.Compare(ops=ops):
            i = int(edit.rsplit("@", 1)[1])
            choices = _CMP_SWAPS[type(ops[i])]
            k = [f"{_name(type(ops[i]))}->{_name(t)}@{i}" for t in choices].index(edit)
            ops[i] = choices[k]()
        case ast.BoolOp(op=op):
            node.op = ast.Or() if isinstance(op, ast.And) else ast.And()
        case ast.UnaryOp():
            return node.operand
        case ast.BinOp(op=op) | ast.AugAssign(op=op):
            node.op = _BIN_SWAPS[type(op)]()
        case ast.Constant(value=bool() as b):
            node.value = not b
        case ast.Constant(value=int() | float() as n):
            node.value = n + 1
        case ast.Constant(value=str()):
            node.value = "XX"
        case ast.Call(func=ast.Name(id=fn) as f):
            f.id = _CALL_SWAPS[fn]
        case ast.Expr():
            return ast.Pass()
        case ast.Break():
            return ast.Continue()
        case ast.Continue():
            return ast.Break()
        case ast.match_case():
            node.guard = None
        case ast.If() | ast.While() | ast.IfExp():
            node.test = ast.UnaryOp(ast.Not(), node.test)
    return None


def _skipped(tree: ast.Module) -> set[int]:
    """ids of the nodes never mutated: annotations, decorators, docstrings, match
    patterns, and the `if TYPE_CHECKING:` blocks."""
    skip: set[int] = set()

    def under(n: ast.AST | None) -> None:
        if n is not None:
            skip.update(id(x) for x in ast.walk(n))

    for n in ast.walk(tree):
        match n:
            case ast.arg(annotation=a) | ast.AnnAssign(annotation=a):
                under(a)
            case ast.FunctionDef(returns=r) | ast.AsyncFunctionDef(returns=r):
                under(r)
        for d in getattr(n, "decorator_list", ()):
            under(d)  # @dataclass(frozen=True, slots=True): declarations, not behaviour
        match n:
            case ast.match_case(pattern=p):
                under(p)
            case ast.If(test=ast.Name(id="TYPE_CHECKING")):
                under(n)
        body = getattr(n, "body", None)
        if (
            isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            under(body[0])
    return skip


def _qualnames(tree: ast.Module) -> dict[int, str]:
    """Each node's enclosing class/function path ("Supervisor._plan", "<module>")."""
    names: dict[int, str] = {}

    def visit(n: ast.AST, path: str) -> None:
        names[id(n)] = path
        for c in ast.iter_child_nodes(n):
            if isinstance(c, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                visit(c, c.name if path == "<module>" else f"{path}.{c.name}")
            else:
                visit(c, path)

    visit(tree, "<module>")
    return names


def _parents(tree: ast.Module) -> dict[int, ast.AST]:
    return {id(c): p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}


def mutants_of(module: str, source: str) -> list[Mutant]:
    tree = ast.parse(source)
    skip, names, parents = _skipped(tree), _qualnames(tree), _parents(tree)
    seen: dict[str, int] = {}
    out: list[Mutant] = []
    for index, node in enumerate(ast.walk(tree)):
        if id(node) in skip:
            continue
        for variant, edit in enumerate(_edits(node, parents.get(id(node)))):
            base = f"{names[id(node)]}/{edit}"
            seen[base] = seen.get(base, 0) + 1
            where = node.pattern if isinstance(node, ast.match_case) else node
            line: int = getattr(where, "lineno", 0)
            out.append(Mutant(module, f"{base}#{seen[base]}", line, edit, index, variant))
    return out


def mutated_code(source: str, path: str, m: Mutant) -> CodeType:
    tree = ast.parse(source)
    parents = _parents(tree)
    node = next(n for i, n in enumerate(ast.walk(tree)) if i == m.node_index)
    new = _apply(node, m.variant, m.edit)
    if new is not None:
        parent = parents[id(node)]
        ast.copy_location(new, node)
        for fname, value in ast.iter_fields(parent):
            if value is node:
                setattr(parent, fname, new)
            elif isinstance(value, list):
                setattr(parent, fname, [new if v is node else v for v in value])
    ast.fix_missing_locations(tree)
    return compile(tree, path, "exec")


# ---- running ----------------------------------------------------------------------------


class _MutantFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves the mutated code for one module name; every other import goes on as usual."""

    def __init__(self, name: str, path: str, code: CodeType) -> None:
        self.name, self.path, self.code = name, path, code

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, origin=self.path)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        module.__file__ = self.path
        exec(self.code, module.__dict__)  # the mutant's compiled code, from our own ast


def _forget_farm_modules() -> None:
    tests = str(ROOT / "tests")
    for name, mod in list(sys.modules.items()):
        f = getattr(mod, "__file__", None) or ""
        if name == "sglang_farm" or name.startswith("sglang_farm.") or f.startswith(tests):
            del sys.modules[name]


def _child(import_name: str, path: str, code: CodeType | None, tests: Sequence[str]) -> None:
    """In the forked child: run the tests against the mutant; exit with pytest's status."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if not os.environ.get("MUTANTS_VERBOSE"):  # the tests' output, for a failing baseline
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
    import pytest

    _forget_farm_modules()
    if code is not None:
        sys.meta_path.insert(0, _MutantFinder(import_name, path, code))
    args = ["-x", "-q", "-p", "no:cacheprovider", "-o", "timeout=60", *tests]
    os._exit(int(pytest.main(args)))


@dataclass(slots=True)
class Outcome:
    mutant: Mutant
    status: str  # killed, survived, timeout, error
    seconds: float


def _fork(import_name: str, path: str, code: CodeType | None, tests: Sequence[str]) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            _child(import_name, path, code, tests)
        except BaseException:
            import traceback

            traceback.print_exc()
        os._exit(99)
    return pid


def _status(rc: int) -> str:
    # pytest: 0 all passed, 1 a test failed, 2 interrupted (a collection error: the
    # mutated module would not import), 3 internal error; 4 usage, 5 no tests: ours.
    if rc == 0:
        return "survived"
    if rc in (1, 2, 3):
        return "killed"
    return "error"


def run_all(
    import_name: str,
    path: str,
    jobs: Sequence[tuple[Mutant, CodeType]],
    tests: Sequence[str],
    limit_s: float,
    parallel: int,
    progress: bool,
) -> Iterator[Outcome]:
    """Run each mutant's tests in a child, `parallel` at once; each past `limit_s` is killed."""
    pending = list(jobs)
    running: dict[int, tuple[Mutant, float]] = {}
    done = 0
    try:
        while pending or running:
            while pending and len(running) < parallel:
                m, code = pending.pop(0)
                running[_fork(import_name, path, code, tests)] = (m, time.monotonic())
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                now = time.monotonic()
                for p, (m, t0) in list(running.items()):
                    if now - t0 > limit_s:
                        os.kill(p, signal.SIGKILL)
                        os.waitpid(p, 0)
                        del running[p]
                        done += 1
                        yield Outcome(m, "timeout", now - t0)
                select.select([], [], [], 0.01)
                continue
            m, t0 = running.pop(pid)
            done += 1
            rc = os.waitstatus_to_exitcode(status)
            if progress:
                print(f"\r  {done}/{len(jobs)}", end="", file=sys.stderr, flush=True)
            yield Outcome(m, _status(rc), time.monotonic() - t0)
    finally:
        for p in running:  # interrupted: no child outlives the run
            os.kill(p, signal.SIGKILL)
            os.waitpid(p, 0)


def baseline(import_name: str, path: str, tests: Sequence[str]) -> float:
    """The tests pass on the real module (else no mutant can be judged); their time."""
    t0 = time.monotonic()
    pid = _fork(import_name, path, None, tests)
    _, status = os.waitpid(pid, 0)
    rc = os.waitstatus_to_exitcode(status)
    if rc != 0:
        raise SystemExit(
            f"mutants: {' '.join(tests)} fail (pytest exit {rc}) on the unmutated code: "
            "fix them first (run them with pytest, or this with MUTANTS_VERBOSE=1, to see why)"
        )
    return time.monotonic() - t0


# ---- equivalents (docs/testing.md) ------------------------------------------------------

_ROW = re.compile(r"^\|\s*`([\w.]+)`\s*\|\s*`([^`]+)`\s*\|(.+)\|\s*$")


def equivalents(doc: Path = DOC) -> dict[tuple[str, str], str]:
    """(module, mutant id) -> why it is equivalent: the rows of docs/testing.md's table."""
    if not doc.exists():
        return {}
    out: dict[tuple[str, str], str] = {}
    in_table = False
    for line in doc.read_text().splitlines():
        if line.startswith("## "):
            in_table = line.strip() == "## Equivalent mutants"
        elif in_table and (m := _ROW.match(line)):
            out[(m.group(1), m.group(2))] = m.group(3).strip()
    return out


@dataclass(slots=True)
class Score:
    module: str
    mutants: int = 0
    killed: int = 0
    survived: int = 0  # unanswered: neither killed nor listed as equivalent
    equivalent: int = 0
    errors: int = 0
    seconds: float = 0.0
    survivors: list[dict[str, object]] = field(default_factory=list)
    stale_equivalents: list[str] = field(default_factory=list)

    @property
    def score(self) -> float:
        judged = self.mutants - self.equivalent
        return self.killed / judged if judged else 1.0


def _source_line(source: str, line: int) -> str:
    lines = source.splitlines()
    return lines[line - 1].strip() if 0 < line <= len(lines) else ""


def run_module(
    module: str, equiv: dict[tuple[str, str], str], parallel: int, progress: bool
) -> Score:
    import_name, tests = MODULES[module]
    spec = importlib.util.find_spec(import_name)
    assert spec is not None and spec.origin is not None, import_name
    path = spec.origin
    source = Path(path).read_text()
    t0 = time.monotonic()
    base = baseline(import_name, path, tests)
    score = Score(module)
    jobs = []
    for m in mutants_of(module, source):
        try:
            jobs.append((m, mutated_code(source, path, m)))
        except (SyntaxError, ValueError, TypeError):
            continue  # an edit Python refuses to compile is no mutant
    score.mutants = len(jobs)
    ids = {m.id for m, _ in jobs}
    limit = max(20.0, 10 * base)
    for o in run_all(import_name, path, jobs, tests, limit, parallel, progress):
        m = o.mutant
        known = (module, m.id) in equiv
        if o.status in ("killed", "timeout"):
            score.killed += 1
            if known:
                score.stale_equivalents.append(f"{m.id} (listed as equivalent, but killed)")
        elif o.status == "error":
            score.errors += 1
            score.survivors.append(
                {"id": m.id, "line": m.line, "code": _source_line(source, m.line), "error": 1}
            )
        elif known:
            score.equivalent += 1
        else:
            score.survived += 1
            score.survivors.append(
                {"id": m.id, "line": m.line, "code": _source_line(source, m.line)}
            )
    score.stale_equivalents += [
        f"{mid} (listed as equivalent, no such mutant)"
        for (mod, mid) in equiv
        if mod == module and mid not in ids
    ]
    score.seconds = time.monotonic() - t0
    if progress:
        print(file=sys.stderr)
    return score


def _warm(modules: Sequence[str]) -> None:
    """Import pytest and what the tests import, once, before any fork (not pytest's
    plugins: imported before pytest runs, they could not be rewritten, and the warning
    is an error under the project's filterwarnings)."""
    import pytest  # noqa: F401  # warm: every child runs it

    for p in (str(ROOT), str(ROOT / "tests")):
        if p not in sys.path:
            sys.path.insert(0, p)
    for module in modules:
        for t in (a for a in MODULES[module][1] if a.endswith(".py")):
            # A test module that will not import is reported by the child's run.
            with contextlib.suppress(Exception):
                importlib.import_module(Path(t).stem)


def table(scores: Sequence[Score]) -> str:
    rows = [
        "| module | mutants | killed | survived | equivalent | score | run time |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in scores:
        rows.append(
            f"| `{s.module}` | {s.mutants} | {s.killed} | {s.survived} | {s.equivalent} | "
            f"{100 * s.score:.1f} % | {s.seconds:.0f} s |"
        )
    return "\n".join(rows)


# A package's name stands for each of its modules (`--module config`: config.lines, ...).
PACKAGES = frozenset(m.rpartition(".")[0] for m in MODULES if "." in m)


def _expand(names: Sequence[str]) -> list[str]:
    """`--module` names -> modules of MODULES, a package's in MODULES' order."""
    out: list[str] = []
    for name in names:
        out += [name] if name in MODULES else [m for m in MODULES if m.startswith(name + ".")]
    return list(dict.fromkeys(out))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench mutants", description=__doc__.split("\n")[0])
    ap.add_argument("--module", action="append", choices=sorted({*MODULES, *PACKAGES}))
    ap.add_argument("--list", action="store_true", help="list the mutants; run nothing")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    os.chdir(ROOT)
    modules = _expand(a.module) if a.module else list(MODULES)
    if a.list:
        for module in modules:
            spec = importlib.util.find_spec(MODULES[module][0])
            assert spec is not None and spec.origin is not None
            for m in mutants_of(module, Path(spec.origin).read_text()):
                print(f"{module}\t{m.line}\t{m.id}")
        return 0
    # SIGTERM ends the run like ^C: its children are killed on the way out (run_all).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    _warm(modules)
    equiv = equivalents()
    t0 = time.monotonic()
    scores = []
    for module in modules:
        print(f"mutants: {module} ({', '.join(MODULES[module][1])})", file=sys.stderr)
        scores.append(run_module(module, equiv, max(1, a.jobs), sys.stderr.isatty()))
    print(table(scores))
    bad = []
    for s in scores:
        for sv in s.survivors:
            what = "ERROR" if sv.get("error") else "survived"
            print(f"{what}: {s.module} {sv['id']} (line {sv['line']}: {sv['code']})")
        for st in s.stale_equivalents:
            print(f"stale: {s.module} {st}")
        if s.score < FLOOR or s.errors:
            bad.append(s.module)
    total = time.monotonic() - t0
    print(f"mutants: {sum(s.mutants for s in scores)} in {total:.0f} s")
    if a.out:
        a.out.write_text(
            json.dumps(
                {"seconds": total, "scores": [asdict(s) | {"score": s.score} for s in scores]},
                indent=2,
            )
            + "\n"
        )
    if bad:
        print(
            f"mutants: below the floor ({100 * FLOOR:.0f} % of non-equivalent mutants killed): "
            f"{', '.join(bad)}; answer each survivor above with a test that kills it, or a "
            "row in docs/testing.md's equivalent mutants (why the behaviour is the same)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
