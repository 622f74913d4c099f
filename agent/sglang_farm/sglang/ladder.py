"""Pure: the OOM ladder, as data plus functions over the `[oom]` steps.

Step 0 is the worker's own flags; step n applies steps 1..n cumulatively, so the
flags in force follow from (base flags, steps, n) alone and a persisted step
number is enough to rebuild them after an agent restart.

Direction: the ladder only ever steps *down* (less memory asked of the GPU: a
lower `mem_fraction_static`, fewer running requests, smaller chunks and CUDA
graphs). That is the right move for CUDA_OOM_LOAD, CUDA_OOM_SERVING,
CUDA_GRAPH_CAPTURE, KV_ALLOC_RUNTIME and HOST_OOM_KILL. It is the wrong move for
KV_CACHE_TOO_SMALL ("Not enough memory... increase --mem-fraction-static",
"Loaded weights leave no GPU memory for the KV cache"): there the static fraction
is too *small*, and lowering it would fail the same way, sooner. `next_step`
returns None for it and the failure's advice says to raise the fraction.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sglang_farm.sglang.failures import Failure, FailureKind
from sglang_farm.spec import FlagValue, OomAdjust, OomStep

# The failures the ladder answers; see the module docstring for the exclusion.
STEP_DOWN_KINDS: frozenset[FailureKind] = frozenset(
    {
        FailureKind.CUDA_OOM_LOAD,
        FailureKind.CUDA_OOM_SERVING,
        FailureKind.CUDA_GRAPH_CAPTURE,
        FailureKind.KV_ALLOC_RUNTIME,
        FailureKind.HOST_OOM_KILL,
    }
)

_FLOAT_DIGITS = 4  # 0.88 - 0.02 must read 0.86, not 0.8600000000000001


@dataclass(frozen=True, slots=True)
class FlagChange:
    """One flag changed by a ladder step; `old` is None when the step introduced the flag."""

    flag: str
    old: FlagValue | None
    new: FlagValue
    step_name: str

    def __str__(self) -> str:
        """`mem_fraction_static 0.88 -> 0.86`, the form the logs and `why` show."""
        old = "(unset)" if self.old is None else _show(self.old)
        return f"{self.flag} {old} -> {_show(self.new)}"


def _show(value: FlagValue) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return str(value)


def _where(index: int, step: OomStep) -> str:
    return f"oom.steps[{index - 1}] ({step.name!r})"


def _adjusted(adj: OomAdjust, current: FlagValue | None, index: int, step: OomStep) -> FlagValue:
    """The new value of `adj.flag`. Raises ValueError for a malformed or inapplicable adjust."""
    ops = [op for op in (adj.set, adj.add, adj.multiply) if op is not None]
    if len(ops) != 1:
        raise ValueError(
            f"{_where(index, step)}: adjust of {adj.flag!r} needs exactly one of "
            f"set/add/multiply, got {len(ops)}"
        )
    if adj.set is not None:
        return adj.set
    if current is None:
        raise ValueError(
            f"{_where(index, step)}: cannot adjust {adj.flag!r}: the worker's flags do not set "
            f"it. Give it a value in the worker's flags (e.g. {adj.flag} = ...) or use `set`."
        )
    if isinstance(current, bool) or not isinstance(current, int | float):
        raise ValueError(
            f"{_where(index, step)}: cannot adjust {adj.flag!r}: its value {current!r} is not a "
            "number; use `set` for it."
        )
    if isinstance(current, int):
        # Int flags stay ints (argparse `type=int` rejects "32.0"): round toward zero
        # by flooring, then clamp to the bounds made integral inward.
        raw = current + adj.add if adj.add is not None else current * (adj.multiply or 0.0)
        value: int | float = math.floor(raw)
        if adj.min is not None:
            value = max(value, math.ceil(adj.min))
        if adj.max is not None:
            value = min(value, math.floor(adj.max))
        return int(value)
    raw_f = current + adj.add if adj.add is not None else current * (adj.multiply or 0.0)
    if adj.min is not None:
        raw_f = max(raw_f, adj.min)
    if adj.max is not None:
        raw_f = min(raw_f, adj.max)
    return round(raw_f, _FLOAT_DIGITS)


def apply_ladder(
    base_flags: Mapping[str, FlagValue], steps: Sequence[OomStep], step: int
) -> tuple[dict[str, FlagValue], list[FlagChange]]:
    """The flags in force at `step` (0 = `base_flags` unchanged) and every change made.

    Steps 1..`step` apply in order, each to the result of the ones before; a change
    that leaves a value as it was (e.g. already at its bound) is not listed.
    Raises ValueError when `step` is outside 0..len(steps), or an adjust is malformed or
    targets a flag absent from the flags (the config should have caught it).
    """
    if not 0 <= step <= len(steps):
        raise ValueError(f"OOM ladder step {step} is out of range: the ladder has 0..{len(steps)}")
    flags: dict[str, FlagValue] = dict(base_flags)
    changes: list[FlagChange] = []
    for index, st in enumerate(steps[:step], start=1):
        for adj in st.adjust:
            old = flags.get(adj.flag)
            new = _adjusted(adj, old, index, st)
            # `1 == True` in Python: compare types too, so set true over 1 is a change.
            if old is None or type(old) is not type(new) or old != new:
                flags[adj.flag] = new
                changes.append(FlagChange(adj.flag, old, new, st.name))
    return flags, changes


def next_step(current: int, steps: Sequence[OomStep], failure: Failure) -> int | None:
    """The step to move to after `failure`, or None when the ladder does not apply.

    None when the failure is not one the ladder answers (see STEP_DOWN_KINDS; in
    particular KV_CACHE_TOO_SMALL, whose fix is the opposite direction) or when
    `current` is already the last step (exhausted).
    """
    if failure.kind not in STEP_DOWN_KINDS:
        return None
    if current >= len(steps):
        return None
    return current + 1


def _describe_adjust(adj: OomAdjust) -> str:
    if adj.set is not None:
        text = f"{adj.flag} = {_show(adj.set)}"
    elif adj.add is not None:
        text = f"{adj.flag} {'+' if adj.add >= 0 else '-'}{abs(adj.add):g}"
    else:
        text = f"{adj.flag} x{adj.multiply:g}"
    bounds = [f"{name} {v:g}" for name, v in (("min", adj.min), ("max", adj.max)) if v is not None]
    shown = ", ".join(bounds)
    return f"{text} ({shown})" if shown else text


def describe_step(steps: Sequence[OomStep], n: int) -> str:
    """One line for status and `why`.

    E.g. `step 2/4 'fewer requests': max_running_requests x0.5 (min 8)`.

    Raises ValueError when `n` is outside 0..len(steps).
    """
    total = len(steps)
    if not 0 <= n <= total:
        raise ValueError(f"OOM ladder step {n} is out of range: the ladder has 0..{total}")
    if n == 0:
        return f"step 0/{total}: base flags"
    st = steps[n - 1]
    what = "; ".join(_describe_adjust(a) for a in st.adjust) or "no change"
    return f"step {n}/{total} {st.name!r}: {what}"
