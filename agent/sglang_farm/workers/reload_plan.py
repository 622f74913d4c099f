"""Pure: what a reload does: restart, restage or refuse, and which workers restart,
arrive and go.

A reload is refused when it changes what only an agent restart applies ([gateway]), or
when its `[model]` cannot be staged; it stages first when the model changed (or the last
stage failed and holds the farm). A worker restarts only when its command line (or
environment) would differ, or when the stage replaced the copy it loaded; a worker that
keeps both keeps running through the reload.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from sglang_farm.sglang.argv import Command
from sglang_farm.spec import FarmSpec
from sglang_farm.staging.failure import StageError
from sglang_farm.staging.state import model_target


@dataclass(frozen=True, slots=True)
class ReloadPlan:
    changed: tuple[int, ...]  # in both configs, with a different command: rolling restart
    added: tuple[int, ...]  # only in the new config: started
    removed: tuple[int, ...]  # only in the old config: stopped, then forgotten


class ModelChange(StrEnum):
    """What a reload does with the model stage before it applies the new config."""

    KEEP = "keep"  # the same [model] (or none, before and after): the copy in place stays
    RESTAGE = "restage"  # a new source, revision or model_path, or a failed stage: stage first
    DROP = "drop"  # [model] removed: the model is no longer the farm's to stage


@dataclass(frozen=True, slots=True)
class Refused:
    """The reload is not applied; the config in force keeps running. `problems`: what,
    where, and what to do."""

    problems: tuple[str, ...]
    # The config is valid but only an agent restart applies it ([gateway]): farmctl
    # reload exits 10, and an orchestrator restarts the agent (the workers keep running).
    restart_needed: bool = False


@dataclass(frozen=True, slots=True)
class ReloadEffects:
    start: tuple[int, ...]  # started (the new workers, or all when a failed stage held them)
    restart: tuple[int, ...]  # restarted in waves, drained


def plan_reload(old: Mapping[int, Command], new: Mapping[int, Command]) -> ReloadPlan:
    """Compare each worker's command line under the old and the new config."""
    shared = sorted(old.keys() & new.keys())
    return ReloadPlan(
        changed=tuple(w for w in shared if old[w] != new[w]),
        added=tuple(sorted(new.keys() - old.keys())),
        removed=tuple(sorted(old.keys() - new.keys())),
    )


def model_change(old: FarmSpec, new: FarmSpec, *, stage_holds: bool) -> Refused | ModelChange:
    """Refuse, restage or keep, before anything is applied. `stage_holds`: the farm's last
    stage failed (or has not run), so no worker may start until one succeeds."""
    if new.gateway != old.gateway:
        # The gateway (its process or unit, its URL, its keys) is set up at agent start.
        return Refused(
            (
                f"{new.source}: [gateway] changed; a reload does not apply it: restart the "
                "agent (systemctl restart sglang-farm) to apply [gateway] changes",
            ),
            restart_needed=True,
        )
    if new.model is not None and (
        new.model != old.model
        or model_target(new) != (model_target(old) if old.model is not None else None)
        or stage_holds
    ):
        # A new source or revision: the new copy takes over model_path at once (the
        # swap), the old one stays beside it until the workers have rolled to the new.
        return ModelChange.RESTAGE
    if new.model is None and old.model is not None:
        return ModelChange.DROP
    return ModelChange.KEEP


def stage_refused(new: FarmSpec, error: StageError) -> Refused:
    """A reload whose [model] could not be staged: the copy in place keeps serving."""
    return Refused((f"{new.source}: [model] not staged: {error.message}; {error.fix}",))


def reload_effects(
    plan: ReloadPlan,
    *,
    copy_replaced: bool,
    loading: Sequence[int],
    held: bool,
    workers: Sequence[int],
) -> ReloadEffects:
    """What starts and what restarts once the new config is in force. `copy_replaced`:
    the reload's stage swapped in a new copy, so every worker `loading` the previous one
    rolls to it; `held`: a failed stage held the rollout at start, which now begins for
    all the `workers` of the new config."""
    restart = plan.changed
    if copy_replaced:
        restart = tuple(sorted({*restart, *(w for w in loading if w not in plan.added)}))
    return ReloadEffects(start=tuple(workers) if held else plan.added, restart=restart)
