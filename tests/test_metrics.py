"""Collectors over hand-built snapshots: single values, the golden exposition, promtool's lint."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from metrics_fixtures import (
    GATEWAY_URL,
    NOW,
    GiB,
    canary_state,
    farm,
    gateway_state,
    state,
)
from sglang_farm.canary.view import CanaryState
from sglang_farm.farm_view import Phase, Quarantine
from sglang_farm.gpus.snapshot import FleetSnapshot
from sglang_farm.metrics.collectors import (
    MetricsState,
    build_registry,
    gpu_label,
    model_from_argv,
    public_url,
)

GOLDEN_DIR = Path(__file__).parent / "golden"
# The shape of a farm without a [gateway], and of one behind a gateway with a draining worker.
GOLDENS = {
    "metrics.txt": state,
    "metrics_gateway.txt": gateway_state,
    "metrics_canary.txt": canary_state,
}
GATEWAY_FAMILIES = (
    "sglang_farm_gateway_up",
    "sglang_farm_gateway_members",
    "sglang_farm_gateway_errors",
    "sglang_farm_gateway_foreign_members",
    "sglang_farm_worker_in_gateway",
)


def _registry(st: MetricsState) -> CollectorRegistry:
    return build_registry(lambda: st, version="0.0.0-test")


def _v(st: MetricsState, metric: str, /, **labels: str) -> float | None:
    return _registry(st).get_sample_value(metric, labels)


def test_gpu_readings_are_exported_per_gpu_with_uuid() -> None:
    st = state()
    assert _v(st, "sglang_farm_nvml_up") == 1
    assert _v(st, "sglang_farm_gpu_simulated") == 0
    g0 = {"gpu": "0", "uuid": "GPU-0000"}
    assert _v(st, "sglang_farm_gpu_memory_used_bytes", **g0) == 71 * GiB
    assert _v(st, "sglang_farm_gpu_memory_total_bytes", **g0) == 140 * GiB
    assert _v(st, "sglang_farm_gpu_utilization_ratio", **g0) == 0.5
    assert _v(st, "sglang_farm_gpu_temperature_celsius", **g0) == 40
    assert _v(st, "sglang_farm_gpu_power_watts", **g0) == 300
    assert _v(st, "sglang_farm_gpu_energy_joules_total", **g0) == 1e6
    assert _v(st, "sglang_farm_gpu_ecc_errors_total", type="uncorrected", **g0) == 0
    assert _v(st, "sglang_farm_gpu_compute_processes", **g0) == 1
    info = {"name": "NVIDIA H200", "compute_capability": "9.0", "driver_version": "580.159.04"}
    assert _v(st, "sglang_farm_gpu_info", pci_bus_id="00000000:18:00.0", **info, **g0) == 1


def test_unsupported_readings_are_absent_not_zero() -> None:
    st = state()
    g2 = {"gpu": "2", "uuid": "GPU-0002"}
    assert _v(st, "sglang_farm_gpu_ecc_errors_total", type="corrected", **g2) is None
    assert _v(st, "sglang_farm_gpu_memory_used_bytes", **g2) == 10 * GiB


def test_a_lost_gpu_is_unhealthy_with_no_readings() -> None:
    st = state()
    g3 = {"gpu": "3", "uuid": "GPU-0003"}
    assert _v(st, "sglang_farm_gpu_healthy", **g3) == 0
    assert _v(st, "sglang_farm_gpu_memory_used_bytes", **g3) is None
    assert _v(st, "sglang_farm_gpu_compute_processes", **g3) is None
    assert _v(st, "sglang_farm_gpu_healthy", gpu="0", uuid="GPU-0000") == 1


def test_xid_errors_are_counted_by_gpu_and_code() -> None:
    st = state()
    assert _v(st, "sglang_farm_gpu_xid_errors_total", gpu="0", uuid="GPU-0000", xid="79") == 2
    assert _v(st, "sglang_farm_gpu_xid_errors_total", gpu="unknown", uuid="", xid="48") == 1


def test_nvml_down_exports_nvml_up_zero_and_no_gpu_series() -> None:
    down = FleetSnapshot(taken_at=NOW, duration_s=0, nvml_up=False, error="no driver")
    st = dataclasses.replace(state(), fleet=down)
    assert _v(st, "sglang_farm_nvml_up") == 0
    assert _v(st, "sglang_farm_gpu_memory_used_bytes", gpu="0", uuid="GPU-0000") is None
    # Per-worker memory cannot be attributed without NVML: absent, not 0.
    assert _v(st, "sglang_farm_worker_gpu_memory_bytes", worker="0", gpu="0") is None
    assert _v(st, "sglang_farm_worker_state", worker="0", gpu="0", state="ready") == 1


def test_no_gpu_source_means_no_nvml_up_series_at_all() -> None:
    st = dataclasses.replace(state(), fleet=None)
    assert _v(st, "sglang_farm_nvml_up") is None
    assert _v(st, "sglang_farm_worker_up", worker="0", gpu="0") == 1


def test_worker_state_is_a_one_hot_state_set() -> None:
    st = state()
    for phase in Phase:
        want = 1 if phase is Phase.READY else 0
        assert _v(st, "sglang_farm_worker_state", worker="0", gpu="0", state=str(phase)) == want
    assert _v(st, "sglang_farm_worker_state", worker="2", gpu="3", state="failed") == 1


def test_a_draining_worker_is_in_state_draining_and_only_there() -> None:
    st = gateway_state()
    w3 = {"worker": "3", "gpu": "4"}
    got = {str(p): _v(st, "sglang_farm_worker_state", state=str(p), **w3) for p in Phase}
    assert got == {str(p): (1 if p is Phase.DRAINING else 0) for p in Phase}
    # The phase exists for every worker, so a drain shows up as a change of an existing series.
    assert _v(st, "sglang_farm_worker_state", worker="0", gpu="0", state="draining") == 0
    assert _v(state(), "sglang_farm_worker_state", worker="0", gpu="0", state="draining") == 0
    assert _v(st, "sglang_farm_worker_state_since_timestamp_seconds", **w3) == NOW - 5


def test_a_draining_worker_still_reports_the_requests_it_finishes() -> None:
    st = gateway_state()
    w3 = {"worker": "3", "gpu": "4"}
    assert _v(st, "sglang_farm_worker_up", **w3) == 1
    assert _v(st, "sglang_farm_worker_running_requests", **w3) == 2
    assert _v(st, "sglang_farm_worker_queued_requests", **w3) == 0
    assert _v(st, "sglang_farm_worker_stats_stale", **w3) == 0


def test_gateway_series_follow_the_gateway_status() -> None:
    st = gateway_state()
    assert _v(st, "sglang_farm_gateway_up", url=GATEWAY_URL) == 1
    assert _v(st, "sglang_farm_gateway_members") == 1
    assert _v(st, "sglang_farm_gateway_errors_total") == 4


def test_a_gateway_that_is_down_exports_up_0_with_its_errors() -> None:
    st = gateway_state()
    assert st.farm is not None and st.farm.gateway is not None
    down = dataclasses.replace(
        st.farm.gateway, up=False, members=0, errors=9, last_error="connection refused"
    )
    st = dataclasses.replace(st, farm=dataclasses.replace(st.farm, gateway=down))
    assert _v(st, "sglang_farm_gateway_up", url=GATEWAY_URL) == 0
    assert _v(st, "sglang_farm_gateway_members") == 0
    assert _v(st, "sglang_farm_gateway_errors_total") == 9


def test_the_gateway_url_label_never_carries_credentials() -> None:
    assert public_url("http://admin:s3cret@10.0.0.5:8000") == "http://10.0.0.5:8000"
    assert public_url("https://k@gw.example:443") == "https://gw.example:443"
    assert public_url(GATEWAY_URL) == GATEWAY_URL
    st = gateway_state()
    assert st.farm is not None and st.farm.gateway is not None
    gw = dataclasses.replace(st.farm.gateway, url="http://admin:s3cret@10.0.0.5:8000")
    st = dataclasses.replace(st, farm=dataclasses.replace(st.farm, gateway=gw))
    text = generate_latest(_registry(st)).decode()
    assert 'sglang_farm_gateway_up{url="http://10.0.0.5:8000"} 1.0' in text
    assert "s3cret" not in text


def test_every_worker_behind_a_gateway_says_whether_it_is_routed_to() -> None:
    st = gateway_state()
    got = {
        w: _v(st, "sglang_farm_worker_in_gateway", worker=w, gpu=g)
        for w, g in (("0", "0"), ("1", "1,2"), ("2", "3"), ("3", "4"))
    }
    assert got == {"0": 1, "1": 0, "2": 0, "3": 0}


def test_the_last_drain_duration_is_exported_when_known() -> None:
    st = gateway_state()
    drain = "sglang_farm_worker_last_drain_duration_seconds"
    assert _v(st, drain, worker="0", gpu="0") == 12.5
    assert _v(st, drain, worker="3", gpu="4") == 3.25
    assert _v(st, drain, worker="1", gpu="1,2") is None  # never drained: absent, not 0


def test_a_farm_without_a_gateway_exports_no_gateway_series() -> None:
    st = state()
    assert st.farm is not None and st.farm.gateway is None
    text = generate_latest(_registry(st)).decode()
    samples = [s.name for f in text_string_to_metric_families(text) for s in f.samples]
    assert samples and not [n for n in samples if "gateway" in n]
    # ...while the same farm behind a gateway exports every one of them.
    with_gw = generate_latest(_registry(gateway_state())).decode()
    names = {f.name for f in text_string_to_metric_families(with_gw)}
    assert set(GATEWAY_FAMILIES) <= names
    # Workers' figures do not depend on the gateway: the same worker reads the same.
    w0 = {"worker": "0", "gpu": "0"}
    assert _v(st, "sglang_farm_worker_queued_requests", **w0) == 7
    assert _v(st, "sglang_farm_worker_in_gateway", **w0) is None


def test_a_quarantined_gpu_is_1_with_its_uuid_and_reason() -> None:
    st = state()
    q = "sglang_farm_gpu_quarantined"
    assert _v(st, q, gpu="5", uuid="GPU-0005", reason="xid 79") == 1
    assert _v(st, q, gpu="5", uuid="GPU-0005", reason="") is None  # one series per GPU
    assert _v(st, "sglang_farm_worker_state", worker="4", gpu="5", state="quarantined") == 1


def test_the_farms_other_gpus_are_0_with_no_reason() -> None:
    st = state()
    q = "sglang_farm_gpu_quarantined"
    got = {g: _v(st, q, gpu=g, uuid=f"GPU-000{g}", reason="") for g in ("0", "1", "2", "3")}
    assert got == {"0": 0, "1": 0, "2": 0, "3": 0}
    # A failed worker on a lost GPU is not quarantined: that is the supervisor's call.
    assert _v(st, q, gpu="3", uuid="GPU-0003", reason="gpu lost") is None


def test_a_quarantine_on_one_gpu_of_a_tensor_parallel_worker_names_that_gpu() -> None:
    st = state()
    assert st.farm is not None
    w1 = dataclasses.replace(
        st.farm.workers[1],
        phase=Phase.QUARANTINED,
        quarantine=Quarantine(gpu=2, reason="pending row remaps", detail="", since=NOW),
    )
    workers = (st.farm.workers[0], w1, *st.farm.workers[2:])
    st = dataclasses.replace(st, farm=dataclasses.replace(st.farm, workers=workers))
    q = "sglang_farm_gpu_quarantined"
    assert _v(st, q, gpu="2", uuid="GPU-0002", reason="pending row remaps") == 1
    assert _v(st, q, gpu="1", uuid="GPU-0001", reason="") == 0


def test_a_quarantined_gpu_without_a_fleet_snapshot_has_an_empty_uuid() -> None:
    st = dataclasses.replace(state(), fleet=None)
    assert _v(st, "sglang_farm_gpu_quarantined", gpu="5", uuid="", reason="xid 79") == 1


def test_quarantines_are_counted_per_worker_by_reason() -> None:
    st = state()
    total = "sglang_farm_worker_quarantines_total"
    w4 = {"worker": "4", "gpu": "5"}
    assert _v(st, total, reason="xid 79", **w4) == 1
    assert _v(st, total, reason="pending row remaps", **w4) == 1
    # Reasons are free-form ("xid N"): only those that happened have a series.
    assert _v(st, total, reason="gpu lost", **w4) is None
    assert _v(st, total, reason="xid 79", worker="0", gpu="0") is None


def test_a_released_gpu_reads_0_and_keeps_its_count() -> None:
    st = state()
    assert st.farm is not None
    released = dataclasses.replace(st.farm.workers[3], phase=Phase.STARTING, quarantine=None)
    workers = (*st.farm.workers[:3], released)
    st = dataclasses.replace(st, farm=dataclasses.replace(st.farm, workers=workers))
    assert _v(st, "sglang_farm_gpu_quarantined", gpu="5", uuid="GPU-0005", reason="") == 0
    assert _v(st, "sglang_farm_gpu_quarantined", gpu="5", uuid="GPU-0005", reason="xid 79") is None
    assert _v(st, "sglang_farm_worker_quarantines_total", worker="4", gpu="5", reason="xid 79") == 1


def test_a_worker_on_two_gpus_is_labelled_with_both() -> None:
    st = state()
    assert gpu_label((1, 2)) == "1,2"
    assert _v(st, "sglang_farm_worker_state", worker="1", gpu="1,2", state="starting") == 1


def test_restarts_and_ooms_export_every_known_reason_including_zero() -> None:
    st = state()
    w0 = {"worker": "0", "gpu": "0"}
    got = {
        r: _v(st, "sglang_farm_worker_restarts_total", reason=r, **w0)
        for r in ("crash", "hang", "oom", "manual", "config")
    }
    assert got == {"crash": 2, "hang": 0, "oom": 1, "manual": 0, "config": 0}
    kinds = {
        k: _v(st, "sglang_farm_worker_oom_events_total", kind=k, **w0)
        for k in ("cuda", "kv_cache", "cuda_graph", "host")
    }
    assert kinds == {"cuda": 1, "kv_cache": 0, "cuda_graph": 0, "host": 0}
    assert _v(st, "sglang_farm_worker_oom_ladder_step", **w0) == 1
    assert _v(st, "sglang_farm_worker_last_load_duration_seconds", **w0) == 41.5


def test_worker_figures_come_from_stats_only_while_it_serves() -> None:
    st = state()
    w0 = {"worker": "0", "gpu": "0"}
    assert _v(st, "sglang_farm_worker_up", **w0) == 1
    assert _v(st, "sglang_farm_worker_queued_requests", **w0) == 7
    assert _v(st, "sglang_farm_worker_running_requests", **w0) == 3
    assert _v(st, "sglang_farm_worker_kv_cache_usage_ratio", **w0) == 0.42
    assert _v(st, "sglang_farm_worker_generation_throughput_tokens_per_second", **w0) == 1234.5
    assert _v(st, "sglang_farm_worker_stats_stale", **w0) == 0
    # Worker 2 failed: its leftover stats are not shown as live figures.
    w2 = {"worker": "2", "gpu": "3"}
    assert _v(st, "sglang_farm_worker_up", **w2) == 0
    assert _v(st, "sglang_farm_worker_queued_requests", **w2) is None
    assert _v(st, "sglang_farm_worker_stats_stale", **w2) is None


def test_stale_stats_are_flagged_and_a_silent_worker_has_no_figures() -> None:
    base = state()
    silent = dataclasses.replace(
        base.workers[0], up=False, stale=True, running=None, queued=None, error="timeout"
    )
    st = dataclasses.replace(base, workers={0: silent})
    w0 = {"worker": "0", "gpu": "0"}
    assert _v(st, "sglang_farm_worker_up", **w0) == 0
    assert _v(st, "sglang_farm_worker_stats_stale", **w0) == 1
    assert _v(st, "sglang_farm_worker_queued_requests", **w0) is None


def test_worker_gpu_memory_is_attributed_through_its_process_tree() -> None:
    st = state()
    assert _v(st, "sglang_farm_worker_gpu_memory_bytes", worker="0", gpu="0") == 70 * GiB
    # Worker 1's tree {200} holds nothing (pid 201 is not in it).
    assert _v(st, "sglang_farm_worker_gpu_memory_bytes", worker="1", gpu="1,2") == 0
    # Worker 2 has no known process tree: absent.
    assert _v(st, "sglang_farm_worker_gpu_memory_bytes", worker="2", gpu="3") is None


def test_info_metrics_carry_model_and_version() -> None:
    st = state()
    assert (
        _v(
            st,
            "sglang_farm_worker_info",
            worker="0",
            gpu="0",
            port="30000",
            model_name="qwen3-8b",
            sglang_version="0.5.23",
        )
        == 1
    )
    # No stats yet: the model comes from the command line.
    assert (
        _v(
            st,
            "sglang_farm_worker_info",
            worker="1",
            gpu="1,2",
            port="30001",
            model_name="/m/big",
            sglang_version="",
        )
        == 1
    )
    assert _v(st, "sglang_farm_build_info", version="0.0.0-test") == 1


def test_model_from_argv_prefers_the_served_name() -> None:
    argv = ("x", "--model-path", "/m/a", "--served-model-name=alpha")
    assert model_from_argv(argv) == "alpha"
    assert model_from_argv(("x", "--model-path", "/m/a")) == "/m/a"
    assert model_from_argv(("x",)) is None


def test_agent_probe_and_snapshot_metrics() -> None:
    st = state()
    assert _v(st, "sglang_farm_snapshot_timestamp_seconds") == NOW
    assert _v(st, "sglang_farm_probe_success", source="gpu") == 1
    assert _v(st, "sglang_farm_probe_success", source="workers") == 0
    assert _v(st, "sglang_farm_probe_duration_seconds", source="workers") == 2.0
    assert _v(st, "sglang_farm_probe_last_success_timestamp_seconds", source="gpu") == NOW - 1
    assert _v(st, "sglang_farm_probe_last_success_timestamp_seconds", source="runtime") is None
    assert _v(st, "sglang_farm_rollout_state", state="done") == 1
    assert _v(st, "sglang_farm_rollout_state", state="halted") == 0
    assert _v(st, "sglang_farm_host_drained") == 0


def test_a_drained_host_says_so() -> None:
    """Issue 26: farmctl drain-host holds the host out of the gateway."""
    st = state()
    assert st.farm is not None
    st = dataclasses.replace(st, farm=dataclasses.replace(st.farm, held_out_since=NOW - 5))
    assert _v(st, "sglang_farm_host_drained") == 1


def test_a_state_file_not_saved_is_counted_and_dated() -> None:
    """Issue 30 item 5: a full state_dir shows in the metrics, not only in the log."""
    from sglang_farm.state_alerts import AlertKind, StateAlert

    st = state()
    assert st.farm is not None
    assert _v(st, "sglang_farm_state_alerts") == 0
    assert _v(st, "sglang_farm_state_save_failures_total") == 0
    alert = StateAlert("/var/lib/sglang-farm/state.json", AlertKind.NOT_SAVED, "full", NOW - 9)
    farm = dataclasses.replace(st.farm, state_alerts=(alert,), state_save_failures=3)
    st = dataclasses.replace(st, farm=farm)
    assert _v(st, "sglang_farm_state_alerts") == 1
    assert _v(st, "sglang_farm_state_save_failures_total") == 3
    assert _v(st, "sglang_farm_state_unsaved_since_timestamp_seconds", file=alert.file) == NOW - 9


def test_each_scrape_reads_the_state_reference_exactly_once() -> None:
    calls = 0
    st = state()

    def getter() -> MetricsState:
        nonlocal calls
        calls += 1
        return st

    registry = build_registry(getter)
    assert calls == 0  # registering does not collect
    generate_latest(registry)
    assert calls == 1
    generate_latest(registry)
    assert calls == 2


def test_a_swapped_state_shows_at_the_next_scrape() -> None:
    current = [state()]
    registry = build_registry(lambda: current[0])
    assert registry.get_sample_value("sglang_farm_worker_state", _ready0()) == 1
    view = farm()
    worker0 = dataclasses.replace(view.workers[0], phase=Phase.BACKOFF)
    current[0] = dataclasses.replace(
        current[0], farm=dataclasses.replace(view, workers=(worker0, *view.workers[1:]))
    )
    assert registry.get_sample_value("sglang_farm_worker_state", _ready0()) == 0


def _ready0() -> dict[str, str]:
    return {"worker": "0", "gpu": "0", "state": "ready"}


def test_every_family_is_prefixed_and_counters_end_in_total() -> None:
    text = generate_latest(_registry(canary_state())).decode()
    for fam in text_string_to_metric_families(text):
        assert fam.name.startswith("sglang_farm_"), fam.name
        for s in fam.samples:
            if fam.type == "counter":
                assert s.name.endswith("_total"), s.name


@pytest.mark.parametrize("golden", sorted(GOLDENS))
def test_exposition_matches_the_golden_file(golden: str, update_golden: bool) -> None:
    text = generate_latest(_registry(GOLDENS[golden]())).decode()
    path = GOLDEN_DIR / golden
    if update_golden:
        path.write_text(text)
    assert text == path.read_text(), "exposition changed; rerun with --update-golden and review"


@pytest.mark.parametrize("golden", sorted(GOLDENS))
def test_promtool_finds_no_problem_in_the_exposition(golden: str) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package 'prometheus'); CI installs it")
    text = generate_latest(_registry(GOLDENS[golden]()))
    r = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, timeout=30, check=False
    )
    assert r.returncode == 0, r.stdout.decode() + r.stderr.decode()
    assert r.stdout.decode().strip() == "", r.stdout.decode()


def test_a_busy_worker_is_marked_and_others_are_not() -> None:
    base = state()
    assert base.farm is not None
    workers = tuple(dataclasses.replace(w, busy=(w.id == 1)) for w in base.farm.workers)
    st = dataclasses.replace(base, farm=dataclasses.replace(base.farm, workers=workers))
    text = generate_latest(build_registry(lambda: st)).decode()
    busy = {
        line.split('worker="')[1].split('"')[0]: line.rsplit(" ", 1)[1]
        for line in text.splitlines()
        if line.startswith("sglang_farm_worker_busy{")
    }
    assert busy["1"] == "1.0" and all(v == "0.0" for k, v in busy.items() if k != "1")


# --- the canary analysis (issue 23) -------------------------------------------------


def test_the_canary_verdict_is_a_one_hot_state_set_with_its_change_and_worker() -> None:
    st = canary_state()
    states = {s: _v(st, "sglang_farm_canary_state", state=s) for s in CanaryState}
    assert states == {
        CanaryState.ANALYSING: 0,
        CanaryState.PROMOTED: 0,
        CanaryState.ROLLED_BACK: 1,
        CanaryState.HELD: 0,
    }
    assert _v(st, "sglang_farm_canary_info", change="3f9a1c2e", worker="1", gpu="1,2") == 1
    assert _v(st, "sglang_farm_canary_window_seconds") == 30
    # Decided: no window end.
    assert _v(st, "sglang_farm_canary_window_end_timestamp_seconds") is None
    assert _v(st, "sglang_farm_canary_window_extensions") == 0


def test_an_extended_window_is_counted_and_its_length_includes_the_extensions() -> None:
    st = canary_state()
    assert st.farm is not None and st.farm.canary is not None
    cv = dataclasses.replace(
        st.farm.canary,
        state=CanaryState.ANALYSING,
        window_s=60.0,
        ends_at=1e9,
        extensions=1,
        max_extensions=2,
    )
    st = dataclasses.replace(st, farm=dataclasses.replace(st.farm, canary=cv))
    assert _v(st, "sglang_farm_canary_window_extensions") == 1
    assert _v(st, "sglang_farm_canary_window_seconds") == 60
    assert _v(st, "sglang_farm_canary_state", state="analysing") == 1


def test_the_compared_figures_are_exported_per_check_and_side() -> None:
    st = canary_state()
    assert _v(st, "sglang_farm_canary_figure", check="itl_p99", side="canary") == 0.052
    assert _v(st, "sglang_farm_canary_figure", check="itl_p99", side="baseline") == 0.01
    assert _v(st, "sglang_farm_canary_check_ratio", check="itl_p99") == 5.2
    assert _v(st, "sglang_farm_canary_check_limit", check="itl_p99") == 1.4
    assert _v(st, "sglang_farm_canary_check_passed", check="itl_p99") == 0
    assert _v(st, "sglang_farm_canary_check_passed", check="itl_p50") == 1
    # Unknown is absent, never 0: TTFT's baseline, its ratio, and its (unjudged) result.
    assert _v(st, "sglang_farm_canary_figure", check="ttft_p50", side="canary") == 0.4
    assert _v(st, "sglang_farm_canary_figure", check="ttft_p50", side="baseline") is None
    assert _v(st, "sglang_farm_canary_check_ratio", check="ttft_p50") is None
    assert _v(st, "sglang_farm_canary_check_passed", check="ttft_p50") is None


def test_rollbacks_are_counted() -> None:
    assert _v(canary_state(), "sglang_farm_canary_rollbacks_total") == 2


def test_an_analysis_under_way_exports_when_its_window_ends() -> None:
    st = canary_state()
    assert st.farm is not None and st.farm.canary is not None
    cv = dataclasses.replace(
        st.farm.canary, state=CanaryState.ANALYSING, ends_at=NOW + 12, checks=()
    )
    st = dataclasses.replace(st, farm=dataclasses.replace(st.farm, canary=cv))
    assert _v(st, "sglang_farm_canary_state", state="analysing") == 1
    assert _v(st, "sglang_farm_canary_window_end_timestamp_seconds") == NOW + 12


def test_a_farm_that_judged_no_change_exports_only_its_rollbacks_counter_at_0() -> None:
    """From the agent's start (review item 10): a canary that fails within one scrape
    interval of its start must show as a step 0 -> 1, or `increase()` never sees it."""
    for st in (state(), gateway_state()):
        assert _v(st, "sglang_farm_canary_rollbacks_total") == 0
        text = generate_latest(_registry(st)).decode()
        samples = [line for line in text.splitlines() if line.startswith("sglang_farm_canary_")]
        assert samples == ["sglang_farm_canary_rollbacks_total 0.0"]
