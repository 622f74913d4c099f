"""A real Prometheus for the end-to-end tests: started on a free port over a scrape config,
waited for, queried.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

SGLANG_TEXT = (
    b"# HELP sglang:num_running_reqs The number of running requests.\n"
    b"# TYPE sglang:num_running_reqs gauge\n"
    b'sglang:num_running_reqs{engine_type="unified",model_name="qwen3-8b",'
    b'moe_ep_rank="0",pp_rank="0",tp_rank="0"} 3.0\n'
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_prometheus(tmp: Path, config: str) -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("prometheus") or "/usr/bin/prometheus"
    if not Path(binary).exists():
        pytest.skip("prometheus not installed (Debian package 'prometheus'); CI installs it")
    (tmp / "prometheus.yml").write_text(config)
    # Prometheus cannot listen on port 0 and report it back: pick a free port, retry if raced.
    for _ in range(3):
        port = _free_port()
        with (tmp / "prometheus.log").open("ab") as log:  # the child keeps its own copy of the fd
            proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={tmp / 'prometheus.yml'}",
                    f"--storage.tsdb.path={tmp / 'data'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                    "--log.level=warn",
                ],
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                    return proc, url
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        proc.kill()
        proc.wait()
    pytest.fail(f"prometheus did not start; its log:\n{(tmp / 'prometheus.log').read_text()}")


def _wait_for(what: str, probe: Callable[[], tuple[bool, Any]], timeout: float = 45.0) -> Any:
    """Poll `probe` until it says done; fail with its last observation."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        done, last = probe()
        if done:
            return last
        time.sleep(0.5)
    pytest.fail(f"timed out waiting for {what}; last observation:\n{last}")


def _query(client: httpx.Client, q: str) -> list[dict[str, Any]]:
    r = client.get("/api/v1/query", params={"query": q})
    r.raise_for_status()
    result: list[dict[str, Any]] = r.json()["data"]["result"]
    return result
