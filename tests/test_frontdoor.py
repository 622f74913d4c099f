"""The front door end to end: real farms of simulators behind the real gateway (smg).

Membership follows readiness, planned stops drain before SIGTERM, a crash leaves the
gateway at once, rolling restarts keep `workers - parallel` routed, a restarted gateway
is refilled, and (external mode) two farms share one gateway without touching each
other's workers.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from farmproc import farm_config, free_port_block, new_marker, tmpdir
from frontdoor_farm import (
    ADMIN_KEY,
    chat,
    gateway_section,
    routed,
    running_farm,
    until,
    worker_urls,
)
from sglang_farm.gateway.managed import ManagedGateway, smg_argv

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("smg") is None,
        reason="smg (SGLang's gateway) is not installed: pip install smg==1.13.0",
    ),
]


def children_named(ppid: int, needle: bytes) -> list[int]:
    """Live children of `ppid` whose command line contains `needle`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            if (
                int(stat[stat.rfind(")") + 2 :].split()[1]) == ppid
                and needle in Path(f"/proc/{entry}/cmdline").read_bytes()
            ):
                found.append(int(entry))
    return found


def test_managed_gateway_follows_readiness_drains_and_survives_a_crash() -> None:
    tmp = tmpdir()
    key = tmp / "admin.key"
    key.write_text(ADMIN_KEY)
    key.chmod(0o600)
    port = free_port_block(2)
    gw = f"http://127.0.0.1:{port}"
    marker = new_marker()
    config = farm_config(
        tmp, workers=4, parallel=2, marker=marker, extra=gateway_section("managed", port, key)
    )
    urls = worker_urls(config)
    with running_farm(config, marker) as farm:
        until(lambda: routed(gw) == set(urls), 60, "all four workers routed")
        # Every ready worker was added once, and users reach the farm at one URL.
        assert chat(gw).status_code == 200

        # A planned stop: out of the gateway first, then the requests it runs finish,
        # then SIGTERM. The long request (300 tokens at 10 ms) is not cut.
        result: dict[str, Any] = {}

        def long_request() -> None:
            result["r"] = chat(urls[1], max_tokens=300)

        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(0.5)
        stop = farm.farmctl("stop", "1", timeout=60)
        assert stop.returncode == 0, stop.stderr
        t.join(30)
        assert result["r"].status_code == 200
        removed = farm.named("gateway_removed", worker=1)[0]["_t"]
        drained = farm.named("worker_drained", worker=1)[0]["_t"]
        exited = farm.named("worker_exited", worker=1)[0]["_t"]
        assert removed < drained < exited
        assert drained - removed >= 1.5  # it waited for the request, which took ~3 s
        assert urls[1] not in routed(gw)

        # An unplanned death: out of the gateway within a second of the farm seeing it.
        pid = int(farm.farmctl("--json", "status").stdout.split('"pid": ')[3].split(",")[0])
        os.kill(pid, signal.SIGKILL)
        seen = farm.wait_for(
            lambda e: e.get("event") == "worker_exited" and e.get("worker") == 2, 10
        )
        gone = farm.wait_for(
            lambda e: e.get("event") == "gateway_removed" and e.get("worker") == 2, 10
        )
        assert gone["_t"] - seen["_t"] <= 1.0
        until(lambda: urls[2] in routed(gw), 30, "worker 2 back in the gateway")

        # A rolling restart never takes more than `parallel` (2) out of the gateway.
        farm.farmctl("start", "1")
        until(lambda: routed(gw) == set(urls), 60, "all four routed again")
        fewest = [len(urls)]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                with contextlib.suppress(httpx.HTTPError):
                    fewest[0] = min(fewest[0], len(routed(gw)))
                time.sleep(0.05)

        sampler = threading.Thread(target=sample)
        sampler.start()
        restart = farm.farmctl("restart", "all", timeout=120)
        done.set()
        sampler.join()
        assert restart.returncode == 0, restart.stderr
        assert fewest[0] >= len(urls) - 2, fewest

        # The gateway dies: the farm starts it again and refills it.
        smg = children_named(farm.proc.pid, b"smg")
        assert smg, "the managed gateway is a child of the farm"
        for p in smg:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        until(lambda: routed(gw) == set(urls), 40, "a restarted gateway refilled")


@pytest.fixture
def external_gateway() -> Iterator[tuple[str, Path]]:
    tmp = tmpdir()
    key = tmp / "admin.key"
    key.write_text(ADMIN_KEY)
    key.chmod(0o600)
    port = free_port_block(2)
    spec = ManagedGateway(host="127.0.0.1", port=port, metrics_port=port + 1, policy="round_robin")
    argv = smg_argv(
        spec, smg=[sys.executable, "-m", "sglang_farm.gateway.launch", "--admin-key-file", str(key)]
    )
    with (tmp / "smg.log").open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        until(lambda: httpx.get(f"{spec.url}/health", timeout=2).status_code == 200, 30, "smg up")
        yield spec.url, key
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def test_two_farms_share_one_external_gateway_without_touching_each_other(
    external_gateway: tuple[str, Path],
) -> None:
    gw, key = external_gateway
    port = int(gw.rsplit(":", 1)[1])
    a_tmp, b_tmp = tmpdir(), tmpdir()
    a_marker, b_marker = new_marker(), new_marker()
    a_cfg = farm_config(
        a_tmp, workers=2, parallel=1, marker=a_marker, extra=gateway_section("external", port, key)
    )
    b_cfg = farm_config(
        b_tmp, workers=2, parallel=1, marker=b_marker, extra=gateway_section("external", port, key)
    )
    a_urls, b_urls = set(worker_urls(a_cfg)), set(worker_urls(b_cfg))
    with running_farm(b_cfg, b_marker):
        with running_farm(a_cfg, a_marker) as a:
            # Two farms of two workers starting at once, on a busy 2-core machine.
            until(lambda: routed(gw) == a_urls | b_urls, 120, "both farms routed")
            lost_b = [False]
            done = threading.Event()

            def watch_b() -> None:
                while not done.is_set():
                    with contextlib.suppress(httpx.HTTPError):
                        if not b_urls <= routed(gw):
                            lost_b[0] = True
                    time.sleep(0.05)

            watcher = threading.Thread(target=watch_b)
            watcher.start()
            r = a.farmctl("restart", "all", timeout=120)
            assert r.returncode == 0, r.stderr
            until(lambda: routed(gw) == a_urls | b_urls, 30, "farm A back")
            done.set()
            watcher.join()
            assert not lost_b[0], "a restart on farm A touched farm B's workers"
            assert a.named("worker_drained")  # A's planned restarts were drained
        # Farm A stopped (its workers drained out); farm B's stay.
        until(lambda: routed(gw) == b_urls, 20, "only farm B left")
        # A comes back and reconciles: its workers are added again.
        with running_farm(a_cfg, a_marker):
            until(lambda: routed(gw) == a_urls | b_urls, 60, "farm A routed again")
