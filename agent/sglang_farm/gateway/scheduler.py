"""Pure: the admission config the farm gives smg's priority scheduler (issue 33).

smg 1.13's scheduler (`--priority-scheduler-enabled`) admits a request only while its
class has a free slot of smg's capacity, which is the sum of the workers' reported
`max_running_requests` (64 for a worker that reports none). Its built-in defaults hold
most of that capacity for the `system` and `interactive` classes, which the farm's
users do not use: on 16 slots (2 workers of 8) a `bulk` batch got 2 at once
(docs/batch.md, "Priority: users first", with the sources). The farm therefore names
every class itself (`--priority-scheduler-config`, the YAML `scheduler_yaml` writes):

- `system`, `interactive`: no reservation (a request at either may still take any
  free slot);
- `default`, the class of every user's request without a header: `[gateway]
  priority_user_share` of the capacity, at least `user_slots` (that share of the farm's
  configured slots, at least one), which `bulk` may not take;
- `bulk`, the batch's: the rest.

Queue sizes, timeouts, starvation thresholds and preemption are smg's source defaults
(lightseekorg/smg, model_gateway/src/middleware/scheduler/config.rs), named so that a
later smg's change of them does not change the farm's gateway.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

# SGLang sizes its running batch from the KV cache when max_running_requests is unset;
# the farm counts this many for such a worker (as the batch runner does).
DEFAULT_MAX_RUNNING = 32
# smg builds its scheduler before any worker joins, against its fallback capacity (1024:
# smg 1.13's log says `old=1024 ... old_source=LegacyFallback`), and falls back to its
# legacy admission (no classes at all) when the reservations exceed it. The floor is at
# most that; `reserved_per_slot` carries the share past it once the workers are in.
MAX_FLOOR = 1024


@dataclass(frozen=True, slots=True)
class ClassAdmission:
    """One class's entry of smg's scheduler YAML (every field smg 1.13 reads)."""

    reserved_floor: int
    reserved_per_slot: float
    queue_size: int
    queue_timeout_secs: int
    starvation_threshold_secs: int
    can_preempt: bool


# smg's class order, highest first, and its source defaults for what the farm keeps.
_KEPT: Mapping[str, tuple[int, int, int, bool]] = {
    "system": (64, 30, 5, True),
    "interactive": (256, 30, 5, True),
    "default": (512, 60, 30, False),
    "bulk": (1024, 300, 120, False),
}


def config_slots(max_running: Iterable[int | None]) -> int:
    """The farm's running-request slots by its config: each worker's
    `max_running_requests`, `DEFAULT_MAX_RUNNING` where the config sets none."""
    return sum(DEFAULT_MAX_RUNNING if n is None else n for n in max_running)


def user_slots(share: float, slots: int) -> int:
    """The slots held for users out of `slots`: `share` of them rounded up, at least one
    and at most `MAX_FLOOR` (0 with a share of 0: bulk may take every slot)."""
    if share <= 0:
        return 0
    return min(MAX_FLOOR, max(1, math.ceil(share * slots)))


def classes(share: float, floor: int) -> dict[str, ClassAdmission]:
    """Every class's admission: `default` holds `share` of smg's capacity, at least
    `floor` slots; no other class holds any."""
    out: dict[str, ClassAdmission] = {}
    for name, (queue, timeout, starve, preempt) in _KEPT.items():
        user = name == "default"
        out[name] = ClassAdmission(
            reserved_floor=floor if user else 0,
            reserved_per_slot=share if user else 0.0,
            queue_size=queue,
            queue_timeout_secs=timeout,
            starvation_threshold_secs=starve,
            can_preempt=preempt,
        )
    return out


def scheduler_yaml(share: float, floor: int) -> str:
    """The text of smg's `--priority-scheduler-config` file for `classes(share, floor)`.
    Raises ValueError for a share outside [0, 1) or a negative floor (the checks
    `gateway.routing.problems` makes on the config)."""
    if not (math.isfinite(share) and 0 <= share < 1):
        raise ValueError(f"priority_user_share: expected a fraction in [0, 1), got {share!r}")
    if not 0 <= floor <= MAX_FLOOR:
        raise ValueError(f"user slots: expected 0..{MAX_FLOOR}, got {floor!r}")
    lines = [
        "# Written by sglang-farm (gateway.scheduler) for smg's --priority-scheduler-config.",
        "classes:",
    ]
    for name, c in classes(share, floor).items():
        lines += [
            f"  {name}:",
            f"    reserved_floor: {c.reserved_floor}",
            f"    reserved_per_slot: {c.reserved_per_slot!r}",
            f"    queue_size: {c.queue_size}",
            f"    queue_timeout_secs: {c.queue_timeout_secs}",
            f"    starvation_threshold_secs: {c.starvation_threshold_secs}",
            f"    can_preempt: {'true' if c.can_preempt else 'false'}",
        ]
    return "\n".join(lines) + "\n"
