"""Pure: `/metrics` text and `/v1/loads` bodies from the engine's snapshots.

Names, types and labels are SGLang 0.5.23's (docs/reference/sglang.md §9): scheduler
metrics carry `model_name, engine_type, tp_rank, pp_rank, moe_ep_rank`,
tokenizer metrics `model_name, engine_type` (+ `is_streaming`), and every one the
`--extra-metric-labels`. The text is what prometheus_client's multiprocess
collector writes: counters as `<name>_total`, no `_created` samples.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sglang_farm.sim.snapshots import HistogramSnapshot, SchedulerStats, TokenizerStats

LOAD_SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})

Labels = Sequence[tuple[str, str]]


@dataclass(frozen=True, slots=True)
class MetricContext:
    """Static facts the metrics are labelled with or report."""

    model_name: str
    extra_labels: tuple[tuple[str, str], ...]
    context_len: int
    page_size: int
    weight_gb: float
    kv_cache_gb: float
    graph_gb: float

    def scheduler_labels(self) -> list[tuple[str, str]]:
        return [
            ("model_name", self.model_name),
            ("engine_type", "unified"),
            ("tp_rank", "0"),
            ("pp_rank", "0"),
            ("moe_ep_rank", "0"),
            *self.extra_labels,
        ]

    def tokenizer_labels(self) -> list[tuple[str, str]]:
        return [("model_name", self.model_name), ("engine_type", "unified"), *self.extra_labels]


def _num(value: float) -> str:
    """prometheus_client's float formatting (`1.0`, `+Inf`)."""
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return repr(float(value))


def _labels(labels: Iterable[tuple[str, str]]) -> str:
    def esc(v: str) -> str:
        return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')

    body = ",".join(f'{k}="{esc(v)}"' for k, v in labels)
    return "{" + body + "}" if body else ""


def _family(name: str, kind: str, help_text: str, samples: Iterable[str]) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples]


def _gauge(name: str, help_text: str, labels: Labels, value: float) -> list[str]:
    return _family(name, "gauge", help_text, [f"{name}{_labels(labels)} {_num(value)}"])


def _counter(name: str, help_text: str, labels: Labels, value: float) -> list[str]:
    return _family(name, "counter", help_text, [f"{name}{_labels(labels)} {_num(value)}"])


def _histogram(name: str, help_text: str, labels: Labels, h: HistogramSnapshot) -> list[str]:
    samples = []
    cumulative = 0
    for bound, count in zip((*h.bounds, math.inf), h.counts, strict=True):
        cumulative += count
        samples.append(f"{name}_bucket{_labels([*labels, ('le', _num(bound))])} {_num(cumulative)}")
    samples.append(f"{name}_count{_labels(labels)} {_num(h.count)}")
    samples.append(f"{name}_sum{_labels(labels)} {_num(h.total)}")
    return _family(name, "histogram", help_text, samples)


@dataclass(frozen=True, slots=True)
class HttpStats:
    """SGLang 0.5.20+'s HTTP counters (`observability/http_request_metrics.py`): requests
    by (endpoint, method) counted as they arrive, responses by (endpoint, status_code,
    method) counted when their status is sent. A stream's status, 200, is sent with its
    first byte: a client that hangs up later leaves it a 200 (and an abort)."""

    requests: Mapping[tuple[str, str], int]
    responses: Mapping[tuple[str, str, str], int]


def _http(stats: HttpStats) -> list[str]:
    req = [
        f"sglang:http_requests_total{_labels([('endpoint', e), ('method', m)])} {_num(n)}"
        for (e, m), n in sorted(stats.requests.items())
    ]
    resp = [
        "sglang:http_responses_total"
        f"{_labels([('endpoint', e), ('method', m), ('status_code', c)])} {_num(n)}"
        for (e, c, m), n in sorted(stats.responses.items())
    ]
    lines = _family("sglang:http_requests_total", "counter", "Number of HTTP requests.", req)
    return lines + _family(
        "sglang:http_responses_total",
        "counter",
        "Number of HTTP responses by status code.",
        resp,
    )


def render_metrics(
    ctx: MetricContext,
    sched: SchedulerStats,
    tok: TokenizerStats,
    http: HttpStats | None = None,
) -> str:
    """The `/metrics` body (Prometheus text format 0.0.4); `http` None: no HTTP counters
    (SGLang before 0.5.20)."""
    s = ctx.scheduler_labels()
    t = ctx.tokenizer_labels()
    ts = [*t, ("is_streaming", "false")]
    lines: list[str] = []
    lines += _gauge(
        "sglang:num_running_reqs", "The number of running requests.", s, sched.num_running_reqs
    )
    lines += _gauge(
        "sglang:num_used_tokens", "The number of used tokens.", s, sched.num_used_tokens
    )
    lines += _gauge("sglang:token_usage", "The token usage.", s, sched.token_usage)
    lines += _gauge(
        "sglang:gen_throughput", "The generation throughput (token/s).", s, sched.gen_throughput
    )
    lines += _gauge(
        "sglang:num_queue_reqs",
        "The number of requests in the waiting queue.",
        s,
        sched.num_waiting_reqs,
    )
    lines += _gauge(
        "sglang:num_grammar_queue_reqs",
        "The number of requests in the grammar waiting queue.",
        s,
        0,
    )
    lines += _gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", s, sched.cache_hit_rate)
    lines += _gauge("sglang:utilization", "The utilization.", s, sched.utilization)
    lines += _gauge(
        "sglang:max_total_num_tokens",
        "Maximum total number of tokens in the KV cache pool.",
        s,
        sched.max_total_num_tokens,
    )
    lines += _gauge("sglang:context_len", "The context length.", s, ctx.context_len)
    lines += _gauge("sglang:page_size", "The page size.", s, ctx.page_size)
    lines += _gauge("sglang:is_cuda_graph", "Whether the batch is using CUDA graph.", s, 1)
    lines += _gauge(
        "sglang:weight_memory_usage_gb", "The weight memory usage in GB.", s, ctx.weight_gb
    )
    lines += _gauge(
        "sglang:kv_cache_memory_usage_gb", "The KV cache memory usage in GB.", s, ctx.kv_cache_gb
    )
    lines += _histogram(
        "sglang:queue_time_seconds",
        "Histogram of time spent in the waiting queue in seconds.",
        s,
        sched.queue_time,
    )
    lines += _counter(
        "sglang:prompt_tokens_total", "Number of prefill tokens processed.", ts, tok.prompt_tokens
    )
    lines += _counter(
        "sglang:generation_tokens_total",
        "Number of generation tokens processed.",
        ts,
        tok.generation_tokens,
    )
    lines += _counter(
        "sglang:num_requests_total", "Number of requests processed.", ts, tok.num_requests
    )
    lines += _counter(
        "sglang:num_aborted_requests_total", "Number of requests aborted.", t, tok.num_aborted
    )
    lines += _histogram(
        "sglang:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        ts,
        tok.ttft,
    )
    lines += _histogram(
        "sglang:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        t,
        tok.itl,
    )
    lines += _histogram(
        "sglang:e2e_request_latency_seconds",
        "Histogram of End-to-end request latency in seconds",
        ts,
        tok.e2e,
    )
    if http is not None:
        lines += _http(http)
    return "\n".join(lines) + "\n"


def parse_include(raw: str | None) -> frozenset[str] | None:
    """`include=` of /v1/loads; raises ValueError with SGLang's message on a bad section."""
    if not raw:
        return None
    asked = frozenset(s.strip() for s in raw.split(","))
    bad = asked - LOAD_SECTIONS
    if bad:
        raise ValueError(
            f"Invalid include sections: {set(bad)}. Valid options: {sorted(LOAD_SECTIONS)}"
        )
    return asked


def load_snapshot(
    ctx: MetricContext, sched: SchedulerStats, include: frozenset[str] | None
) -> dict[str, Any]:
    """One LoadSnapshot (dp_rank 0) with the core keys of docs/reference/sglang.md §8."""
    load: dict[str, Any] = {
        "timestamp": sched.timestamp,
        "dp_rank": 0,
        "num_running_reqs": sched.num_running_reqs,
        "num_waiting_reqs": sched.num_waiting_reqs,
        "num_waiting_uncached_tokens": sched.num_waiting_uncached_tokens,
        "num_used_tokens": sched.num_used_tokens,
        "num_total_tokens": sched.num_used_tokens + sched.num_waiting_uncached_tokens,
        "num_active_tokens": sched.num_used_tokens,
        "num_prealloc_ready_tokens": 0,
        "max_total_num_tokens": sched.max_total_num_tokens,
        "max_running_requests": sched.max_running_requests,
        "token_usage": sched.token_usage,
        "gen_throughput": sched.gen_throughput,
        "cache_hit_rate": sched.cache_hit_rate,
        "utilization": sched.utilization,
        "total_prefill_uncached_tokens": 0,
        "total_prefill_busy_us": 0,
        "decode_moments": [],
    }
    asked = include if include is not None else frozenset({"all"})
    every = "all" in asked
    if every or "memory" in asked:
        load["memory"] = {
            "weight_gb": ctx.weight_gb,
            "kv_cache_gb": ctx.kv_cache_gb,
            "graph_gb": ctx.graph_gb,
            "token_capacity": sched.max_total_num_tokens,
        }
    if every or "queues" in asked:
        load["queues"] = {
            "waiting": sched.num_waiting_reqs,
            "grammar": 0,
            "paused": 0,
            "retracted": 0,
            "prealloc_ready": 0,
        }
    return load


def loads_body(
    now_iso: str,
    version: str,
    ctx: MetricContext,
    sched: SchedulerStats,
    include: frozenset[str] | None,
    num_accelerators: int,
) -> dict[str, Any]:
    """The `/v1/loads` JSON body."""
    return {
        "timestamp": now_iso,
        "version": version,
        "accelerator": "NVIDIA H200 (simulated)",
        "num_accelerators": num_accelerators,
        "loads": [load_snapshot(ctx, sched, include)],
    }


def loads_prometheus(load: Mapping[str, Any]) -> str:
    """`/v1/loads?format=prometheus`: `sglang_<key>{dp_rank="0"}` gauges."""
    prefixes = {"speculative": "spec", "disaggregation": "disagg"}
    dp_rank = load["dp_rank"]
    lines: list[str] = []
    for key, value in load.items():
        if key == "dp_rank":
            continue
        if isinstance(value, dict):
            for sub, v in value.items():
                if isinstance(v, int | float):
                    name = f"sglang_{prefixes.get(key, key)}_{sub}"
                    lines += [f"# TYPE {name} gauge", f'{name}{{dp_rank="{dp_rank}"}} {v}']
        elif isinstance(value, int | float):
            lines += [f"# TYPE sglang_{key} gauge", f'sglang_{key}{{dp_rank="{dp_rank}"}} {value}']
    return "\n".join(lines) + "\n"
