"""Pure: each worker's latest start, phase by phase."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric

from sglang_farm.metrics.families import (
    WORKER_LABELS,
    MetricsState,
    gpu_label,
    new_gauge,
)


def worker_starts(st: MetricsState) -> Iterator[Metric]:
    """Each worker's latest start, phase by phase, and the capacity SGLang chose (issue 34
    §4): from its log's milestones (`sglang.startup`)."""
    if st.farm is None:
        return
    wl = WORKER_LABELS
    phases = new_gauge(
        "sglang_farm_worker_startup_seconds",
        "Seconds each phase of the worker's latest start took (the phases that ended), from "
        "SGLang's log milestones.",
        [*wl, "phase"],
    )
    starting = new_gauge(
        "sglang_farm_worker_startup_phase",
        "The phase the worker's start is in now (a state set; absent once served).",
        [*wl, "phase"],
    )
    since = new_gauge(
        "sglang_farm_worker_startup_phase_since_timestamp_seconds",
        "When the phase the worker's start is in now began (Unix time; absent once served).",
        wl,
    )
    kv = new_gauge(
        "sglang_farm_worker_kv_cache_tokens",
        "The KV cache's size in tokens SGLang chose at the worker's start (max_total_num_tokens).",
        wl,
    )
    running = new_gauge(
        "sglang_farm_worker_max_running_requests",
        "The running-request limit SGLang settled on at the worker's start.",
        wl,
    )
    context = new_gauge(
        "sglang_farm_worker_context_length",
        "The context length SGLang serves the worker's model with.",
        wl,
    )
    for w in st.farm.workers:
        s = w.start
        if s is None:
            continue
        lv = [str(w.id), gpu_label(w.gpus)]
        for phase, seconds in s.durations.items():
            phases.add_metric([*lv, phase], seconds)
        if s.in_progress:
            starting.add_metric([*lv, str(s.phase)], 1)
            since.add_metric(lv, s.phase_since)
        if s.capacity is not None:
            kv.add_metric(lv, s.capacity.kv_tokens)
            running.add_metric(lv, s.capacity.max_running_requests)
            context.add_metric(lv, s.capacity.context_len)
    yield from (phases, starting, since, kv, running, context)
