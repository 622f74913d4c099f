"""I/O: one stage of a farm's `[model]` into its workers' `[sglang] model_path`, in order:
the source (a local directory, or the Hub's snapshot in the persistent cache), the copy
(`copier.stage_copy`), and the page-cache warm-up where asked for and not on a tmpfs.

Blocking: the agent runs it in a thread (`asyncio.to_thread`) and stops it through
`cancel`.
"""

from __future__ import annotations

import asyncio
import functools
import grp
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from sglang_farm.spec import FarmSpec, ModelSpec
from sglang_farm.staging.copier import REPORT_EVERY_S, Report, stage_copy
from sglang_farm.staging.lock import lock_dir_of
from sglang_farm.staging.plan import MountFacts
from sglang_farm.staging.progress import StageProgress
from sglang_farm.staging.space import mount_facts
from sglang_farm.staging.state import StageResult, model_target


def hub_cache_dir(spec: FarmSpec, model: ModelSpec) -> Path:
    return Path(model.cache_dir or f"{spec.farm.state_dir}/hub-cache")


def copy_group(spec: FarmSpec, *, euid: int | None = None) -> int | None:
    """The gid the staged copy is given (0640/0750: the agent and the workers read it,
    nobody else): [farm] group when the agent runs as root (the workers run as
    [farm] user and group); None, the agent's own group, when it does not (the workers
    then run as the agent itself) or when this host lacks the group (the agent starts
    no worker as a group that does not exist: it says so at the launch)."""
    if (os.geteuid() if euid is None else euid) != 0:
        return None
    try:
        return grp.getgrnam(spec.farm.group).gr_gid
    except KeyError:
        return None


def stage_model(
    spec: FarmSpec,
    *,
    cancel: threading.Event,
    report: Report = lambda _p: None,
    keep_old: bool = False,
    measure: Callable[[Path], MountFacts] = mount_facts,
    endpoint: str | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> StageResult:
    """Stage `spec.model` (which must be set). Raises StageError."""
    from sglang_farm.staging.source import local_manifest

    model = spec.model
    assert model is not None
    target = model_target(spec)
    report(StageProgress("checking", 0, 0, 0.0))
    if model.is_local:
        root = Path(model.source)
        manifest = local_manifest(root)
    else:
        from sglang_farm.staging.hub import download, snapshot_manifest

        t0 = clock()
        last = [float("-inf")]

        def on_bytes(done: int, total: int) -> None:
            # Throttled like the copy's reports (each rebuilds the farm view).
            now = clock()
            if now - last[0] >= REPORT_EVERY_S:
                last[0] = now
                report(StageProgress("downloading", done, total, now - t0))

        root = download(
            model.source,
            model.revision,
            hub_cache_dir(spec, model),
            token_file=model.token_file,
            endpoint=endpoint,
            report=on_bytes,
            cancel=cancel,
        )
        manifest = snapshot_manifest(root, f"hub:{model.source}@{root.name}")
    result = stage_copy(
        root,
        manifest,
        target,
        lock_dir=lock_dir_of(spec.farm.state_dir),
        headroom=model.headroom,
        cancel=cancel,
        report=report,
        measure=measure,
        keep_old=keep_old,
        clock=clock,
        group=copy_group(spec),
    )
    if model.warm_page_cache and not measure(target).is_tmpfs:
        from sglang_farm.staging.warm import warm

        warm(target, cancel=cancel, report=report, clock=clock)
    return result


class Stager(Protocol):
    """How the agent stages a spec's model (the default runs `stage_model` in a thread)."""

    async def __call__(
        self, spec: FarmSpec, *, report: Report, cancel: threading.Event, keep_old: bool
    ) -> StageResult: ...


async def thread_stager(
    spec: FarmSpec, *, report: Report, cancel: threading.Event, keep_old: bool
) -> StageResult:
    """`stage_model` off the event loop: the control socket answers while it copies."""
    return await asyncio.to_thread(
        functools.partial(stage_model, spec, cancel=cancel, report=report, keep_old=keep_old)
    )
