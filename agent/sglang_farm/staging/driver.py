"""I/O: the agent's side of a model stage: runs the stager off the event loop and feeds
what it reports (progress, its result, its failure) through `staging.state`'s
transitions into the `StagingView` the farm shows, with a log line for each end; reads
the facts `staging.stale` decides on (when the copy was installed, when each worker's
process started) and removes an old copy when told, or puts it back in model_path when a
canary's rollback says so (issue 23).

The agent decides when to stage and what follows (the rollout, a reload's restarts);
this module decides nothing either: every next view is `staging.state`'s.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import replace
from typing import Any

import structlog

from sglang_farm.spec import FarmSpec
from sglang_farm.staging import state
from sglang_farm.staging.copier import remove_old, swap_back
from sglang_farm.staging.failure import StageError, unexpected
from sglang_farm.staging.installed import installed_at
from sglang_farm.staging.progress import StageProgress
from sglang_farm.staging.runner import Stager
from sglang_farm.staging.stale import RemoveOldCopy, on_old_copy
from sglang_farm.staging.state import StageResult, StagingView

log = structlog.get_logger("sglang_farm.agent")


class StageDriver:
    """The farm's stage view (`view`, None without [model]) and the stages that change it.

    `on_change` is called on the event loop after every new view; `cancel`, once set (the
    agent is stopping), stops the copy under way at once.
    """

    def __init__(
        self,
        spec: FarmSpec,
        stager: Stager,
        *,
        on_change: Callable[[], None],
        clock: Callable[[], float],
        wall: Callable[[], float],
        process_started: Callable[[int], float | None],
    ) -> None:
        self._stager = stager
        self._on_change = on_change
        self._clock = clock
        self._wall = wall
        self._process_started = process_started
        self._loop = asyncio.get_running_loop()
        self.cancel = threading.Event()
        self.view: StagingView | None = state.waiting_for(spec, None, now=wall())
        self._kept: RemoveOldCopy | None = None  # the previous copy, until it is removed

    def publish(self, view: StagingView | None) -> None:
        self.view = view
        self._on_change()

    def _progress(self, p: StageProgress) -> None:
        """A report from the staging thread (through call_soon_threadsafe)."""
        if self.view is not None and (nxt := state.progressed(self.view, p)) is not self.view:
            self.publish(nxt)

    async def stage(
        self, spec: FarmSpec, *, keep_old: bool, serving: StagingView | None = None
    ) -> StageResult:
        """Make the workers' model path hold `spec.model`. Raises StageError; the view (status,
        `why`, metrics) and the log say what failed and what to do. `serving`: the stage
        whose copy stays in place should this one fail (a reload's)."""
        assert spec.model is not None
        base = state.waiting_for(spec, self.view, now=self._wall())
        assert base is not None  # spec.model is set
        self.publish(state.begun(base))
        blog = log.bind(source=base.source, target=base.target)
        blog.info("model_stage_started")
        t0 = self._clock()

        def report(p: StageProgress) -> None:
            self._loop.call_soon_threadsafe(self._progress, p)

        try:
            try:
                result = await self._stager(
                    spec, report=report, cancel=self.cancel, keep_old=keep_old
                )
            except StageError:
                raise
            except Exception as exc:
                if not isinstance(exc, OSError):  # a library's own error, a defect
                    blog.exception("model_stage_crashed")
                hub = not spec.model.is_local
                raise unexpected(exc, base.source, base.target, hub=hub) from exc
        except StageError as exc:
            self.publish(
                state.failed(
                    self.view or base,
                    exc,
                    now=self._wall(),
                    duration_s=self._clock() - t0,
                    serving=serving,
                )
            )
            blog.error("model_stage_failed", kind=str(exc.kind), error=exc.message, fix=exc.fix)
            raise
        self.publish(state.succeeded(self.view or base, result, now=self._wall()))
        blog.info(
            "model_staged",
            current=result.current,
            copied_files=result.copied_files,
            copied_bytes=result.copied_bytes,
            total_bytes=result.total_bytes,
            seconds=round(result.seconds, 3),
        )
        return result

    async def on_old_copy(
        self,
        result: StageResult,
        pids: Mapping[int, int | None],
        launched: Mapping[int, float] | None = None,
    ) -> list[int]:
        """Of the loading workers (`pids`: worker -> its process), those on a copy other
        than the one `result` left at model_path (`stale.on_old_copy`). The copy's stat and
        the /proc reads run in a thread, not on the event loop; a stage that replaced the
        copy needs neither."""
        if not result.current:
            return on_old_copy(result, dict.fromkeys(pids), None)

        def facts() -> tuple[dict[int, float | None], float | None]:
            started = {
                w: self._process_started(pid) if pid is not None else None
                for w, pid in pids.items()
            }
            return started, installed_at(result.target)

        started, installed = await asyncio.to_thread(facts)
        return on_old_copy(result, started, installed, launched)

    def remove_old_copy(
        self, action: RemoveOldCopy, rolled: Callable[[float], Awaitable[object]]
    ) -> Coroutine[Any, Any, None]:
        """Carry out `action` (the coroutine to spawn): wait for the rolling restart
        (`rolled`, bounded by its `wait_s`), then remove the copy off the event loop.
        Until then (kept from this call on, before the coroutine first runs) the copy can
        go back to model_path: `restore_old_copy`."""
        self._kept = action
        return self._remove_old_copy(action, rolled)

    async def _remove_old_copy(
        self, action: RemoveOldCopy, rolled: Callable[[float], Awaitable[object]]
    ) -> None:
        try:
            await rolled(action.wait_s)
            await asyncio.to_thread(remove_old, action.path)
            log.info("model_old_copy_removed", path=str(action.path))
        finally:
            if self._kept is action:
                self._kept = None

    def restore_old_copy(self, spec: FarmSpec) -> None:
        """Issue 23: a change of the model rolled back from its canary (or superseded):
        the previous copy, kept beside model_path since the reload's swap, goes back to
        model_path and the rejected copy takes its place aside, where the pending removal
        removes it. Called on the event loop before the canary's relaunch is issued (two
        renames in one folder), so the canary loads the previous copy. The previous copy's
        manifest keeps its mtime: the workers that never left it started after it."""
        kept = self._kept
        if kept is None or spec.model is None or kept.target != state.model_target(spec):
            return  # no copy swapped out by a reload is waiting to be removed
        try:
            swap_back(kept.target, kept.path)
        except OSError as exc:
            log.error(
                "model_old_copy_not_restored",
                target=str(kept.target),
                old_copy=str(kept.path),
                error=str(exc),
                fix=f"the canary loads the rejected copy: stop it (farmctl stop "
                f"{spec.startup.canary}), move {kept.path} back to {kept.target} by hand "
                "(mv), then start it",
            )
            return
        log.info("model_old_copy_restored", target=str(kept.target), rejected=str(kept.path))
        if self.view is not None and (back := state.waiting_for(spec, None, now=0.0)):
            self.publish(replace(self.view, source=back.source))
