"""I/O: what the agent is wired to, given at construction (`Agent(collaborators=...)`).

Value types over the seams of the agent's I/O (the prober, the gateway, the doctor's
checks, the stager, the canary's scrape and gate...): the collaborators themselves are
built by the entry point (`service`) or by a test. Nothing here runs I/O, but the seams
are the I/O modules' own types and the defaults are the production readers of the host
(`ports.port_state`, `installed.process_started`), so the module is on the I/O side.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from sglang_farm.canary.driver import Gate, Scrape
from sglang_farm.canary.probe import Send
from sglang_farm.control.farm_api import GpuMemory
from sglang_farm.farm_view import FarmView
from sglang_farm.gateway.port import Gateway
from sglang_farm.host.portowner import PortOwner
from sglang_farm.host.ports import PortState, port_state
from sglang_farm.sglang.health import Prober
from sglang_farm.sglang.load import RecentAnswers
from sglang_farm.spec import FarmSpec
from sglang_farm.staging.installed import process_started
from sglang_farm.staging.runner import Stager
from sglang_farm.workers.drain import InFlight
from sglang_farm.workers.launcher import Preflight


@dataclass(frozen=True, slots=True)
class StatsReaders:
    """Read the pollers' latest figures that the control socket shows, and the GPUs' NUMA
    nodes the doctor read (each call returns at once: it reads the last snapshot or
    report, never polls)."""

    gpu_memory: Callable[[], Sequence[GpuMemory]] = lambda: ()
    queue_depths: Callable[[], Mapping[int, float]] = dict
    recent_answers: Callable[[], Mapping[int, RecentAnswers]] = dict
    gpu_numa_nodes: Callable[[], Mapping[int, int]] = dict


@dataclass(frozen=True, slots=True)
class Collaborators:
    """What the agent is wired to, given at construction (nothing is set afterwards).

    `gateway`: membership follows readiness there (`workers.gateway_sync`); planned stops drain.
    `more_gateways`: the others with `[gateway] urls` (`gateways` lists them all).
    `preflight(spec, worker)`: the doctor's blocking failures for a worker (empty: may
    start). `compute_caps`: compute capability per GPU index (attention_backend = "auto").
    `observers`: called with every new farm view. `stats`: the pollers' figures.
    """

    prober: Prober | None = None
    # With [gateway]: the gateway workers are registered with, and how a draining
    # worker's requests in flight are counted.
    gateway: Gateway | None = None
    # Issue 26: more gateways ([gateway] urls): every ready worker joins each of them.
    more_gateways: tuple[Gateway, ...] = ()
    in_flight: InFlight | None = None
    preflight: Preflight | None = None
    # Re-gather the doctor's facts for this config (a reload, an operator's start): what
    # a fixed model path or a new flag changes is judged anew, not from the start's report.
    refresh_preflight: Callable[[FarmSpec], Awaitable[None]] | None = None
    compute_caps: Mapping[int, tuple[int, int]] = field(default_factory=dict)
    # Re-check a quarantined GPU through NVML before its worker is released: the problems
    # that keep it set aside (empty: clear).
    check_gpu: Callable[[int], Awaitable[list[str]]] | None = None
    # How the canary analysis reads a /metrics (None: HTTP; tests: synthetic text), and
    # how it runs the eval gate (None: `canary.evalrun.run_gate`).
    canary_scrape: Scrape | None = None
    canary_gate: Gate | None = None
    # How the paired probes send a request (None: HTTP; tests: a fake on the loop's clock).
    canary_probe_send: Send | None = None
    observers: Sequence[Callable[[FarmView], None]] = ()
    stats: StatsReaders = StatsReaders()
    port_state: Callable[[str, int], PortState] = port_state
    # Whose socket listens on a worker's port: only the worker's own makes it ready
    # (None: `portowner.ProcPortOwner`, over /proc).
    port_owner: PortOwner | None = None
    # [model]: how the model is staged before the rollout (None: `stage_model` in a thread).
    stager: Stager | None = None
    # When a worker's process started (pid -> wall time; None: unknown): an adopted worker
    # that started before its model copy was installed is restarted onto it.
    process_started: Callable[[int], float | None] = process_started

    @property
    def gateways(self) -> tuple[Gateway, ...]:
        """Every gateway the farm's workers join (`gateway`, then `more_gateways`)."""
        return (*((self.gateway,) if self.gateway is not None else ()), *self.more_gateways)
