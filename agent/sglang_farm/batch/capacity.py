"""Pure: how many requests the runner keeps in flight, from what the farm can serve now.

The farm's running-request slots are its serving workers' `max_running_requests`
added up: a worker counts while it is ready and (with a gateway) routed, not quarantined,
and the host not held out (`farmctl drain-host`). A quarantine, a drain, a wave's restart
take its slots away; its return gives them back. The gateway's overload answers
(429, 503) cut the target to a share of that (halved per overload, at most once a
second), grown back step by step while answers come without one. A configured
`concurrency` caps it all. With no farm status at all (the agent is down), the last
known slots stand (the workers keep serving without the agent); before any, the
config's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

# SGLang sizes its running batch from the KV cache when max_running_requests is unset;
# the farm cannot know that figure before a worker reports it, so it counts this many.
DEFAULT_MAX_RUNNING = 32
MIN_SHARE = 1 / 16
GROW_PER_S = 0.05


@dataclass(frozen=True, slots=True)
class WorkerSlots:
    """One worker as the agent's status reports it, with its running-request slots."""

    id: int
    state: str
    in_gateway: bool
    quarantined: bool
    max_running: int


def slots(workers: Iterable[WorkerSlots], *, gateway: bool, held_out: bool) -> int:
    """The farm's running-request slots that serve now."""
    if held_out:
        return 0
    return sum(
        w.max_running
        for w in workers
        if w.state == "ready" and not w.quarantined and (w.in_gateway or not gateway)
    )


def workers_from_status(
    status: Mapping[str, object], max_running: Mapping[int, int]
) -> tuple[list[WorkerSlots], bool, bool]:
    """The agent's `status` answer -> (workers, has a gateway, host held out)."""
    out: list[WorkerSlots] = []
    raw = status.get("workers")
    for w in raw if isinstance(raw, list) else []:
        if not isinstance(w, dict) or not isinstance(w.get("id"), int):
            continue
        wid = int(w["id"])
        out.append(
            WorkerSlots(
                id=wid,
                state=str(w.get("state")),
                in_gateway=bool(w.get("in_gateway")),
                quarantined=w.get("quarantine") is not None,
                max_running=max_running.get(wid, DEFAULT_MAX_RUNNING),
            )
        )
    return out, status.get("gateway") is not None, status.get("held_out_since") is not None


@dataclass(frozen=True, slots=True)
class Throttle:
    """The share of the slots the runner fills: 1.0 until the gateway says it is full."""

    share: float = 1.0
    last_cut_at: float = float("-inf")
    last_grow_at: float = float("-inf")

    def overload(self, now: float) -> Throttle:
        if now - self.last_cut_at < 1.0:
            return self
        return Throttle(max(MIN_SHARE, self.share / 2), now, now)

    def ok(self, now: float) -> Throttle:
        if self.share >= 1.0:
            return self
        if self.last_grow_at == float("-inf"):
            return replace(self, last_grow_at=now)
        grown = min(1.0, self.share + GROW_PER_S * (now - self.last_grow_at))
        return replace(self, share=grown, last_grow_at=now)


def target(free_slots: int, throttle: Throttle, cap: int | None) -> int:
    """Requests to keep in flight: the throttled slots, at least 1 while any slot serves,
    0 when none does; at most `cap`."""
    if free_slots <= 0:
        return 0
    n = max(1, int(free_slots * throttle.share))
    return min(n, cap) if cap is not None else n
