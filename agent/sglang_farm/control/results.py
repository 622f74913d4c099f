"""Pure: the results of control commands, built from the agent's views.

Each function turns what the agent reports (`FarmView`, `WorkerView`,
`GpuMemory`, `ReloadResult`) into the JSON-ready object a reply carries in
`result` (or, for `phase_payload`, in a stream message). Key names and their
order are part of protocol version 1: docs/control-protocol.md lists them, and
removing or renaming one bumps `codec.PROTOCOL_VERSION`; a new key goes after
the existing ones and keeps the version. No I/O, no clock: times are passed in. The
sentences they carry are `control.prose`'s; when a wait is over (a settled farm, a worker's
`wait-ready`) is `control.settled`'s rule: these are only the shapes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from sglang_farm.canary.view import CheckView, RolloutVerdictView
from sglang_farm.control import facts
from sglang_farm.control.codec import PROTOCOL_VERSION
from sglang_farm.control.farm_api import GpuMemory, HostDrainResult, ReloadResult
from sglang_farm.control.prose import (
    quarantine_next_step,
    release_command,
    staging_note,
    state_note,
)
from sglang_farm.farm_view import (
    FarmView,
    GatewayStatus,
    Phase,
    Quarantine,
    StartView,
    WorkerView,
)
from sglang_farm.sglang.load import RecentAnswers
from sglang_farm.staging.state import StageState, StagingView

Result = dict[str, object]


def worker_result(w: WorkerView) -> Result:
    """One worker as `status` lists it (and as `wait-ready` ends with)."""
    by_reason = {str(k): int(v) for k, v in w.restarts_by_reason.items()}
    return {
        "id": w.id,
        "gpus": list(w.gpus),
        "port": w.port,
        "base_url": w.base_url,
        "state": str(w.phase),
        "since": w.since,
        "pid": w.pid,
        "restarts": [{"at": r.at, "reason": r.reason} for r in w.restarts],
        "restarts_total": sum(by_reason.values()),
        "restarts_by_reason": by_reason,
        "oom_events_by_kind": {str(k): int(v) for k, v in w.oom_events_by_kind.items()},
        "last_failure": w.last_failure.to_dict() if w.last_failure else None,
        "last_failure_at": w.last_failure_at,
        "last_action": w.last_action,
        "oom_step": w.oom_step,
        "oom_step_name": w.oom_step_name,
        "last_load_seconds": w.last_load_seconds,
        "in_gateway": w.in_gateway,
        "last_drain_seconds": w.last_drain_seconds,
        "quarantine": quarantine_result(w.quarantine),
        "quarantines_by_reason": {str(k): int(v) for k, v in w.quarantines_by_reason.items()},
        "start": start_result(w.start),
        "failure_past": w.failure_past,  # issue 31: "served" / "reset" since the failure
        # Issue 32: the command that ends its quarantine (null when none), said by farmctl.
        "release": release_command(w) if w.quarantine is not None else None,
        # Facts farmctl renders instead of judging state names (control.facts).
        "has_process": facts.has_process(str(w.phase)),
        "failure_shown": facts.failure_shown(str(w.phase), w.last_failure, w.failure_past),
    }


def start_result(s: StartView | None) -> Result | None:
    """A worker's latest start (issue 34 §4): the phase it is in (`served` once over) since
    when, each ended phase's seconds, the capacity SGLang chose, and the phases well slower
    than its siblings' (`slow`, the `worker_start_slow` log line's); None when not seen."""
    if s is None:
        return None
    cap = s.capacity
    return {
        "phase": str(s.phase),
        "phase_since": s.phase_since,
        "in_progress": s.in_progress,
        "durations": dict(s.durations),
        "capacity": None
        if cap is None
        else {
            "kv_tokens": cap.kv_tokens,
            "max_running_requests": cap.max_running_requests,
            "context_len": cap.context_len,
        },
        "slow": [
            {
                "phase": str(p.phase),
                "seconds": p.seconds,
                "siblings_median": p.siblings_median,
                "siblings": p.siblings,
                "text": p.text(),
            }
            for p in s.slow
        ],
    }


def quarantine_result(q: Quarantine | None) -> Result | None:
    """A worker's quarantine as `status` and `why` carry it; None when its GPU is in service."""
    if q is None:
        return None
    return {"gpu": q.gpu, "reason": q.reason, "detail": q.detail, "since": q.since}


def gateway_result(g: GatewayStatus | None) -> Result | None:
    """The farm's gateway as `status` reports it; None when the farm has none."""
    if g is None:
        return None
    return {
        "url": g.url,
        "up": g.up,
        "members": g.members,
        "errors": g.errors,
        "last_error": g.last_error,
        "foreign": list(g.foreign),
        "overloaded": [{"worker": w, "reason": r} for w, r in g.overloaded],
    }


_QUEUE_PHASES = frozenset({Phase.READY, Phase.UNHEALTHY, Phase.DRAINING})


def staging_result(s: StagingView | None) -> Result | None:
    """The model stage ([model]): under way (bytes, rate, time left) or the last one."""
    if s is None:
        return None
    return {
        "source": s.source,
        "target": s.target,
        "state": str(s.state),
        "since": s.since,
        "step": s.step,
        "bytes_done": s.bytes_done,
        "bytes_total": s.bytes_total,
        "rate_bytes_per_s": s.rate,
        "eta_s": s.eta_s,
        "error": s.error,
        "error_kind": s.error_kind,
        "fix": s.fix,
        "last_copied_bytes": s.last_copied_bytes,
        "last_duration_s": s.last_duration_s,
        "failed": s.state is StageState.FAILED,  # the fact farmctl renders (control.facts)
    }


def _finite(x: float | None) -> float | None:
    """A figure for the wire: JSON has no inf or NaN (the wire refuses them), so a figure
    that is not finite travels as null, like one not known."""
    return x if x is not None and math.isfinite(x) else None


def check_result(c: CheckView) -> Result:
    """One compared figure of a canary verdict (`RolloutVerdictView.checks`)."""
    return {
        "name": c.name,
        "canary": _finite(c.canary),
        "baseline": _finite(c.baseline),
        "ratio": _finite(c.ratio),
        "limit": _finite(c.limit),
        "passed": c.passed,
    }


def canary_result(c: RolloutVerdictView | None) -> Result | None:
    """The canary analysis of the latest rolling change (docs/canary.md): its state, the
    change's short hash, the canary worker, the window (wall clock), the one-line
    evidence, every figure compared, and the rollbacks counted since the agent started.
    None when the farm has not judged a change since it started."""
    if c is None:
        return None
    return {
        "state": str(c.state),
        "change": c.change,
        "canary": c.canary,
        "started_at": c.started_at,
        "window_s": c.window_s,
        "ends_at": c.ends_at,
        "evidence": c.evidence,
        "checks": [check_result(k) for k in c.checks],
        "rollbacks_total": c.rollbacks_total,
        "extensions": c.extensions,
        "max_extensions": c.max_extensions,
    }


def _with_queue(result: Result, queued: float | None) -> Result:
    if queued is not None:
        result["queue_depth"] = queued
    return result


def answers_result(r: RecentAnswers) -> Result:
    """A worker's recent answers from SGLang's own counter (issue 34 §2): over `seconds`
    (its oldest poll of the window to its newest), the 2xx and 5xx answers on its serving
    routes, the 5xx of them, and their ratio (null when it answered nothing)."""
    return {
        "seconds": r.seconds,
        "answered": r.answered,
        "server_errors": r.server_errors,
        "ratio": r.ratio,
    }


def worker_numa_nodes(w: WorkerView, gpu_nodes: Mapping[int, int]) -> list[int] | None:
    """The NUMA node of each of the worker's GPUs, in its GPU order (issue 34 §5); None
    when one of them is not known (`gpu_nodes` is empty on a host of one node)."""
    nodes = [gpu_nodes[g] for g in w.gpus if g in gpu_nodes]
    return nodes if w.gpus and len(nodes) == len(w.gpus) else None


def _with_readings(
    result: Result, answers: RecentAnswers | None, numa_nodes: list[int] | None
) -> Result:
    if answers is not None:
        result["recent_5xx"] = answers_result(answers)
    if numa_nodes is not None:
        result["numa_nodes"] = numa_nodes
    return result


def status_result(
    view: FarmView,
    gpus: Sequence[GpuMemory],
    *,
    version: str,
    now: float,
    queues: Mapping[int, float] | None = None,
    config_file_sha256: str | None = None,
    answers: Mapping[int, RecentAnswers] | None = None,
    gpu_nodes: Mapping[int, int] | None = None,
) -> Result:
    """`status`: the farm, every worker (with `queue_depth` where known; `recent_5xx`,
    its answers and 5xx over its recent polls, where its SGLang counts them; `numa_nodes`,
    its GPUs' NUMA nodes, on a host of several nodes where known), VRAM per GPU,
    the gateway (null without one; with several, their sum and `gateways`, each
    one's own), with a [model] its stage (`staging`), once a
    change has been judged its canary analysis (`canary`), and while the host is held
    out of the gateway (`farmctl drain-host`) since when (`held_out_since`, last).
    `config_file_sha256`: the digest of the config file on disk now (the caller reads
    it; None: unreadable), compared with the one in force (`config_pending`)."""
    result: Result = {
        "protocol_version": PROTOCOL_VERSION,
        "agent_version": version,
        "farm": view.name,
        "runtime": view.runtime,
        "config_source": view.config_source,
        # Fleet review #2: the config in force, the file on disk now (null: unreadable),
        # and whether they differ (a refused reload, an edit not reloaded yet).
        "config_sha256": view.config_sha256,
        "config_file_sha256": config_file_sha256,
        "config_pending": view.config_sha256 is not None
        and config_file_sha256 != view.config_sha256,
        "started_at": view.started_at,
        "now": now,
        "rollout": view.rollout,
        "rollout_reason": view.rollout_reason,
        "ready": view.ready_count,
        # Issue 31: which, so that the header names the others (and, with a gateway, the
        # ready ones it does not route: each worker's `in_gateway`).
        "ready_workers": [w.id for w in view.workers if w.ready],
        # A queue depth only for a worker that serves now: the pollers' last figure for a
        # worker that stopped since is stale.
        "workers": [
            _with_readings(
                _with_queue(
                    worker_result(w),
                    (queues or {}).get(w.id) if w.phase in _QUEUE_PHASES else None,
                ),
                (answers or {}).get(w.id) if w.phase in _QUEUE_PHASES else None,
                worker_numa_nodes(w, gpu_nodes or {}),
            )
            for w in view.workers
        ],
        "gpus": [
            {
                "index": g.index,
                "used_bytes": g.used_bytes,
                "total_bytes": g.total_bytes,
                "simulated": g.simulated,
            }
            for g in gpus
        ],
        "gateway": gateway_result(view.gateway),
    }
    if view.gateway is not None and view.gateway.gateways:
        # Issue 26, [gateway] urls: each gateway's own; `gateway` then sums them up.
        result["gateways"] = [gateway_result(g) for g in view.gateway.gateways]
    if view.staging is not None:
        result["staging"] = staging_result(view.staging)
    if view.canary is not None:
        result["canary"] = canary_result(view.canary)
    if view.held_out_since is not None:
        # Issue 26: only while farmctl drain-host holds the host out of the gateway.
        result["held_out_since"] = view.held_out_since
    if view.state_alerts:
        # Issue 30: only while a state file is not saved, or was damaged or refused.
        result["state_alerts"] = [
            {
                "file": a.file,
                "kind": str(a.kind),
                "error": a.error,
                "since": a.since,
                "kept": a.kept,
                "then": a.then,
                "message": a.line(),
            }
            for a in view.state_alerts
        ]
    return result


def version_result(version: str) -> Result:
    return {"protocol_version": PROTOCOL_VERSION, "agent_version": version}


def why_result(
    w: WorkerView,
    gateway: GatewayStatus | None = None,
    staging: StagingView | None = None,
    canary: RolloutVerdictView | None = None,
    *,
    held_out: bool = False,
    answers: RecentAnswers | None = None,
    gpu_nodes: Mapping[int, int] | None = None,
) -> Result:
    """`why`: the worker's last failure with its advice, what the agent did about it
    (`failure_past`: set when that failure is its past: "served" since, or "reset" by
    the operator since), what its state means now (`state_note`: quarantined, draining,
    or ready but out of the gateway), for a quarantined GPU the quarantine and the
    operator's `next_step`, and for the canary of the latest change its verdict with the
    evidence and the checks (`canary`; only on that worker), and, as `status` has them,
    `gpus`, and `recent_5xx` and `numa_nodes` (each only where known)."""
    f = w.last_failure
    q = w.quarantine
    result: Result = {
        "worker": w.id,
        "state": str(w.phase),
        "since": w.since,
        "last_failure": f.to_dict() if f else None,
        "last_failure_at": w.last_failure_at,
        "last_action": w.last_action,
        "advice": f.advice if f else None,
        "oom_step": w.oom_step,
        "oom_step_name": w.oom_step_name,
        "restarts_by_reason": {str(k): int(v) for k, v in w.restarts_by_reason.items()},
        "in_gateway": w.in_gateway,
        "state_note": staging_note(w, staging) or state_note(w, gateway, held_out=held_out),
        "quarantine": quarantine_result(q),
        "quarantines_by_reason": {str(k): int(v) for k, v in w.quarantines_by_reason.items()},
        "next_step": quarantine_next_step(q, w) if q is not None else None,
        "start": start_result(w.start),  # issue 34 §4
        "failure_past": w.failure_past,
    }
    if staging_note(w, staging):
        # The stage that holds this worker (a failed one: its error and fix).
        result["staging"] = staging_result(staging)
    if canary is not None and canary.canary == w.id:
        result["canary"] = canary_result(canary)
    result["gpus"] = list(w.gpus)  # what `numa_nodes` is in the order of
    result["state_timed"] = facts.state_timed(str(w.phase))  # farmctl says for how long
    serving = w.phase in _QUEUE_PHASES
    return _with_readings(
        result, answers if serving else None, worker_numa_nodes(w, gpu_nodes or {})
    )


def endpoints_result(view: FarmView) -> Result:
    """`endpoints`: the base URL of every ready worker (what a router balances over),
    and the gateway's URL (the one URL for users; null without a gateway; with several,
    the first, and `gateways` lists them all). While the host is held out of the gateway
    (farmctl drain-host) no worker is listed, and `held_out_since` says since when (issue
    31: a router fed this list sent users to a host drained for its reboot)."""
    held = view.held_out_since is not None
    result: Result = {
        "endpoints": [
            {"worker": w.id, "base_url": w.base_url} for w in view.workers if w.ready and not held
        ],
        "gateway": view.gateway.url if view.gateway is not None else None,
    }
    if held:
        result["held_out_since"] = view.held_out_since
    if view.gateway is not None and view.gateway.gateways:
        result["gateways"] = [g.url for g in view.gateway.gateways]
    return result


def logs_result(worker: int, lines: Sequence[str]) -> Result:
    """`logs` without `follow`: the tail."""
    return {"worker": worker, "lines": list(lines)}


def logs_ended_result(worker: int) -> Result:
    """`logs` with `follow`: the final reply once the log source has ended."""
    return {"worker": worker, "ended": True}


def line_payload(line: str) -> Result:
    """A `logs` stream message's body."""
    return {"line": line}


def phase_payload(w: WorkerView, elapsed: float) -> Result:
    """A `wait-ready` progress message's body."""
    return {
        "worker": w.id,
        "state": str(w.phase),
        "since": w.since,
        "elapsed_s": round(elapsed, 3),
        "ends_wait": facts.ends_wait(str(w.phase)),  # the final reply reports this phase
    }


def wait_result(
    w: WorkerView, gateway: GatewayStatus | None, *, settled: bool, elapsed: float
) -> Result:
    """`wait-ready`'s final reply: the worker, whether it is ready, whether time ran out,
    and with a gateway whether it routes to the worker (`routed`; null without one).

    `settled` says the worker reached ready or failed after the client's `after`, or is
    quarantined; when it did not, the wait timed out.
    """
    result = worker_result(w)
    result["ready"] = w.phase is Phase.READY and settled
    result["timed_out"] = not settled
    result["waited_s"] = round(elapsed, 3)
    result["routed"] = None if gateway is None else w.in_gateway
    result["gateway_up"] = None if gateway is None else gateway.up
    return result


def change_result(ids: Sequence[int], issued_at: float, quarantined: Sequence[int] = ()) -> Result:
    """`start`/`stop`/`restart`: the workers acted on and when (for `wait-ready after=`);
    after `start`/`restart all`, `quarantined` (only when there are some): the workers left
    as they are, since only a release starts them."""
    result: Result = {"workers": list(ids), "issued_at": issued_at}
    if quarantined:
        result["quarantined"] = list(quarantined)
    return result


def reset_oom_result(worker: int) -> Result:
    return {"worker": worker, "oom_step": 0}


def release_gpu_result(
    gpu: int | None,
    workers: Sequence[int],
    problems: Sequence[str],
    *,
    worker: int | None = None,
    checked: Sequence[int] = (),
) -> Result:
    """`release-gpu`: released when the agent found no problem; `workers` are those that
    were quarantined on the GPU (started again, or still set aside when refused).

    By worker (`worker` set), two keys follow: `worker`, and `checked`, the GPUs the
    worker uses now (those the agent re-checks); `gpu` is then the GPU its quarantine
    names (null when none)."""
    result: Result = {
        "released": not problems,
        "gpu": gpu,
        "workers": list(workers),
        "problems": list(problems),
    }
    if worker is not None:
        result["worker"] = worker
        result["checked"] = list(checked)
    return result


def reload_result(r: ReloadResult, issued_at: float | None = None) -> Result:
    """`reload`: applied or not (the problems), the workers restarted, added and removed;
    `issued_at` (when given: the agent's wall clock before it read the config) lets
    `farmctl reload` tell the canary analysis of this reload from an earlier one (its
    `started_at` is later); `held` (only when set): the config was not applied because
    its change was rejected by a canary before, and why; `gated_on` (only when set): the
    canary restarted alone now, the other `restarted` workers following only if its
    analysis passes."""
    result: Result = {
        "applied": r.applied,
        "problems": list(r.problems),
        "restarted": list(r.restarted),
        "added": list(r.added),
        "removed": list(r.removed),
    }
    if issued_at is not None:
        result["issued_at"] = issued_at
    if r.held is not None:
        result["held"] = r.held
    if r.restart_needed:
        result["restart_needed"] = True
    if r.gated_on is not None:
        result["gated_on"] = r.gated_on
    return result


def drain_host_result(r: HostDrainResult) -> Result:
    """`drain-host`: the workers held out, those drained, those still running requests
    when the wait ran out (`left`: worker id as a string -> running + queued, null when
    unknown), `drained_all`, and how long the agent waited."""
    return {
        "workers": list(r.workers),
        "drained": list(r.drained),
        "left": {str(w): n for w, n in r.left.items()},
        "drained_all": not r.left and not r.unconfirmed,
        "waited_s": round(r.waited_s, 3),
        # Issue 30: gateway URL -> the workers it never confirmed out (it does not answer).
        "unconfirmed": {u: list(ws) for u, ws in r.unconfirmed.items()},
    }


def undrain_host_result(ids: Sequence[int]) -> Result:
    """`undrain-host`: the workers let back into the gateway (as each is ready)."""
    return {"workers": list(ids)}
