"""XID 79 through the GPU poller's seam: the real pollers, agent and exporter, on a real clock.

The simulated GPUs (`gpus.simulated.FakeGpuPoller`) stand in for NVML at the poller's seam;
workers are the fake runtime's (no processes). Issue 14's "done when": worker 5 is
stopped and quarantined within 10 s, naming XID 79, the other seven untouched, the
metric at 1; XID 13 quarantines nothing; the quarantine survives an agent restart, and
a release brings the worker back.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from prometheus_client import generate_latest

from agent_harness import Farm, farm, farm_toml
from sglang_farm.gpus.simulated import FakeGpuPoller
from sglang_farm.gpus.snapshot import FleetSnapshot
from sglang_farm.gpus.xid import XidClass, classify
from sglang_farm.metrics.pollers import MetricPollers
from sglang_farm.workers.phase import Phase


def fast_farm(tmp: Path) -> str:
    """The harness's farm on the simulated GPUs, polled and probed often (a real clock)."""
    return farm_toml(
        tmp,
        metrics={
            "gpu_source": "fake",
            "listen": "127.0.0.1:0",
            "gpu_poll_interval": "0.2s",
            "worker_poll_interval": "0.5s",
        },
        health={"period": "0.3s"},
        startup={"poll_interval": "100ms"},
    )


def gpu_line(text: str, metric: str, gpu: int) -> str:
    """The exposition's one sample line of `metric` for `gpu`."""
    lines = text.splitlines()
    (line,) = [ln for ln in lines if ln.startswith(metric + "{") and f'gpu="{gpu}"' in ln]
    return line


async def run_farm(tmp: Path, gpus: FakeGpuPoller, scenario: str) -> dict[int, Phase]:
    async def check_gpu(gpu: int) -> list[str]:
        return []  # the operator reset it: NVML finds it clear

    async with farm(tmp, text=fast_farm(tmp), check_gpu=check_gpu, load_s=0.2) as f:
        # Every snapshot the agent has observed (appended once `observe_fleet` returned).
        observed: list[FleetSnapshot] = []

        def on_fleet(fleet: FleetSnapshot) -> None:
            f.agent.observe_fleet(fleet)
            observed.append(fleet)

        pollers = MetricPollers(f.agent.spec, gpus, f.agent.view(), on_fleet=on_fleet)
        await pollers.start()
        try:
            return await _scenario(f, gpus, pollers, observed, scenario)
        finally:
            await pollers.close()


async def _scenario(
    f: Farm,
    gpus: FakeGpuPoller,
    pollers: MetricPollers,
    observed: list[FleetSnapshot],
    scenario: str,
) -> dict[int, Phase]:
    async def observes(xid: tuple[int, int], then: int = 1) -> None:
        """Until the agent observed a snapshot counting `xid`, and `then` - 1 after it."""

        def seen() -> bool:
            at = next((i for i, s in enumerate(observed) if s.xid_events_total.get(xid)), None)
            return at is not None and len(observed) - at >= then

        await f.until(seen, within=10)

    def settled() -> bool:
        p = f.phases()
        others = all(p[w] is Phase.READY for w in p if w != 5)
        return others and p[5] in (Phase.READY, Phase.QUARANTINED)

    await f.until(settled, within=20)
    if scenario == "xid79":
        t0 = time.monotonic()
        gpus.inject_xid(5, 79)
        await f.until(lambda: f.phase(5) is Phase.QUARANTINED, within=10)
        assert time.monotonic() - t0 <= 10
        q = f.agent.view().worker(5).quarantine
        assert q is not None and q.reason == "xid 79"
        pollers.on_view(f.agent.view())
        text = generate_latest(pollers.registry).decode()
        line = gpu_line(text, "sglang_farm_gpu_quarantined", 5)
        assert line.endswith(" 1.0") and 'reason="xid 79"' in line, line
        await observes((5, 79), then=3)  # two more snapshots seen since: the others stay
        assert all(f.phase(w) is Phase.READY for w in range(8) if w != 5)
    elif scenario == "xid13":
        assert classify(13).xid_class is XidClass.APPLICATION  # the catalog's, for the record
        gpus.inject_xid(2, 13)
        # Arrived: the agent observed the XID, and the snapshot after it (a verdict the
        # agent would queue rather than apply at once has been applied by then).
        await observes((2, 13), then=2)
        # Classified as the application's: the worker keeps running, nothing set aside.
        assert f.phase(2) is Phase.READY and f.agent.view().worker(2).quarantine is None
        assert f.runtime.starts_of(2) == 1 and f.runtime.stops == []
        pollers.on_view(f.agent.view())
        text = generate_latest(pollers.registry).decode()
        assert gpu_line(text, "sglang_farm_gpu_xid_errors_total", 2).endswith(" 1.0")
        assert gpu_line(text, "sglang_farm_gpu_quarantined", 2).endswith(" 0.0")
    elif scenario == "release":
        assert f.phase(5) is Phase.QUARANTINED  # after the agent's restart
        assert await f.ops.release_gpu(5) == []
        await f.until(lambda: f.phase(5) is Phase.READY, within=10)
    return f.phases()


def test_xid_79_quarantines_worker_5_only_and_a_release_brings_it_back(tmp_path: Path) -> None:
    asyncio.run(run_farm(tmp_path, FakeGpuPoller(count=8), "xid79"))
    # A new agent (cold start, same state file): still quarantined; a release brings it back.
    asyncio.run(run_farm(tmp_path, FakeGpuPoller(count=8), "release"))


def test_xid_13_is_the_applications_and_quarantines_nothing(tmp_path: Path) -> None:
    asyncio.run(run_farm(tmp_path, FakeGpuPoller(count=8), "xid13"))
