"""Pure: a worker's phase, the supervisor's one word for where a worker stands, and why
it is being stopped."""

from __future__ import annotations

from enum import StrEnum


class Phase(StrEnum):
    """A worker's state, as the supervisor tracks it."""

    STOPPED = "stopped"  # not meant to run (operator stop, or farm not started)
    PENDING = "pending"  # meant to run, waiting for its turn in the rollout
    STARTING = "starting"  # launched; the model loads; waiting for /health
    READY = "ready"  # /health answered 200
    UNHEALTHY = "unhealthy"  # was ready; liveness probes are failing (below the threshold)
    DRAINING = "draining"  # planned stop: out of the gateway, its requests finishing
    STOPPING = "stopping"  # stop or restart issued; waiting for the process tree to exit
    BACKOFF = "backoff"  # exited; a restart is scheduled after the back-off delay
    QUARANTINED = "quarantined"  # its GPU is failing: stopped, not restarted until released
    FAILED = "failed"  # given up: crash-loop limit, a deterministic failure, or a failed canary


class StopIntent(StrEnum):
    """Why a worker is being stopped: what becomes of it once its process has exited."""

    STOP = "stop"  # operator stop: stay stopped
    RESTART = "restart"  # operator or config restart: start again at once
    FAILURE = "failure"  # the farm stopped it (hang, load timeout, OOM while serving)
    QUARANTINE = "quarantine"  # its GPU is failing: stay stopped until the GPU is released
