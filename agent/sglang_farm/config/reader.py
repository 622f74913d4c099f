"""Pure: reading typed values out of the TOML tables, recording each problem.

`_Reader` is what the sections share: a table with only its known keys (a typo is a
problem with a guess, never a silent default), one key through a converter, an
environment table, a table of SGLang flags.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import TypeVar

from sglang_farm.config.flags import _check_flag_value, _flag_key_problem, _flag_value
from sglang_farm.config.lines import _Path
from sglang_farm.config.problems import _ConversionError, _fmt_path, _Problems, _show
from sglang_farm.config.values import _ENV_NAME_RE, _is_number
from sglang_farm.sglang import flags as sglang_flags
from sglang_farm.spec import FlagValue

_T = TypeVar("_T")
_Table = dict[str, object]


_KEY_HINTS: dict[_Path, str] = {
    ("workers", "env"): "the farm-wide environment goes in [farm] env; one worker's in "
    "[workers.overrides.N] env",
    ("workers", "gpu"): "write gpus",
}


class _Reader:
    """Reads the document's tables for the sections; every problem goes to `problems`."""

    def __init__(self, problems: _Problems) -> None:
        self.problems = problems

    def table(self, path: _Path, value: object, allowed: tuple[str, ...]) -> _Table:
        """`value` as a table with only `allowed` keys; {} (and a problem) if it is not a table."""
        if not isinstance(value, dict):
            self.problems.add(path, f"expected a table, got {_show(value)}")
            return {}
        for key in value:
            if key in allowed:
                continue
            kpath = (*path, key)
            close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
            hint = _KEY_HINTS.get(kpath) or (f"did you mean {close[0]!r}?" if close else "")
            where = f"[{_fmt_path(path)}]" if path else "the file"
            self.problems.add(
                kpath,
                f"unknown key{f' ({hint})' if hint else ''}; {where} accepts: {', '.join(allowed)}",
            )
        return value

    def get(
        self, tbl: _Table, path: _Path, key: str, conv: Callable[[object], _T], default: _T
    ) -> _T:
        """The converted value of `key`; `default` when absent or invalid (then with a problem)."""
        if key not in tbl:
            return default
        try:
            return conv(tbl[key])
        except _ConversionError as exc:
            self.problems.add((*path, key), str(exc))
            return default

    def env(self, tbl: _Table, path: _Path) -> dict[str, str]:
        raw = tbl.get("env", {})
        epath = (*path, "env")
        if not isinstance(raw, dict):
            self.problems.add(epath, f'expected a table of NAME = "value", got {_show(raw)}')
            return {}
        out: dict[str, str] = {}
        for name, value in raw.items():
            if not _ENV_NAME_RE.fullmatch(name):
                self.problems.add(
                    (*epath, name),
                    "expected an environment variable name "
                    "(letters, digits, '_', not starting with a digit)",
                )
            elif name == "CUDA_VISIBLE_DEVICES":
                self.problems.add(
                    (*epath, name),
                    "the farm sets CUDA_VISIBLE_DEVICES from workers.gpus "
                    "(one worker: workers.overrides.N.gpus); remove it here",
                )
            elif not isinstance(value, str):
                self.problems.add(
                    (*epath, name),
                    f"expected a string (quote it: {name} = "
                    f'"{value if _is_number(value) else "..."}"), got {_show(value)}',
                )
            else:
                out[name] = value
        return out

    def stale_flag(self, path: _Path, key: str) -> None:
        """A warning for a spelling of an older SGLang (the installed one may be that old)."""
        stale = sglang_flags.stale_spelling(key)
        if stale is not None:
            self.problems.warn(path, stale)

    def flags(self, tbl: _Table, path: _Path) -> dict[str, FlagValue]:
        """SGLang flags of `[sglang]` or an override's `sglang` table, valid ones only."""
        out: dict[str, FlagValue] = {}
        for key, raw in tbl.items():
            kpath = (*path, key)
            problem = _flag_key_problem(key)
            if problem is not None:
                self.problems.add(kpath, problem)
                continue
            self.stale_flag(kpath, key)
            try:
                value = _flag_value(raw)
                _check_flag_value(key, value)
            except _ConversionError as exc:
                self.problems.add(kpath, str(exc))
                continue
            out[key] = value
        return out
