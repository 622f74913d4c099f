"""I/O: structlog configured once, by the entry point.

Two renderings. JSON lines, every event and field, for the journal (journald keeps them
under systemd) and for whoever asks (`--log-format json`); the default when the stream
is not a terminal. For a person (`--log-format console`, the default on a terminal, and
what `./scripts/demo` asks for whether or not its output is a terminal): one short
plain line per event (`human_line`), the same under nohup or in a file as on a
terminal: the time, the level only when it is a warning or an error, the event, its
worker and GPU, then its fields as `key=value`; an event that carries a `summary` (the
rollout's end) prints that sentence instead of the fields it sums up (and, at info,
instead of its name: a warning keeps its name). What only the
journal needs is left out of it (`JOURNAL_ONLY`: each phase change, which the lines
around it already say, and each launch's whole command line, which `farmctl status
--json`, `ps` and the JSON log show).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any, TextIO

import structlog

# Info-level events a person's rendering leaves out (the JSON log keeps them).
JOURNAL_ONLY = frozenset({"worker_state", "worker_launching"})
# Fields said by the line's own shape, or by `summary`, never again as `key=value`.
_SAID = ("event", "level", "timestamp", "worker", "gpu")
_SUMMED_UP = ("farm", "front_door", "next", "ready", "workers", "routed", "not_routed")


def _value(v: object) -> str:
    """A field's value as a person reads it: plain text (no JSON escapes); quoted when it
    holds a space; a list as its items joined by commas."""
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_value(i) for i in v) + "]"
    text = str(v)
    return f'"{text}"' if (" " in text or not text) and not isinstance(v, int | float) else text


def human_line(event: Mapping[str, Any]) -> str:
    """One event as one line a person reads (see the module's docstring)."""
    ts = str(event.get("timestamp") or "")
    clock = ts[11:19] if len(ts) >= 19 else ts
    level = str(event.get("level") or "info")
    parts = [clock] if clock else []
    if level not in ("info", "debug"):
        parts.append(level.upper())
    if not event.get("summary") or level not in ("info", "debug"):
        parts.append(str(event.get("event")))  # an info summary is a sentence of its own
    if event.get("worker") is not None:
        gpu = event.get("gpu")
        parts.append(f"worker {event['worker']}" + (f" (GPU {gpu})" if gpu is not None else ""))
    skip: tuple[str, ...] = _SAID
    if event.get("summary"):
        parts.append(str(event["summary"]))
        skip = _SAID + _SUMMED_UP + ("summary",)
    parts += [f"{k}={_value(v)}" for k, v in event.items() if k not in skip]
    exc = event.get("exception")
    return "  ".join(parts) if not exc else "  ".join(parts) + "\n" + str(exc)


def _drop_journal_only(
    _logger: object, _name: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    if event.get("event") in JOURNAL_ONLY and event.get("level") in ("info", "debug"):
        raise structlog.DropEvent
    return event


def _render_human(_logger: object, _name: str, event: MutableMapping[str, Any]) -> str:
    return human_line(event)


def configure(
    level: str = "info", *, stream: TextIO | None = None, json: bool | None = None
) -> None:
    out = stream or sys.stderr
    if json is None:
        json = not out.isatty()
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if json:
        # Plain UTF-8, as journald keeps it ("8/8 ready · front door", not "\\u00b7").
        processors += [
            structlog.processors.dict_tracebacks,
            structlog.processors.JSONRenderer(ensure_ascii=False),
        ]
    else:
        processors += [
            _drop_journal_only,
            structlog.processors.format_exc_info,
            _render_human,
        ]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(out),
        cache_logger_on_first_use=False,
    )
