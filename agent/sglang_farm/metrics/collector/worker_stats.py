"""Pure: each serving worker's polled load figures."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric

from sglang_farm.metrics.families import (
    WORKER_LABELS,
    MetricsState,
    gpu_label,
    model_from_argv,
    new_counter,
    new_gauge,
)
from sglang_farm.workers.phase_sets import SERVING_OR_DRAINING


def worker_stats(st: MetricsState) -> Iterator[Metric]:
    """What the latest stats poll said of each serving worker (and its model and version)."""
    if st.farm is None:
        return
    wl = WORKER_LABELS
    info = new_gauge(
        "sglang_farm_worker_info",
        "A worker's port, model and SGLang version; always 1.",
        [*wl, "port", "model_name", "sglang_version"],
    )
    up = new_gauge(
        "sglang_farm_worker_up",
        "1 if the worker is serving and answered the latest stats poll.",
        wl,
    )
    queued = new_gauge(
        "sglang_farm_worker_queued_requests", "Requests waiting in the worker's queue.", wl
    )
    running = new_gauge(
        "sglang_farm_worker_running_requests", "Requests the worker is running.", wl
    )
    kv = new_gauge("sglang_farm_worker_kv_cache_usage_ratio", "KV-cache pool usage (0-1).", wl)
    tput = new_gauge(
        "sglang_farm_worker_generation_throughput_tokens_per_second",
        "Decode throughput as SGLang last reported it.",
        wl,
    )
    hit = new_gauge(
        "sglang_farm_worker_prefix_cache_hit_ratio", "Prefix (radix) cache hit ratio (0-1).", wl
    )
    stale = new_gauge(
        "sglang_farm_worker_stats_stale",
        "1 if the worker's figures are stale: no answer, or frozen while requests run.",
        wl,
    )
    polled = new_gauge(
        "sglang_farm_worker_stats_timestamp_seconds", "When the worker's figures were read.", wl
    )
    poll_dur = new_gauge(
        "sglang_farm_worker_stats_poll_duration_seconds", "How long the latest stats poll took.", wl
    )
    # Issue 34 §2: from SGLang's own sglang:http_responses_total (>= 0.5.20), absent without.
    answered = new_counter(
        "sglang_farm_worker_http_responses",
        "The worker's 2xx and 5xx answers on its serving routes since it started, as its "
        "SGLang counts them (sglang:http_responses_total).",
        wl,
    )
    errors = new_counter(
        "sglang_farm_worker_http_server_errors",
        "The worker's 5xx answers on its serving routes since it started, as its SGLang "
        "counts them.",
        wl,
    )
    ratio = new_gauge(
        "sglang_farm_worker_http_5xx_ratio",
        "The 5xx share of the worker's answers over its polls of the last 5 minutes "
        "(absent with no answer then).",
        wl,
    )
    for w in st.farm.workers:
        lv = [str(w.id), gpu_label(w.gpus)]
        stats = st.workers.get(w.id)
        model = (stats.model_name if stats else None) or model_from_argv(w.argv) or ""
        version = (stats.sglang_version if stats else None) or ""
        info.add_metric([*lv, str(w.port), model, version], 1)
        serving = w.phase in SERVING_OR_DRAINING
        up.add_metric(lv, 1 if serving and stats is not None and stats.up else 0)
        if not serving or stats is None:
            continue
        stale.add_metric(lv, 1 if stats.stale else 0)
        polled.add_metric(lv, stats.taken_at)
        poll_dur.add_metric(lv, stats.poll_duration_s)
        if not stats.up:
            continue
        for fam, v in (
            (queued, stats.queued),
            (running, stats.running),
            (kv, stats.token_usage),
            (tput, stats.gen_throughput),
            (hit, stats.cache_hit_rate),
        ):
            if v is not None:
                fam.add_metric(lv, v)
        if stats.answered is not None and stats.server_errors is not None:
            answered.add_metric(lv, stats.answered)
            errors.add_metric(lv, stats.server_errors)
        recent = stats.recent
        if recent is not None and recent.ratio is not None:
            ratio.add_metric(lv, recent.ratio)
    yield from (info, up, queued, running, kv, tput, hit, stale, polled, poll_dur)
    yield from (answered, errors, ratio)
