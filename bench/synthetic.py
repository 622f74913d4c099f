"""I/O (timing only): format cost of `/metrics` in-process, on a hand-built `MetricsState`.

Splits a scrape's latency into what formatting costs and what the HTTP server, the
thread hand-off and the agent's other work add. Sized like a real farm of n workers on
n GPUs, all ready, each with a GPU process and worker stats.

The exporter formats a body once per state and format, so what a scraper waits for is
the first scrape after a swap (every Prometheus scrape: swaps come every few seconds,
scrapes every 15 s). Measured here for each kind of swap the agent makes, in both
formats, with prometheus_client's encoder over the whole registry (what the exporter
ran before `exposition.py`) and with the farm's own writer, in the same run.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from types import MappingProxyType

from prometheus_client.exposition import choose_encoder, generate_latest

from bench.stats import summary
from metrics_fixtures import GiB, gpu
from sglang_farm.farm_view import FarmView, Phase, WorkerView
from sglang_farm.gpus.snapshot import FleetSnapshot, GpuProcess
from sglang_farm.metrics import exposition
from sglang_farm.metrics.collectors import MetricsState, ProbeStatus, build_registry
from sglang_farm.metrics.exposition import PROMETHEUS_ACCEPT
from sglang_farm.sglang.load import WorkerStats
from sglang_farm.workers.supervisor import Rollout


def state(n: int) -> MetricsState:
    now = time.time()
    workers = tuple(
        WorkerView(
            id=i,
            gpus=(i,),
            port=30000 + i,
            base_url=f"http://127.0.0.1:{30000 + i}",
            phase=Phase.READY,
            since=now - 600,
            pid=1000 + 10 * i,
            restarts_by_reason=MappingProxyType({"crash": 1}),
            last_load_seconds=41.5,
            argv=("python", "-m", "sglang.launch_server", "--model-path", "/models/qwen3-8b"),
        )
        for i in range(n)
    )
    fleet = FleetSnapshot(
        taken_at=now - 1,
        duration_s=0.0004,
        nvml_up=True,
        gpus=tuple(gpu(i, processes=(GpuProcess(1001 + 10 * i, 70 * GiB),)) for i in range(n)),
        xid_events_total=MappingProxyType({}),
        driver_version="580.159.04",
    )
    stats = {
        i: WorkerStats(
            worker=i,
            taken_at=now - 2,
            up=True,
            running=3,
            queued=1,
            token_usage=0.4,
            gen_throughput=1234.5,
            cache_hit_rate=0.3,
            model_name="qwen3-8b",
            sglang_version="0.5.23",
            source="metrics",
            poll_duration_s=0.004,
        )
        for i in range(n)
    }
    return MetricsState(
        snapshot_at=now,
        farm=FarmView(
            name="bench",
            runtime="process",
            workers=workers,
            config_source="x",
            started_at=now - 3600,
            rollout=Rollout.DONE,
        ),
        fleet=fleet,
        workers=MappingProxyType(stats),
        worker_pids=MappingProxyType(
            {i: frozenset({1000 + 10 * i, 1001 + 10 * i}) for i in range(n)}
        ),
        probes=MappingProxyType(
            {"gpu": ProbeStatus(True, 0.001, now), "workers": ProbeStatus(True, 0.01, now)}
        ),
    )


def _swap(kind: str, st: MetricsState, i: int) -> MetricsState:
    """`st` after one swap of `kind`, with new objects for the parts that swap replaces."""
    assert st.farm is not None and st.fleet is not None
    at = st.snapshot_at + i
    if kind == "worker poll":
        return dataclasses.replace(st, snapshot_at=at, workers=MappingProxyType(dict(st.workers)))
    if kind == "gpu poll":
        return dataclasses.replace(
            st,
            snapshot_at=at,
            fleet=dataclasses.replace(st.fleet),
            worker_pids=MappingProxyType(dict(st.worker_pids)),
        )
    return dataclasses.replace(st, snapshot_at=at, farm=dataclasses.replace(st.farm))


SWAPS = ("worker poll", "gpu poll", "view change")


def _timed(
    reps: int, before: Callable[[int], None], call: Callable[[], object]
) -> dict[str, float]:
    xs = []
    for i in range(reps):
        before(i)
        t0 = time.perf_counter()
        call()
        xs.append(time.perf_counter() - t0)
    return summary(xs, scale=1000)


def _costs(st: MetricsState, accept: str, reps: int) -> dict[str, dict[str, float]]:
    current = [st]
    registry = build_registry(lambda: current[0])
    library, _ = choose_encoder(accept)
    fast = exposition.choose(accept).encode
    row = {"library_ms": _timed(reps, lambda i: None, lambda: library(registry))}
    fast(registry)  # every section formatted once: from here on, only what a swap replaced
    for kind in SWAPS:

        def swap(i: int, kind: str = kind) -> None:
            current[0] = _swap(kind, st, i + 1)

        row[f"{kind}_ms"] = _timed(reps, swap, lambda: fast(registry))
    return row


def format_cost(n: int, reps: int) -> dict[str, object]:
    """ms per body of an n-worker state: the library's encoder, and the farm's writer
    after each kind of swap, for the text format and for what Prometheus asks for."""
    st = state(n)
    return {
        "workers": n,
        "body_bytes": len(generate_latest(build_registry(lambda: st))),
        "text": _costs(st, "", reps),
        "prometheus": _costs(st, PROMETHEUS_ACCEPT, reps),
    }
