"""Pure: read-only views of the farm, as the control socket and the exporter see them.

The agent builds a new `FarmView` whenever something changes and swaps the reference;
readers (scrapes, `status` requests) only format it. No reader ever calls a worker,
NVML or systemd, so a hung worker can slow nothing but itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

from sglang_farm.failures import Failure


class Phase(StrEnum):
    """A worker's state, as the supervisor tracks it."""

    STOPPED = "stopped"  # not meant to run (operator stop, or farm not started)
    PENDING = "pending"  # meant to run, waiting for its turn in the rollout
    STARTING = "starting"  # launched; the model loads; waiting for /health
    READY = "ready"  # /health answered 200
    UNHEALTHY = "unhealthy"  # was ready; liveness probes are failing (below the threshold)
    STOPPING = "stopping"  # stop or restart issued; waiting for the process tree to exit
    BACKOFF = "backoff"  # exited; a restart is scheduled after the back-off delay
    FAILED = "failed"  # given up: crash-loop limit, a deterministic failure, or a failed canary


@dataclass(frozen=True, slots=True)
class RestartRecord:
    at: float  # wall-clock seconds since the epoch
    reason: str  # a RestartReason value


@dataclass(frozen=True, slots=True)
class WorkerView:
    id: int
    gpus: tuple[int, ...]
    port: int
    base_url: str
    phase: Phase
    since: float  # wall-clock seconds since the epoch when `phase` was entered
    pid: int | None
    restarts: tuple[RestartRecord, ...] = ()  # most recent last, bounded
    restarts_by_reason: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    oom_events_by_kind: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    last_failure: Failure | None = None
    last_failure_at: float | None = None
    last_action: str | None = None  # what the farm did about the last failure
    oom_step: int = 0  # 0 = the configured flags; n = ladder step n in force
    oom_step_name: str | None = None
    last_load_seconds: float | None = None
    argv: tuple[str, ...] = ()

    @property
    def ready(self) -> bool:
        return self.phase is Phase.READY


@dataclass(frozen=True, slots=True)
class FarmView:
    name: str
    runtime: str  # "process" or "systemd"
    workers: tuple[WorkerView, ...]
    config_source: str
    started_at: float  # wall clock of the agent's start
    rollout: str  # "idle" | "canary" | "rolling" | "done" | "halted"
    rollout_reason: str | None = None  # why a rollout halted

    def worker(self, worker_id: int) -> WorkerView:
        for w in self.workers:
            if w.id == worker_id:
                return w
        raise KeyError(worker_id)

    @property
    def ready_count(self) -> int:
        return sum(1 for w in self.workers if w.ready)
