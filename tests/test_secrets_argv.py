"""Secrets (issue 15, item 4) under the process runtime: what `ps` and /proc/PID/cmdline show
every local user of a running (simulator) worker holds no API key, and the worker still
requires the key. Uses only what the code had before the fix, so it ran (and failed) there."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from sglang_farm.config import load_spec
from sglang_farm.runtime import RuntimeEvent, Started
from sglang_farm.runtime.process import ProcessRuntime
from sglang_farm.sglang.argv import build_command
from sglang_farm.spec import FarmSpec

API_KEY = "sk-farm-secret-4f1c"
TOKEN = "hf_token_secret_9a7e"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def keyed_spec(port: int = 30000, state_dir: str = "/var/lib/sglang-farm") -> FarmSpec:
    text = f"""
[farm]
python = "{sys.executable}"
module = "sglang_farm.sim"
user = "root"
group = "root"
state_dir = "{state_dir}"
env = {{ HF_TOKEN = "{TOKEN}", SGLANG_SIM_LOAD_SECONDS = "0.2", SGLANG_SIM_WARMUP_SECONDS = "0.1" }}

[workers]
gpus = [0, 1]
host = "127.0.0.1"
base_port = {port}

[sglang]
model_path = "sim/m"
api_key = "{API_KEY}"
"""
    return load_spec(text, source="/etc/sglang-farm/farm.toml", gpu_count=2)


def _wait_healthy(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code
            if last == 200:
                return
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.1)
    raise AssertionError(f"worker on port {port} never healthy; last: {last!r}")


async def test_process_runtime_worker_cmdline_holds_no_key_and_the_worker_requires_it() -> None:
    spec = keyed_spec(port=_free_port())
    events: list[RuntimeEvent] = []
    rt = ProcessRuntime(events.append)
    await rt.prepare(spec, {})
    port = spec.workers[0].port
    await rt.start(0, build_command(spec.farm, spec.workers[0]))
    try:
        pid = next(e.pid for e in events if isinstance(e, Started))
        await asyncio.to_thread(_wait_healthy, port)
        raw = await asyncio.to_thread(Path(f"/proc/{pid}/cmdline").read_bytes)
        cmdline = raw.decode()
        assert API_KEY not in cmdline, cmdline
        assert "sglang_farm.sim" in cmdline
        # What `ps` shows every local user: no key either (the children included).
        ps = await asyncio.to_thread(
            subprocess.run, ["ps", "-eo", "args"], capture_output=True, text=True, check=True
        )
        assert API_KEY not in ps.stdout
        async with httpx.AsyncClient() as client:
            url = f"http://127.0.0.1:{port}/v1/models"
            assert (await client.get(url)).status_code == 401
            auth = {"Authorization": f"Bearer {API_KEY}"}
            assert (await client.get(url, headers=auth)).status_code == 200
    finally:
        await rt.stop(0, 10.0)
        await rt.close()
