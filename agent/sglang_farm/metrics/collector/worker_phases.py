"""Pure: each worker's phase, restarts, OOM events and gateway membership."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric

from sglang_farm.farm_view import Phase
from sglang_farm.metrics.families import (
    WORKER_LABELS,
    MetricsState,
    add_counts,
    gpu_label,
    new_counter,
    new_gauge,
)
from sglang_farm.sglang.failures import OomKind, RestartReason


def worker_phases(st: MetricsState) -> Iterator[Metric]:
    """What the farm view alone says of each worker: phase, restarts, OOM ladder, loads."""
    if st.farm is None:
        return
    wl = WORKER_LABELS
    state = new_gauge(
        "sglang_farm_worker_state", "The worker's phase (a state set).", [*wl, "state"]
    )
    since = new_gauge(
        "sglang_farm_worker_state_since_timestamp_seconds",
        "When the worker entered its phase (Unix time).",
        wl,
    )
    restarts = new_counter("sglang_farm_worker_restarts", "Restarts by reason.", [*wl, "reason"])
    ooms = new_counter(
        "sglang_farm_worker_oom_events", "Out-of-memory failures by kind.", [*wl, "kind"]
    )
    step = new_gauge(
        "sglang_farm_worker_oom_ladder_step", "OOM-ladder step in force (0 = as configured).", wl
    )
    load = new_gauge(
        "sglang_farm_worker_last_load_duration_seconds",
        "How long the last start took from launch to ready.",
        wl,
    )
    drain = new_gauge(
        "sglang_farm_worker_last_drain_duration_seconds",
        "How long the last planned stop waited for the worker to leave the gateway and go idle.",
        wl,
    )
    in_gateway = new_gauge(
        "sglang_farm_worker_in_gateway", "1 if the gateway confirmed it routes to the worker.", wl
    )
    busy = new_gauge(
        "sglang_farm_worker_busy",
        "1 while a slow /health is excused: the worker's own counters were advancing.",
        wl,
    )
    gateway = st.farm.gateway is not None
    reasons = [str(r) for r in RestartReason]
    kinds = [str(k) for k in OomKind]
    for w in st.farm.workers:
        lv = [str(w.id), gpu_label(w.gpus)]
        for p in Phase:
            state.add_metric([*lv, str(p)], 1 if w.phase is p else 0)
        since.add_metric(lv, w.since)
        add_counts(restarts, lv, w.restarts_by_reason, reasons)
        add_counts(ooms, lv, w.oom_events_by_kind, kinds)
        step.add_metric(lv, w.oom_step)
        busy.add_metric(lv, 1 if w.busy else 0)
        if w.last_load_seconds is not None:
            load.add_metric(lv, w.last_load_seconds)
        if w.last_drain_seconds is not None:
            drain.add_metric(lv, w.last_drain_seconds)
        if gateway:
            in_gateway.add_metric(lv, 1 if w.in_gateway else 0)
    yield from (state, since, restarts, ooms, step, busy, load, drain)
    if gateway:
        yield in_gateway
