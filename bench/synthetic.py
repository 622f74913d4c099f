"""I/O (timing only): format cost of `/metrics` in-process, on a hand-built `MetricsState`.

Splits a scrape's latency into what `generate_latest` costs and what the HTTP server,
the thread hand-off and the agent's other work add. Sized like a real farm of n
workers on n GPUs, all ready, each with a GPU process and worker stats.
"""

from __future__ import annotations

import time
from types import MappingProxyType

from prometheus_client.exposition import generate_latest
from tests.metrics_fixtures import GiB, gpu

from bench.stats import summary
from sglang_farm.farm_view import FarmView, Phase, WorkerView
from sglang_farm.gpu import FleetSnapshot, GpuProcess
from sglang_farm.metrics import MetricsState, ProbeStatus, build_registry
from sglang_farm.workerstats import WorkerStats


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
            rollout="done",
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


def format_cost(n: int, reps: int) -> dict[str, object]:
    """`generate_latest` of an n-worker state, ms per call, with the body size."""
    st = state(n)
    registry = build_registry(lambda: st)
    body = generate_latest(registry)
    xs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        generate_latest(registry)
        xs.append(time.perf_counter() - t0)
    return {"format_ms": summary(xs, scale=1000), "body_bytes": len(body), "workers": n}
