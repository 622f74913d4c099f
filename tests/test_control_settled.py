"""`settled` (farmctl wait, issue 26 item 1): when the farm is settled, what it waits for,
and what holds it; and when one worker's `wait-ready` is over; pure, from hand-made views
(control/settled.py)."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest

from farmtoml import sim_farm, toml_text
from sglang_farm.canary.view import CanaryState, RolloutVerdictView
from sglang_farm.control.settled import (
    GATEWAY_JOIN_GRACE_S,
    routed_or_never,
    settled_result,
    worker_settled,
)
from sglang_farm.control.wire import FAILURE_KINDS
from sglang_farm.farm_view import FarmView, GatewayStatus, Phase, Quarantine, WorkerView
from sglang_farm.sglang.failures import Failure, FailureKind
from sglang_farm.staging.state import StageState, StagingView
from sglang_farm.workers.phase import StopIntent

GW = GatewayStatus("http://gw:8000", True, 2, 0)


def worker(wid: int, phase: Phase = Phase.READY, **kw: object) -> WorkerView:
    kw.setdefault("in_gateway", phase is Phase.READY)
    w = WorkerView(wid, (wid,), 30000 + wid, f"http://127.0.0.1:{30000 + wid}", phase, 1.0, None)
    return replace(w, **kw)  # type: ignore[arg-type]


def farm(*workers: WorkerView, **kw: object) -> FarmView:
    kw.setdefault("gateway", GW)
    return replace(FarmView("f", "process", workers, "/x.toml", 0.0, "done"), **kw)  # type: ignore[arg-type]


def kinds(r: dict[str, object], key: str) -> list[tuple[object, object]]:
    items = r[key]
    assert isinstance(items, list)
    return [(i["kind"], i["worker"]) for i in items]


def test_every_ready_worker_in_the_gateway_is_settled() -> None:
    r = settled_result(farm(worker(0), worker(1)))
    assert r["settled"] is True and r["state"] == "settled"
    assert (r["should_serve"], r["serving"], r["failures"], r["waiting"]) == (2, 2, [], [])


def test_without_a_gateway_ready_is_enough() -> None:
    r = settled_result(farm(worker(0, in_gateway=False), gateway=None))
    assert r["settled"] is True and r["serving"] == 1


def test_a_worker_an_operator_stopped_does_not_count() -> None:
    r = settled_result(farm(worker(0), worker(1, Phase.STOPPED)))
    assert r["settled"] is True and (r["should_serve"], r["serving"]) == (1, 1)


@pytest.mark.parametrize(
    "phase",
    [Phase.PENDING, Phase.STARTING, Phase.BACKOFF, Phase.UNHEALTHY, Phase.DRAINING, Phase.STOPPING],
)
def test_a_worker_on_its_way_is_waited_for(phase: Phase) -> None:
    r = settled_result(farm(worker(0), worker(1, phase)))
    assert r["state"] == "waiting" and kinds(r, "waiting") == [("worker", 1)]


def test_a_ready_worker_not_yet_in_the_gateway_is_waited_for_and_a_gateway_down_said_once() -> None:
    r = settled_result(farm(worker(0), worker(1, in_gateway=False)))
    assert r["state"] == "waiting" and kinds(r, "waiting") == [("gateway_join", 1)]
    down = replace(GW, up=False)
    r = settled_result(farm(worker(0, in_gateway=False), worker(1, in_gateway=False), gateway=down))
    assert kinds(r, "waiting") == [("gateway_down", None)] and r["serving"] == 0


@pytest.mark.parametrize("rollout", ["idle", "canary", "rolling"])
def test_a_rollout_under_way_or_not_begun_is_waited_for(rollout: str) -> None:
    r = settled_result(farm(worker(0), rollout=rollout))
    assert r["state"] == "waiting" and kinds(r, "waiting") == [("rollout", None)]


def test_a_rolling_restart_under_way_is_waited_for() -> None:
    r = settled_result(farm(worker(0), worker(1), rolling=1))
    assert kinds(r, "waiting") == [("rolling_restart", None)]


def test_a_failed_or_quarantined_worker_holds_the_farm_and_says_the_way_out() -> None:
    oom = Failure(FailureKind.CUDA_OOM_LOAD, "OOM while loading", "lower it")
    q = Quarantine(1, "xid 79", "fell off the bus", 5.0)
    r = settled_result(
        farm(
            worker(0, Phase.FAILED, last_failure=oom),
            worker(1, Phase.QUARANTINED, quarantine=q),
            # stopping for its GPU
            worker(
                2, Phase.STOPPING, quarantine=replace(q, gpu=2), stop_intent=StopIntent.QUARANTINE
            ),
            worker(3, Phase.STARTING),
        )
    )
    assert r["state"] == "failed" and r["settled"] is False
    assert kinds(r, "failures") == [
        ("worker_failed", 0),
        ("worker_quarantined", 1),
        ("worker_quarantined", 2),
    ]
    assert kinds(r, "waiting") == [("worker", 3)]
    failures = r["failures"]
    assert isinstance(failures, list)
    assert (
        "OOM while loading" in failures[0]["message"] and "farmctl why 0" in failures[0]["message"]
    )
    assert "farmctl release-gpu 1" in failures[1]["message"]


def test_a_halted_rollout_is_a_failure_with_its_reason() -> None:
    r = settled_result(
        farm(
            worker(0, Phase.FAILED),
            worker(1, Phase.STOPPED),
            rollout="halted",
            rollout_reason="canary worker 0 failed: bad flag",
        )
    )
    assert kinds(r, "failures") == [("rollout_halted", None), ("worker_failed", 0)]
    failures = r["failures"]
    assert isinstance(failures, list) and "bad flag" in failures[0]["message"]


def _canary(state: CanaryState) -> RolloutVerdictView:
    return RolloutVerdictView(state, "ab12", 1, 10.0, 30.0, None, f"{state}: ITL 5x")


def test_the_canary_analysing_is_waited_for_promoted_is_settled() -> None:
    r = settled_result(farm(worker(0), worker(1), canary=_canary(CanaryState.ANALYSING)))
    assert kinds(r, "waiting") == [("canary_analysing", 1)]
    r = settled_result(farm(worker(0), worker(1), canary=_canary(CanaryState.PROMOTED)))
    assert r["settled"] is True


@pytest.mark.parametrize(
    ("state", "kind"),
    [(CanaryState.ROLLED_BACK, "canary_rolled_back"), (CanaryState.HELD, "canary_held")],
)
def test_a_canary_rolled_back_or_held_holds_the_farm(state: CanaryState, kind: str) -> None:
    r = settled_result(farm(worker(0), worker(1), canary=_canary(state)))
    assert r["state"] == "failed" and kinds(r, "failures") == [(kind, 1)]


def test_a_host_held_out_of_the_gateway_is_not_settled_and_its_workers_are_not_waited_for() -> None:
    r = settled_result(
        farm(worker(0, in_gateway=False), worker(1, in_gateway=False), held_out_since=5.0)
    )
    assert kinds(r, "failures") == [("host_drained", None)] and r["waiting"] == []
    assert r["serving"] == 0
    failures = r["failures"]
    assert isinstance(failures, list) and "farmctl undrain-host" in failures[0]["message"]


def test_a_failed_stage_holds_the_farm_one_under_way_is_waited_for() -> None:
    sv = StagingView(
        "/src", "/models/m", StageState.FAILED, 1.0, error="disk full", fix="free space"
    )
    stopped = (worker(0, Phase.STOPPED), worker(1, Phase.STOPPED))
    r = settled_result(farm(*stopped, rollout="idle", staging=sv))
    assert kinds(r, "failures") == [("stage_failed", None)] and r["waiting"] == []
    under_way = replace(sv, state=StageState.STAGING, error=None, fix=None)
    r = settled_result(farm(*stopped, rollout="idle", staging=under_way))
    assert kinds(r, "waiting") == [("staging", None), ("rollout", None)]


def test_failures_come_in_the_documented_order() -> None:
    r = settled_result(
        farm(
            worker(0, Phase.FAILED),
            worker(1, in_gateway=False),
            rollout="halted",
            held_out_since=3.0,
            canary=_canary(CanaryState.HELD),
        )
    )
    got = [k for k, _ in kinds(r, "failures")]
    assert got == ["rollout_halted", "canary_held", "host_drained", "worker_failed"]
    assert got == sorted(got, key=FAILURE_KINDS.index)


# --- several gateways ([gateway] urls): settled means in EVERY one (issue 26 review) -----

A, B = "http://gw-a:8000", "http://gw-b:8000"


def _two(a: GatewayStatus, b: GatewayStatus) -> GatewayStatus:
    """The fleet's summary of two gateways (workers.gateway_fleet.GatewayFleet.status)."""
    return GatewayStatus(A, a.up or b.up, 2, 0, None, gateways=(a, b))


def test_a_gateway_that_does_not_answer_keeps_the_farm_from_settling_and_is_named() -> None:
    a = GatewayStatus(A, True, 2, 0, routed=(0, 1))
    b = GatewayStatus(B, False, 2, 3, "cannot reach it", routed=(0, 1))
    r = settled_result(farm(worker(0), worker(1), gateway=_two(a, b)))
    assert r["state"] == "waiting" and kinds(r, "waiting") == [("gateway_down", None)]
    waiting = r["waiting"]
    assert isinstance(waiting, list)
    assert waiting[0]["message"] == f"the gateway at {B} is not answering (cannot reach it)"
    r = settled_result(farm(worker(0), worker(1), gateway=_two(a, replace(b, up=True))))
    assert r["settled"] is True and r["serving"] == 2


def test_a_worker_one_gateway_does_not_route_is_waited_for_by_name() -> None:
    a = GatewayStatus(A, True, 2, 0, routed=(0, 1))
    b = GatewayStatus(B, True, 1, 0, routed=(0,))
    # Its combined word may say "in" for a moment (the fleet's rule runs on each change):
    # what each gateway confirmed is what counts.
    r = settled_result(farm(worker(0), worker(1), gateway=_two(a, b)))
    assert r["state"] == "waiting" and kinds(r, "waiting") == [("gateway_join", 1)]
    waiting = r["waiting"]
    assert isinstance(waiting, list)
    assert waiting[0]["message"] == f"worker 1 is ready; the gateway at {B} does not route it"
    assert r["serving"] == 1


# --- one worker's wait-ready ------------------------------------------------------------


def test_a_ready_worker_waits_for_the_gateway_unless_it_is_down_or_the_grace_ran_out() -> None:
    w = worker(0, since=100.0, in_gateway=False)
    assert routed_or_never(w, None, 101.0)  # no gateway: ready is the end
    assert not routed_or_never(w, GW, 101.0)  # the farm is adding it
    assert routed_or_never(replace(w, in_gateway=True), GW, 101.0)
    assert routed_or_never(w, replace(GW, up=False), 101.0)  # down: say so, end
    assert routed_or_never(w, GW, 100.0 + GATEWAY_JOIN_GRACE_S)


def test_a_worker_wait_ends_on_ready_or_failed_since_the_request_and_on_quarantined() -> None:
    ready = worker(0, since=100.0)
    assert worker_settled(ready, farm(ready), after=100.0, now=101.0)
    # A ready phase from before the request (the restart not yet begun) is not its end.
    assert not worker_settled(ready, farm(ready), after=100.5, now=101.0)
    failed = worker(0, Phase.FAILED, since=100.0)
    assert worker_settled(failed, farm(failed), after=100.0, now=101.0)
    assert not worker_settled(failed, farm(failed), after=100.5, now=101.0)
    quarantined = worker(0, Phase.QUARANTINED, since=50.0)  # whenever entered
    assert worker_settled(quarantined, farm(quarantined), after=100.0, now=101.0)
    starting = worker(0, Phase.STARTING, since=100.0)
    assert not worker_settled(starting, farm(starting), after=100.0, now=101.0)


def test_a_ready_worker_out_of_the_gateway_ends_its_wait_only_once_routed_or_held_out() -> None:
    out = worker(0, since=100.0, in_gateway=False)
    assert not worker_settled(out, farm(out), after=100.0, now=101.0)  # being added
    held = farm(out, held_out_since=99.0)  # drain-host: it stays out, the wait is over
    assert worker_settled(out, held, after=100.0, now=101.0)
    assert worker_settled(out, farm(out), after=100.0, now=100.0 + GATEWAY_JOIN_GRACE_S)


def test_set_aside_is_the_supervisors_rule_as_the_view_publishes_it() -> None:
    """Issue 32 §2: one rule of "set aside" (`phase_sets.set_aside`), read by the control
    socket's handlers (a start or restart skips such a worker) and by `farmctl wait`
    through `WorkerView.set_aside`, which the view builds from the supervisor's state: a
    worker stopping for its GPU is set aside already, one stopping for a restart is not."""
    from sglang_farm.config import load_spec
    from sglang_farm.farm_view import Rollout, build_view
    from sglang_farm.workers.supervisor import WorkerState

    spec = load_spec(toml_text(sim_farm(4, sys.executable)), source="t.toml")
    states = {
        0: WorkerState(0, Phase.STOPPING, stop_intent=StopIntent.QUARANTINE),
        1: WorkerState(1, Phase.STOPPING, stop_intent=StopIntent.RESTART),
        2: WorkerState(2, Phase.QUARANTINED),
        3: WorkerState(3, Phase.READY),
    }
    view = build_view(
        spec,
        states,
        runtime="process",
        rollout=Rollout.DONE,
        rollout_reason=None,
        started_at=0.0,
        mono_to_wall=0.0,
        argv={},
    )
    assert [w.set_aside for w in view.workers] == [True, False, True, False]
