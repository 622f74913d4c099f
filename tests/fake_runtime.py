"""A `Runtime` and a health `Prober` with no processes and no sockets, for driving the Agent.

`FakeRuntime` records every call and reports like a real runtime (Started on start,
Exited on stop); a test makes a worker crash, log or hang through its methods. Its stops
and `FakeInFlight`'s answers also go to a `timeline` ("stop 2", "in_flight 2: 5"), a list
a harness may share with FakeGateway's to see in which order the agent called them.
`FakeProber` answers /health for a worker once its fake process has "loaded" for
`load_s` seconds of the loop's clock, unless the test made it hang or fail.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection, Hashable, Mapping
from dataclasses import dataclass, field

from sglang_farm.host.listeners import OwnerKind, Ownership
from sglang_farm.runtime import Emit, Exited, LogLine, Running, Started
from sglang_farm.sglang.argv import Command
from sglang_farm.sglang.health import ProbeResult
from sglang_farm.spec import FarmSpec


@dataclass
class FakeProcess:
    pid: int
    command: Command
    started_at: float


@dataclass
class FakeRuntime:
    emit: Emit
    running_at_start: Mapping[int, Running] = field(default_factory=dict)
    workers_outlive_agent: bool = False
    name: str = "fake"
    starts: list[tuple[int, Command]] = field(default_factory=list)
    stops: list[int] = field(default_factory=list)
    prepares: int = 0
    # What the next prepare reports as workers whose secret files it changed.
    secrets_changed_at_prepare: frozenset[int] = frozenset()
    adopt_configured: Collection[int] | None = None
    procs: dict[int, FakeProcess] = field(default_factory=dict)
    timeline: list[str] = field(default_factory=list)
    # Workers whose stop never ends (their process outlives every signal).
    unstoppable: set[int] = field(default_factory=set)
    _next_pid: int = 1000

    async def prepare(self, spec: FarmSpec, commands: Mapping[int, Command]) -> frozenset[int]:
        self.prepares += 1
        changed, self.secrets_changed_at_prepare = self.secrets_changed_at_prepare, frozenset()
        return changed

    async def start(self, worker: int, command: Command) -> None:
        self._next_pid += 1
        self.starts.append((worker, command))
        loop = asyncio.get_running_loop()
        self.procs[worker] = FakeProcess(self._next_pid, command, loop.time())
        self.emit(Started(worker, self._next_pid))

    async def stop(self, worker: int, timeout: float) -> None:
        self.stops.append(worker)
        self.timeline.append(f"stop {worker}")
        if worker in self.unstoppable:
            return
        proc = self.procs.pop(worker, None)
        if proc is not None:
            self.emit(Exited(worker, proc.pid, -15, None))

    async def confirm_ready(self, worker: int) -> bool:
        return True

    def exit_pending(self, worker: int) -> bool:
        return False

    async def worker_pids(self, worker: int) -> frozenset[int]:
        proc = self.procs.get(worker)
        return frozenset({proc.pid}) if proc is not None else frozenset()

    async def adopt(self, configured: Collection[int] | None = None) -> Mapping[int, Running]:
        self.adopt_configured = configured
        for wid, r in self.running_at_start.items():
            self.procs[wid] = FakeProcess(r.pid, Command(r.argv or (), ()), -1e9)  # loaded
        return self.running_at_start

    def log_tail(self, worker: int, lines: int) -> list[str]:
        return []

    async def close(self) -> None:
        pass

    # -- what a test makes happen ------------------------------------------------------

    def crash(self, worker: int, status: int, lines: tuple[str, ...] = ()) -> None:
        """The worker's process writes `lines` and exits on its own."""
        proc = self.procs.pop(worker)
        for line in lines:
            self.emit(LogLine(worker, line))
        self.emit(Exited(worker, proc.pid, status, None))

    def log(self, worker: int, line: str) -> None:
        self.emit(LogLine(worker, line))

    def starts_of(self, worker: int) -> int:
        return sum(1 for w, _ in self.starts if w == worker)


@dataclass
class FakeProber:
    """Answers for the workers of `spec` by port; a worker is healthy once loaded."""

    spec: FarmSpec
    runtime: FakeRuntime | None = None  # set once the agent built it
    load_s: float = 10.0
    hung: set[int] = field(default_factory=set)  # probes never answer
    failing: set[int] = field(default_factory=set)  # probes answer 503
    starved: set[int] = field(default_factory=set)  # the agent's own EMFILE on these probes
    probes: int = 0
    # Another process listening on a port answers 200 there, loaded worker or not.
    ports: FakePortOwner | None = None

    def _worker(self, url: str) -> int:
        for w in self.spec.workers:
            if url.startswith(w.base_url):
                return w.id
        raise AssertionError(f"probe of an unknown URL {url}")

    async def probe(self, url: str, timeout: float) -> ProbeResult:
        self.probes += 1
        worker = self._worker(url)
        loop = asyncio.get_running_loop()
        if worker in self.hung:
            await asyncio.sleep(timeout)
            return ProbeResult(False, f"timeout after {timeout:g} s")
        assert self.runtime is not None, "the agent has not built its runtime yet"
        if self.ports is not None and self.spec.worker(worker).port in self.ports.squatters:
            self.ports.squatter_probes += 1
            return ProbeResult(True, "200")
        proc = self.runtime.procs.get(worker)
        if proc is None:
            return ProbeResult(False, "connection refused", refused=True)
        if loop.time() - proc.started_at < self.load_s:
            return ProbeResult(False, "connection refused", refused=True)
        if worker in self.failing:
            return ProbeResult(False, "503")
        if worker in self.starved:
            return ProbeResult(False, "local error: Too many open files", local_error=True)
        return ProbeResult(True, "200")

    async def aclose(self) -> None:
        pass


@dataclass
class FakePortOwner:
    """Whose socket listens on each port: the worker's own, unless a test put a squatter
    there (`squat`), which then also answers the worker's probes (see FakeProber)."""

    squatters: dict[int, Ownership] = field(default_factory=dict)
    unseen: set[int] = field(default_factory=set)  # a listener no visible process holds
    squatter_probes: int = 0  # probes the squatter answered
    checks: int = 0

    def squat(self, port: int, pid: int = 4242, user: str = "nobody") -> None:
        self.squatters[port] = Ownership(OwnerKind.FOREIGN, port, pid, 65534, user)

    async def check(
        self,
        host: str,
        port: int,
        ours: Callable[[], Awaitable[frozenset[int]]],
        *,
        fresh: bool = False,
        whose: Hashable = None,
    ) -> Ownership:
        self.checks += 1
        if port in self.squatters:
            return self.squatters[port]
        if port in self.unseen:
            return Ownership(OwnerKind.UNSEEN, port, None, 65534, "nobody")
        return Ownership(OwnerKind.OURS, port, inodes=frozenset({port}))


@dataclass
class FakeInFlight:
    """Running + queued requests per worker, as a test sets them (0 when unset)."""

    counts: dict[int, int] = field(default_factory=dict)
    timeline: list[str] = field(default_factory=list)

    async def in_flight(self, worker: int, base_url: str) -> int | None:
        n = self.counts.get(worker, 0)
        self.timeline.append(f"in_flight {worker}: {n}")
        return n
