"""Pure: the pollers' snapshots as supervisor events, with the memory a next look needs.

The NVML poller's fleet snapshot is compared with the previous one (a new XID counts
once: `workers.gpu_health.fleet_events`); a worker's counters with their previous change
(`progress.progress_events`), its GPUs' utilization taken from the latest fleet. The
pollers only report: what each event means for the worker is the supervisor's call.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from sglang_farm.gpus.snapshot import FleetSnapshot
from sglang_farm.sglang.load import WorkerStats
from sglang_farm.workers.events import Event
from sglang_farm.workers.gpu_health import busiest_utilization, fleet_events
from sglang_farm.workers.progress import progress_events


class Observations:
    def __init__(self) -> None:
        self.fleet: FleetSnapshot | None = None  # the latest NVML snapshot
        self._changed_at: dict[int, float | None] = {}  # each worker's counters, last look

    def of_fleet(
        self, fleet: FleetSnapshot, worker_gpus: Mapping[int, Collection[int]]
    ) -> list[tuple[int, Event]]:
        """A new NVML snapshot: the events for the workers (id -> its GPUs) it concerns."""
        events = fleet_events(self.fleet, fleet, worker_gpus)
        self.fleet = fleet
        return list(events)

    def of_stats(
        self,
        stats: Mapping[int, WorkerStats],
        worker_gpus: Mapping[int, Collection[int]],
        *,
        stall_window: float,
        now: float,
    ) -> list[tuple[int, Event]]:
        """The worker pollers' figures (`now`: wall clock, as theirs): progress and stalls
        of the workers in `worker_gpus` (others are not, or no longer, the farm's)."""
        out: list[tuple[int, Event]] = []
        for wid, st in stats.items():
            if wid not in worker_gpus:
                continue
            events = progress_events(
                self._changed_at.get(wid),
                st,
                gpu_util=busiest_utilization(self.fleet, worker_gpus[wid]),
                stall_window=stall_window,
                now=now,
            )
            self._changed_at[wid] = st.changed_at
            out += [(wid, e) for e in events]
        return out
