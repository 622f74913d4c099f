"""I/O: a reload carried out (`farmctl reload`, SIGHUP, the canary analysis's retry).

Kept apart from the agent's pump because a reload is one long sequence of awaits over
many of the agent's parts: the config file read (in a thread), the canary analysis asked
(a change it rejected is refused, one under analysis superseded: `canary.driver`), the
stage run when the model changes, the removed workers stopped and waited for, the new
config put in force, then the starts and the rolling restart (gated by the canary
when it says so), each a command of the core (`workers.commands`: `Stop`, `Reconfigure`,
`Start`, `RestartRolling`) handed to the agent's one entry. What it may do to the farm
is `Farm`, the agent's narrow surface; it never touches the supervisor. Nothing here
decides: refuse, restage or keep the model, and what stops, starts and restarts are
`workers/reload_plan`'s answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol

import structlog

from sglang_farm.canary.driver import CanaryDriver  # issue 23
from sglang_farm.control.farm_api import ReloadResult
from sglang_farm.errors import ConfigError
from sglang_farm.sglang.argv import Command
from sglang_farm.sglang.failures import RestartReason
from sglang_farm.spec import FarmSpec
from sglang_farm.staging.driver import StageDriver
from sglang_farm.staging.failure import StageError
from sglang_farm.staging.state import StageResult
from sglang_farm.workers.commands import FarmEntry, Reconfigure, RestartRolling, Start, Stop
from sglang_farm.workers.loading import loading
from sglang_farm.workers.phase_sets import HELD
from sglang_farm.workers.reload_plan import (
    ModelChange,
    Refused,
    model_change,
    plan_reload,
    reload_effects,
    stage_refused,
)
from sglang_farm.workers.supervisor import STOP_SLACK_S, stop_budget

log = structlog.get_logger("sglang_farm.agent")


class Farm(FarmEntry, Protocol):
    """What a reload may do to the farm (the agent implements it): its commands go to
    the agent's one entry (`FarmEntry.submit`), its reads are the workers' states and the
    policy; beside them, the command lines, the stage's hold and swap, and the view."""

    def command_for(self, worker: int, spec: FarmSpec | None = None) -> Command: ...

    async def wait_until(self, cond: Callable[[], bool], timeout: float) -> bool: ...

    def take_stage_hold(self) -> list[int] | None: ...

    def after_swap(self, result: StageResult) -> None: ...

    def republish(self) -> None: ...


class Reloader:
    """Carries out reloads, one at a time (`changes`, the agent's lock for every change)."""

    def __init__(
        self,
        farm: Farm,
        *,
        loader: Callable[[], FarmSpec] | None,
        changes: asyncio.Lock,
        canary: CanaryDriver,
        stages: StageDriver,
        refresh_preflight: Callable[[FarmSpec], Awaitable[None]] | None,
    ) -> None:
        self._farm = farm
        self._config_loader = loader
        self._changes = changes
        self._canary = canary
        self._stages = stages
        self._refresh_preflight = refresh_preflight

    async def reload(self) -> ReloadResult:
        """Apply the config file if valid. One at a time (the control socket and SIGHUP
        alike), and worker commands wait for it: a restart racing the removal of its
        worker would otherwise leave a process nobody tracks."""
        async with self._changes:
            return await self._reload()

    async def _reload(self) -> ReloadResult:
        farm = self._farm
        if self._config_loader is None:
            return ReloadResult(
                applied=False, problems=("this agent was started without a config file",)
            )
        try:
            # In a thread: the file read, and under systemd the account lookups (NSS).
            new = await asyncio.to_thread(self._config_loader)
        except ConfigError as exc:
            return _refused(Refused(exc.problems))
        await asyncio.to_thread(self._canary.loaded, new)  # its text, for the record
        # Issue 23: a change its canary rejected is refused; one under analysis (or held)
        # is superseded by this reload (its canary back on the accepted config first).
        if (rejected := self._canary.held(new)) is not None:
            log.error("reload_rejected", problems=[rejected])
            return ReloadResult(applied=False, problems=(rejected,), held=rejected)
        if problems := self._canary.eval_problems(new):  # a config problem: not "held"
            return _refused(Refused(problems))
        # Refused before anything is superseded: a refused reload leaves an analysis alone.
        base = self._canary.superseded_by(new) or farm.spec
        serving = self._stages.view
        holds = serving is not None and serving.blocks_rollout
        if isinstance(refused := model_change(base, new, stage_holds=holds), Refused):
            return _refused(refused)
        self._canary.supersede(new)
        old, serving = farm.spec, self._stages.view
        change = model_change(old, new, stage_holds=serving is not None and serving.blocks_rollout)
        if isinstance(change, Refused):
            return _refused(change)
        staged: StageResult | None = None
        if change is ModelChange.RESTAGE:
            try:
                staged = await self._stages.stage(
                    new, keep_old=bool(loading(farm.states())), serving=serving
                )
            except StageError as exc:
                return _refused(stage_refused(new, exc))
        elif change is ModelChange.DROP:
            self._stages.publish(None)  # the model is no longer the farm's to stage
        if self._refresh_preflight is not None:
            await self._refresh_preflight(new)
        plan = plan_reload(
            {w: farm.command_for(w, old) for w in old.worker_ids},
            {w: farm.command_for(w, new) for w in new.worker_ids},
        )
        if plan.removed:
            farm.submit(Stop(plan.removed))
            await farm.wait_until(
                lambda: all(farm.states()[w].phase in HELD for w in plan.removed),
                stop_budget(farm.policy) + STOP_SLACK_S,
            )
        # The canary's verdict may have come during the awaits above (its rollback does
        # not wait for this lock): a change it rejected meanwhile is not put in force.
        if (rejected := self._canary.rejected(new)) is not None:
            log.error("reload_rejected", problems=[rejected])
            return ReloadResult(applied=False, problems=(rejected,), held=rejected)
        farm.submit(Reconfigure(new, plan.added, plan.removed))
        log.info(
            "reload_applied",
            restarted=list(plan.changed),
            added=list(plan.added),
            removed=list(plan.removed),
        )
        held = farm.take_stage_hold()
        effects = reload_effects(
            plan,
            copy_replaced=staged is not None and not staged.current,
            loading=loading(farm.states()),
            held=held is not None,
            workers=new.worker_ids,
        )
        gated = self._canary.begin(old, new, effects.restart)  # issue 23: canary analysis
        if effects.start:
            farm.submit(Start(effects.start))
        if effects.restart:
            farm.submit(RestartRolling(effects.restart, RestartReason.CONFIG, gated=gated))
        if staged is not None:
            farm.after_swap(staged)
        farm.republish()  # the canary's record and view, the stage: not the core's states
        return ReloadResult(
            applied=True,
            restarted=effects.restart,
            added=plan.added,
            removed=plan.removed,
            gated_on=new.startup.canary if gated else None,
        )


def _refused(refused: Refused) -> ReloadResult:
    log.error("reload_rejected", problems=list(refused.problems))
    return ReloadResult(
        applied=False, problems=refused.problems, restart_needed=refused.restart_needed
    )
