"""Pure: SGLang flags in the config: which keys may be a flag, and their values.

A flag that some SGLang version accepts is never refused here (the doctor judges flags
by the installed SGLang); only the spelling rules and the few values SGLang itself
rejects only after minutes, or never.
"""

from __future__ import annotations

import math
import re

from sglang_farm.config.problems import _ConversionError, _show
from sglang_farm.config.values import _is_int, _is_number
from sglang_farm.sglang import flags as sglang_flags
from sglang_farm.spec import FlagValue

_SNAKE_RE = re.compile(r"[a-z][a-z0-9_]*")


def _check_flag_value(key: str, value: FlagValue) -> None:
    """Checks for the few flags whose bad values SGLang only rejects after minutes, or never."""
    number = value if _is_number(value) and isinstance(value, int | float) else None
    integer = value if _is_int(value) and isinstance(value, int) else None
    if key == "mem_fraction_static" and not (number is not None and 0 < number < 1):
        raise _ConversionError(
            f"expected a number in (0, 1), the fraction of GPU memory, got {_show(value)}"
        )
    chunk_ok = integer is not None and (integer > 0 or integer == -1)
    if key == "chunked_prefill_size" and not chunk_ok:
        raise _ConversionError(
            f"expected an integer > 0, or -1 to disable (SGLang rejects '8k'), got {_show(value)}"
        )
    if key == "max_running_requests" and not (integer is not None and integer >= 1):
        raise _ConversionError(f"expected an integer >= 1, got {_show(value)}")
    if key in sglang_flags.MAMBA_STRATEGY_KEYS and value not in sglang_flags.MAMBA_STRATEGIES:
        accepted = ", ".join(repr(s) for s in sglang_flags.MAMBA_STRATEGIES)
        raise _ConversionError(f"expected one of {accepted}, got {_show(value)}")
    if key == "served_model_name" and isinstance(value, str) and ":" in value:
        raise _ConversionError(
            f"SGLang asserts that the served model name has no ':', got {_show(value)}"
        )


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
        raise _ConversionError(f"expected a finite number, got {_show(v)}")


def _flag_value(v: object) -> FlagValue:
    if isinstance(v, bool | int | float | str):
        _finite(v)
        return v
    if isinstance(v, list):
        if not v:
            raise _ConversionError(
                "expected at least one item (SGLang's list flags need one); omit the key"
            )
        if not all(_is_number(x) or isinstance(x, str) for x in v):
            raise _ConversionError(f"expected a list of strings or numbers, got {_show(v)}")
        for x in v:
            _finite(x)
        return tuple(v)
    if isinstance(v, dict):
        raise _ConversionError(
            f"expected a flag value (true, false, a number, a string or a list), got a table "
            f"{_show(v)}; JSON flags take a string: key = '{{\"k\": 1}}'"
        )
    raise _ConversionError(f"expected true, false, a number, a string or a list, got {_show(v)}")
