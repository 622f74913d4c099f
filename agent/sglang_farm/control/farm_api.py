"""Pure: the seam between the control socket and the agent.

The control server only decodes requests and calls these methods;
`operations.FarmControl` implements them on the agent. Tests drive the server with a
fake implementation.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from sglang_farm.farm_view import FarmView
from sglang_farm.sglang.load import RecentAnswers


@dataclass(frozen=True, slots=True)
class ReloadResult:
    applied: bool
    problems: tuple[str, ...] = ()  # config problems when not applied
    restarted: tuple[int, ...] = ()  # workers whose command line changed
    added: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()
    # Not applied because its change was rejected by a canary before (docs/canary.md):
    # why, in one line (also in `problems`). farmctl exits "held" (6), not "rejected" (1).
    held: str | None = None
    # Not applied because only an agent restart applies it (a [gateway] change): farmctl
    # exits "restart needed" (10), which an orchestrator acts on (docs/fleet.md).
    restart_needed: bool = False
    # The canary whose analysis the other restarts wait on (docs/canary.md): only it is
    # restarted now; the rest of `restarted` follow if it passes, never if it fails.
    gated_on: int | None = None


@dataclass(frozen=True, slots=True)
class HostDrainResult:
    """`drain-host`: the workers held out of the gateway, those whose requests all
    finished, and those still running some when the wait ran out (`left`: worker ->
    running + queued, None when its figures or the gateway's confirmation are missing).
    `unconfirmed` (issue 30): each gateway that does not answer and never confirmed some
    of them out (URL -> those workers): it may still route users to them."""

    workers: tuple[int, ...]
    drained: tuple[int, ...]
    left: Mapping[int, int | None]
    waited_s: float
    unconfirmed: Mapping[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class GpuMemory:
    index: int
    used_bytes: int
    total_bytes: int
    simulated: bool = False  # the demo's simulated GPUs, not NVML


class FarmOps(Protocol):
    """What the control socket can ask of the agent. Worker ids are validated by the caller."""

    def startup_pending(self) -> str | None:
        """Why state changes must wait, or None once they may run (never blocks).

        Not None from the agent's start until it has restored its state file and
        adopted the workers still running: a change before that (a stop, a reset)
        would be recorded over a state not yet loaded and clobber it. The reason is
        one phrase, e.g. "the agent is restoring its state and adopting running
        workers"; the server answers `busy` with it. Read-only commands never ask.
        """
        ...

    def view(self) -> FarmView:
        """The latest farm view (never blocks)."""
        ...

    def gpu_memory(self) -> Sequence[GpuMemory]:
        """Latest VRAM per GPU, empty when unknown (never blocks)."""
        ...

    def queue_depths(self) -> Mapping[int, float]:
        """Latest queued requests per serving worker, from its own metrics (never blocks)."""
        ...

    def recent_answers(self) -> Mapping[int, RecentAnswers]:
        """Each serving worker's answers and 5xx over its recent polls, from SGLang's own
        counter; a worker whose SGLang has none is absent (never blocks)."""
        ...

    def gpu_numa_nodes(self) -> Mapping[int, int]:
        """GPU index -> its PCI device's NUMA node, as the doctor last read it; empty on a
        host of one node, with simulated GPUs, or when not known (never blocks)."""
        ...

    async def start(self, worker_ids: Sequence[int]) -> None:
        """Ask for these workers to run; returns once the request is recorded."""
        ...

    async def stop(self, worker_ids: Sequence[int], *, drain: bool = True) -> None:
        """Stop these workers; returns once they have exited.

        With a gateway, a serving worker is drained first: taken out of the gateway,
        then stopped once its requests are done or `[gateway] drain_timeout` is spent.
        `drain=False` skips the drain: the worker is stopped at once, requests and all.
        """
        ...

    async def restart(self, worker_ids: Sequence[int], *, drain: bool = True) -> None:
        """Restart these workers one wave at a time (never all at once); returns when issued.

        Each is drained first as in `stop`; `drain=False` skips the drain.
        """
        ...

    async def logs(self, worker_id: int, lines: int) -> Sequence[str]:
        """The worker's last `lines` output lines (journal or captured output)."""
        ...

    def follow_logs(self, worker_id: int) -> AsyncIterator[str]:
        """New output lines of the worker as they come."""
        ...

    async def reset_oom(self, worker_id: int) -> None:
        """Return the worker to step 0 of the OOM ladder (takes effect at its next start)."""
        ...

    async def reload(self) -> ReloadResult:
        """Re-read the config; apply it only if valid."""
        ...

    async def release_gpu(self, gpu: int) -> list[str]:
        """Take GPU `gpu` out of quarantine and start its worker(s) again, if it is clear.

        Re-checks the GPU through NVML first: healthy, no row remaps pending, its memory
        free, no compute process left on it. When every check passes, the workers
        quarantined on it go back to `pending` (the farm starts them as usual) and the
        answer is empty. Otherwise nothing changes (the quarantine stays) and the answer
        is the problems, one complete line each (also when no worker is quarantined on
        `gpu`, or the agent has no NVML to check with). `gpu` is validated by the caller:
        a worker of the farm uses it.
        """
        ...

    async def drain_host(self, timeout: float | None) -> HostDrainResult:
        """Hold every worker of this host out of the gateway (persisted across agent
        restarts) without stopping any, and wait at most `timeout` seconds (None: the
        farm's `[gateway] drain_timeout`) until each serving one is out of the gateway and
        has no request running or queued. The hold stays when the wait runs out."""
        ...

    async def undrain_host(self) -> tuple[int, ...]:
        """End the hold: the ready workers go back into the gateway (the sync adds them);
        returns the workers it concerns at once."""
        ...

    async def release_worker(self, worker: int) -> list[str]:
        """Take worker `worker` out of quarantine, whichever GPU its quarantine names.

        For a quarantine `release_gpu` cannot reach: a reload moved the worker off the
        GPU it names. Re-checks, as `release_gpu` does, every GPU the worker uses now
        (those it will run on); the answer is the same (empty: released; else the
        problems, also when the worker is not quarantined). `worker` is validated by the
        caller: a worker of the farm.
        """
        ...
