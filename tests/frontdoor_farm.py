"""A real farm (farmproc.py) with a gateway in front: its [gateway] section, the workers it
routes to, a chat through it. Shared by the end-to-end tests of the front door.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from farmproc import Farm, marked_pids

MODEL = "sim/Qwen3.6-27B"
ADMIN_KEY = "test-admin-key-0123456789"


def routed(gateway: str) -> set[str]:
    """The URLs the gateway routes new requests to now (status ready)."""
    r = httpx.get(f"{gateway}/workers", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=5)
    r.raise_for_status()
    return {w["url"] for w in r.json()["workers"] if w.get("status", "ready") == "ready"}


def until(cond: Callable[[], bool], within: float, what: str) -> None:
    end = time.monotonic() + within
    while time.monotonic() < end:
        with contextlib.suppress(httpx.HTTPError):
            if cond():
                return
        time.sleep(0.1)
    raise AssertionError(f"not within {within} s: {what}")


def chat(url: str, max_tokens: int = 4, timeout: float = 30) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": max_tokens,
        },
        timeout=timeout,
    )


def gateway_section(mode: str, port: int, key_file: Path, **extra: str) -> str:
    lines = [f'mode = "{mode}"', f'admin_key_file = "{key_file}"', 'drain_timeout = "20s"']
    if mode == "managed":
        lines += [
            f'listen = "127.0.0.1:{port}"',
            f'metrics_listen = "127.0.0.1:{port + 1}"',
            'policy = "round_robin"',
        ]
    else:
        lines.append(f'url = "http://127.0.0.1:{port}"')
    lines += [f'{k} = "{v}"' for k, v in extra.items()]
    return "[gateway]\n" + "\n".join(lines) + "\n"


def worker_urls(config: Path) -> list[str]:
    import tomllib

    doc = tomllib.loads(config.read_text())
    base = doc["workers"]["base_port"]
    return [f"http://127.0.0.1:{base + i}" for i in range(len(doc["workers"]["gpus"]))]


@contextlib.contextmanager
def running_farm(config: Path, marker: str) -> Iterator[Farm]:
    farm = Farm(config, marker)
    try:
        yield farm
    finally:
        with contextlib.suppress(Exception):
            farm.stop(timeout=60)
        for pid in marked_pids(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
