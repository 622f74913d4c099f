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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Run:
    """One farm's run, as a scenario sees it."""

    farm: Farm
    gpus: FakeGpuPoller
    pollers: MetricPollers
    observed: list[FleetSnapshot]  # every snapshot the agent observed, in order

    async def observes(self, xid: tuple[int, int], then: int = 1) -> None:
        """Until the agent observed a snapshot counting `xid`, and `then` - 1 after it."""
        observed = self.observed

        def seen() -> bool:
            at = next((i for i, s in enumerate(observed) if s.xid_events_total.get(xid)), None)
            return at is not None and len(observed) - at >= then

        await self.farm.until(seen, within=10)


# A scenario is a function, not a name compared in branches: a misspelt one is a NameError
# (and a mypy error), never a run that asserts nothing (issue 32, 4.5).
Scenario = Callable[[Run], Awaitable[None]]


async def run_farm(tmp: Path, gpus: FakeGpuPoller, scenario: Scenario) -> dict[int, Phase]:
    async def check_gpu(gpu: int) -> list[str]:
        return []  # the operator reset it: NVML finds it clear

    async with farm(tmp, text=fast_farm(tmp), check_gpu=check_gpu, load_s=0.2) as f:
        observed: list[FleetSnapshot] = []

        def on_fleet(fleet: FleetSnapshot) -> None:
            f.agent.observe_fleet(fleet)
            observed.append(fleet)  # once `observe_fleet` returned

        pollers = MetricPollers(lambda: f.agent.spec, gpus, f.agent.view(), on_fleet=on_fleet)
        await pollers.start()
        try:

            def settled() -> bool:
                p = f.phases()
                others = all(p[w] is Phase.READY for w in p if w != 5)
                return others and p[5] in (Phase.READY, Phase.QUARANTINED)

            await f.until(settled, within=20)
            await scenario(Run(f, gpus, pollers, observed))
            return f.phases()
        finally:
            await pollers.close()


async def xid79(run: Run) -> None:
    f, pollers = run.farm, run.pollers
    t0 = time.monotonic()
    run.gpus.inject_xid(5, 79)
    await f.until(lambda: f.phase(5) is Phase.QUARANTINED, within=10)
    assert time.monotonic() - t0 <= 10
    q = f.agent.view().worker(5).quarantine
    assert q is not None and q.reason == "xid 79"
    pollers.on_view(f.agent.view())
    text = generate_latest(pollers.registry).decode()
    line = gpu_line(text, "sglang_farm_gpu_quarantined", 5)
    assert line.endswith(" 1.0") and 'reason="xid 79"' in line, line
    await run.observes((5, 79), then=3)  # two more snapshots seen since: the others stay
    assert all(f.phase(w) is Phase.READY for w in range(8) if w != 5)


async def xid13(run: Run) -> None:
    f, pollers = run.farm, run.pollers
    assert classify(13).xid_class is XidClass.APPLICATION  # the catalog's, for the record
    run.gpus.inject_xid(2, 13)
    # Arrived: the agent observed the XID, and the snapshot after it (a verdict the
    # agent would queue rather than apply at once has been applied by then).
    await run.observes((2, 13), then=2)
    # Classified as the application's: the worker keeps running, nothing set aside.
    assert f.phase(2) is Phase.READY and f.agent.view().worker(2).quarantine is None
    assert f.runtime.starts_of(2) == 1 and f.runtime.stops == []
    pollers.on_view(f.agent.view())
    text = generate_latest(pollers.registry).decode()
    assert gpu_line(text, "sglang_farm_gpu_xid_errors_total", 2).endswith(" 1.0")
    assert gpu_line(text, "sglang_farm_gpu_quarantined", 2).endswith(" 0.0")


async def release(run: Run) -> None:
    f = run.farm
    assert f.phase(5) is Phase.QUARANTINED  # after the agent's restart
    assert await f.ops.release_gpu(5) == []
    await f.until(lambda: f.phase(5) is Phase.READY, within=10)


def test_xid_79_quarantines_worker_5_only_and_a_release_brings_it_back(tmp_path: Path) -> None:
    phases = asyncio.run(run_farm(tmp_path, FakeGpuPoller(count=8), xid79))
    assert phases[5] is Phase.QUARANTINED
    # A new agent (cold start, same state file): still quarantined; a release brings it back.
    phases = asyncio.run(run_farm(tmp_path, FakeGpuPoller(count=8), release))
    assert phases == dict.fromkeys(range(8), Phase.READY)


def test_xid_13_is_the_applications_and_quarantines_nothing(tmp_path: Path) -> None:
    phases = asyncio.run(run_farm(tmp_path, FakeGpuPoller(count=8), xid13))
    assert phases == dict.fromkeys(range(8), Phase.READY)
