"""Pure: what a reload changes: which workers restart, which arrive, which go.

A worker restarts only when its command line (or environment) would differ; a worker
that keeps its command line keeps running through the reload.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sglang_farm.sglang_argv import Command


@dataclass(frozen=True, slots=True)
class ReloadPlan:
    changed: tuple[int, ...]  # in both configs, with a different command: rolling restart
    added: tuple[int, ...]  # only in the new config: started
    removed: tuple[int, ...]  # only in the old config: stopped, then forgotten


def plan_reload(old: Mapping[int, Command], new: Mapping[int, Command]) -> ReloadPlan:
    """Compare each worker's command line under the old and the new config."""
    shared = sorted(old.keys() & new.keys())
    return ReloadPlan(
        changed=tuple(w for w in shared if old[w] != new[w]),
        added=tuple(sorted(new.keys() - old.keys())),
        removed=tuple(sorted(old.keys() - new.keys())),
    )
