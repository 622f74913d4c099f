"""End to end with the real gateway (issue 23, "Done when"): the demo's shape, smaller.

Four simulator workers behind the managed smg (cache-aware, drained stops, as the demo
runs it), 16 clients through the front door. A reload making every token 5x slower
(`SGLANG_SIM_TOKEN_SECONDS = "0.05"`) and one crashing the workers 10 s into serving
(`SGLANG_SIM_FAIL_AFTER = "10"`) are each rolled back from the canary: `farmctl reload`
exits 5 with the evidence, `farmctl status` says "rolled back" with it, and no worker
process is left running the change. A harmless change then reaches every worker with no
failed request. The window is 15 s (the demo's is 30 s): long enough that the crash 10 s
after the canary is ready falls inside it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import os
import signal
import threading
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from farmproc import Farm, farm_config, free_port_block, marked_pids, new_marker
from farmtoml import rewritten

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("smg") is None,
        reason="smg (SGLang's gateway) is not installed: pip install smg==1.13.0",
    ),
]

MODEL = "sim/Qwen3.6-27B"
WORKERS = 4
CLIENTS = 16


def gateway_section(port: int) -> str:
    """The demo's [gateway] on free ports (the agent generates its admin key)."""
    return (
        "[gateway]\n"
        'mode = "managed"\n'
        f'listen = "127.0.0.1:{port}"\n'
        'policy = "cache_aware"\n'
        f'metrics_listen = "127.0.0.1:{port + 1}"\n'
        'drain_timeout = "30s"\n'
    )


@contextlib.contextmanager
def load(url: str) -> Iterator[list[tuple[float, str]]]:
    """CLIENTS clients sending chat completions through `url` without pause (each its own
    prompts, so the cache-aware gateway spreads them); yields the failures seen, as
    (monotonic time, why)."""
    stop = threading.Event()
    failures: list[tuple[float, str]] = []
    counter = itertools.count()

    def client() -> None:
        with httpx.Client(base_url=url, timeout=30, trust_env=False) as c:
            while not stop.is_set():
                n = next(counter)
                body = {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"{n * 7919 % 100_003} count"}],
                    "max_tokens": 8,
                }
                try:
                    r = c.post("/v1/chat/completions", json=body)
                    ok = r.status_code == 200 and bool(r.json().get("choices"))
                    why = "" if ok else f"status {r.status_code}: {r.text[:200]}"
                except (httpx.HTTPError, ValueError) as exc:
                    why = repr(exc)
                if why:
                    failures.append((time.monotonic(), why))
                    time.sleep(0.05)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(CLIENTS)]
    for t in threads:
        t.start()
    try:
        yield failures
    finally:
        stop.set()
        for t in threads:
            t.join(40)


def environ(pid: object) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(kv.decode(errors="replace").partition("=")[::2] for kv in raw if b"=" in kv)


def worker_pids(farm: Farm) -> dict[int, Any]:
    out = farm.farmctl("--json", "status")
    assert out.returncode == 0, out.stdout + out.stderr
    return {int(w["id"]): w.get("pid") for w in json.loads(out.stdout)["workers"]}


def canary_status_line(farm: Farm) -> str:
    out = farm.farmctl("status")
    assert out.returncode == 0, out.stdout + out.stderr
    return next((ln for ln in out.stdout.splitlines() if ln.startswith("canary ")), out.stdout)


def rolled_back(farm: Farm, good: str, env: dict[str, str], evidence: str) -> None:
    """Reload `good` with `env` added to [farm] env: rolled back from the canary (worker
    0) with `evidence`, the canary serving the old config again, no worker running it."""
    n = len(farm.snapshot())
    farm.config.write_text(rewritten(good, farm={"env": {**base_env(good), **env}}))
    out = farm.farmctl("reload", timeout=180)
    assert out.returncode == 5, out.stdout + out.stderr
    assert "rolled back" in out.stderr + out.stdout and evidence in out.stderr + out.stdout
    line = canary_status_line(farm)
    assert line.startswith("canary 0: rolled back: ") and evidence in line, line
    back = farm.named("canary_rolled_back")[-1]
    farm.wait_for(
        lambda e: (
            e.get("event") == "worker_ready" and e.get("worker") == 0 and e["_t"] > back["_t"]
        ),
        after=n,
        timeout=60,
    )
    launched = [e["worker"] for e in farm.snapshot()[n:] if e.get("event") == "worker_launching"]
    assert launched == [0, 0], launched  # the change, then the old config; no one else
    pids = worker_pids(farm)
    assert sorted(pids) == list(range(WORKERS)) and all(pids.values()), pids
    for wid, pid in pids.items():
        left = {k for k in env if k in environ(pid)}
        assert not left, f"worker {wid} (pid {pid}) still runs {left}"


def base_env(text: str) -> dict[str, str]:
    return dict(tomllib.loads(text)["farm"]["env"])


def test_bad_changes_are_rolled_back_and_a_harmless_one_rolls_with_no_failed_request(
    short_tmp: Path,
) -> None:
    marker = new_marker()
    port = free_port_block(2)
    cfg = farm_config(
        short_tmp,
        workers=WORKERS,
        parallel=2,
        load_seconds=0.5,
        marker=marker,
        extra=gateway_section(port),
        rollout={"analysis_window": "15s"},
        # A loaded CI machine (4 test workers on 2 cores) may miss a probe or two; a
        # canary judged unhealthy there would be a false rollback, not the change's doing.
        health={"period": "1s", "timeout": "5s", "failure_threshold": 5},
    )
    farm = Farm(cfg, marker)
    try:
        farm.wait_for(lambda e: e.get("event") == "rollout_done", timeout=90)
        good = cfg.read_text()
        front = f"http://127.0.0.1:{port}"
        with load(front) as failures:
            rolled_back(farm, good, {"SGLANG_SIM_TOKEN_SECONDS": "0.05"}, "ITL")
            rolled_back(farm, good, {"SGLANG_SIM_FAIL_AFTER": "10"}, "canary oom")
            # A harmless change: promoted from the canary, then every wave, none failing.
            before = len(failures)
            n = len(farm.snapshot())
            farm.config.write_text(rewritten(good, farm={"env": {**base_env(good), "NOTE": "1"}}))
            out = farm.farmctl("reload", timeout=180)
            assert out.returncode == 0, out.stdout + out.stderr
            assert "promoted" in out.stdout and "rollout done" in out.stdout, out.stdout
            assert failures[before:] == [], failures[before:]
        launched = [
            e["worker"] for e in farm.snapshot()[n:] if e.get("event") == "worker_launching"
        ]
        assert sorted(launched) == list(range(WORKERS)) and launched[0] == 0, launched
        for wid, pid in worker_pids(farm).items():
            assert environ(pid).get("NOTE") == "1", wid
    finally:
        with contextlib.suppress(Exception):
            farm.stop(timeout=60)
        for pid in marked_pids(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
