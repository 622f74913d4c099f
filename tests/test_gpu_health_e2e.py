"""XID 79 through the GPU poller's seam: the real pollers, agent and exporter, on a real clock.

The simulated GPUs (`gpu_sim.FakeGpuPoller`) stand in for NVML at the poller's seam;
workers are the fake runtime's (no processes). Issue 14's "done when": worker 5 is
stopped and quarantined within 10 s, naming XID 79, the other seven untouched, the
metric at 1; XID 13 quarantines nothing; the quarantine survives an agent restart, and
a release brings the worker back.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client import generate_latest

from agent_harness import farm_toml
from fake_runtime import FakePortOwner, FakeProber, FakeRuntime
from sglang_farm.agent import Agent
from sglang_farm.collaborators import Collaborators
from sglang_farm.config import load_spec
from sglang_farm.gpu_sim import FakeGpuPoller
from sglang_farm.phase import Phase
from sglang_farm.pollers import MetricPollers
from sglang_farm.ports import PortState
from sglang_farm.runtime import Emit


def fast_farm(tmp: Path) -> str:
    metrics = (
        'gpu_source = "fake"\nlisten = "127.0.0.1:0"\n'
        'gpu_poll_interval = "0.2s"\nworker_poll_interval = "0.5s"'
    )
    text = farm_toml(tmp).replace('gpu_source = "none"', metrics)
    return text.replace('period = "2s"', 'period = "0.3s"').replace(
        'poll_interval = "500ms"', 'poll_interval = "100ms"'
    )


async def run_farm(tmp: Path, gpus: FakeGpuPoller, scenario: str) -> dict[int, Phase]:
    spec = load_spec(fast_farm(tmp), source="test.toml")
    ports = FakePortOwner()
    prober = FakeProber(spec, load_s=0.2, ports=ports)

    def factory(emit: Emit) -> FakeRuntime:
        rt = FakeRuntime(emit)
        prober.runtime = rt
        return rt

    async def check_gpu(gpu: int) -> list[str]:
        return []  # the operator reset it: NVML finds it clear

    agent = Agent(
        spec,
        factory,
        collaborators=Collaborators(
            prober=prober,
            port_state=lambda _h, _p: PortState.FREE,
            port_owner=ports,
            check_gpu=check_gpu,
        ),
    )
    pollers = MetricPollers(spec, gpus, agent.view(), on_fleet=agent.observe_fleet)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    await pollers.start()

    async def until(cond: Callable[[], bool], within: float) -> None:
        end = time.monotonic() + within
        while not cond():
            assert time.monotonic() < end, {w.id: str(w.phase) for w in agent.view().workers}
            await asyncio.sleep(0.05)

    def phases() -> dict[int, Phase]:
        return {w.id: w.phase for w in agent.view().workers}

    try:

        def settled() -> bool:
            p = phases()
            others = all(p[w] is Phase.READY for w in p if w != 5)
            return others and p[5] in (Phase.READY, Phase.QUARANTINED)

        await until(settled, 20)
        if scenario == "xid79":
            t0 = time.monotonic()
            gpus.inject_xid(5, 79)
            await until(lambda: phases()[5] is Phase.QUARANTINED, 10)
            assert time.monotonic() - t0 <= 10
            q = agent.view().worker(5).quarantine
            assert q is not None and q.reason == "xid 79"
            pollers.on_view(agent.view())
            text = generate_latest(pollers.registry).decode()
            line = next(
                ln
                for ln in text.splitlines()
                if ln.startswith("sglang_farm_gpu_quarantined{") and 'gpu="5"' in ln
            )
            assert line.endswith(" 1.0") and 'reason="xid 79"' in line, line
            await asyncio.sleep(2)
            assert all(phases()[w] is Phase.READY for w in range(8) if w != 5)
        elif scenario == "xid13":
            gpus.inject_xid(2, 13)
            await asyncio.sleep(2)
            assert phases()[2] is Phase.READY
        elif scenario == "release":
            assert phases()[5] is Phase.QUARANTINED  # after the agent's restart
            assert await agent.release_gpu(5) == []
            await until(lambda: phases()[5] is Phase.READY, 10)
        return phases()
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await pollers.close()


def test_xid_79_quarantines_worker_5_only_and_a_release_brings_it_back(tmp_path: Path) -> None:
    asyncio.run(run_farm(tmp_path, FakeGpuPoller(count=8), "xid79"))
    # A new agent (cold start, same state file): still quarantined; a release brings it back.
    asyncio.run(run_farm(tmp_path, FakeGpuPoller(count=8), "release"))


def test_xid_13_is_the_applications_and_quarantines_nothing(tmp_path: Path) -> None:
    asyncio.run(run_farm(tmp_path, FakeGpuPoller(count=8), "xid13"))
