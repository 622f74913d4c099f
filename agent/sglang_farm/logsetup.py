"""I/O: structlog configured once, by the entry point.

JSON lines when not on a terminal (journald keeps them under systemd), a readable
console rendering on a terminal.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog


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
        processors += [structlog.processors.dict_tracebacks, structlog.processors.JSONRenderer()]
    else:
        processors.append(structlog.dev.ConsoleRenderer(colors=out.isatty()))
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(out),
        cache_logger_on_first_use=False,
    )
