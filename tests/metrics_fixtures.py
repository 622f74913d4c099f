"""Hand-built snapshots shared by the metrics, exporter and Prometheus tests."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

from sglang_farm.farm_view import (
    FarmView,
    GatewayStatus,
    Phase,
    Quarantine,
    Rollout,
    WorkerView,
)
from sglang_farm.gpus.snapshot import FleetSnapshot, GpuProcess, GpuSnapshot
from sglang_farm.metrics.collectors import MetricsState, ProbeStatus
from sglang_farm.sglang.load import WorkerStats

GiB = 1024**3
NOW = 1_700_000_000.0


def gpu(index: int, **kw: object) -> GpuSnapshot:
    base: dict[str, object] = dict(
        index=index,
        uuid=f"GPU-{index:04d}",
        name="NVIDIA H200",
        pci_bus_id=f"00000000:{0x18 + index:02X}:00.0",
        compute_capability=(9, 0),
        memory_total_bytes=140 * GiB,
        memory_used_bytes=10 * GiB,
        memory_free_bytes=129 * GiB,
        memory_reserved_bytes=1 * GiB,
        utilization_gpu_ratio=0.5,
        utilization_memory_ratio=0.25,
        temperature_c=40.0,
        power_w=300.0,
        energy_j=1e6,
        sm_clock_hz=1.98e9,
        throttle_reasons=0,
        ecc_corrected_volatile_total=0,
        ecc_uncorrected_volatile_total=0,
        remapped_rows_correctable=0,
        remapped_rows_uncorrectable=0,
        remapped_rows_pending=False,
        remapped_rows_failure=False,
    )
    base.update(kw)
    return GpuSnapshot(**base)  # type: ignore[arg-type]  # a dict of mixed field values


def fleet() -> FleetSnapshot:
    return FleetSnapshot(
        taken_at=NOW - 1,
        duration_s=0.0004,
        nvml_up=True,
        gpus=(
            gpu(0, memory_used_bytes=71 * GiB, processes=(GpuProcess(101, 70 * GiB),)),
            gpu(1, processes=(GpuProcess(201, 5 * GiB),)),
            gpu(2, ecc_corrected_volatile_total=None, ecc_uncorrected_volatile_total=None),
            GpuSnapshot(3, uuid="GPU-0003", healthy=False, error="GPU is lost"),
            # GPU 5 fell off the bus (XID 79): worker 4 on it is quarantined.
            GpuSnapshot(5, uuid="GPU-0005", healthy=False, error="GPU is lost"),
        ),
        xid_events_total=MappingProxyType({(0, 79): 2, (-1, 48): 1, (5, 79): 1}),
        driver_version="580.159.04",
    )


def farm() -> FarmView:
    return FarmView(
        name="lab",
        runtime="process",
        config_source="/etc/sglang-farm/farm.toml",
        started_at=NOW - 3600,
        rollout=Rollout.DONE,
        workers=(
            WorkerView(
                id=0,
                gpus=(0,),
                port=30000,
                base_url="http://127.0.0.1:30000",
                phase=Phase.READY,
                since=NOW - 600,
                pid=100,
                restarts_by_reason=MappingProxyType({"crash": 2, "oom": 1}),
                oom_events_by_kind=MappingProxyType({"cuda": 1}),
                oom_step=1,
                oom_step_name="lower-mem-fraction",
                last_load_seconds=41.5,
                argv=("python", "-m", "sglang.launch_server", "--model-path", "/models/qwen3-8b"),
            ),
            WorkerView(
                id=1,
                gpus=(1, 2),
                port=30001,
                base_url="http://127.0.0.1:30001",
                phase=Phase.STARTING,
                since=NOW - 30,
                pid=200,
                argv=("python", "-m", "sglang.launch_server", "--model-path", "/m/big"),
            ),
            WorkerView(
                id=2,
                gpus=(3,),
                port=30002,
                base_url="http://127.0.0.1:30002",
                phase=Phase.FAILED,
                since=NOW - 100,
                pid=None,
                restarts_by_reason=MappingProxyType({"crash": 5}),
            ),
            quarantined_worker(),
        ),
    )


QUARANTINE_DETAIL = "GPU has fallen off the bus; NVIDIA's action: RESTART_BM"


def quarantined_worker() -> WorkerView:
    """Worker 4 on GPU 5, quarantined after XID 79; its GPU was quarantined once before
    for pending row remaps (released since)."""
    return WorkerView(
        id=4,
        gpus=(5,),
        port=30004,
        base_url="http://127.0.0.1:30004",
        phase=Phase.QUARANTINED,
        since=NOW - 50,
        pid=None,
        restarts_by_reason=MappingProxyType({"crash": 1}),
        argv=("python", "-m", "sglang.launch_server", "--model-path", "/models/qwen3-8b"),
        quarantine=Quarantine(gpu=5, reason="xid 79", detail=QUARANTINE_DETAIL, since=NOW - 50),
        quarantines_by_reason=MappingProxyType({"pending row remaps": 1, "xid 79": 1}),
    )


GATEWAY_URL = "http://127.0.0.1:8000"


def gateway_farm() -> FarmView:
    """`farm()` behind a gateway: worker 0 routed to (its last restart drained in 12.5 s),
    and a worker 3 on GPU 4 draining for a planned restart, already out of the gateway."""
    view = farm()
    routed = dataclasses.replace(view.workers[0], in_gateway=True, last_drain_seconds=12.5)
    draining = WorkerView(
        id=3,
        gpus=(4,),
        port=30003,
        base_url="http://127.0.0.1:30003",
        phase=Phase.DRAINING,
        since=NOW - 5,
        pid=400,
        restarts_by_reason=MappingProxyType({"manual": 1}),
        last_load_seconds=39.0,
        last_drain_seconds=3.25,
        argv=("python", "-m", "sglang.launch_server", "--model-path", "/models/qwen3-8b"),
    )
    return dataclasses.replace(
        view,
        workers=(routed, *view.workers[1:3], draining, *view.workers[3:]),
        gateway=GatewayStatus(url=GATEWAY_URL, up=True, members=1, errors=4),
    )


def stats() -> dict[int, WorkerStats]:
    return {
        0: WorkerStats(
            worker=0,
            taken_at=NOW - 2,
            up=True,
            running=3,
            queued=7,
            token_usage=0.42,
            gen_throughput=1234.5,
            cache_hit_rate=0.3,
            model_name="qwen3-8b",
            sglang_version="0.5.23",
            source="metrics",
            poll_duration_s=0.004,
            # Issue 34 §2: SGLang 0.5.23's own counter; 6 answers and 3 of them 5xx lately.
            answered=1200,
            server_errors=12,
            answers=((NOW - 62, 1194, 9), (NOW - 32, 1197, 11), (NOW - 2, 1200, 12)),
        ),
        # A FAILED worker's last stats must not be exported as if it served.
        2: WorkerStats(worker=2, taken_at=NOW - 200, up=True, running=9, queued=9),
        # Worker 3 drains (gateway_farm): its last requests still run; absent from farm().
        3: WorkerStats(
            worker=3,
            taken_at=NOW - 1,
            up=True,
            running=2,
            queued=0,
            model_name="qwen3-8b",
            sglang_version="0.5.23",
            source="metrics",
            poll_duration_s=0.003,
        ),
    }


def state() -> MetricsState:
    return MetricsState(
        snapshot_at=NOW,
        farm=farm(),
        fleet=fleet(),
        workers=MappingProxyType(stats()),
        worker_pids=MappingProxyType({0: frozenset({100, 101}), 1: frozenset({200})}),
        probes=MappingProxyType(
            {
                "gpu": ProbeStatus(True, 0.0004, NOW - 1),
                "workers": ProbeStatus(False, 2.0, NOW - 60),
                "runtime": ProbeStatus(False, 0.1, None),
            }
        ),
    )


def gateway_state() -> MetricsState:
    """`state()` of a farm with a [gateway] (`gateway_farm`)."""
    return dataclasses.replace(state(), farm=gateway_farm())


def canary_farm() -> FarmView:
    """`gateway_farm()` whose latest change was rolled back from canary worker 1 (GPUs 1
    and 2): ITL p99 5.2x the baseline's; TTFT's baseline unknown and not judged."""
    from sglang_farm.canary.view import CanaryState, CheckView, RolloutVerdictView

    return dataclasses.replace(
        gateway_farm(),
        canary=RolloutVerdictView(
            state=CanaryState.ROLLED_BACK,
            change="3f9a1c2e",
            canary=1,
            started_at=NOW - 40,
            window_s=30.0,
            ends_at=None,
            evidence="rolled back: canary ITL p99 0.052 s = 5.2x the baseline's over 30 s, "
            "412 vs 2,830 requests",
            checks=(
                CheckView("errors", 0.002, 0.001, 2.0, 0.01, True),
                CheckView("itl_p50", 0.021, 0.02, 1.05, 1.4, True),
                CheckView("itl_p99", 0.052, 0.01, 5.2, 1.4, False),
                CheckView("ttft_p50", 0.4, None, None, 3.0, None),
            ),
            rollbacks_total=2,
        ),
    )


def canary_state() -> MetricsState:
    """`gateway_state()` after a canary rollback (`canary_farm`): every family exported."""
    return dataclasses.replace(state(), farm=canary_farm())
