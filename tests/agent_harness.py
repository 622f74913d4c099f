"""Test harness: the real Agent with a fake runtime, prober and gateway, on a virtual clock.

`farm(...)` runs an Agent on the test's loop; `run_virtual` (virtual_time.py) makes
minutes of farm time take milliseconds. No processes, no sockets, no real sleeps.
`farm_toml` is its config; conftest.py's `tmp` fixture its folder.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fake_gateway import FakeGateway
from fake_runtime import FakeInFlight, FakePortOwner, FakeProber, FakeRuntime
from farmtoml import Table, merged, sim_farm, toml_text
from sglang_farm.agent import Agent
from sglang_farm.canary.driver import Gate, Scrape
from sglang_farm.canary.probe import Send
from sglang_farm.collaborators import Collaborators
from sglang_farm.config import load_spec
from sglang_farm.farm_view import FarmView
from sglang_farm.host.ports import PortState
from sglang_farm.operations import FarmControl
from sglang_farm.runtime import Emit, Running
from sglang_farm.spec import FarmSpec
from sglang_farm.staging.runner import Stager
from sglang_farm.workers.launcher import Preflight
from sglang_farm.workers.phase import Phase

# A gateway table of two external gateways (issue 26).
A, B = "http://127.0.0.1:8000", "http://127.0.0.1:8001"
TWO = {"mode": "external", "urls": [A, B], "drain_timeout": "30s"}

OOM_LINE = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
    "total capacity of 79.11 GiB of which 1.00 GiB is free."
)
READY_LINE = "The server is fired up and ready to roll!"


def farm_toml(state_dir: Path, *, workers: int | Sequence[int] = 8, **tables: Table) -> str:
    """The harness's farm (`farmtoml.sim_farm`) on `workers` GPUs, state under `state_dir`,
    with each of `tables` (`gateway=GATEWAY`, `sglang={...}`) merged over its table."""
    doc = sim_farm(
        workers,
        sys.executable,
        farm={"state_dir": str(state_dir)},
        startup={"parallel": 3, "load_timeout": "2m", "poll_interval": "500ms"},
        health={"period": "2s", "timeout": "5s", "failure_threshold": 3},
        restart={
            "backoff_initial": "1s",
            "backoff_max": "30s",
            "reset_after": "1m",
            "stop_timeout": "10s",
        },
        metrics={"gpu_source": "none"},
        control={"socket": f"{state_dir}/control.sock"},
        sglang={"mem_fraction_static": 0.8},
    )
    return toml_text(merged(doc, tables))


@dataclass
class Farm:
    agent: Agent
    ops: FarmControl  # the operator's commands (farmctl's, SIGHUP's) on `agent`
    runtime: FakeRuntime
    prober: FakeProber
    stop: asyncio.Event
    gateway: FakeGateway
    in_flight: FakeInFlight
    ports: FakePortOwner
    # The gateway's calls, the runtime's stops and the in-flight counts read, in order.
    timeline: list[str]

    def phases(self) -> dict[int, Phase]:
        return {w.id: w.phase for w in self.agent.view().workers}

    def phase(self, worker: int) -> Phase:
        return self.agent.view().worker(worker).phase

    async def until(self, cond: Callable[[], bool], within: float = 600.0) -> None:
        """Wait (in farm time) until `cond` holds; fail the test past `within` seconds."""
        loop = asyncio.get_running_loop()
        end = loop.time() + within
        while not cond():
            if loop.time() > end:
                raise AssertionError(f"not within {within} s of farm time: {self.phases()}")
            await asyncio.sleep(0.1)

    def all_ready(self) -> bool:
        return all(p is Phase.READY for p in self.phases().values())


@asynccontextmanager
async def farm(
    tmp: Path,
    *,
    text: str | None = None,
    running: Mapping[int, Running] | None = None,
    loader: Callable[[], FarmSpec] | None = None,
    gateway: FakeGateway | None = None,
    more_gateways: Sequence[FakeGateway] = (),
    preflight: Preflight | None = None,
    refresh: Callable[[FarmSpec], Awaitable[None]] | None = None,
    check_gpu: Callable[[int], Awaitable[list[str]]] | None = None,
    stager: Stager | None = None,
    process_started: Callable[[int], float | None] = lambda _pid: None,
    load_s: float = 10.0,
    observers: Sequence[Callable[[FarmView], None]] = (),
    scrape: Scrape | None = None,
    gate: Gate | None = None,
    port_state: Callable[[str, int], PortState] | None = None,
    probe_send: Send | None = None,
) -> AsyncIterator[Farm]:
    """The real Agent over the fakes, running on the test's loop until the block ends.

    The one place a test builds an Agent. `running`: workers found running at start;
    `stager`: how [model] is staged; `process_started`: pid -> when its process started
    (the fakes' pids are no real processes: unknown unless a test says); `load_s`: how
    long a fake worker loads (the loop's seconds); `observers`: called with every farm view;
    `more_gateways`: the others of `[gateway] urls` (issue 26), beside `gateway`;
    `scrape`: the canary analysis's /metrics reader (url, key) -> Prometheus text;
    `gate`: its eval gate (evalrun.run_gate's signature); `port_state`: whether a worker's
    port is free at launch (default: always free); `probe_send`: the canary's paired
    probes' requests (canary/probe.py's Send).
    """
    loop = asyncio.get_running_loop()
    spec = load_spec(text or farm_toml(tmp), source="test.toml")
    gw = gateway or FakeGateway()
    timeline = gw.timeline
    in_flight = FakeInFlight(timeline=timeline)
    ports = FakePortOwner()
    prober = FakeProber(spec, ports=ports, load_s=load_s)
    made: list[FakeRuntime] = []

    def factory(emit: Emit) -> FakeRuntime:
        rt = FakeRuntime(emit, running_at_start=running or {}, timeline=timeline)
        prober.runtime = rt
        made.append(rt)
        return rt

    collaborators = Collaborators(
        prober=prober,
        port_state=port_state or (lambda _h, _p: PortState.FREE),
        port_owner=ports,
        gateway=gw if spec.gateway.enabled else None,
        more_gateways=tuple(more_gateways) if spec.gateway.enabled else (),
        in_flight=in_flight,
        preflight=preflight,
        refresh_preflight=refresh,
        check_gpu=check_gpu,
        stager=stager,
        process_started=process_started,
        observers=observers,
        canary_scrape=scrape,
        canary_gate=gate,
        canary_probe_send=probe_send,
    )
    agent = Agent(
        spec,
        factory,
        config_loader=loader,
        clock=loop.time,
        wall=lambda: 1.8e9 + loop.time(),
        collaborators=collaborators,
    )
    stop = asyncio.Event()
    ops = FarmControl(agent, collaborators)
    f = Farm(agent, ops, made[0], prober, stop, gw, in_flight, ports, timeline)

    task = asyncio.create_task(agent.run(stop))
    try:
        yield f
    finally:
        stop.set()
        await asyncio.wait_for(task, 120)


GATEWAY: Table = {"mode": "external", "url": "http://127.0.0.1:8000", "drain_timeout": "30s"}


def urls(ids: range | list[int]) -> set[str]:
    return {f"http://127.0.0.1:{30000 + w}" for w in ids}
