"""Pure: the entry points, TOML text -> `FarmSpec` or every problem at once.

`load_spec`/`check_spec` parse (`tomllib.loads`), refuse control characters, read each
section, resolve the workers, then run the cross-checks. `load_spec_file` and
`check_spec_file` are the thin shell around them: the one file read (I/O).
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import tomllib
from dataclasses import dataclass

from sglang_farm.config.checks import _check_model, _cross_check
from sglang_farm.config.lines import _LineIndex
from sglang_farm.config.oom import _oom
from sglang_farm.config.printable import _refuse_control_chars
from sglang_farm.config.problems import _Problems, _show
from sglang_farm.config.reader import _Reader
from sglang_farm.config.rollout import _rollout
from sglang_farm.config.sections import (
    _batch,
    _control,
    _farm,
    _gateway,
    _health,
    _metrics,
    _model,
    _restart,
    _startup,
)
from sglang_farm.config.workers import _workers
from sglang_farm.errors import ConfigError
from sglang_farm.host.paths import DEFAULT_CONFIG_PATH
from sglang_farm.spec import FarmSpec, FlagValue

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
    "rollout",
    "batch",
)


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
    reader = _Reader(problems)
    reader.table((), doc, _SECTIONS)
    farm = _farm(reader, doc, agent_python)
    startup = _startup(reader, doc)
    health = _health(reader, doc)
    restart = _restart(reader, doc)
    oom, oom_indices = _oom(reader, doc)
    metrics = _metrics(reader, doc)
    control = _control(reader, doc)
    gateway = _gateway(reader, doc)
    model = _model(reader, doc)
    rollout = _rollout(reader, doc)
    batch = _batch(reader, doc)
    raw_flags = doc.get("sglang", {})
    base_flags: dict[str, FlagValue] = {}
    if isinstance(raw_flags, dict):
        base_flags = reader.flags(raw_flags, ("sglang",))
    else:
        reader.problems.add(
            ("sglang",), f"expected a table of SGLang flags, got {_show(raw_flags)}"
        )
    resolved = _workers(reader, doc, farm, base_flags, gpu_count)
    if resolved is not None:
        workers, claims = resolved
        _cross_check(reader, farm, workers, claims, startup, oom, oom_indices, metrics, gateway)
        _check_model(reader, model, workers)
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
        rollout=rollout,
        batch=batch,
        config_sha256=text_digest(text),
    )
    return LoadResult(spec, tuple(problems.sorted_warnings()))


def text_digest(text: str) -> str:
    """The sha256 (hex) of a config's text as read (UTF-8, newlines as Python reads
    them): what `status` compares to tell the file on disk from the config in force."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


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
