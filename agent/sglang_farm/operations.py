"""I/O: the operator's commands (`control.farm_api.FarmOps`) carried out on the agent.

The control socket and SIGHUP call these; each turns a command into one of the core's
(`workers.commands`) handed to the agent's one entry (`Farm.submit`), and waits where the command
says it waits (a stop until the workers are gone). State changes wait for the agent's
`changes` lock: one at a time, and never before the start-up's restore and adoption.
Nothing here decides: what a release, a stop or a restart does is the supervisor's.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from typing import Any, Protocol

import structlog

from sglang_farm.collaborators import Collaborators
from sglang_farm.control.farm_api import GpuMemory, HostDrainResult, ReloadResult
from sglang_farm.farm_view import FarmView
from sglang_farm.reloader import Reloader
from sglang_farm.runtime import Runtime
from sglang_farm.sglang.failures import RestartReason
from sglang_farm.sglang.load import RecentAnswers
from sglang_farm.spec import gpu_field
from sglang_farm.workers.commands import (
    FarmEntry,
    HoldOut,
    Release,
    ResetOom,
    RestartRolling,
    Start,
    Stop,
)
from sglang_farm.workers.drain import Drains
from sglang_farm.workers.gpu_health import not_quarantined, quarantined_on
from sglang_farm.workers.logs import WorkerLogs
from sglang_farm.workers.phase_sets import HELD, SERVING
from sglang_farm.workers.supervisor import STOP_SLACK_S, stop_budget

log = structlog.get_logger("sglang_farm.agent")


class Farm(FarmEntry, Protocol):
    """What the operator's commands may do to the farm (the agent implements it): what
    changes the core goes to its one entry (`FarmEntry.submit`); the workers' states are
    read-only; beside them, the view, the runtime's logs, the stage, the drains' wait."""

    runtime: Runtime
    reloader: Reloader
    worker_logs: WorkerLogs
    changes: asyncio.Lock
    clock: Callable[[], float]

    def view(self) -> FarmView: ...

    def startup_pending(self) -> str | None: ...

    async def save_state(self, change: str, undone: str) -> None: ...

    async def wait_until(self, cond: Callable[[], bool], timeout: float) -> bool: ...

    async def restage(self) -> list[int]: ...

    def worker_gpus(self) -> dict[int, tuple[int, ...]]: ...

    def log_for(self, worker: int) -> structlog.typing.FilteringBoundLogger: ...

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]: ...

    drains: Drains


class FarmControl:
    """`farm_api.FarmOps` over one agent (and what it is wired to: the pollers' figures,
    the doctor, NVML's GPU check)."""

    def __init__(self, farm: Farm, collaborators: Collaborators) -> None:
        self._farm = farm
        self._collaborators = collaborators

    def view(self) -> FarmView:
        return self._farm.view()

    def gpu_memory(self) -> Sequence[GpuMemory]:
        return self._collaborators.stats.gpu_memory()

    def queue_depths(self) -> Mapping[int, float]:
        return self._collaborators.stats.queue_depths()

    def recent_answers(self) -> Mapping[int, RecentAnswers]:
        return self._collaborators.stats.recent_answers()

    def gpu_numa_nodes(self) -> Mapping[int, int]:
        return self._collaborators.stats.gpu_numa_nodes()

    def startup_pending(self) -> str | None:
        """Why state-changing commands must wait now, or None (see control.handlers)."""
        return self._farm.startup_pending()

    async def start(self, worker_ids: Sequence[int]) -> None:
        """Start workers; while a failed stage holds the farm, stage again first (raises
        StageError when it fails again: nothing starts)."""
        farm = self._farm
        async with farm.changes:
            stale = await farm.restage()
            if self._collaborators.refresh_preflight is not None:
                await self._collaborators.refresh_preflight(farm.spec)
            ids = [w for w in worker_ids if w in farm.states()]
            farm.submit(Start(ids))
            if stale:
                # Adopted workers still on the previous copy roll to the staged one.
                log.warning("workers_on_old_model_copy", workers=stale)
                farm.submit(RestartRolling(stale, RestartReason.CONFIG))

    async def stop(self, worker_ids: Sequence[int], *, drain: bool = True) -> None:
        farm = self._farm
        async with farm.changes:
            ids = [w for w in worker_ids if w in farm.states()]
            farm.submit(Stop(ids, drain))
        await farm.wait_until(
            lambda: all(s.phase in HELD for w, s in farm.states().items() if w in ids),
            stop_budget(farm.policy, drain=drain) + STOP_SLACK_S,
        )
        # Issue 30: a stop an agent restart would undo is said so.
        await farm.save_state(f"worker(s) {_ids(ids)} stopped", "start them again")

    async def restart(self, worker_ids: Sequence[int], *, drain: bool = True) -> None:
        farm = self._farm
        async with farm.changes:
            farm.submit(RestartRolling(list(worker_ids), RestartReason.MANUAL, drain))

    async def logs(self, worker_id: int, lines: int) -> Sequence[str]:
        # In a thread: under systemd this runs journalctl, which must not stall the loop.
        return await asyncio.to_thread(self._farm.runtime.log_tail, worker_id, lines)

    def follow_logs(self, worker_id: int) -> AsyncIterator[str]:
        return self._farm.worker_logs.follow(worker_id)

    async def reset_oom(self, worker_id: int) -> None:
        farm = self._farm
        async with farm.changes:  # a state change, as the module says (issue 32, 4.4)
            if worker_id not in farm.states():
                return  # removed by a reload meanwhile
            farm.submit(ResetOom(worker_id))
            farm.log_for(worker_id).info("oom_ladder_reset")

    def reload_on_signal(self) -> None:
        """SIGHUP: reload, unless the start-up (adoption, the first stage) is still under way:
        then refused with a log line, as the control socket's `busy` (a reload racing the
        start-up's rollout would start workers of the config it replaced)."""
        if (startup := self._farm.startup_pending()) is not None:
            log.warning(
                "reload_refused_during_startup",
                reason=startup,
                fix="send SIGHUP again (systemctl reload sglang-farm) once `farmctl status` "
                "shows the start-up done",
            )
            return
        self._farm.spawn(self.reload())

    async def reload(self) -> ReloadResult:
        """Apply the config file if valid (`reloader.Reloader.reload`)."""
        return await self._farm.reloader.reload()

    async def drain_host(self, timeout: float | None) -> HostDrainResult:
        """The host out of the gateway, nothing stopped; wait for the requests in flight
        (`FarmOps.drain_host`). The supervisor's hold does the rest: the sync removes the
        workers, and no worker that becomes ready joins until `undrain_host`."""
        farm = self._farm
        async with farm.changes:
            farm.submit(HoldOut(True))
            # Issue 30: a hold an agent restart would drop is not "drained".
            await farm.save_state(
                "the host is held out of the gateway now", "put it back in the gateway"
            )
            serving = [w for w, s in farm.states().items() if s.phase in SERVING]
        budget = timeout if timeout is not None else (farm.policy.drain_timeout or 0.0)
        began = farm.clock()
        left = await farm.drains.host_idle(serving, budget)
        waited = farm.clock() - began
        result = HostDrainResult(
            tuple(sorted(farm.states())),
            tuple(w for w in serving if w not in left),
            left,
            waited,
            # Issue 30: a gateway that does not answer (frozen) may still route to them.
            dict(farm.drains.unconfirmed(serving)),
        )
        if result.unconfirmed:
            log.warning(
                "host_drain_unconfirmed",
                gateways={u: list(ws) for u, ws in result.unconfirmed.items()},
                why="these gateways do not answer and never confirmed the workers out: "
                "they may still route users to them",
            )
        (log.warning if left else log.info)(
            "host_drained" if not left else "host_drain_incomplete",
            workers=list(result.workers),
            drained=list(result.drained),
            left={str(w): n for w, n in left.items()},
            waited_s=round(waited, 3),
            **({"why": "the wait ran out; the host stays out of the gateway"} if left else {}),
        )
        return result

    async def undrain_host(self) -> tuple[int, ...]:
        """The host back in the gateway (`FarmOps.undrain_host`)."""
        farm = self._farm
        async with farm.changes:
            farm.submit(HoldOut(False))
            await farm.save_state(  # issue 30
                "the host is back in the gateway now", "hold it out of the gateway again"
            )
            return tuple(sorted(farm.states()))

    async def release_gpu(self, gpu: int) -> list[str]:
        """Start the workers quarantined on `gpu` again, once NVML says it is clear.

        Returns what keeps it set aside (its quarantine then stays); empty when released.
        """
        farm = self._farm
        held, problems = quarantined_on(gpu, farm.states(), farm.worker_gpus())
        if not held:
            return problems
        return await self._release(held, [gpu])

    async def release_worker(self, worker: int) -> list[str]:
        """Start `worker` again out of its quarantine, whichever GPU the quarantine names,
        once NVML says each GPU it uses now is clear (a reload may have moved it)."""
        problems = not_quarantined(worker, self._farm.states()[worker])
        if problems:
            return problems
        return await self._release([worker], self._farm.spec.worker(worker).gpus)

    async def _release(self, held: Sequence[int], gpus: Sequence[int]) -> list[str]:
        if self._collaborators.check_gpu is None:
            return ["this agent has no NVML to check the GPU with ([metrics] gpu_source)"]
        problems = [p for g in gpus for p in await self._collaborators.check_gpu(g)]
        if problems:
            log.warning(
                "gpu_release_refused",
                gpu=gpu_field(gpus),
                workers=list(held),
                problems=problems,
            )
            return problems
        async with self._farm.changes:
            self._farm.submit(Release(held))
            await self._farm.save_state(  # issue 30
                f"worker(s) {_ids(held)} released from quarantine",
                "quarantine them again (farmctl release-gpu again releases them)",
            )
        return []


def _ids(ids: Sequence[int]) -> str:
    return ", ".join(map(str, ids)) or "none"
