"""Pure: value conversion, one TOML value -> a typed value, else `_ConversionError`.

Each converter says what is wrong and what is accepted (durations, sizes, ports, paths,
names); the section readers attach the key path and the line.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable

from sglang_farm.config.problems import _ConversionError, _show
from sglang_farm.spec import Endpoint

# `farm.python = "@agent"`: the interpreter that runs the agent itself (the demo uses it
# to run the simulator from the agent's own environment).
AGENT_PYTHON = "@agent"


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _str(v: object) -> str:
    if not isinstance(v, str) or not v:
        raise _ConversionError(f"expected a non-empty string, got {_show(v)}")
    return v


def _bool(v: object) -> bool:
    if not isinstance(v, bool):
        raise _ConversionError(f"expected true or false, got {_show(v)}")
    return v


def _int(lo: int | None = None, hi: int | None = None) -> Callable[[object], int]:
    def conv(v: object) -> int:
        if not _is_int(v):
            raise _ConversionError(f"expected an integer{_range_text(lo, hi)}, got {_show(v)}")
        assert isinstance(v, int)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise _ConversionError(f"expected an integer{_range_text(lo, hi)}, got {_show(v)}")
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
            raise _ConversionError(str(exc)) from None
        if seconds < 0 or (seconds == 0 and not allow_zero):
            need = ">= 0" if allow_zero else "> 0"
            raise _ConversionError(f"expected a duration {need} ({_DURATION_HINT}), got {_show(v)}")
        return seconds

    return conv


def _choice(*options: str) -> Callable[[object], str]:
    def conv(v: object) -> str:
        if v not in options:
            accepted = ", ".join(repr(o) for o in options)
            raise _ConversionError(f"expected one of {accepted}, got {_show(v)}")
        assert isinstance(v, str)
        return v

    return conv


def _abs_path(v: object) -> str:
    if not isinstance(v, str) or not v.startswith("/"):
        raise _ConversionError(f"expected an absolute path (starting with '/'), got {_show(v)}")
    return v


_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")

_MODULE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")

_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _farm_name(v: object) -> str:
    if not isinstance(v, str) or not _NAME_RE.fullmatch(v):
        raise _ConversionError(f"expected a name of letters, digits, '_', '.', '-', got {_show(v)}")
    return v


def _module(v: object) -> str:
    if not isinstance(v, str) or not _MODULE_RE.fullmatch(v):
        raise _ConversionError(
            f"expected a dotted Python module name like 'sglang.launch_server', got {_show(v)}"
        )
    return v


# What systemd refuses in an ExecStart= program path (quotes, backslashes; `$` is not
# expanded there), and whitespace, which would need quoting wherever the path is written.
_PYTHON_BAD = frozenset("\"'\\$")


def _python(v: object) -> str:
    if not isinstance(v, str) or not (v.startswith("/") or v == AGENT_PYTHON):
        raise _ConversionError(
            f"expected an absolute path to the SGLang environment's interpreter "
            f"(e.g. '/opt/sglang/bin/python3') or {AGENT_PYTHON!r}, got {_show(v)}"
        )
    bad = sorted({ch for ch in v if ch in _PYTHON_BAD or ch.isspace()})
    if bad:
        shown = ", ".join(repr(ch) for ch in bad)
        raise _ConversionError(
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
            raise _ConversionError(
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
        raise _ConversionError(
            f"expected a path without surrounding blanks or a trailing backslash "
            f"(systemd's LoadCredential= would misread it), got {_show(v)}"
        )
    return path


def _socket_path(v: object) -> str:
    path = _abs_path(v)
    # AF_UNIX paths are capped at 108 bytes including the terminating NUL.
    if len(os.fsencode(path)) > 107:
        raise _ConversionError(
            f"a Unix socket path must be at most 107 bytes, got {len(path)}: {_show(v)}"
        )
    return path


def parse_endpoint(text: object) -> Endpoint:
    """The `Endpoint` of a "host:port" listen address ('[v6]:port' too).

    Raises ValueError with a user-facing message saying what is accepted. Port 0 asks the
    kernel for a free port (tests, throwaway farms); the log names the one it got.
    """
    hint = "expected 'host:port' (e.g. '127.0.0.1:9840', '[::1]:9840')"
    if not isinstance(text, str) or ":" not in text:
        raise ValueError(f"{hint}, got {_show(text)}")
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{hint} with a port in 0..65535, got {_show(text)}")
    if host.startswith("[") != host.endswith("]"):
        raise ValueError(f"{hint}, got {_show(text)}")
    return Endpoint(host.strip("[]"), int(port))


def _listen(v: object) -> Endpoint:
    try:
        return parse_endpoint(v)
    except ValueError as exc:
        raise _ConversionError(str(exc)) from None


def _canary(v: object) -> int | None:
    if v is False:
        return None
    if not _is_int(v) or not isinstance(v, int):
        raise _ConversionError(
            f"expected a worker id (an integer) or false for no canary, got {_show(v)}"
        )
    return v


def _url_path(v: object) -> str:
    if not isinstance(v, str) or not v.startswith("/"):
        raise _ConversionError(f"expected a URL path starting with '/', got {_show(v)}")
    return v


def _ready_path(v: object) -> str:
    """`[health] ready_path`: "auto" (sglang/ready_route) or a URL path."""
    if v == "auto":
        return "auto"
    if not isinstance(v, str) or not v.startswith("/"):
        raise _ConversionError(f"expected \"auto\" or a URL path starting with '/', got {_show(v)}")
    return v


# A DNS name or IPv4 address (never starting with '-': it is an argv item), or an IPv6
# address with or without its brackets.
_HOST_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]*|\[[0-9A-Fa-f:.]+\]|[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*")


def _host(v: object) -> str:
    if not isinstance(v, str) or not _HOST_RE.fullmatch(v):
        raise _ConversionError(
            f"expected a host name or IP address (letters, digits, '.', '-'; IPv6 "
            f"with ':'), got {_show(v)}"
        )
    return v.strip("[]")


def _http_url(v: object) -> str:
    if isinstance(v, str) and re.match(r"https?://", v) and "@" in v:
        # httpx sends a URL's user:password as Basic auth, which replaces the farm's
        # Bearer admin key, and smg takes only that key: refused (the secret unshown,
        # up to the last '@', whatever else is wrong with the URL: a base URL has none),
        # and the same gateway cannot be named twice by one URL with credentials.
        shown = re.sub(r"//.*@", "//…@", v)
        raise _ConversionError(
            f"credentials in a gateway URL ('{shown}') are "
            "not used by smg, which takes a key: drop the user:password part and put the "
            "gateway's admin key in [gateway] admin_key_file (a root-only file)"
        )
    if not isinstance(v, str) or not re.fullmatch(r"https?://[^\s/]+(:\d+)?/?", v):
        raise _ConversionError(f"expected a base URL like 'http://10.0.0.5:8000', got {_show(v)}")
    return v.rstrip("/")


def _http_urls(v: object) -> tuple[str, ...]:
    """`[gateway] urls`: one or more base URLs, none twice (the same gateway named twice
    would get every worker registered twice over and count twice in status)."""
    if not isinstance(v, list) or not v:
        raise _ConversionError(
            f"expected a list of base URLs like ['http://10.0.0.5:8000'], got {_show(v)}"
        )
    urls = tuple(_http_url(x) for x in v)
    seen: set[str] = set()
    for u in urls:
        if u.lower() in seen:
            raise _ConversionError(f"{u!r} is named twice; name each gateway once")
        seen.add(u.lower())
    return urls


def _str_list(v: object) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise _ConversionError(f"expected a list of strings, got {_show(v)}")
    return tuple(v)


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
    raise _ConversionError(
        f"expected an absolute directory (a persistent disk, NFS) or a Hugging Face "
        f"repo id like 'Qwen/Qwen3-8B', got {_show(v)}"
    )


def _revision(v: object) -> str:
    if not isinstance(v, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_./-]*", v):
        raise _ConversionError(f"expected a branch, tag or commit of the repo, got {_show(v)}")
    return v


def _size(v: object) -> int:
    if _is_int(v) and isinstance(v, int) and v >= 0:
        return v
    m = _SIZE_RE.fullmatch(v.strip()) if isinstance(v, str) else None
    if m is None:
        raise _ConversionError(
            f"expected a size: bytes (a number) or a string like '4GiB', '512MiB', got {_show(v)}"
        )
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2)])
