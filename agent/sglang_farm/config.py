"""Pure: TOML text -> a validated, frozen `FarmSpec`, or every problem at once.

`load_spec(text, source=...)` does no I/O (`tomllib.loads`); `load_spec_file(path)` is
the thin shell that reads one file. Validation runs in two passes: shape and types
per section, then cross-field rules over the resolved workers (one worker per GPU,
unique ports, the canary is a worker, the OOM ladder adjusts configured numbers).
Unknown keys are errors, so a typo never turns into a silent default. Before both, every
string value anywhere is refused if it holds a control character: values are written
into unit files (a newline would start a new directive), command lines and environments.

Every problem is one line, `file:line: key.path: what is wrong (the bad value) and
what is accepted`. tomllib gives no positions, so `_LineIndex` finds them by scanning
the text for table headers and key lines (best effort; no line when it cannot tell).

Raises `errors.ConfigError(source, problems)`. A flag that some SGLang version accepts
is never a problem: a spelling of an older SGLang (`sglang_flags.RENAMES`) is a
warning naming both versions, returned by `check_spec` / `check_spec_file` beside the
spec (this module has no SGLang at hand; the doctor judges flags by the installed
one). Workers listening off loopback without an API key are a warning too. The
reference is `docs/config.md`.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import sys
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TypeVar

from sglang_farm import sglang_flags
from sglang_farm.errors import ConfigError
from sglang_farm.gateway.managed import OWNED_FLAGS as GATEWAY_OWNED_FLAGS
from sglang_farm.gateway.managed import POLICIES as GATEWAY_POLICIES
from sglang_farm.gateway.managed import is_loopback
from sglang_farm.paths import DEFAULT_CONFIG_PATH
from sglang_farm.sglang_flags import SGLANG_MODULE
from sglang_farm.spec import (
    ControlSpec,
    FarmSection,
    FarmSpec,
    FlagValue,
    GatewaySpec,
    HealthPolicy,
    MetricsSpec,
    ModelSpec,
    OomAdjust,
    OomPolicy,
    OomStep,
    RestartPolicy,
    StartupPolicy,
    WorkerSpec,
)

# `farm.python = "@agent"`: the interpreter that runs the agent itself (the demo uses it
# to run the simulator from the agent's own environment).
AGENT_PYTHON = "@agent"

_T = TypeVar("_T")
_Path = tuple[str | int, ...]
_Table = dict[str, object]


@dataclass(frozen=True, slots=True)
class WorkersDefaults:
    """`[workers]` defaults (the section resolves into `WorkerSpec`s, so it has no spec class)."""

    gpus: str = "all"
    gpus_per_worker: int = 1
    host: str = "127.0.0.1"  # SGLang's own default; "0.0.0.0" serves other hosts too
    base_port: int = 30000  # SGLang's default port; worker i listens on base_port + i
    # Outside SGLang's random NCCL range (22000-29999) so a pinned port never races a
    # random one; worker i uses nccl_base_port + i.
    nccl_base_port: int = 31000


# --- where keys live in the text ------------------------------------------------------

_KEYPART = r"""(?:[A-Za-z0-9_-]+|"(?:[^"\\]|\\.)*"|'[^']*')"""
_DOTTED = rf"{_KEYPART}(?:\s*\.\s*{_KEYPART})*"
_HEADER_RE = re.compile(rf"^\s*(\[\[?)\s*({_DOTTED})\s*\]")
_KEYLINE_RE = re.compile(rf"^\s*({_DOTTED})\s*=")
_KEYPART_RE = re.compile(_KEYPART)


def _split_key(dotted: str) -> list[str]:
    parts = []
    for raw in _KEYPART_RE.findall(dotted):
        if raw.startswith('"'):
            parts.append(raw[1:-1].encode("latin-1", "backslashreplace").decode("unicode_escape"))
        elif raw.startswith("'"):
            parts.append(raw[1:-1])
        else:
            parts.append(raw)
    return parts


class _ValueScanner:
    """Tracks whether a value continues on the next line (open brackets, multi-line strings)."""

    def __init__(self) -> None:
        self.depth = 0
        self.mode: str | None = None  # '"""' or "'''" inside a multi-line string

    @property
    def open(self) -> bool:
        return self.depth > 0 or self.mode is not None

    def feed(self, s: str) -> None:
        i = 0
        while i < len(s):
            if self.mode is not None:
                if s.startswith(self.mode, i):
                    i += 3
                    self.mode = None
                elif self.mode == '"""' and s[i] == "\\":
                    i += 2
                else:
                    i += 1
                continue
            c = s[i]
            if c == "#":
                return
            if s.startswith('"""', i) or s.startswith("'''", i):
                self.mode = s[i : i + 3]
                i += 3
                continue
            if c in "\"'":
                i += 1
                while i < len(s) and s[i] != c:
                    i += 2 if (c == '"' and s[i] == "\\") else 1
            elif c in "[{":
                self.depth += 1
            elif c in "]}":
                self.depth = max(0, self.depth - 1)
            i += 1


class _LineIndex:
    """Key path -> 1-based line of its table header or key line."""

    def __init__(self, text: str) -> None:
        self.lines: dict[_Path, int] = {}
        aot_index: dict[_Path, int] = {}  # array-of-tables path -> index of its last element
        table: _Path = ()
        scanner = _ValueScanner()
        for lineno, line in enumerate(text.splitlines(), start=1):
            if scanner.open:
                scanner.feed(line)
                continue
            header = _HEADER_RE.match(line)
            if header:
                parts = _split_key(header.group(2))
                path = (*self._resolve(parts[:-1], aot_index), parts[-1])
                if header.group(1) == "[[":
                    aot_index[path] = aot_index.get(path, -1) + 1
                    path = (*path, aot_index[path])
                elif path in aot_index:
                    path = (*path, aot_index[path])
                table = path
                self.lines.setdefault(table, lineno)
                continue
            keyline = _KEYLINE_RE.match(line)
            if keyline:
                path = table + tuple(_split_key(keyline.group(1)))
                self.lines.setdefault(path, lineno)
                scanner.feed(line[keyline.end() :])

    @staticmethod
    def _resolve(parts: list[str], aot_index: Mapping[_Path, int]) -> _Path:
        path: _Path = ()
        for part in parts:
            path = (*path, part)
            if path in aot_index:
                path = (*path, aot_index[path])
        return path

    def line(self, path: _Path) -> int | None:
        """The line of `path`, else of its nearest enclosing key or table; None if unknown."""
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path[:-1]
        return None


# --- problems -------------------------------------------------------------------------


def _fmt_path(path: _Path) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            text = part if re.fullmatch(r"[A-Za-z0-9_-]+", part) else repr(part)
            out += ("." if out else "") + text
    return out


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class _Bad(Exception):
    """Raised by a converter; the message says what is wrong and what is accepted."""


_Located = tuple[int | None, int, str]


def _by_line(items: list[_Located]) -> list[str]:
    # By line, so the report reads top to bottom; lines without a position last.
    return [t for _, _, t in sorted(items, key=lambda x: (x[0] is None, x[0] or 0, x[1]))]


class _Problems:
    def __init__(self, source: str, index: _LineIndex) -> None:
        self.source = source
        self.index = index
        self.items: list[_Located] = []
        self.warnings: list[_Located] = []
        # Keys whose value was already refused as a whole (control characters): later
        # problems at or below them would only repeat it.
        self.refused: set[_Path] = set()

    def _locate(self, path: _Path, message: str, line_of: _Path | None) -> tuple[int | None, str]:
        line = self.index.line(path if line_of is None else line_of)
        where = f"{self.source}:{line}" if line is not None else self.source
        return line, (f"{where}: {_fmt_path(path)}: {message}" if path else f"{where}: {message}")

    def add(self, path: _Path, message: str, *, line_of: _Path | None = None) -> None:
        if any(path[: len(r)] == r for r in self.refused):
            return
        line, text = self._locate(path, message, line_of)
        self.items.append((line, len(self.items), text))

    def warn(self, path: _Path, message: str) -> None:
        """Something that works but deserves a look (never fails the load)."""
        line, text = self._locate(path, message, None)
        self.warnings.append((line, len(self.warnings), text))

    def sorted(self) -> list[str]:
        return _by_line(self.items)

    def sorted_warnings(self) -> list[str]:
        return _by_line(self.warnings)

    def __bool__(self) -> bool:
        return bool(self.items)


# --- converters: value -> typed value, or _Bad ----------------------------------------


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _str(v: object) -> str:
    if not isinstance(v, str) or not v:
        raise _Bad(f"expected a non-empty string, got {_show(v)}")
    return v


def _bool(v: object) -> bool:
    if not isinstance(v, bool):
        raise _Bad(f"expected true or false, got {_show(v)}")
    return v


def _int(lo: int | None = None, hi: int | None = None) -> Callable[[object], int]:
    def conv(v: object) -> int:
        if not _is_int(v):
            raise _Bad(f"expected an integer{_range_text(lo, hi)}, got {_show(v)}")
        assert isinstance(v, int)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise _Bad(f"expected an integer{_range_text(lo, hi)}, got {_show(v)}")
        return v

    return conv


def _range_text(lo: int | None, hi: int | None) -> str:
    if lo is not None and hi is not None:
        return f" in {lo}..{hi}"
    if lo is not None:
        return f" >= {lo}"
    if hi is not None:
        return f" <= {hi}"
    return ""


_PORT = _int(1, 65535)

_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION_HINT = "seconds as a number, or a string like '500ms', '30s', '5m', '1h30m'"
# Durations become systemd time spans (TimeoutStartSec=, TimeoutStopSec=), and systemd
# ignores a span it cannot parse (and keeps its 90 s default); none of the farm's waits
# needs more than a year.
MAX_DURATION_S = 365 * 24 * 3600.0


def parse_duration(v: object) -> float:
    """Seconds from a number or a string like "500ms", "30s", "5m", "1h30m".

    Raises ValueError with a user-facing message, also for NaN and infinity (TOML has
    `nan` and `inf`; a string of 400 digits overflows to infinity) and for more than
    `MAX_DURATION_S`. Zero and negative values are for the caller to judge.
    """
    seconds: float | None = None
    if _is_number(v):
        assert isinstance(v, int | float)
        # An integer too big for a float (TOML integers may be huge here) is just "too long".
        seconds = float(v) if isinstance(v, float) or abs(v) < 10**18 else math.copysign(1e18, v)
    elif isinstance(v, str):
        text = v.strip()
        pos, total = 0, 0.0
        for m in _DURATION_RE.finditer(text):
            if m.start() != pos:
                break
            total += float(m.group(1)) * _DURATION_UNITS[m.group(2)]
            pos = m.end()
        if text and pos == len(text):
            seconds = total
    if seconds is None:
        raise ValueError(f"expected a duration ({_DURATION_HINT}), got {_show(v)}")
    if not math.isfinite(seconds):
        raise ValueError(f"expected a duration ({_DURATION_HINT}), a finite one, got {_show(v)}")
    if seconds > MAX_DURATION_S:
        raise ValueError(
            f"expected a duration of at most {MAX_DURATION_S:.0f} s (365 days), got {_show(v)}"
        )
    return seconds


def _duration(*, allow_zero: bool = False) -> Callable[[object], float]:
    def conv(v: object) -> float:
        try:
            seconds = parse_duration(v)
        except ValueError as exc:
            raise _Bad(str(exc)) from None
        if seconds < 0 or (seconds == 0 and not allow_zero):
            need = ">= 0" if allow_zero else "> 0"
            raise _Bad(f"expected a duration {need} ({_DURATION_HINT}), got {_show(v)}")
        return seconds

    return conv


def _choice(*options: str) -> Callable[[object], str]:
    def conv(v: object) -> str:
        if v not in options:
            accepted = ", ".join(repr(o) for o in options)
            raise _Bad(f"expected one of {accepted}, got {_show(v)}")
        assert isinstance(v, str)
        return v

    return conv


def _abs_path(v: object) -> str:
    if not isinstance(v, str) or not v.startswith("/"):
        raise _Bad(f"expected an absolute path (starting with '/'), got {_show(v)}")
    return v


_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_MODULE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SNAKE_RE = re.compile(r"[a-z][a-z0-9_]*")


def _farm_name(v: object) -> str:
    if not isinstance(v, str) or not _NAME_RE.fullmatch(v):
        raise _Bad(f"expected a name of letters, digits, '_', '.', '-', got {_show(v)}")
    return v


def _module(v: object) -> str:
    if not isinstance(v, str) or not _MODULE_RE.fullmatch(v):
        raise _Bad(
            f"expected a dotted Python module name like 'sglang.launch_server', got {_show(v)}"
        )
    return v


# What systemd refuses in an ExecStart= program path (quotes, backslashes; `$` is not
# expanded there), and whitespace, which would need quoting wherever the path is written.
_PYTHON_BAD = frozenset("\"'\\$")


def _python(v: object) -> str:
    if not isinstance(v, str) or not (v.startswith("/") or v == AGENT_PYTHON):
        raise _Bad(
            f"expected an absolute path to the SGLang environment's interpreter "
            f"(e.g. '/opt/sglang/bin/python3') or {AGENT_PYTHON!r}, got {_show(v)}"
        )
    bad = sorted({ch for ch in v if ch in _PYTHON_BAD or ch.isspace()})
    if bad:
        shown = ", ".join(repr(ch) for ch in bad)
        raise _Bad(
            f"the workers' ExecStart= cannot run a program path containing {shown}, "
            f"got {_show(v)}; use a path without quotes, backslashes, '$' or spaces "
            "(a symlink to the interpreter will do)"
        )
    return v


# POSIX portable user names (letters, digits, '.', '_', '-'; no leading '-') as systemd's
# User=/Group= accept them, and not starting with a digit (systemd would read a number as
# a uid); at most 32 characters (useradd's limit).
_ACCOUNT_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}")


def _account(kind: str) -> Callable[[object], str]:
    def conv(v: object) -> str:
        if not isinstance(v, str) or not _ACCOUNT_RE.fullmatch(v):
            raise _Bad(
                f"expected a {kind} name: a letter or '_', then letters, digits, '_', "
                f"'.' or '-', at most 32 characters (as useradd and systemd's "
                f"{kind.capitalize()}= accept), got {_show(v)}"
            )
        return v

    return conv


def _key_file(v: object) -> str:
    path = _abs_path(v)
    # The rest of a LoadCredential= line is the path: systemd strips surrounding blanks
    # and reads a trailing backslash as a line continuation.
    if path != path.strip() or path.endswith("\\"):
        raise _Bad(
            f"expected a path without surrounding blanks or a trailing backslash "
            f"(systemd's LoadCredential= would misread it), got {_show(v)}"
        )
    return path


def _socket_path(v: object) -> str:
    path = _abs_path(v)
    # AF_UNIX paths are capped at 108 bytes including the terminating NUL.
    if len(os.fsencode(path)) > 107:
        raise _Bad(f"a Unix socket path must be at most 107 bytes, got {len(path)}: {_show(v)}")
    return path


def _listen(v: object) -> str:
    hint = "expected 'host:port' (e.g. '127.0.0.1:9840', '[::1]:9840')"
    if not isinstance(v, str) or ":" not in v:
        raise _Bad(f"{hint}, got {_show(v)}")
    host, _, port = v.rpartition(":")
    # Port 0 asks the kernel for a free port (tests, throwaway farms); the log names it.
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise _Bad(f"{hint} with a port in 0..65535, got {_show(v)}")
    if host.startswith("[") != host.endswith("]"):
        raise _Bad(f"{hint}, got {_show(v)}")
    return v


def listen_port(listen: str) -> int:
    """The port of a validated `metrics.listen` value."""
    return int(listen.rpartition(":")[2])


# --- control characters ---------------------------------------------------------------

_CONTROL_NAMES = {"\n": "a newline", "\r": "a carriage return", "\t": "a tab", "\0": "a NUL"}


def _control_char(text: str) -> str | None:
    """The first C0 control character or DEL in `text`, named for people; None if none."""
    for ch in text:
        if ord(ch) < 0x20 or ord(ch) == 0x7F:
            return _CONTROL_NAMES.get(ch, f"the control character {ch!r}")
    return None


def _refuse_control_chars(p: _Problems, value: object, path: _Path = ()) -> None:
    """Refuse every string value holding a control character, wherever it is.

    Values end up in unit files (User=, Environment=, ExecStart=), whose parser reads a
    newline as the start of the next directive (`ExecStartPre=+...` runs as root), in
    argv and environments (no NUL can pass), and in log and status lines. The key is
    then marked refused, so the section's own checks do not report it again.
    """
    if isinstance(value, dict):
        for key, item in value.items():
            _refuse_control_chars(p, item, (*path, key))
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, dict | list):
                _refuse_control_chars(p, item, (*path, i))
            elif isinstance(item, str) and (found := _control_char(item)) is not None:
                _refuse_control(p, path, found, f" (item {i + 1})")
                return
        return
    if isinstance(value, str) and (found := _control_char(value)) is not None:
        _refuse_control(p, path, found, "")


def _refuse_control(p: _Problems, path: _Path, found: str, where: str) -> None:
    nul = "; no process can receive a NUL" if found == "a NUL" else ""
    p.add(
        path,
        f"contains {found}{where}, a control character: every value must be one line "
        f"of printable text (it goes into unit files, command lines and environments{nul}); "
        "remove it (a JSON value fits on one line)",
    )
    p.refused.add(path)


# --- SGLang flags ---------------------------------------------------------------------


def _check_flag_value(key: str, value: FlagValue) -> None:
    """Checks for the few flags whose bad values SGLang only rejects after minutes, or never."""
    number = value if _is_number(value) and isinstance(value, int | float) else None
    integer = value if _is_int(value) and isinstance(value, int) else None
    if key == "mem_fraction_static" and not (number is not None and 0 < number < 1):
        raise _Bad(f"expected a number in (0, 1), the fraction of GPU memory, got {_show(value)}")
    chunk_ok = integer is not None and (integer > 0 or integer == -1)
    if key == "chunked_prefill_size" and not chunk_ok:
        raise _Bad(
            f"expected an integer > 0, or -1 to disable (SGLang rejects '8k'), got {_show(value)}"
        )
    if key == "max_running_requests" and not (integer is not None and integer >= 1):
        raise _Bad(f"expected an integer >= 1, got {_show(value)}")
    if key in sglang_flags.MAMBA_STRATEGY_KEYS and value not in sglang_flags.MAMBA_STRATEGIES:
        accepted = ", ".join(repr(s) for s in sglang_flags.MAMBA_STRATEGIES)
        raise _Bad(f"expected one of {accepted}, got {_show(value)}")
    if key == "served_model_name" and isinstance(value, str) and ":" in value:
        raise _Bad(f"SGLang asserts that the served model name has no ':', got {_show(value)}")


def _flag_key_problem(key: str) -> str | None:
    """Why `key` cannot be in a table of SGLang flags; None when it can."""
    if key in sglang_flags.REFUSED_ALIASES:
        return sglang_flags.REFUSED_ALIASES[key]
    if key in sglang_flags.FARM_OWNED:
        return f"not allowed here: {sglang_flags.FARM_OWNED[key]}"
    if not _SNAKE_RE.fullmatch(key):
        snake = key.strip("-").replace("-", "_").lower()
        hint = f"; write {snake!r}" if _SNAKE_RE.fullmatch(snake) else ""
        return (
            f"SGLang flags are written in snake_case (mem_fraction_static for "
            f"--mem-fraction-static), got {key!r}{hint}"
        )
    return None


def _finite(v: object) -> None:
    """Refuse TOML's nan and inf: no SGLang flag or farm number means them."""
    if isinstance(v, float) and not math.isfinite(v):
        raise _Bad(f"expected a finite number, got {_show(v)}")


def _flag_value(v: object) -> FlagValue:
    if isinstance(v, bool | int | float | str):
        _finite(v)
        return v
    if isinstance(v, list):
        if not v:
            raise _Bad("expected at least one item (SGLang's list flags need one); omit the key")
        if not all(_is_number(x) or isinstance(x, str) for x in v):
            raise _Bad(f"expected a list of strings or numbers, got {_show(v)}")
        for x in v:
            _finite(x)
        return tuple(v)
    if isinstance(v, dict):
        raise _Bad(
            f"expected a flag value (true, false, a number, a string or a list), got a table "
            f"{_show(v)}; JSON flags take a string: key = '{{\"k\": 1}}'"
        )
    raise _Bad(f"expected true, false, a number, a string or a list, got {_show(v)}")


# --- the reader -----------------------------------------------------------------------

_SECTIONS = (
    "farm",
    "workers",
    "startup",
    "health",
    "restart",
    "oom",
    "metrics",
    "control",
    "gateway",
    "sglang",
    "model",
)

_KEY_HINTS: dict[_Path, str] = {
    ("workers", "env"): "the farm-wide environment goes in [farm] env; one worker's in "
    "[workers.overrides.N] env",
    ("workers", "gpu"): "write gpus",
}


class _Reader:
    def __init__(self, problems: _Problems) -> None:
        self.p = problems

    def table(self, path: _Path, value: object, allowed: tuple[str, ...]) -> _Table:
        """`value` as a table with only `allowed` keys; {} (and a problem) if it is not a table."""
        if not isinstance(value, dict):
            self.p.add(path, f"expected a table, got {_show(value)}")
            return {}
        for key in value:
            if key in allowed:
                continue
            kpath = (*path, key)
            close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
            hint = _KEY_HINTS.get(kpath) or (f"did you mean {close[0]!r}?" if close else "")
            where = f"[{_fmt_path(path)}]" if path else "the file"
            self.p.add(
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
        except _Bad as exc:
            self.p.add((*path, key), str(exc))
            return default

    def env(self, tbl: _Table, path: _Path) -> dict[str, str]:
        raw = tbl.get("env", {})
        epath = (*path, "env")
        if not isinstance(raw, dict):
            self.p.add(epath, f'expected a table of NAME = "value", got {_show(raw)}')
            return {}
        out: dict[str, str] = {}
        for name, value in raw.items():
            if not _ENV_NAME_RE.fullmatch(name):
                self.p.add(
                    (*epath, name),
                    "expected an environment variable name "
                    "(letters, digits, '_', not starting with a digit)",
                )
            elif name == "CUDA_VISIBLE_DEVICES":
                self.p.add(
                    (*epath, name),
                    "the farm sets CUDA_VISIBLE_DEVICES from workers.gpus "
                    "(one worker: workers.overrides.N.gpus); remove it here",
                )
            elif not isinstance(value, str):
                self.p.add(
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
            self.p.warn(path, stale)

    def flags(self, tbl: _Table, path: _Path) -> dict[str, FlagValue]:
        """SGLang flags of `[sglang]` or an override's `sglang` table, valid ones only."""
        out: dict[str, FlagValue] = {}
        for key, raw in tbl.items():
            kpath = (*path, key)
            problem = _flag_key_problem(key)
            if problem is not None:
                self.p.add(kpath, problem)
                continue
            self.stale_flag(kpath, key)
            try:
                value = _flag_value(raw)
                _check_flag_value(key, value)
            except _Bad as exc:
                self.p.add(kpath, str(exc))
                continue
            out[key] = value
        return out


# --- sections -------------------------------------------------------------------------


def _farm(r: _Reader, doc: _Table, agent_python: str | None) -> FarmSection:
    path = ("farm",)
    d = FarmSection()
    tbl = r.table(
        path, doc.get("farm", {}), ("name", "python", "module", "user", "group", "state_dir", "env")
    )
    python = r.get(tbl, path, "python", _python, d.python)
    if python == AGENT_PYTHON:
        if agent_python is None:
            r.p.add(
                (*path, "python"),
                f"{AGENT_PYTHON!r} means the interpreter running the "
                "agent, which this caller did not give; write an absolute path instead",
            )
        python = agent_python or d.python
    return FarmSection(
        name=r.get(tbl, path, "name", _farm_name, d.name),
        python=python,
        module=r.get(tbl, path, "module", _module, d.module),
        user=r.get(tbl, path, "user", _account("user"), d.user),
        group=r.get(tbl, path, "group", _account("group"), d.group),
        state_dir=r.get(tbl, path, "state_dir", _abs_path, d.state_dir),
        env=MappingProxyType(r.env(tbl, path)),
    )


def _canary(v: object) -> int | None:
    if v is False:
        return None
    if not _is_int(v) or not isinstance(v, int):
        raise _Bad(f"expected a worker id (an integer) or false for no canary, got {_show(v)}")
    return v


def _startup(r: _Reader, doc: _Table) -> StartupPolicy:
    path = ("startup",)
    d = StartupPolicy()
    tbl = r.table(
        path, doc.get("startup", {}), ("canary", "parallel", "load_timeout", "poll_interval")
    )
    return StartupPolicy(
        # An invalid canary becomes None so that the cross-check does not report it twice.
        canary=r.get(tbl, path, "canary", _canary, d.canary if "canary" not in tbl else None),
        parallel=r.get(tbl, path, "parallel", _int(1), d.parallel),
        load_timeout=r.get(tbl, path, "load_timeout", _duration(), d.load_timeout),
        poll_interval=r.get(tbl, path, "poll_interval", _duration(), d.poll_interval),
    )


def _url_path(v: object) -> str:
    if not isinstance(v, str) or not v.startswith("/"):
        raise _Bad(f"expected a URL path starting with '/', got {_show(v)}")
    return v


def _health(r: _Reader, doc: _Table) -> HealthPolicy:
    path = ("health",)
    d = HealthPolicy()
    tbl = r.table(
        path,
        doc.get("health", {}),
        ("period", "timeout", "failure_threshold", "path", "busy_window", "stall_window"),
    )
    # No lower bound on timeout: SGLang's /health may take up to 20 s (hence the 25 s
    # default), but the simulator answers in about 1 s and the demo wants short probes.
    return HealthPolicy(
        period=r.get(tbl, path, "period", _duration(), d.period),
        timeout=r.get(tbl, path, "timeout", _duration(), d.timeout),
        failure_threshold=r.get(tbl, path, "failure_threshold", _int(1), d.failure_threshold),
        path=r.get(tbl, path, "path", _url_path, d.path),
        busy_window=r.get(tbl, path, "busy_window", _duration(allow_zero=True), d.busy_window),
        stall_window=r.get(tbl, path, "stall_window", _duration(), d.stall_window),
    )


def _restart(r: _Reader, doc: _Table) -> RestartPolicy:
    path = ("restart",)
    d = RestartPolicy()
    tbl = r.table(
        path,
        doc.get("restart", {}),
        ("backoff_initial", "backoff_max", "reset_after", "max_failures", "stop_timeout"),
    )
    policy = RestartPolicy(
        backoff_initial=r.get(
            tbl, path, "backoff_initial", _duration(allow_zero=True), d.backoff_initial
        ),
        backoff_max=r.get(tbl, path, "backoff_max", _duration(allow_zero=True), d.backoff_max),
        reset_after=r.get(tbl, path, "reset_after", _duration(), d.reset_after),
        max_failures=r.get(tbl, path, "max_failures", _int(1), d.max_failures),
        stop_timeout=r.get(tbl, path, "stop_timeout", _duration(), d.stop_timeout),
    )
    if policy.backoff_max < policy.backoff_initial:
        r.p.add(
            (*path, "backoff_max"),
            f"must be >= backoff_initial "
            f"({policy.backoff_initial:g} s), got {policy.backoff_max:g} s",
        )
    return policy


def _metrics(r: _Reader, doc: _Table) -> MetricsSpec:
    path = ("metrics",)
    d = MetricsSpec()
    tbl = r.table(
        path,
        doc.get("metrics", {}),
        (
            "listen",
            "gpu_poll_interval",
            "worker_poll_interval",
            "worker_poll_timeout",
            "gpu_source",
        ),
    )
    return MetricsSpec(
        listen=r.get(tbl, path, "listen", _listen, d.listen),
        gpu_poll_interval=r.get(tbl, path, "gpu_poll_interval", _duration(), d.gpu_poll_interval),
        worker_poll_interval=r.get(
            tbl, path, "worker_poll_interval", _duration(), d.worker_poll_interval
        ),
        worker_poll_timeout=r.get(
            tbl, path, "worker_poll_timeout", _duration(), d.worker_poll_timeout
        ),
        gpu_source=r.get(tbl, path, "gpu_source", _choice("nvml", "fake", "none"), d.gpu_source),
    )


def _control(r: _Reader, doc: _Table) -> ControlSpec:
    path = ("control",)
    d = ControlSpec()
    tbl = r.table(path, doc.get("control", {}), ("socket", "group"))
    return ControlSpec(
        socket=r.get(tbl, path, "socket", _socket_path, d.socket),
        group=r.get(tbl, path, "group", _account("group"), d.group),
    )


# A DNS name or IPv4 address (never starting with '-': it is an argv item), or an IPv6
# address with or without its brackets.
_HOST_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]*|\[[0-9A-Fa-f:.]+\]|[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*")


def _host(v: object) -> str:
    if not isinstance(v, str) or not _HOST_RE.fullmatch(v):
        raise _Bad(
            f"expected a host name or IP address (letters, digits, '.', '-'; IPv6 "
            f"with ':'), got {_show(v)}"
        )
    return v.strip("[]")


def _http_url(v: object) -> str:
    if not isinstance(v, str) or not re.fullmatch(r"https?://[^\s/]+(:\d+)?/?", v):
        raise _Bad(f"expected a base URL like 'http://10.0.0.5:8000', got {_show(v)}")
    return v.rstrip("/")


def _str_list(v: object) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise _Bad(f"expected a list of strings, got {_show(v)}")
    return tuple(v)


def _gateway(r: _Reader, doc: _Table) -> GatewaySpec:
    path = ("gateway",)
    d = GatewaySpec()
    tbl = r.table(
        path,
        doc.get("gateway", {}),
        (
            "mode",
            "listen",
            "url",
            "policy",
            "metrics_listen",
            "extra_args",
            "admin_key_file",
            "api_key_file",
            "worker_host",
            "drain_timeout",
        ),
    )
    g = GatewaySpec(
        mode=r.get(tbl, path, "mode", _choice("off", "managed", "external"), d.mode),
        listen=r.get(tbl, path, "listen", _listen, d.listen),
        url=r.get(tbl, path, "url", _http_url, d.url),
        policy=r.get(tbl, path, "policy", _choice(*GATEWAY_POLICIES), d.policy),
        metrics_listen=r.get(tbl, path, "metrics_listen", _listen, d.metrics_listen),
        extra_args=r.get(tbl, path, "extra_args", _str_list, d.extra_args),
        admin_key_file=r.get(tbl, path, "admin_key_file", _key_file, d.admin_key_file),
        api_key_file=r.get(tbl, path, "api_key_file", _key_file, d.api_key_file),
        worker_host=r.get(tbl, path, "worker_host", _host, d.worker_host),
        drain_timeout=r.get(
            tbl, path, "drain_timeout", _duration(allow_zero=True), d.drain_timeout
        ),
    )
    if g.mode == "external" and g.url is None:
        r.p.add(
            (*path, "url"),
            "missing: mode = 'external' needs the gateway's url "
            "(e.g. url = 'http://10.0.0.5:8000')",
        )
    if g.mode == "managed":
        for arg in g.extra_args:
            flag = arg.split("=", 1)[0]
            if flag in GATEWAY_OWNED_FLAGS:
                r.p.add(
                    (*path, "extra_args"),
                    f"{flag} is set by the farm from [gateway] "
                    "(listen, policy, metrics_listen, the key files); remove it",
                )
        host = g.listen.rpartition(":")[0].strip("[]")
        # The worker API always has a key (admin_key_file, else one the agent generates:
        # gateway/adminkey.py); only users' requests may be open.
        if g.api_key_file is None and not is_loopback(host):
            r.p.warn(
                (*path, "listen"),
                f"the gateway listens on {host!r} (not loopback) "
                "without api_key_file: anyone who reaches it can send requests; set "
                "api_key_file to require a key, or listen on 127.0.0.1",
            )
    return g


# --- [model] (model staging, docs/staging.md) -----------------------------------------

# As huggingface_hub's validate_repo_id: each part starts and ends with a letter, digit or
# '_', at most 96 characters, and no '--' or '..' anywhere.
_REPO_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
_REPO_ID_RE = re.compile(rf"(?!.*(?:--|\.\.)){_REPO_PART}/{_REPO_PART}")
_SIZE_RE = re.compile(r"(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)?")
_SIZE_UNITS = {
    None: 1,
    "B": 1,
    "KiB": 1 << 10,
    "MiB": 1 << 20,
    "GiB": 1 << 30,
    "TiB": 1 << 40,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
}


def _model_source(v: object) -> str:
    if isinstance(v, str) and (v.startswith("/") or _REPO_ID_RE.fullmatch(v)):
        return v.rstrip("/") if v != "/" else v
    raise _Bad(
        f"expected an absolute directory (a persistent disk, NFS) or a Hugging Face "
        f"repo id like 'Qwen/Qwen3-8B', got {_show(v)}"
    )


def _revision(v: object) -> str:
    if not isinstance(v, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_./-]*", v):
        raise _Bad(f"expected a branch, tag or commit of the repo, got {_show(v)}")
    return v


def _size(v: object) -> int:
    if _is_int(v) and isinstance(v, int) and v >= 0:
        return v
    m = _SIZE_RE.fullmatch(v.strip()) if isinstance(v, str) else None
    if m is None:
        raise _Bad(
            f"expected a size: bytes (a number) or a string like '4GiB', '512MiB', got {_show(v)}"
        )
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2)])


def _model(r: _Reader, doc: _Table) -> ModelSpec | None:
    if "model" not in doc:
        return None
    path = ("model",)
    tbl = r.table(
        path,
        doc["model"],
        ("source", "revision", "warm_page_cache", "headroom", "token_file", "cache_dir"),
    )
    if "source" not in tbl:
        if isinstance(doc["model"], dict):
            r.p.add(
                (*path, "source"),
                "missing: [model] needs source = '/persistent/dir' "
                "or a Hugging Face repo id ('org/name')",
            )
        return None
    source = r.get(tbl, path, "source", _model_source, "")
    d = ModelSpec(source)
    m = ModelSpec(
        source=source,
        revision=r.get(tbl, path, "revision", _revision, d.revision),
        warm_page_cache=r.get(tbl, path, "warm_page_cache", _bool, d.warm_page_cache),
        headroom=r.get(tbl, path, "headroom", _size, d.headroom),
        token_file=r.get(tbl, path, "token_file", _key_file, d.token_file),
        cache_dir=r.get(tbl, path, "cache_dir", _abs_path, d.cache_dir),
    )
    if not source:
        return None  # its problem is recorded; the other keys were checked all the same
    if m.is_local:
        for key in ("revision", "token_file", "cache_dir"):
            if key in tbl:
                r.p.add(
                    (*path, key),
                    f"only for a Hugging Face repo source; {source!r} is a "
                    "local directory: remove it",
                )
    return m


def _check_model(r: _Reader, model: ModelSpec | None, workers: list[WorkerSpec]) -> None:
    """[model] stages into the workers' one model path: absolute, the same for all."""
    if model is None or not workers:
        return
    paths = {w.flags.get("model_path") for w in workers}
    target = workers[0].flags.get("model_path")
    if len(paths) != 1 or not isinstance(target, str):
        r.p.add(
            ("sglang", "model_path"),
            "[model] stages one copy for every worker: set "
            "model_path in [sglang] (not per worker) to where workers load it from, "
            "e.g. '/dev/shm/model'",
        )
        return
    if not target.startswith("/") or target.rstrip("/") in ("", "/dev/shm", "/tmp"):
        r.p.add(
            ("sglang", "model_path"),
            f"[model] stages into model_path: expected an "
            f"absolute directory of its own (e.g. '/dev/shm/Qwen3.6-27B'), got {target!r}",
        )
        return
    t = target.rstrip("/")
    if model.is_local and (
        t == model.source or t.startswith(model.source + "/") or model.source.startswith(t + "/")
    ):
        r.p.add(
            ("model", "source"),
            f"the source {model.source!r} and the workers' "
            f"model_path {target!r} overlap; the source must be another directory",
        )


_OOM_OPS = ("set", "add", "multiply")


def _oom(r: _Reader, doc: _Table) -> tuple[OomPolicy, tuple[int, ...]]:
    """The policy, and each kept step's index in the file (invalid steps are left out)."""
    path = ("oom",)
    tbl = r.table(path, doc.get("oom", {}), ("enabled", "scope", "steps"))
    d = OomPolicy()
    raw_steps = tbl.get("steps", [])
    if not isinstance(raw_steps, list):
        r.p.add(
            (*path, "steps"),
            f"expected a list of steps ([[oom.steps]] tables), got {_show(raw_steps)}",
        )
        raw_steps = []
    steps: list[OomStep] = []
    indices: list[int] = []
    names: dict[str, int] = {}
    for i, raw in enumerate(raw_steps):
        step = _oom_step(r, (*path, "steps", i), raw)
        if step is None:
            continue
        if step.name in names:
            r.p.add(
                (*path, "steps", i, "name"),
                f"step name {step.name!r} is already used by "
                f"oom.steps[{names[step.name]}]; each step needs its own name",
            )
        names.setdefault(step.name, i)
        steps.append(step)
        indices.append(i)
    policy = OomPolicy(
        enabled=r.get(tbl, path, "enabled", _bool, d.enabled),
        scope=r.get(tbl, path, "scope", _choice("worker", "all"), d.scope),
        steps=tuple(steps),
    )
    return policy, tuple(indices)


def _oom_step(r: _Reader, path: _Path, raw: object) -> OomStep | None:
    tbl = r.table(path, raw, ("name", "set", "add", "multiply", "min", "max"))
    if not tbl:
        return None
    ok = True
    name = r.get(tbl, path, "name", _str, None)
    if name is None:
        ok = False
        if "name" not in tbl:
            r.p.add(
                (*path, "name"),
                "missing: each step needs a name (shown in status and "
                "metrics), e.g. name = 'no_buffer'",
            )
    ops: dict[str, dict[str, object]] = {}
    for op in (*_OOM_OPS, "min", "max"):
        value = tbl.get(op, {})
        if not isinstance(value, dict):
            r.p.add((*path, op), f"expected a table of flag = value, got {_show(value)}")
            ok = False
            value = {}
        ops[op] = value
    if not any(ops[op] for op in _OOM_OPS):
        r.p.add(
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
                r.p.add(fpath, problem)
                ok = False
                continue
            r.stale_flag(fpath, flag)
            if flag in owner:
                r.p.add(
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
                    raise _Bad(f"expected a number, got {_show(value)}")
                _finite(value)
                assert isinstance(value, int | float)
                if op == "multiply" and value <= 0:
                    raise _Bad(f"expected a factor > 0, got {_show(value)}")
                bounds = {}
                for bound in ("min", "max"):
                    b = ops[bound].get(flag)
                    if b is not None and _is_number(b):
                        assert isinstance(b, int | float)
                        bounds[bound] = float(b)
                adjust.append(OomAdjust(flag, **{op: float(value)}, **bounds))
            except _Bad as exc:
                r.p.add(fpath, str(exc))
                ok = False
    for bound in ("min", "max"):
        for flag, value in ops[bound].items():
            bpath = (*path, bound, flag)
            if owner.get(flag) not in ("add", "multiply"):
                r.p.add(
                    bpath,
                    f"{bound} bounds a flag this step adds to or multiplies; "
                    f"{flag!r} is in neither add nor multiply of this step",
                )
                ok = False
            elif not _is_number(value) or (isinstance(value, float) and not math.isfinite(value)):
                r.p.add(bpath, f"expected a finite number, got {_show(value)}")
                ok = False
    lo, hi = ops["min"], ops["max"]
    for flag in set(lo) & set(hi):
        low, high = lo[flag], hi[flag]
        if isinstance(low, int | float) and isinstance(high, int | float) and low > high:
            r.p.add((*path, "max", flag), f"max {hi[flag]!r} is below min {lo[flag]!r}")
            ok = False
    if not ok or name is None:
        return None
    return OomStep(name=name, adjust=tuple(adjust))


# --- workers --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Claim:
    """Where a worker's GPUs/ports came from, for problems about clashes."""

    gpus_path: _Path
    port_path: _Path
    nccl_path: _Path
    host_path: _Path


def _gpu_list(r: _Reader, path: _Path, value: object, gpu_count: int | None) -> list[int] | None:
    if value == "all":
        if gpu_count is None:
            r.p.add(
                path,
                'gpus = "all" needs NVML to count GPUs, and no count was given '
                "here; list them instead, e.g. gpus = [0, 1, 2, 3]",
            )
            return None
        if gpu_count < 1:
            r.p.add(path, 'gpus = "all" but this host has no GPU that NVML can see')
            return None
        return list(range(gpu_count))
    if not isinstance(value, list) or not value or not all(_is_int(g) and g >= 0 for g in value):
        r.p.add(
            path,
            f'expected "all" or a non-empty list of GPU indices (integers >= 0), '
            f"got {_show(value)}",
        )
        return None
    gpus: list[int] = [g for g in value if isinstance(g, int)]
    ok = True
    for i, g in enumerate(gpus):
        if g in gpus[:i]:
            r.p.add(path, f"GPU {g} is listed twice; each GPU belongs to one worker")
            ok = False
        if gpu_count is not None and g >= gpu_count:
            r.p.add(
                path,
                f"GPU {g} does not exist; this host has {gpu_count} GPU(s), 0..{gpu_count - 1}",
            )
            ok = False
    return gpus if ok else None


def _workers(
    r: _Reader,
    doc: _Table,
    farm: FarmSection,
    base_flags: dict[str, FlagValue],
    gpu_count: int | None,
) -> tuple[list[WorkerSpec], dict[int, _Claim]] | None:
    path = ("workers",)
    d = WorkersDefaults()
    tbl = r.table(
        path,
        doc.get("workers", {}),
        ("gpus", "gpus_per_worker", "host", "base_port", "nccl_base_port", "overrides"),
    )
    before = len(r.p.items)
    per = r.get(tbl, path, "gpus_per_worker", _int(1), d.gpus_per_worker)
    per_ok = len(r.p.items) == before
    host = r.get(tbl, path, "host", _host, d.host)
    base_port = r.get(tbl, path, "base_port", _PORT, d.base_port)
    nccl_base = r.get(tbl, path, "nccl_base_port", _PORT, d.nccl_base_port)
    gpus = _gpu_list(r, (*path, "gpus"), tbl.get("gpus", d.gpus), gpu_count)
    raw_overrides = tbl.get("overrides", {})
    if not isinstance(raw_overrides, dict):
        r.p.add(
            (*path, "overrides"),
            f"expected tables [workers.overrides.N], got {_show(raw_overrides)}",
        )
        raw_overrides = {}
    if gpus is None or not per_ok:
        # Nothing to lay workers out on; still check the overrides' shapes.
        for key, raw in raw_overrides.items():
            _override(r, (*path, "overrides", key), raw, gpu_count)
        return None
    if len(gpus) % per:
        r.p.add(
            (*path, "gpus_per_worker"),
            f"{len(gpus)} GPU(s) do not split into workers "
            f"of {per}; list a multiple of {per} GPUs in workers.gpus",
            line_of=(*path, "gpus_per_worker"),
        )
        return None
    count = len(gpus) // per
    for key, base in (("base_port", base_port), ("nccl_base_port", nccl_base)):
        if base + count - 1 > 65535:
            r.p.add(
                (*path, key),
                f"{base} + {count - 1} (the last worker) exceeds 65535; "
                f"choose a base port <= {65536 - count}",
            )
    overrides: dict[int, _Table] = {}
    for key, raw in raw_overrides.items():
        opath = (*path, "overrides", key)
        ov = _override(r, opath, raw, gpu_count)
        if not key.isdigit():
            r.p.add(opath, f"expected a worker id (an integer 0..{count - 1}), got {key!r}")
        elif int(key) >= count:
            r.p.add(
                opath,
                f"no worker {int(key)}; workers are 0..{count - 1} "
                f"({len(gpus)} GPU(s), {per} per worker)",
            )
        elif ov is not None:
            overrides[int(key)] = ov
    workers: list[WorkerSpec] = []
    claims: dict[int, _Claim] = {}
    for wid in range(count):
        ov = overrides.get(wid, {})
        opath = (*path, "overrides", str(wid))
        flags = dict(base_flags)
        ov_flags = ov.get("sglang", {})
        assert isinstance(ov_flags, dict)
        flags.update(ov_flags)
        env = dict(farm.env)
        ov_env = ov.get("env", {})
        assert isinstance(ov_env, dict)
        env.update(ov_env)
        wgpus = ov.get("gpus", gpus[wid * per : (wid + 1) * per])
        assert isinstance(wgpus, list)
        whost, wport, wnccl = ov.get("host", host), ov.get("port"), ov.get("nccl_port")
        assert isinstance(whost, str)
        assert wport is None or isinstance(wport, int)
        assert wnccl is None or isinstance(wnccl, int)
        workers.append(
            WorkerSpec(
                id=wid,
                gpus=tuple(wgpus),
                host=whost,
                port=wport if wport is not None else base_port + wid,
                nccl_port=wnccl if wnccl is not None else nccl_base + wid,
                flags=MappingProxyType(flags),
                env=MappingProxyType(env),
            )
        )
        claims[wid] = _Claim(
            gpus_path=(*opath, "gpus") if "gpus" in ov else (*path, "gpus"),
            port_path=(*opath, "port") if "port" in ov else (*path, "base_port"),
            nccl_path=(*opath, "nccl_port") if "nccl_port" in ov else (*path, "nccl_base_port"),
            host_path=(*opath, "host") if "host" in ov else (*path, "host"),
        )
    return workers, claims


def _override(r: _Reader, path: _Path, raw: object, gpu_count: int | None) -> _Table | None:
    """A valid override as a table of converted values; None if it has problems."""
    tbl = r.table(path, raw, ("gpus", "host", "port", "nccl_port", "env", "sglang"))
    before = len(r.p.items)
    out: _Table = {}
    if "gpus" in tbl:
        gpus = _gpu_list(r, (*path, "gpus"), tbl["gpus"], gpu_count)
        if gpus is not None and tbl["gpus"] == "all":
            r.p.add((*path, "gpus"), "expected a list of this worker's GPUs, got 'all'")
        elif gpus is not None:
            out["gpus"] = gpus
    for key, conv in (("host", _host), ("port", _PORT), ("nccl_port", _PORT)):
        value = r.get(tbl, path, key, conv, None)
        if value is not None:
            out[key] = value
    out["env"] = r.env(tbl, path)
    raw_flags = tbl.get("sglang", {})
    if isinstance(raw_flags, dict):
        out["sglang"] = r.flags(raw_flags, (*path, "sglang"))
    else:
        r.p.add((*path, "sglang"), f"expected a table of SGLang flags, got {_show(raw_flags)}")
    return out if len(r.p.items) == before else None


def _cross_check(
    r: _Reader,
    farm: FarmSection,
    workers: list[WorkerSpec],
    claims: dict[int, _Claim],
    startup: StartupPolicy,
    oom: OomPolicy,
    oom_indices: tuple[int, ...],
    metrics: MetricsSpec,
    gateway: GatewaySpec,
) -> None:
    # One worker per GPU. Workers that keep their default GPUs claim first, so a clash
    # is reported on the override that moved a worker, where the fix is.
    order = sorted(workers, key=lambda w: (claims[w.id].gpus_path[1] == "overrides", w.id))
    gpu_owner: dict[int, int] = {}
    for w in order:
        for g in w.gpus:
            if g in gpu_owner:
                r.p.add(
                    claims[w.id].gpus_path,
                    f"GPU {g} is already used by worker "
                    f"{gpu_owner[g]}; each GPU belongs to one worker",
                )
            else:
                gpu_owner[g] = w.id
    # HTTP and NCCL ports share the host's port space (NCCL binds all interfaces), and
    # so does the metrics listener.
    port_owner: dict[int, str] = {listen_port(metrics.listen): "the metrics listener"}
    if gateway.mode == "managed":
        for listen, who in (
            (gateway.listen, "the gateway ([gateway] listen)"),
            (gateway.metrics_listen, "the gateway's metrics listener"),
        ):
            port = listen_port(listen)
            if port in port_owner:
                r.p.add(
                    ("gateway", "listen" if "listen)" in who else "metrics_listen"),
                    f"port {port} for {who} is already used by {port_owner[port]}",
                )
            else:
                port_owner[port] = who
    port_claims: list[tuple[int, str, _Path]] = []
    for w in workers:
        port_claims.append((w.port, f"worker {w.id} (HTTP)", claims[w.id].port_path))
        port_claims.append((w.nccl_port, f"worker {w.id} (NCCL)", claims[w.id].nccl_path))
    # Defaults claim before overrides, HTTP before NCCL: the clash lands on the knob
    # that made it.
    port_claims.sort(key=lambda c: (c[2][1] == "overrides", "NCCL" in c[1]))
    for port, who, cpath in port_claims:
        if port in port_owner:
            r.p.add(
                cpath,
                f"port {port} for {who} is already used by {port_owner[port]}; "
                "every HTTP, NCCL and metrics port must be distinct",
            )
        else:
            port_owner[port] = who
    ids = [w.id for w in workers]
    if startup.canary is not None and startup.canary not in ids:
        r.p.add(
            ("startup", "canary"),
            f"no worker {startup.canary}; workers are "
            f"0..{len(ids) - 1} (or write canary = false for none)",
        )
    if farm.module == SGLANG_MODULE:
        missing = [w.id for w in workers if "model_path" not in w.flags]
        if missing:
            r.p.add(
                ("sglang", "model_path"),
                "missing: SGLang requires --model-path; set "
                "model_path = '/path/to/model' in [sglang]"
                + ("" if len(missing) == len(workers) else f" (workers {missing} lack it)"),
            )
    _check_no_buffer(r, workers)
    _check_oom_flags(r, workers, oom, oom_indices)
    _warn_exposed(r, workers, claims)


def _ids_text(ids: list[int]) -> str:
    """`worker 3`, `workers 0-7` or `workers [0, 2, 5]`."""
    if len(ids) == 1:
        return f"worker {ids[0]}"
    if ids == list(range(ids[0], ids[-1] + 1)):
        return f"workers {ids[0]}-{ids[-1]}"
    return f"workers {ids}"


def _warn_exposed(r: _Reader, workers: list[WorkerSpec], claims: dict[int, _Claim]) -> None:
    # Without --api-key SGLang serves every route, admin ones included, to whoever reaches
    # the port (docs/reference/sglang.md §6.2); on a non-loopback address that is the network.
    exposed: dict[tuple[_Path, str], list[int]] = {}
    for w in workers:
        if not is_loopback(w.host) and not w.flags.get("api_key"):
            exposed.setdefault((claims[w.id].host_path, w.host), []).append(w.id)
    for (path, host), ids in exposed.items():
        listen, them = ("listens", "it") if len(ids) == 1 else ("listen", "them")
        r.p.warn(
            path,
            f"{_ids_text(ids)} {listen} on {host!r} (not loopback) without api_key: "
            f"anyone who can reach this host can use {them}, admin routes included; bind "
            f'{them} to host = "127.0.0.1" and serve through the gateway ([gateway]), or '
            "set api_key and keep it out of world-readable files (docs/config.md, "
            '"Exposure and keys")',
        )


def _no_buffer_key(flags: Mapping[str, FlagValue]) -> str | None:
    """The key that sets an explicit mamba `no_buffer` (either SGLang's spelling), or None."""
    found = sglang_flags.mamba_strategy(flags)
    return found[0] if found is not None and found[1] == "no_buffer" else None


def _check_no_buffer(r: _Reader, workers: list[WorkerSpec]) -> None:
    # SGLang 0.5.23 asserts --disable-overlap-schedule for an explicit no_buffer
    # (mamba_hook.py::validate_mamba_no_buffer): fail here, not after a model load.
    bad: dict[str, list[int]] = {}
    for w in workers:
        key = _no_buffer_key(w.flags)
        if key is not None and w.flags.get("disable_overlap_schedule") is not True:
            bad.setdefault(key, []).append(w.id)
    for key, ids in bad.items():
        r.p.add(
            ("sglang", key),
            "'no_buffer' makes SGLang 0.5.23 "
            "assert --disable-overlap-schedule; add disable_overlap_schedule = true"
            + ("" if len(ids) == len(workers) else f" (workers {ids})"),
        )


def _check_oom_flags(
    r: _Reader, workers: list[WorkerSpec], oom: OomPolicy, indices: tuple[int, ...]
) -> None:
    set_so_far: dict[str, FlagValue] = {}
    for i, step in zip(indices, oom.steps, strict=True):
        spath: _Path = ("oom", "steps", i)
        for a in step.adjust:
            if a.set is not None:
                set_so_far[a.flag] = a.set
                continue
            op = "add" if a.add is not None else "multiply"
            if a.flag in set_so_far and _is_number(set_so_far[a.flag]):
                continue
            lacking = [w.id for w in workers if not _is_number(w.flags.get(a.flag))]
            if lacking:
                who = "" if len(lacking) == len(workers) else f" for workers {lacking}"
                r.p.add(
                    (*spath, op, a.flag),
                    f"{op} changes the configured value, but "
                    f"{a.flag} is not set to a number in [sglang]{who}; set it there, "
                    f"e.g. {a.flag} = <number>",
                )
        key = _no_buffer_key(set_so_far)
        if key is not None:
            overlap_off = set_so_far.get("disable_overlap_schedule") is True or all(
                w.flags.get("disable_overlap_schedule") is True for w in workers
            )
            if not overlap_off and any(a.flag == key for a in step.adjust):
                r.p.add(
                    (*spath, "set", key),
                    "'no_buffer' makes "
                    "SGLang 0.5.23 assert --disable-overlap-schedule; add "
                    "disable_overlap_schedule = true to this step's set",
                )


# --- entry points ---------------------------------------------------------------------


def _syntax_problem(source: str, exc: tomllib.TOMLDecodeError) -> str:
    text = str(exc)
    m = re.search(r"\(at line (\d+), column (\d+)\)", text)
    if m:
        what = text[: m.start()].strip()
        return f"{source}:{m.group(1)}: TOML syntax: {what} (column {m.group(2)})"
    return f"{source}: TOML syntax: {text}"


@dataclass(frozen=True, slots=True)
class LoadResult:
    """A valid config and its warnings (lines like problems: file:line: key: what)."""

    spec: FarmSpec
    warnings: tuple[str, ...] = ()


def load_spec(
    text: str,
    *,
    source: str,
    agent_python: str | None = None,
    gpu_count: int | None = None,
) -> FarmSpec:
    """Validate TOML text and resolve it into a `FarmSpec` (`check_spec` without warnings).

    `source` names the text in messages (usually the file path). `agent_python` resolves
    `farm.python = "@agent"`; `gpu_count` (from NVML) resolves `workers.gpus = "all"`
    and bounds listed GPUs. Raises `ConfigError` listing every problem found.
    """
    return check_spec(text, source=source, agent_python=agent_python, gpu_count=gpu_count).spec


def check_spec(
    text: str,
    *,
    source: str,
    agent_python: str | None = None,
    gpu_count: int | None = None,
) -> LoadResult:
    """`load_spec`, plus the warnings of a valid config (e.g. a flag spelt as an older
    SGLang spells it). Raises `ConfigError` listing every problem found; a config with
    problems has its warnings left out until they are fixed."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(source, [_syntax_problem(source, exc)]) from exc
    problems = _Problems(source, _LineIndex(text))
    _refuse_control_chars(problems, doc)
    r = _Reader(problems)
    r.table((), doc, _SECTIONS)
    farm = _farm(r, doc, agent_python)
    startup = _startup(r, doc)
    health = _health(r, doc)
    restart = _restart(r, doc)
    oom, oom_indices = _oom(r, doc)
    metrics = _metrics(r, doc)
    control = _control(r, doc)
    gateway = _gateway(r, doc)
    model = _model(r, doc)
    raw_flags = doc.get("sglang", {})
    base_flags: dict[str, FlagValue] = {}
    if isinstance(raw_flags, dict):
        base_flags = r.flags(raw_flags, ("sglang",))
    else:
        r.p.add(("sglang",), f"expected a table of SGLang flags, got {_show(raw_flags)}")
    resolved = _workers(r, doc, farm, base_flags, gpu_count)
    if resolved is not None:
        workers, claims = resolved
        _cross_check(r, farm, workers, claims, startup, oom, oom_indices, metrics, gateway)
        _check_model(r, model, workers)
    if problems or resolved is None:
        raise ConfigError(source, problems.sorted() or [f"{source}: no workers"])
    spec = FarmSpec(
        source=source,
        farm=farm,
        workers=tuple(resolved[0]),
        startup=startup,
        health=health,
        restart=restart,
        oom=oom,
        metrics=metrics,
        control=control,
        gateway=gateway,
        model=model,
    )
    return LoadResult(spec, tuple(problems.sorted_warnings()))


def load_spec_file(path: str | os.PathLike[str], *, gpu_count: int | None = None) -> FarmSpec:
    """Read and validate one config file; `"@agent"` resolves to this interpreter.

    Raises `ConfigError` for a file that cannot be read as well as for one that does
    not validate.
    """
    return check_spec_file(path, gpu_count=gpu_count).spec


def check_spec_file(path: str | os.PathLike[str], *, gpu_count: int | None = None) -> LoadResult:
    """`load_spec_file`, with the config's warnings (`check_spec`)."""
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError as exc:
        raise ConfigError(
            source,
            [
                f"{source}: no such file; write one (the package ships "
                f"{DEFAULT_CONFIG_PATH}) or pass --config PATH"
            ],
        ) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(
            source, [f"{source}: not UTF-8 text (byte {exc.start}); TOML files must be UTF-8"]
        ) from exc
    except OSError as exc:
        raise ConfigError(
            source,
            [
                f"{source}: cannot read: {exc.strerror or exc}; check the "
                "path and its permissions, or pass --config PATH"
            ],
        ) from exc
    return check_spec(text, source=source, agent_python=sys.executable, gpu_count=gpu_count)
