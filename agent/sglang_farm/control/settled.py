"""Pure: the rules of when a wait is over, from the view: `farmctl wait`'s settled farm
(`settled`, issue 26) and one worker's `wait-ready` (`worker_settled`).

Settled: every worker that should serve is ready and routed by every gateway, and no
stage, rollout, canary analysis, rolling restart, drain or stop is under way; else what
the farm waits for, and what holds it that will not change by itself (`wire.FAILURE_KINDS`).
A worker's wait is over once it is ready (and routed, or never soon to be), failed, or
quarantined. The shapes of the replies are `control.results`'.
"""

from __future__ import annotations

from sglang_farm.canary.view import CanaryState
from sglang_farm.control import wire
from sglang_farm.control.prose import release_command
from sglang_farm.control.results import Result
from sglang_farm.control.wire import FAILURE_KINDS
from sglang_farm.farm_view import FarmView, GatewayStatus, Phase, WorkerView
from sglang_farm.staging.state import StageState

# Phases a worker passes through on its way to serving (or out of it): the farm is busy.
_UNDER_WAY = frozenset(
    {
        Phase.PENDING,
        Phase.STARTING,
        Phase.BACKOFF,
        Phase.UNHEALTHY,
        Phase.DRAINING,
        Phase.STOPPING,
    }
)


def _item(kind: str, message: str, worker: int | None = None) -> Result:
    return {"kind": kind, "worker": worker, "message": message}


def _not_routing(gateways: tuple[GatewayStatus, ...], w: WorkerView) -> list[str]:
    """The URLs of the answering gateways that say they do not route to worker `w` (those
    that list what they route: several gateways, `GatewayStatus.routed`)."""
    return [g.url for g in gateways if g.up and g.routed is not None and w.id not in g.routed]


def settled_result(view: FarmView) -> Result:
    """`settled` (what `farmctl wait` polls): whether the farm is settled, and if not,
    what it waits for and what holds it.

    Settled: every worker that should serve is ready, and with a gateway the gateway
    routes to it; no model stage, rollout, canary analysis, rolling restart, drain or stop
    is under way. A worker "should serve" unless an operator stopped it (STOPPED); a
    quarantined worker should (its GPU is set aside: the host is not whole), and so does a
    failed one. `failures` are what will not change by itself (a failed or quarantined
    worker, a halted rollout, a failed stage, a canary rolled back or held, the host held
    out of the gateway by drain-host), in `FAILURE_KINDS` order; `waiting` what is still
    under way. `state`: "failed" when there is a failure, else "waiting" or "settled".
    """
    failures: list[Result] = []
    waiting: list[Result] = []
    sg = view.staging
    if sg is not None and sg.blocks_rollout:
        if sg.state is StageState.FAILED:
            failures.append(
                _item(
                    wire.STAGE_FAILED,
                    f"the model could not be staged into {sg.target}: {sg.error}; what to "
                    f"do: {sg.fix}; then farmctl start all",
                )
            )
        else:
            waiting.append(_item("staging", f"the model is being staged into {sg.target}"))
    if view.rollout == "halted":
        failures.append(
            _item(
                wire.ROLLOUT_HALTED,
                f"the rollout is halted ({view.rollout_reason or 'the canary failed'}); "
                "fix the cause (farmctl why on the canary) and farmctl start all",
            )
        )
    elif view.rollout != "done" and not failures:
        what = "has not begun" if view.rollout == "idle" else f"is under way ({view.rollout})"
        waiting.append(_item("rollout", f"the rollout {what}"))
    cv = view.canary
    if cv is not None and cv.state is not CanaryState.PROMOTED:
        where = f"change {cv.change} on canary worker {cv.canary}"
        if cv.state is CanaryState.ANALYSING:
            waiting.append(_item("canary_analysing", f"{where} is being analysed", cv.canary))
        else:
            kind = (
                wire.CANARY_ROLLED_BACK if cv.state is CanaryState.ROLLED_BACK else wire.CANARY_HELD
            )
            failures.append(
                _item(
                    kind,
                    f"{where} was {str(cv.state).replace('_', ' ')}: {cv.evidence}; "
                    f"farmctl why {cv.canary}; the next reload of a changed config is judged "
                    "again",
                    cv.canary,
                )
            )
    if view.rolling:
        waiting.append(_item("rolling_restart", "a rolling restart is under way"))
    if view.held_out_since is not None:
        failures.append(
            _item(
                wire.HOST_DRAINED,
                "the host is held out of the gateway (farmctl drain-host); its workers "
                "serve no user until farmctl undrain-host",
            )
        )
    gw = view.gateway
    # Issue 26: in EVERY gateway ([gateway] urls), each one's own word: a gateway that
    # does not answer keeps the farm from settling (an orchestrator waits; the farm's own
    # waves and stops go on without it), one that does not route a worker names it.
    each = gw.each if gw is not None else ()
    for g in each:
        if not g.up:
            why = f" ({g.last_error})" if g.last_error else ""
            waiting.append(_item("gateway_down", f"the gateway at {g.url} is not answering{why}"))
    for w in view.workers:
        if w.set_aside:
            q = w.quarantine
            what = f"GPU {q.gpu} is quarantined ({q.reason})" if q is not None else "quarantined"
            failures.append(
                _item(
                    wire.WORKER_QUARANTINED,
                    f"worker {w.id}: {what}; farmctl why {w.id}, then {release_command(w)}",
                    w.id,
                )
            )
        elif w.phase is Phase.FAILED:
            why = w.last_failure.summary if w.last_failure else "gave up"
            failures.append(
                _item(
                    wire.WORKER_FAILED,
                    f"worker {w.id} failed: {why}; farmctl why {w.id}, then farmctl start {w.id}",
                    w.id,
                )
            )
        elif w.phase in _UNDER_WAY:
            waiting.append(_item("worker", f"worker {w.id} is {w.phase}", w.id))
        elif w.phase is Phase.READY and gw is not None and view.held_out_since is None:
            missing = _not_routing(each, w)
            if missing:
                item = _item(
                    "gateway_join",
                    f"worker {w.id} is ready; the gateway at {', '.join(missing)} "
                    "does not route it",
                    w.id,
                )
                # Issue 31: the fact, so that farmctl says one line for all such workers.
                item["not_routed_by"] = missing
                waiting.append(item)
            elif not w.in_gateway and all(g.up for g in each):
                item = _item(
                    "gateway_join", f"worker {w.id} is ready, not yet in the gateway", w.id
                )
                item["not_routed_by"] = []  # no gateway said so: not yet confirmed in
                waiting.append(item)
    failures.sort(key=lambda f: FAILURE_KINDS.index(str(f["kind"])))
    should = [w for w in view.workers if w.phase is not Phase.STOPPED]
    state = "failed" if failures else "waiting" if waiting else "settled"
    return {
        "settled": state == "settled",
        "state": state,
        "should_serve": len(should),
        "serving": sum(
            1
            for w in should
            if w.ready
            and (gw is None or (w.in_gateway and not _not_routing(each, w)))
            and view.held_out_since is None
        ),
        "failures": failures,
        "waiting": waiting,
    }


# How long `wait-ready` waits, once a worker is ready, for the gateway to route to it (the
# farm adds it within a reconcile or two); past that it ends and says the worker is out.
GATEWAY_JOIN_GRACE_S = 30.0


def routed_or_never(w: WorkerView, gateway: GatewayStatus | None, now: float) -> bool:
    """Whether a ready worker's wait is over as far as the gateway goes: no gateway, the
    gateway routes to it, the gateway is down (it will not join soon), or it has been ready
    for `GATEWAY_JOIN_GRACE_S` without joining (the final reply says it is out)."""
    return (
        gateway is None or w.in_gateway or not gateway.up or now - w.since >= GATEWAY_JOIN_GRACE_S
    )


def worker_settled(w: WorkerView, view: FarmView, *, after: float, now: float) -> bool:
    """Whether `wait-ready`'s wait for `w` is over: it failed or became ready at or after
    `after` (the client's request: a ready phase from before a restart is not its end;
    ready counts once `routed_or_never`, or while the host is held out of the gateway),
    or it is quarantined (whenever: start and restart leave it so)."""
    return (
        (w.phase is Phase.FAILED and w.since >= after)
        or w.phase is Phase.QUARANTINED
        or (
            w.phase is Phase.READY
            and w.since >= after
            and (
                routed_or_never(w, view.gateway, now)
                # issue 26: a drained host's workers stay out of the gateway
                or view.held_out_since is not None
            )
        )
    )
