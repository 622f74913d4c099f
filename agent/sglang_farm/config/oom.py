"""Pure: `[oom]`, the ladder of steps that adjust SGLang flags after out-of-memory failures.

Each step is read on its own; whether its add/multiply finds a configured number is a
cross-check over the resolved workers (`checks`).
"""

from __future__ import annotations

import math

from sglang_farm.config.flags import _check_flag_value, _finite, _flag_key_problem, _flag_value
from sglang_farm.config.lines import _Path
from sglang_farm.config.problems import _ConversionError, _show
from sglang_farm.config.reader import _Reader, _Table
from sglang_farm.config.values import _bool, _choice, _is_number, _str
from sglang_farm.spec import OomAdjust, OomPolicy, OomStep

_OOM_OPS = ("set", "add", "multiply")


def _oom(reader: _Reader, doc: _Table) -> tuple[OomPolicy, tuple[int, ...]]:
    """The policy, and each kept step's index in the file (invalid steps are left out)."""
    path = ("oom",)
    tbl = reader.table(path, doc.get("oom", {}), ("enabled", "scope", "steps"))
    d = OomPolicy()
    raw_steps = tbl.get("steps", [])
    if not isinstance(raw_steps, list):
        reader.problems.add(
            (*path, "steps"),
            f"expected a list of steps ([[oom.steps]] tables), got {_show(raw_steps)}",
        )
        raw_steps = []
    steps: list[OomStep] = []
    indices: list[int] = []
    names: dict[str, int] = {}
    for i, raw in enumerate(raw_steps):
        step = _oom_step(reader, (*path, "steps", i), raw)
        if step is None:
            continue
        if step.name in names:
            reader.problems.add(
                (*path, "steps", i, "name"),
                f"step name {step.name!r} is already used by "
                f"oom.steps[{names[step.name]}]; each step needs its own name",
            )
        names.setdefault(step.name, i)
        steps.append(step)
        indices.append(i)
    policy = OomPolicy(
        enabled=reader.get(tbl, path, "enabled", _bool, d.enabled),
        scope=reader.get(tbl, path, "scope", _choice("worker", "all"), d.scope),
        steps=tuple(steps),
    )
    return policy, tuple(indices)


def _oom_step(reader: _Reader, path: _Path, raw: object) -> OomStep | None:
    tbl = reader.table(path, raw, ("name", "set", "add", "multiply", "min", "max"))
    if not tbl:
        return None
    ok = True
    name = reader.get(tbl, path, "name", _str, None)
    if name is None:
        ok = False
        if "name" not in tbl:
            reader.problems.add(
                (*path, "name"),
                "missing: each step needs a name (shown in status and "
                "metrics), e.g. name = 'no_buffer'",
            )
    ops: dict[str, dict[str, object]] = {}
    for op in (*_OOM_OPS, "min", "max"):
        value = tbl.get(op, {})
        if not isinstance(value, dict):
            reader.problems.add(
                (*path, op), f"expected a table of flag = value, got {_show(value)}"
            )
            ok = False
            value = {}
        ops[op] = value
    if not any(ops[op] for op in _OOM_OPS):
        reader.problems.add(
            path,
            "a step needs at least one of set, add, multiply "
            "(e.g. set = { mamba_radix_cache_strategy = 'no_buffer' })",
        )
        ok = False
    owner: dict[str, str] = {}
    adjust: list[OomAdjust] = []
    for op in _OOM_OPS:
        for flag, value in ops[op].items():
            fpath = (*path, op, flag)
            problem = _flag_key_problem(flag)
            if problem is not None:
                reader.problems.add(fpath, problem)
                ok = False
                continue
            reader.stale_flag(fpath, flag)
            if flag in owner:
                reader.problems.add(
                    fpath,
                    f"flag is also in {owner[flag]} of this step; a step changes "
                    "a flag one way (set, add or multiply)",
                )
                ok = False
                continue
            owner[flag] = op
            try:
                if op == "set":
                    fv = _flag_value(value)
                    _check_flag_value(flag, fv)
                    adjust.append(OomAdjust(flag, set=fv))
                    continue
                if not _is_number(value):
                    raise _ConversionError(f"expected a number, got {_show(value)}")
                _finite(value)
                assert isinstance(value, int | float)
                if op == "multiply" and value <= 0:
                    raise _ConversionError(f"expected a factor > 0, got {_show(value)}")
                bounds = {}
                for bound in ("min", "max"):
                    b = ops[bound].get(flag)
                    if b is not None and _is_number(b):
                        assert isinstance(b, int | float)
                        bounds[bound] = float(b)
                adjust.append(OomAdjust(flag, **{op: float(value)}, **bounds))
            except _ConversionError as exc:
                reader.problems.add(fpath, str(exc))
                ok = False
    for bound in ("min", "max"):
        for flag, value in ops[bound].items():
            bpath = (*path, bound, flag)
            if owner.get(flag) not in ("add", "multiply"):
                reader.problems.add(
                    bpath,
                    f"{bound} bounds a flag this step adds to or multiplies; "
                    f"{flag!r} is in neither add nor multiply of this step",
                )
                ok = False
            elif not _is_number(value) or (isinstance(value, float) and not math.isfinite(value)):
                reader.problems.add(bpath, f"expected a finite number, got {_show(value)}")
                ok = False
    lo, hi = ops["min"], ops["max"]
    for flag in set(lo) & set(hi):
        low, high = lo[flag], hi[flag]
        if isinstance(low, int | float) and isinstance(high, int | float) and low > high:
            reader.problems.add((*path, "max", flag), f"max {hi[flag]!r} is below min {lo[flag]!r}")
            ok = False
    if not ok or name is None:
        return None
    return OomStep(name=name, adjust=tuple(adjust))
