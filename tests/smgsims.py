"""Simulators behind a real smg, for the gateway's end-to-end tests: their processes, the
wait for an HTTP answer, and the skip where smg is not installed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

MODEL = "sim/Qwen3.6-27B"
HAS_SMG = importlib.util.find_spec("smg") is not None
needs_smg = pytest.mark.skipif(
    not HAS_SMG, reason="smg is not installed (pip install smg; scripts/setup installs it)"
)


@dataclass
class Sim:
    """A simulator whose access log is read as it comes: `hits` are the monotonic times at
    which each chat completion it served was logged (SGLang logs a request when it answers)."""

    port: int
    proc: subprocess.Popen[str]
    hits: list[float] = field(default_factory=list)
    tail: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if "POST /v1/chat/completions" in line:
                self.hits.append(time.monotonic())
            self.tail = [*self.tail[-20:], line]

    def served_after(self, t: float) -> list[float]:
        return [h for h in list(self.hits) if h > t]


def stop_sim(sim: Sim) -> None:
    kill_group(sim.proc)
    if sim.reader is not None:
        sim.reader.join(timeout=5)  # it ends at the pipe's EOF
    if sim.proc.stdout is not None:
        sim.proc.stdout.close()


def kill_group(proc: subprocess.Popen[Any]) -> None:
    # SIGKILL, not SIGTERM: smg keeps its listener open 5 s after SIGTERM (its
    # load-balancer propagation window); nothing here needs a graceful stop.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def wait_http(url: str, deadline_s: float, what: str, log: list[str] | Path) -> None:
    end = time.monotonic() + deadline_s
    last = "no attempt"
    while time.monotonic() < end:
        try:
            r = httpx.get(url, timeout=2)
            if r.status_code == 200:
                return
            last = f"status {r.status_code}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.1)
    tail = log.read_text()[-3000:] if isinstance(log, Path) else "".join(log)
    pytest.fail(f"{what} not up within {deadline_s} s ({url}: {last}); log tail:\n{tail}")
