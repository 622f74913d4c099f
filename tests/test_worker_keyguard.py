"""A worker's API key goes only to the worker's own listener (`host.keyguard`).

While a worker is down any local user may bind its port. The canary's paired probes and
the metrics pollers send the worker's key there: each asks the guard first, and sends
nothing to a listener that is not the worker's. The other user is `nobody` for real; what
it was sent is what its socket received.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping

import pytest
import structlog

from asuser import popen_as_nobody, require
from sglang_farm.canary import probe
from sglang_farm.host.keyguard import KeyGuard
from sglang_farm.host.portowner import ProcPortOwner
from sglang_farm.metrics.pollers import MetricPollers
from sglang_farm.spec import FarmSpec
from sglang_farm.workers.commands import FarmCommand
from sglang_farm.workers.supervisor import WorkerState, farm_policy

KEY = "k-worker-secret-0123456789"

# Accepts connections and prints every byte it is sent (one repr per line), answering
# each request with an empty 200: what a squatter would do to collect keys.
SQUATTER = """
import socket, sys
s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()
print(s.getsockname()[1], flush=True)
while True:
    c, _ = s.accept()
    c.settimeout(2)
    try:
        data = c.recv(65536)
    except OSError:
        data = b''
    print(repr(data), flush=True)
    try:
        c.sendall(b'HTTP/1.1 200 OK\\r\\nContent-Length: 0\\r\\nConnection: close\\r\\n\\r\\n')
    except OSError:
        pass
    c.close()
"""


@pytest.fixture
def squatter() -> Iterator[tuple[subprocess.Popen[str], int]]:
    require()
    proc = popen_as_nobody([sys.executable, "-I", "-c", SQUATTER])
    try:
        assert proc.stdout is not None
        yield proc, int(proc.stdout.readline())
    finally:
        proc.kill()
        proc.communicate(timeout=10)


def received(proc: subprocess.Popen[str]) -> str:
    proc.kill()
    out, _ = proc.communicate(timeout=10)
    return out


async def worker_pids(_worker: int) -> frozenset[int]:
    """The worker's processes: this test's own (the squatter is not among them)."""
    return frozenset({os.getpid()})


def guard() -> KeyGuard:
    return KeyGuard(worker_pids, ProcPortOwner(), gpu=lambda w: w)


async def test_a_probe_sends_no_key_to_a_listener_of_another_user(
    squatter: tuple[subprocess.Popen[str], int],
) -> None:
    proc, port = squatter
    url = f"http://127.0.0.1:{port}"
    prober = probe.Prober(
        "c0ffee",
        probe.Target(3, url, KEY),
        [probe.Target(4, url, KEY)],
        concurrency=1,
        model=None,
        timeout_s=5,
        guard=guard(),
    )
    with structlog.testing.capture_logs() as logs:
        task = asyncio.ensure_future(prober.run())
        for _ in range(200):  # a give-up bound
            if prober.pairs:
                break
            await asyncio.sleep(0.02)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    got = received(proc)
    assert "Authorization" not in got and KEY not in got
    assert got == ""  # no request at all: a stranger's answer is no figure of the worker
    pair = prober.pairs[0]
    assert not pair.canary.ok and not pair.baseline.ok
    assert f"PID {proc.pid} (user nobody)" in pair.canary.error
    assert "not by worker 3" in pair.canary.error
    warned = [e for e in logs if e["event"] == "worker_key_withheld"]
    # Once per worker for this squatter, naming the worker, GPU, port and the holder.
    assert sorted(e["worker"] for e in warned) == [3, 4]
    assert {(e["port"], e["owner_uid"], e["owner_pid"]) for e in warned} == {
        (port, 65534, proc.pid)
    }
    assert {e["gpu"] for e in warned} == {3, 4}


async def test_the_poller_sends_no_key_to_a_listener_of_another_user(
    squatter: tuple[subprocess.Popen[str], int],
) -> None:
    """The worker loop of the metrics pollers, as the service builds it (`guard=`)."""
    from metrics_fixtures import farm
    from sglang_farm.config import load_spec
    from sglang_farm.farm_view import Phase

    proc, port = squatter
    spec = load_spec(
        f"""
[farm]
python = "{sys.executable}"
module = "sglang_farm.sim"
[workers]
gpus = [0]
host = "127.0.0.1"
base_port = {port}
[metrics]
gpu_source = "none"
worker_poll_interval = "0.1s"
[sglang]
model_path = "sim/model"
api_key = "{KEY}"
""",
        source="t.toml",
    )
    view = farm()
    w = dataclasses.replace(view.workers[0], phase=Phase.READY, base_url=f"http://127.0.0.1:{port}")
    polling = MetricPollers(
        lambda: spec, None, dataclasses.replace(view, workers=(w,)), guard=guard()
    )
    with structlog.testing.capture_logs() as logs:
        loop = asyncio.ensure_future(polling._worker_loop())
        for _ in range(200):  # a give-up bound: three polls, 0.1 s apart
            if polling._stats:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # more polls of the same squatter
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop
    got = received(proc)
    assert "Authorization" not in got and KEY not in got and got == ""
    # The worker has no figures, and its error says whose the port is.
    assert f"PID {proc.pid} (user nobody)" in (polling._stats[w.id].error or "")
    warned = [e for e in logs if e["event"] == "worker_key_withheld"]
    # Said once for this worker and this squatter, not at every poll.
    assert len(warned) == 1 and f"PID {proc.pid} (user nobody)" in warned[0]["why"]
    assert (warned[0]["worker"], warned[0]["gpu"], warned[0]["port"]) == (0, 0, port)
    assert warned[0]["owner_uid"] == 65534 and warned[0]["owner_pid"] == proc.pid


async def test_the_workers_own_listener_gets_the_poll_with_its_key() -> None:
    """The guard lets through what is the worker's: here this test's own socket."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        g = guard()
        assert await g.refusal(0, f"http://127.0.0.1:{port}") is None
        # A second check costs no walk of descriptors: the inode is remembered.
        assert await g.refusal(0, f"http://127.0.0.1:{port}") is None
    fresh = guard()  # a reading of its own, after the socket closed
    assert "nothing listens" in (await fresh.refusal(0, f"http://127.0.0.1:{port}") or "")


class _ScrapeOnlyFarm:
    """The agent's entry as the canary driver sees it: states read, nothing submitted."""

    def __init__(self, spec: FarmSpec) -> None:
        self.spec = spec
        self.policy = farm_policy(spec)

    def states(self) -> Mapping[int, WorkerState]:
        return {w: WorkerState(w) for w in self.spec.worker_ids}

    def submit(self, command: FarmCommand) -> None:
        raise AssertionError(f"not asked by a scrape: {command}")


async def test_the_canary_scrapes_no_worker_whose_port_is_not_its_own() -> None:
    """The canary's `/metrics` scrapes carry the worker's key: a squatted port is skipped
    (its worker has no sample), the others are scraped as before."""
    from fake_runtime import FakePortOwner
    from poller_farm import TOML
    from sglang_farm.canary.driver import CanaryDriver, Host
    from sglang_farm.config import load_spec

    spec = load_spec(TOML, source="t.toml")  # worker 1 has api_key "k-worker-1"
    scraped: list[tuple[str, str | None]] = []

    async def scrape(url: str, key: str | None) -> str:
        scraped.append((url, key))
        return ""

    owner = FakePortOwner()
    owner.squat(30001)

    def unused(*_a: object) -> None:
        raise AssertionError("not asked by a scrape")

    driver = CanaryDriver(
        spec,
        Host(
            farm=_ScrapeOnlyFarm(spec),
            rollout_over=lambda: True,
            spawn=unused,  # type: ignore[arg-type]
            refresh=unused,
            reload=unused,  # type: ignore[arg-type]
            startup_done=lambda: True,
            clock=lambda: 0.0,
            wall=lambda: 0.0,
            gateway=lambda: False,
            restore_model=unused,
            key_guard=KeyGuard(worker_pids, owner, gpu=lambda w: w),
        ),
        scrape=scrape,
    )
    with structlog.testing.capture_logs() as logs:
        await driver._samples([0, 1])
    assert scraped == [("http://127.0.0.1:30000/metrics", None)]
    assert "k-worker-1" not in repr(logs)
    [warned] = [e for e in logs if e["event"] == "worker_key_withheld"]
    assert (warned["worker"], warned["port"], warned["owner_pid"]) == (1, 30001, 4242)


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999/metrics", "http://127.0.0.1:x/v1"])
def test_a_url_with_no_usable_port_is_a_refusal_not_an_exception(url: str) -> None:
    """urlsplit raises on a port out of range or not a number: the guard says why and
    nothing is sent, rather than ending the poll or probe that asked (the review's
    finding)."""
    why = asyncio.run(guard().refusal(0, url))
    assert why is not None and why.startswith(f"{url}: no port to check the listener of")
