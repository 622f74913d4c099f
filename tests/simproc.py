"""The simulator as a real process (python -m sglang_farm.sim) for the tests: `Sim`, the
`sims` fixture's starter (conftest.py), its streams and metrics read back.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

FAST = {
    "SGLANG_SIM_LOAD_SECONDS": "0.3",
    "SGLANG_SIM_WARMUP_SECONDS": "0.2",
    "SGLANG_SIM_HEALTH_DELAY": "0.05",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(what: str, check: Callable[[], object], timeout: float = 10.0) -> object:
    """Poll `check` until it returns something truthy; fail with the last observation."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (httpx.HTTPError, OSError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(0.02)
    pytest.fail(f"timed out waiting for {what}; last observation: {last!r}")


class Sim:
    """One simulator process in its own session, with its stderr collected line by line."""

    def __init__(self, *flags: str, env: dict[str, str] | None = None, port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [
            sys.executable,
            "-m",
            "sglang_farm.sim",
            "--model-path",
            "/models/llama-3-8b",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--nccl-port",
            str(free_port()),
            *flags,
        ]
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_SIM_")}
        full_env.update(FAST if env is None else env)
        self.proc = subprocess.Popen(
            argv,
            env=full_env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def wait_log(self, text: str, timeout: float = 10.0) -> None:
        wait_until(f"log line {text!r}", lambda: text in self.log, timeout)

    def wait_ready(self, timeout: float = 60.0) -> None:
        # A give-up bound, not a timing goal: a simulator starts in about a second, but a
        # CI run loads the 2 cores with the .deb build and two systemd containers at once
        # (one start took over 10 s there).
        self.wait_log("The server is fired up and ready to roll!", timeout)

    def wait(self, timeout: float = 15.0) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(5)
        return code

    def close(self) -> None:
        """SIGKILL whatever is left of the session, then release the pipe."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._reader.join(5)
        assert self.proc.stderr is not None
        self.proc.stderr.close()


# One decoded `data:` payload: a JSON value, or the string "[DONE]". Any on purpose: each
# test asserts the shape of SGLang's events by indexing into them, and a wrong shape fails there.
SseEvent = Any


def sse_frames(body: bytes) -> list[SseEvent]:
    """Split a text/event-stream body into its `data:` payloads, checking SGLang's framing.

    Every event is exactly `data: <payload>\\n\\n`; JSON payloads are decoded, `[DONE]` is kept.
    """
    assert body.endswith(b"\n\n"), body[-80:]
    frames: list[SseEvent] = []
    for raw in body[:-2].split(b"\n\n"):
        assert raw.startswith(b"data: "), raw
        payload = raw.removeprefix(b"data: ")
        frames.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return frames


def post_stream(
    client: httpx.Client, path: str, body: dict[str, object]
) -> tuple[str, list[SseEvent]]:
    """POST a streaming request; returns the content type and the decoded events."""
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        return r.headers["content-type"], sse_frames(r.read())


def metric_values(client: httpx.Client) -> dict[str, float]:
    fams = text_string_to_metric_families(client.get("/metrics").text)
    return {s.name: s.value for f in fams for s in f.samples}


class StartSim(Protocol):
    """The `sims` fixture: start a simulator with these flags; it is killed at teardown."""

    def __call__(
        self, *flags: str, env: dict[str, str] | None = None, port: int | None = None
    ) -> Sim: ...


@contextlib.contextmanager
def started_sims() -> Iterator[StartSim]:
    """The `sims` fixture's starter (conftest.py): every simulator it started is closed
    when the block ends."""
    started: list[Sim] = []

    def start(*flags: str, env: dict[str, str] | None = None, port: int | None = None) -> Sim:
        sim = Sim(*flags, env=env, port=port)
        started.append(sim)
        return sim

    try:
        yield start
    finally:
        for sim in started:
            sim.close()


def sim_help(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_SIM_")}
    return subprocess.run(
        [sys.executable, "-m", "sglang_farm.sim", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
