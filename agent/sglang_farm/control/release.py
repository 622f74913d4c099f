"""Pure: the one builder of the release command, the farmctl command that ends a worker's
quarantine. Imports nothing of the farm: the agent says it (prose, refusals, the `release`
key of a worker's result) and farmctl, which imports this on every run, falls back on it
for an agent older than that key."""

from __future__ import annotations

from collections.abc import Sequence


def release_command(worker: int, quarantined_gpu: int | None, gpus: Sequence[int]) -> str:
    """By GPU when the quarantine names a GPU the worker uses, else by worker: a reload
    moved the worker off that GPU, `release-gpu GPU` is refused (no worker uses it) and
    the release by worker re-checks the GPUs it runs on now."""
    if quarantined_gpu is not None and quarantined_gpu in gpus:
        return f"farmctl release-gpu {quarantined_gpu}"
    return f"farmctl release-gpu --worker {worker}"
