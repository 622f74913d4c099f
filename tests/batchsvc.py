"""Test helper: the batch service (`python -m sglang_farm.batch`) as a child process, on a
farm.toml of its own, in front of simulator workers started directly (no agent) or any
other front door; and a fake front door for the answers the simulator does not give.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from farmproc import free_port_block
from farmtoml import merged, sim_farm, toml_text

API_KEY = "batch-test-key-0123456789"


def wait_until(ok: Callable[[], bool], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if ok():
            return
        time.sleep(0.05)
    raise AssertionError(f"not within {within} s: {what}")


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


class Sims:
    """n simulator workers on consecutive free ports (SGLang's argv, no farm)."""

    def __init__(self, n: int, *, env: Mapping[str, str] | None = None, args: tuple[str, ...] = ()):
        self.base = free_port_block(n)
        self.n = n
        self.env = {
            **os.environ,
            "SGLANG_SIM_LOAD_SECONDS": "0",
            "SGLANG_SIM_HEALTH_DELAY": "0.01",
            "SGLANG_SIM_TOKEN_SECONDS": "0.001",
            **(env or {}),
        }
        self.args = args
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.base + i}"

    def start(self, i: int) -> None:
        self.procs[i] = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sglang_farm.sim",
                "--model-path",
                "sim/model",
                "--port",
                str(self.base + i),
                "--skip-server-warmup",
                *self.args,
            ],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def kill(self, i: int) -> None:
        p = self.procs.pop(i)
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()

    def __enter__(self) -> Sims:
        for i in range(self.n):
            self.start(i)
        for i in range(self.n):
            wait_until(functools.partial(_answers, self.url(i) + "/health"), 60, f"simulator {i}")
        return self

    def __exit__(self, *exc: object) -> None:
        for i in list(self.procs):
            self.kill(i)


def write_config(
    tmp: Path,
    *,
    workers: int,
    base_port: int,
    batch: Mapping[str, Any] | None = None,
    gateway: Mapping[str, Any] | None = None,
    max_running: int = 4,
) -> Path:
    """tmp/farm.toml: a simulator farm at `base_port`, `[batch]` enabled on a free port with
    its key in tmp/batch.key and its state in tmp/batch-state, merged with `batch`."""
    key = tmp / "batch.key"
    key.write_text(API_KEY + "\n")
    key.chmod(0o600)
    port = free_port_block(1)
    doc = sim_farm(
        workers,
        sys.executable,
        workers={"base_port": base_port, "nccl_base_port": free_port_block(workers)},
        control={"socket": f"{tmp}/control.sock", "group": "root"},
        sglang={"model_path": "sim/model", "max_running_requests": max_running},
        gateway=dict(gateway or {}),
        batch={
            "enabled": True,
            "listen": f"127.0.0.1:{port}",
            "api_key_file": str(key),
            "state_dir": f"{tmp}/batch-state",
            "retry_backoff_s": 0.05,
            **(batch or {}),
        },
    )
    path = tmp / "farm.toml"
    path.write_text(toml_text(merged(doc, {})))
    return path


class BatchService:
    """`python -m sglang_farm.batch --config PATH` as a child; its log in `log_path`."""

    def __init__(self, config: Path, *, name: str = "batch") -> None:
        self.config = config
        self.log_path = config.parent / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        import tomllib

        listen = tomllib.loads(config.read_text())["batch"]["listen"]
        self.url = f"http://{listen}"

    def start(self, within: float = 60.0) -> None:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_farm.batch", "--config", str(self.config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()

        def up() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"the batch service exited {self.proc.returncode}: {self.log_path.read_text()}"
                )
            return _answers(self.url + "/metrics")

        wait_until(up, within, "the batch service answers /metrics")

    def kill(self) -> None:
        """kill -9, as a crash."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.proc = None

    def stop(self) -> int:
        assert self.proc is not None
        self.proc.terminate()
        code = self.proc.wait(timeout=60)
        self.proc = None
        return code

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text

    def __enter__(self) -> BatchService:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.kill()


def jsonl(rows: Sequence[Mapping[str, Any]]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def chat_lines(n: int, *, prefix: str = "req", max_tokens: int = 4) -> list[dict[str, Any]]:
    return [
        {
            "custom_id": f"{prefix}-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "sim/model",
                "messages": [{"role": "user", "content": f"question {i}"}],
                "max_tokens": max_tokens,
            },
        }
        for i in range(n)
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def fake_front_door(
    answer: Callable[[dict[str, Any]], tuple[int, dict[str, Any]]],
) -> Iterator[str]:
    """A front door on a free port (Starlette on uvicorn, in a thread) answering every POST
    with `answer(body)` -> (status, JSON), called in a thread of its own (it may block);
    yields its base URL."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    pool = ThreadPoolExecutor(max_workers=256)  # answers may block (a test holding them)

    async def route(request: Request) -> JSONResponse:
        body = await request.json()
        status, doc = await asyncio.get_running_loop().run_in_executor(pool, answer, body)
        return JSONResponse(doc, status_code=status)

    app = Starlette(
        routes=[
            Route(p, route, methods=["POST"]) for p in ("/v1/chat/completions", "/v1/completions")
        ]
    )
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, 30, "the fake front door started")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        pool.shutdown(wait=False, cancel_futures=True)
