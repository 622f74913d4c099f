"""Pure: the GPUs set aside and why."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric

from sglang_farm.metrics.families import (
    MetricsState,
    gpu_label,
    new_counter,
    new_gauge,
)


def quarantines(st: MetricsState) -> Iterator[Metric]:
    # A quarantine is the worker's (the supervisor sets it), but it names one GPU: the
    # gauge is per GPU, so an alert says which card to reset; the counter is per worker,
    # like restarts. XID reasons are free-form ("xid 79"), so only counted reasons appear.
    if st.farm is None:
        return
    uuids = {g.index: g.uuid or "" for g in st.fleet.gpus} if st.fleet is not None else {}
    gauge = new_gauge(
        "sglang_farm_gpu_quarantined",
        "1 while the GPU is quarantined (its worker stopped, not restarted until released); "
        '0 with reason="" for the farm\'s other GPUs.',
        ["gpu", "uuid", "reason"],
    )
    total = new_counter(
        "sglang_farm_worker_quarantines",
        'Times the worker\'s GPU was quarantined, by reason ("xid 79", "gpu lost", ...).',
        ["worker", "gpu", "reason"],
    )
    shown: dict[int, str] = {}
    for w in st.farm.workers:
        q = w.quarantine
        if q is not None:
            shown[q.gpu] = q.reason
        for g in w.gpus:
            shown.setdefault(g, "")
        lv = [str(w.id), gpu_label(w.gpus)]
        for reason in sorted(w.quarantines_by_reason):
            total.add_metric([*lv, reason], w.quarantines_by_reason[reason])
    for gpu in sorted(shown):
        reason = shown[gpu]
        gauge.add_metric([str(gpu), uuids.get(gpu, ""), reason], 1 if reason else 0)
    yield gauge
    yield total
