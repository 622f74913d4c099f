"""Secrets (issue 15, item 4) under the process runtime: what `ps` and /proc/PID/cmdline show
every local user of a running (simulator) worker holds no API key, and the worker still
requires the key. Uses only what the code had before the fix, so it ran (and failed) there."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import httpx

from keyed_spec import API_KEY, _free_port, _wait_healthy, keyed_spec
from sglang_farm.runtime import RuntimeEvent, Started
from sglang_farm.runtime.process import ProcessRuntime
from sglang_farm.sglang.argv import build_command


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
