"""Results of control commands, built from hand-made views (pure; control/results.py);
when a wait is over is tests/test_control_settled.py's."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from farm_views import _view, _worker
from sglang_farm.canary.view import CanaryState, CheckView, RolloutVerdictView
from sglang_farm.control import codec, prose, results
from sglang_farm.control.farm_api import GpuMemory, ReloadResult
from sglang_farm.farm_view import (
    FarmView,
    GatewayStatus,
    Phase,
    Quarantine,
    WorkerView,
)
from sglang_farm.workers.supervisor import Rollout


def test_status_result_carries_protocol_version_workers_and_gpus() -> None:
    st = results.status_result(_view(), [GpuMemory(0, 1, 2)], version="9.9", now=300.0)
    json.dumps(st)  # JSON-ready
    assert st["protocol_version"] == codec.PROTOCOL_VERSION == 1
    assert (st["agent_version"], st["farm"], st["rollout"], st["ready"]) == (
        "9.9",
        "f",
        "halted",
        1,
    )
    workers = st["workers"]
    assert isinstance(workers, list)
    w1 = workers[1]
    assert w1["state"] == "failed" and w1["gpus"] == [1, 2] and w1["restarts_total"] == 3
    assert w1["restarts"] == [{"at": 150.0, "reason": "oom"}, {"at": 190.0, "reason": "crash"}]
    assert w1["last_failure"]["kind"] == "cuda_oom_load" and w1["oom_step"] == 2
    assert st["gpus"] == [{"index": 0, "used_bytes": 1, "total_bytes": 2, "simulated": False}]


def test_status_result_keys_keep_their_wire_order() -> None:
    # Key order is visible on the wire (and to anyone diffing replies): it is pinned.
    st = results.status_result(_view(), [], version="9.9", now=300.0)
    assert list(st) == [
        "protocol_version",
        "agent_version",
        "farm",
        "runtime",
        "config_source",
        "config_sha256",
        "config_file_sha256",
        "config_pending",
        "started_at",
        "now",
        "rollout",
        "rollout_reason",
        "ready",
        "ready_workers",
        "workers",
        "gpus",
        "gateway",
    ]
    assert list(results.worker_result(_view().worker(0))) == [
        "id",
        "gpus",
        "port",
        "base_url",
        "state",
        "since",
        "pid",
        "restarts",
        "restarts_total",
        "restarts_by_reason",
        "oom_events_by_kind",
        "last_failure",
        "last_failure_at",
        "last_action",
        "oom_step",
        "oom_step_name",
        "last_load_seconds",
        "in_gateway",
        "last_drain_seconds",
        "quarantine",
        "quarantines_by_reason",
        "start",
        "failure_past",
        "release",
        "has_process",
        "failure_shown",
    ]


def test_why_endpoints_reload_results() -> None:
    v = _view()
    why = results.why_result(v.worker(1))
    assert (
        why["advice"] == "lower mem fraction" and why["last_action"] == "gave up after 5 failures"
    )
    last_failure = why["last_failure"]
    assert isinstance(last_failure, dict)
    assert last_failure["lines"] == ["l1", "l2"]
    assert results.why_result(v.worker(0))["last_failure"] is None
    assert results.endpoints_result(v) == {
        "endpoints": [{"worker": 0, "base_url": "http://127.0.0.1:30000"}],
        "gateway": None,
    }
    rr = results.reload_result(ReloadResult(False, problems=("workers[1].gpu: bad",)))
    assert rr == {
        "applied": False,
        "problems": ["workers[1].gpu: bad"],
        "restarted": [],
        "added": [],
        "removed": [],
    }


def test_wait_result_is_ready_only_when_settled_on_ready() -> None:
    v = _view()
    ready = results.wait_result(v.worker(0), None, settled=True, elapsed=1.23456)
    assert (ready["ready"], ready["timed_out"], ready["waited_s"]) == (True, False, 1.235)
    assert ready["id"] == 0 and ready["pid"] == 11
    failed = results.wait_result(v.worker(1), None, settled=True, elapsed=2.0)
    assert (failed["ready"], failed["timed_out"]) == (False, False)
    # Ready, but entered before the client's `after`: not settled, so the wait timed out.
    stale = results.wait_result(v.worker(0), None, settled=False, elapsed=5.0)
    assert (stale["ready"], stale["timed_out"]) == (False, True)


def test_phase_payload_and_command_results() -> None:
    w = _view().worker(1)
    assert results.phase_payload(w, 0.12345) == {
        "worker": 1,
        "state": "failed",
        "since": 200.0,
        "elapsed_s": 0.123,
        "ends_wait": True,
    }
    assert results.change_result((2, 3), 99.5) == {"workers": [2, 3], "issued_at": 99.5}
    assert results.logs_result(1, ("a", "b")) == {"worker": 1, "lines": ["a", "b"]}
    assert results.logs_ended_result(1) == {"worker": 1, "ended": True}
    assert results.line_payload("x") == {"line": "x"}
    assert results.reset_oom_result(4) == {"worker": 4, "oom_step": 0}
    assert results.version_result("9.9") == {"protocol_version": 1, "agent_version": "9.9"}


@pytest.mark.parametrize(
    ("ids", "text"), [([], "none"), ([3], "3"), ([0, 1, 2, 3, 5], "0-3, 5"), ([7, 1, 2], "1-2, 7")]
)
def test_describe_ids(ids: list[int], text: str) -> None:
    assert prose.describe_ids(ids) == text


def test_status_result_carries_queue_depth_only_where_it_is_known() -> None:
    st = results.status_result(_view(), [], version="9.9", now=300.0, queues={0: 7.0})
    workers = st["workers"]
    assert isinstance(workers, list)
    assert workers[0]["queue_depth"] == 7.0
    assert all("queue_depth" not in w for w in workers[1:])


GW = GatewayStatus("http://127.0.0.1:8000", up=True, members=1, errors=0)


def _gateway_view(gateway: GatewayStatus | None, *workers: WorkerView) -> FarmView:
    return FarmView("f", "process", workers, "/etc/x.toml", 50.0, Rollout.DONE, gateway=gateway)


def test_status_without_a_gateway_says_null_and_workers_are_out() -> None:
    st = results.status_result(_view(), [], version="9.9", now=300.0)
    assert st["gateway"] is None
    workers = st["workers"]
    assert isinstance(workers, list)
    assert [(w["in_gateway"], w["last_drain_seconds"]) for w in workers] == [
        (False, None),
        (False, None),
    ]


def test_status_carries_the_gateway_and_each_workers_membership_and_drain() -> None:
    gw = GatewayStatus(
        "http://gw:8000",
        up=False,
        members=1,
        errors=4,
        last_error="refused",
        foreign=("http://10.0.0.9:30000",),
    )
    v = _gateway_view(
        gw,
        _worker(Phase.READY, in_gateway=True, last_drain=2.5),
        replace(_worker(Phase.DRAINING, in_gateway=False), id=4),
    )
    st = results.status_result(v, [], version="9.9", now=300.0)
    json.dumps(st)  # JSON-ready
    assert st["gateway"] == {
        "url": "http://gw:8000",
        "up": False,
        "members": 1,
        "errors": 4,
        "last_error": "refused",
        "foreign": ["http://10.0.0.9:30000"],
        "overloaded": [],
    }
    workers = st["workers"]
    assert isinstance(workers, list)
    assert [(w["state"], w["in_gateway"], w["last_drain_seconds"]) for w in workers] == [
        ("ready", True, 2.5),
        ("draining", False, None),
    ]


def test_endpoints_carry_the_gateway_url_besides_the_ready_workers() -> None:
    v = _gateway_view(GW, _worker(Phase.READY, in_gateway=True))
    assert results.endpoints_result(v) == {
        "endpoints": [{"worker": 3, "base_url": "http://127.0.0.1:30003"}],
        "gateway": "http://127.0.0.1:8000",
    }


def test_why_of_a_draining_worker_out_of_the_gateway_says_it_waits_for_its_requests() -> None:
    why = results.why_result(_worker(Phase.DRAINING, in_gateway=False), GW)
    assert (why["state"], why["since"], why["in_gateway"]) == ("draining", 250.0, False)
    assert why["state_note"] == (
        "draining before a planned stop: it is out of the gateway; the farm waits for its "
        "running and queued requests to finish, at most the drain budget "
        "([gateway] drain_timeout), then stops it (and starts it again if this is a restart)"
    )
    # New keys come after the old ones (protocol version 1): the order is pinned.
    assert list(why) == [
        "worker",
        "state",
        "since",
        "last_failure",
        "last_failure_at",
        "last_action",
        "advice",
        "oom_step",
        "oom_step_name",
        "restarts_by_reason",
        "in_gateway",
        "state_note",
        "quarantine",
        "quarantines_by_reason",
        "next_step",
        "start",
        "failure_past",
        "gpus",  # issue 34 §5: what `numa_nodes` is in the order of
        "state_timed",
    ]


def test_why_of_a_draining_worker_still_listed_says_it_is_being_taken_out() -> None:
    note = results.why_result(_worker(Phase.DRAINING, in_gateway=True), GW)["state_note"]
    assert isinstance(note, str)
    assert note.startswith(
        "draining before a planned stop: the farm is taking it out of the gateway "
        "(not confirmed yet), then waits for its running and queued requests"
    )
    # A gateway that does not answer routes nothing: the wait for requests has begun.
    down = replace(GW, up=False, last_error="connection refused")
    note = results.why_result(_worker(Phase.DRAINING, in_gateway=True), down)["state_note"]
    assert isinstance(note, str)
    assert note.startswith(
        "draining before a planned stop: the gateway is not answering (it routes nothing); "
        "the farm waits for its running and queued requests"
    )


def test_why_of_a_ready_worker_out_of_the_gateway_says_why() -> None:
    w = _worker(Phase.READY, in_gateway=False)
    assert results.why_result(w, GW)["state_note"] == (
        "ready, but not in the gateway yet: the farm is adding it"
    )
    down = replace(GW, up=False, last_error="connection refused")
    assert results.why_result(w, down)["state_note"] == (
        "ready, but not in the gateway: the gateway at http://127.0.0.1:8000 is not answering "
        "(connection refused); the farm retries and adds it when the gateway is back"
    )
    # No note where the state says it all: in the gateway, or no gateway at all.
    assert results.why_result(_worker(Phase.READY, in_gateway=True), GW)["state_note"] is None
    assert results.why_result(w)["state_note"] is None
    assert results.why_result(_worker(Phase.STOPPED, in_gateway=False), GW)["state_note"] is None


def test_why_of_a_ready_worker_the_gateway_passes_over_for_overload_says_so() -> None:
    """Issue 34 §3: in the gateway (smg lists it ready), yet routed nothing new while its
    queue is over smg's threshold: `why` says so, and what it means for a drain."""
    reason = "13 requests waiting (overload_waiting_requests 8)"
    gw = replace(GW, overloaded=((3, reason),))
    note = results.why_result(_worker(Phase.READY, in_gateway=True), gw)["state_note"]
    assert note == (
        f"ready and in the gateway, but the gateway routes it no new request while it is "
        f"overloaded ({reason}; smg's overload protection, [gateway] overload_*): its "
        "queue drains into its running slots, and a drain of it waits for that queue"
    )
    assert results.why_result(_worker(Phase.READY, in_gateway=True), GW)["state_note"] is None


# --- quarantine ---------------------------------------------------------------------------

XID_79 = Quarantine(
    5,
    "xid 79",
    "GPU has fallen off the bus; NVIDIA's action: RESTART_BM: Restart bare metal, "
    "system should be restarted.",
    1000.0,
)


def _quarantined(q: Quarantine = XID_79, phase: Phase = Phase.QUARANTINED) -> WorkerView:
    return WorkerView(
        5,
        (q.gpu,),  # the GPU its quarantine names (release_command: by GPU)
        30005,
        "http://127.0.0.1:30005",
        phase,
        1001.0,
        None,
        last_action=f"GPU {q.gpu} quarantined ({q.reason}); not restarted until released",
        quarantine=q,
        quarantines_by_reason={q.reason: 1, "gpu lost": 2},
    )


def test_status_carries_each_workers_quarantine_and_its_count_by_reason() -> None:
    v = FarmView(
        "f", "process", (_view().worker(0), _quarantined()), "/etc/x.toml", 50.0, Rollout.DONE
    )
    st = results.status_result(v, [], version="9.9", now=1100.0)
    json.dumps(st)  # JSON-ready
    workers = st["workers"]
    assert isinstance(workers, list)
    assert (workers[0]["quarantine"], workers[0]["quarantines_by_reason"]) == (None, {})
    assert workers[1]["state"] == "quarantined"
    assert workers[1]["quarantine"] == {
        "gpu": 5,
        "reason": "xid 79",
        "detail": XID_79.detail,
        "since": 1000.0,
    }
    assert workers[1]["quarantines_by_reason"] == {"xid 79": 1, "gpu lost": 2}
    assert st["ready"] == 1  # a quarantined worker serves nothing


def test_why_of_a_quarantined_worker_gives_the_reason_and_the_next_step() -> None:
    why = results.why_result(_quarantined())
    json.dumps(why)
    assert list(why)[-8:-4] == ["state_note", "quarantine", "quarantines_by_reason", "next_step"]
    assert why["state"] == "quarantined"
    assert why["quarantine"] == results.quarantine_result(XID_79)
    assert why["state_note"] == (
        "GPU 5 is quarantined (xid 79): GPU has fallen off the bus; NVIDIA's action: "
        "RESTART_BM: Restart bare metal, system should be restarted. The farm stopped the "
        "worker and does not start it again (farmctl start and restart leave it stopped) "
        "until the GPU is released; the farm's other GPUs are not affected"
    )
    # XID 79 is RESTART_BM in NVIDIA's catalog: a reset does not recover it.
    step = why["next_step"]
    assert isinstance(step, str)
    assert step.startswith("reboot the node (NVIDIA's catalog says a GPU reset does not recover")
    assert step.endswith(
        "then `farmctl release-gpu 5`, which re-checks the GPU through NVML (healthy, no row "
        "remaps pending, memory free, no compute process) before it starts the worker again"
    )
    assert "nvidia-smi -r" not in step


@pytest.mark.parametrize(
    ("reason", "detail"),
    [
        ("xid 48", "Double Bit ECC Error; NVIDIA's action: WORKFLOW_XID_48"),
        ("xid 999", "not in the farm's copy of NVIDIA's XID catalog"),
        ("gpu lost", "GPU is lost"),
        ("gpu unhealthy", "Unknown Error"),
        ("pending row remaps", "row remaps pending"),
    ],
)
def test_why_asks_for_a_gpu_reset_for_reset_class_and_nvml_reasons(
    reason: str, detail: str
) -> None:
    why = results.why_result(_quarantined(Quarantine(3, reason, detail, 1000.0)))
    step = why["next_step"]
    assert isinstance(step, str)
    assert step.startswith(
        "reset the GPU with `nvidia-smi -r -i 3` when no process holds it (or reboot), "
        "then `farmctl release-gpu 3`"
    )
    assert "nvidia-smi --query-compute-apps=pid --format=csv -i 3" in step
    note = why["state_note"]
    assert isinstance(note, str) and note.startswith(f"GPU 3 is quarantined ({reason}): {detail}. ")


def test_why_of_a_worker_being_stopped_for_a_quarantine_says_so() -> None:
    why = results.why_result(_quarantined(phase=Phase.STOPPING))
    note = why["state_note"]
    assert isinstance(note, str)
    assert "The farm is stopping the worker (now stopping) and does not start it again" in note
    assert why["next_step"] is not None


def test_why_without_a_quarantine_has_null_quarantine_and_next_step() -> None:
    why = results.why_result(_view().worker(1))
    assert (why["quarantine"], why["quarantines_by_reason"], why["next_step"]) == (None, {}, None)


def test_release_gpu_result_is_released_only_without_problems() -> None:
    assert results.release_gpu_result(5, [5], []) == {
        "released": True,
        "gpu": 5,
        "workers": [5],
        "problems": [],
    }
    refused = results.release_gpu_result(5, (5,), ("GPU 5 has row remaps pending",))
    assert refused == {
        "released": False,
        "gpu": 5,
        "workers": [5],
        "problems": ["GPU 5 has row remaps pending"],
    }


def test_the_way_out_of_a_quarantine_is_by_worker_once_its_gpu_is_not_the_workers() -> None:
    """Issue 22 item 7: a reload moved worker 5 off GPU 5 (its quarantine's): `release-gpu 5`
    cannot reach it, so `why` and a refused start name the release by worker."""
    moved = replace(_quarantined(), gpus=(6,))
    assert prose.release_command(_quarantined()) == "farmctl release-gpu 5"
    assert prose.release_command(moved) == "farmctl release-gpu --worker 5"
    step = results.why_result(moved)["next_step"]
    assert isinstance(step, str) and "then `farmctl release-gpu --worker 5`, which" in step
    assert prose.quarantined_refusal(moved, "start") == (
        "worker 5 is quarantined: GPU 5 is set aside (xid 79), and start leaves it stopped; "
        "deal with the GPU (farmctl why 5 says how), then release it with farmctl "
        "release-gpu --worker 5, which re-checks the GPU through NVML and starts the worker"
    )
    no_record = replace(_quarantined(), quarantine=None)
    assert "its GPU is set aside" in prose.quarantined_refusal(no_record, "restart")
    assert prose.release_command(no_record) == "farmctl release-gpu --worker 5"


def test_release_by_worker_result_adds_the_worker_and_the_gpus_checked() -> None:
    assert results.release_gpu_result(2, [2], [], worker=2, checked=(5,)) == {
        "released": True,
        "gpu": 2,
        "workers": [2],
        "problems": [],
        "worker": 2,
        "checked": [5],
    }


def test_wait_result_says_whether_the_gateway_routes_the_ready_worker() -> None:
    w = replace(_view().worker(0), phase=Phase.READY, since=100.0, in_gateway=False)
    up = GatewayStatus(url="http://gw:8000", up=True, members=3, errors=0)
    out = results.wait_result(w, replace(up, up=False), settled=True, elapsed=1.0)
    assert (out["ready"], out["routed"], out["gateway_up"]) == (True, False, False)
    assert results.wait_result(w, None, settled=True, elapsed=1.0)["routed"] is None


# --- the canary analysis (issue 23) ------------------------------------------------


def _canary(**kw: object) -> RolloutVerdictView:
    base = RolloutVerdictView(
        state=CanaryState.ROLLED_BACK,
        change="3f9a1c2e",
        canary=1,
        started_at=400.0,
        window_s=30.0,
        ends_at=None,
        evidence="rolled back: canary ITL p99 0.052 s = 5.2x the baseline's over 30 s, "
        "412 vs 2,830 requests",
        checks=(
            CheckView("itl_p99", 0.052, 0.01, 5.2, 1.4, False),
            CheckView("ttft_p50", math.inf, None, math.nan, 3.0, None),
        ),
        rollbacks_total=2,
    )
    return replace(base, **kw)  # type: ignore[arg-type]  # test-only keyword overrides


def test_status_carries_the_canary_last_and_it_round_trips_through_the_wire() -> None:
    v = replace(_view(), canary=_canary())
    st = results.status_result(v, [], version="9.9", now=500.0)
    assert list(st)[-1] == "canary"
    reply = codec.decode_reply(codec.encode_ok(7, st))
    assert isinstance(reply.result, dict)
    assert reply.result["canary"] == {
        "state": "rolled_back",
        "change": "3f9a1c2e",
        "canary": 1,
        "started_at": 400.0,
        "window_s": 30.0,
        "ends_at": None,
        "evidence": _canary().evidence,
        "checks": [
            {
                "name": "itl_p99",
                "canary": 0.052,
                "baseline": 0.01,
                "ratio": 5.2,
                "limit": 1.4,
                "passed": False,
            },
            # inf and NaN are not JSON (the wire refuses them): they travel as null.
            {
                "name": "ttft_p50",
                "canary": None,
                "baseline": None,
                "ratio": None,
                "limit": 3.0,
                "passed": None,
            },
        ],
        "rollbacks_total": 2,
        "extensions": 0,
        "max_extensions": 0,
    }


def test_status_without_a_canary_has_no_canary_key() -> None:
    assert "canary" not in results.status_result(_view(), [], version="9.9", now=1.0)


def test_why_carries_the_canary_only_for_the_canary_worker() -> None:
    v = replace(_view(), canary=_canary(state=CanaryState.ANALYSING, ends_at=430.0))
    why1 = results.why_result(v.worker(1), canary=v.canary)
    assert isinstance(why1["canary"], dict)
    assert why1["canary"]["state"] == "analysing" and why1["canary"]["ends_at"] == 430.0
    assert "canary" not in results.why_result(v.worker(0), canary=v.canary)


def test_reload_result_names_the_canary_the_other_restarts_wait_on() -> None:
    rr = results.reload_result(ReloadResult(True, restarted=(0, 1, 2), gated_on=0))
    assert rr["restarted"] == [0, 1, 2] and rr["gated_on"] == 0
    assert "gated_on" not in results.reload_result(ReloadResult(True, restarted=(0, 1)))


def test_reload_result_carries_when_the_agent_took_it() -> None:
    rr = results.reload_result(ReloadResult(True, restarted=(1,)), 123.5)
    assert list(rr) == ["applied", "problems", "restarted", "added", "removed", "issued_at"]
    assert rr["issued_at"] == 123.5


def test_a_reload_held_for_a_rejected_change_says_so_apart_from_its_problems() -> None:
    why = "change 3f9a1c2e was rejected by its canary at 2026-12-01 18:00:00 UTC: ..."
    rr = results.reload_result(ReloadResult(False, problems=(why,), held=why), 1.0)
    assert rr["held"] == why and rr["problems"] == [why] and rr["applied"] is False
    assert "held" not in results.reload_result(ReloadResult(True), 1.0)


def test_status_says_whether_the_config_file_on_disk_is_the_one_in_force() -> None:
    """Fleet review #2: a refused reload leaves a file on disk that is not in force; an
    orchestrator re-running must see it (`config_pending`) and reload again."""
    view = replace(_view(), config_sha256="a" * 64)
    st = results.status_result(view, [], version="9", now=1.0, config_file_sha256="a" * 64)
    assert (st["config_sha256"], st["config_file_sha256"], st["config_pending"]) == (
        "a" * 64,
        "a" * 64,
        False,
    )
    st = results.status_result(view, [], version="9", now=1.0, config_file_sha256="b" * 64)
    assert st["config_pending"] is True
    # The file gone or unreadable: not the one in force (a reload says why).
    st = results.status_result(view, [], version="9", now=1.0, config_file_sha256=None)
    assert st["config_file_sha256"] is None and st["config_pending"] is True
    # An agent started without a file (tests, embedders): nothing to compare.
    st = results.status_result(_view(), [], version="9", now=1.0, config_file_sha256=None)
    assert st["config_sha256"] is None and st["config_pending"] is False
