"""I/O: SGLang-format log lines on stderr, written whole and flushed at once.

One re-entrant lock, so that lines from HTTP threads never interleave and a
signal handler that logs while the main thread holds the lock cannot deadlock.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

from sglang_farm.sim.texts import stamp, uvicorn


class SimLog:
    """Writes `[date time{prefix}] message` lines; `raw` writes text as is (uncaught tracebacks)."""

    def __init__(self, prefix: str = "", stream: TextIO | None = None) -> None:
        self._prefix = prefix
        self._stream = stream if stream is not None else sys.stderr
        self._lock = threading.RLock()

    def info(self, message: str) -> None:
        self.raw(f"{stamp(time.time(), self._prefix)} {message}\n")

    def uvicorn(self, level: str, message: str) -> None:
        self.info(uvicorn(level, message))

    def raw(self, text: str) -> None:
        with self._lock:
            try:
                self._stream.write(text)
                self._stream.flush()
            except (OSError, ValueError):
                # The reader went away (closed pipe): the server keeps running, as SGLang does.
                pass
