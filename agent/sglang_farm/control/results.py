"""Pure: the results of control commands, built from the agent's views.

Each function turns what the agent reports (`FarmView`, `WorkerView`,
`GpuMemory`, `ReloadResult`) into the JSON-ready object a reply carries in
`result` (or, for `phase_payload`, in a stream message). Key names and their
order are part of protocol version 1: docs/control-protocol.md lists them, and
removing or renaming one bumps `codec.PROTOCOL_VERSION`; a new key goes after
the existing ones and keeps the version. No I/O, no clock: times are passed in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from sglang_farm.canary.view import CanaryState, CheckView, RolloutVerdictView
from sglang_farm.control.codec import PROTOCOL_VERSION
from sglang_farm.control.farm_api import GpuMemory, HostDrainResult, ReloadResult
from sglang_farm.farm_view import (
    FarmView,
    GatewayStatus,
    Phase,
    Quarantine,
    StartView,
    WorkerView,
)
from sglang_farm.gpus import xid
from sglang_farm.staging.state import StageState, StagingView
from sglang_farm.workers.load import RecentAnswers

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


def _xid_code(reason: str) -> int | None:
    """The XID code of a quarantine reason such as "xid 79"; None for NVML's reasons."""
    kind, _, code = reason.partition(" ")
    return int(code) if kind == "xid" and code.isdigit() else None


def release_command(w: WorkerView) -> str:
    """The farmctl command that ends `w`'s quarantine: by GPU when the quarantine names a
    GPU the worker uses, else by worker (a reload moved the worker to another GPU; the
    GPUs checked are then the ones it will run on)."""
    q = w.quarantine
    if q is not None and q.gpu in w.gpus:
        return f"farmctl release-gpu {q.gpu}"
    return f"farmctl release-gpu --worker {w.id}"


def quarantined_refusal(w: WorkerView, cmd: str) -> str:
    """`start`/`restart` of a quarantined worker, refused: what holds it and the way out."""
    q = w.quarantine
    what = f"GPU {q.gpu} is set aside ({q.reason})" if q is not None else "its GPU is set aside"
    return (
        f"worker {w.id} is quarantined: {what}, and {cmd} leaves it stopped; deal with the "
        f"GPU (farmctl why {w.id} says how), then release it with {release_command(w)}, "
        "which re-checks the GPU through NVML and starts the worker"
    )


def quarantine_next_step(q: Quarantine, worker: WorkerView | None = None) -> str:
    """What the operator does to bring a quarantined GPU back, for `why`.

    A reboot-class XID (NVIDIA's catalog: a GPU reset does not recover it, xid.py) asks
    for a reboot; everything else (a reset-class XID, a GPU lost or unhealthy, row remaps
    pending, which a reset applies) for a GPU reset, or a reboot where the reset fails.
    The release is `release_command` (by GPU, or by worker once a reload moved it).
    """
    g = q.gpu
    release = release_command(worker) if worker is not None else f"farmctl release-gpu {g}"
    then = (
        f"then `{release}`, which re-checks the GPU through NVML (healthy, no "
        "row remaps pending, memory free, no compute process) before it starts the worker "
        "again"
    )
    code = _xid_code(q.reason)
    if code is not None and xid.classify(code).xid_class is xid.XidClass.REBOOT:
        return (
            f"reboot the node (NVIDIA's catalog says a GPU reset does not recover XID {code}; "
            f"if it comes back after the reboot, contact your support organization), {then}"
        )
    return (
        f"reset the GPU with `nvidia-smi -r -i {g}` when no process holds it (or reboot), "
        f"{then}; `nvidia-smi --query-compute-apps=pid --format=csv -i {g}` lists the "
        "processes that hold it"
    )


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
    }


def staging_note(w: WorkerView, s: StagingView | None) -> str | None:
    """Why a stopped worker has not started: the rollout waits on (or was stopped by) the
    model stage. None when the stage is not what holds it."""
    if s is None or w.phase is not Phase.STOPPED or not s.blocks_rollout:
        return None
    if s.state is StageState.FAILED:
        return (
            f"not started: the model could not be staged into {s.target}: {s.error}. "
            f"What to do: {s.fix}. No worker starts until a stage succeeds "
            "(`farmctl start all` or a reload stages again)"
        )
    return (
        f"waiting for the model to be staged into {s.target} (from {s.source}); the "
        "rollout begins once it is in place"
    )


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


def state_note(
    w: WorkerView, gateway: GatewayStatus | None, *, held_out: bool = False
) -> str | None:
    """What the worker's state means now, where the state name alone does not say; else None.

    Built only from the view: a quarantined worker's `quarantine` is what set its GPU
    aside (also while the stop it caused is under way), a draining worker's `since` is
    when its drain began, and `in_gateway` is what the gateway last confirmed.
    """
    q = w.quarantine
    if q is not None:
        detail = q.detail.rstrip(". ")
        what = f"GPU {q.gpu} is quarantined ({q.reason})" + (f": {detail}" if detail else "")
        if w.phase is Phase.QUARANTINED:
            done = "The farm stopped the worker"
        else:  # decided, the stop under way
            done = f"The farm is stopping the worker (now {w.phase})"
        return (
            f"{what}. {done} and does not start it again (farmctl start and restart leave it "
            f"stopped) until the GPU is released; the farm's other GPUs are not affected"
        )
    if w.phase is Phase.DRAINING:
        # As drain.watch_drain goes: out of the gateway (or the gateway down, routing
        # nothing) first, then the worker's own running + queued count.
        if not w.in_gateway:
            where = "it is out of the gateway; the farm waits"
        elif gateway is not None and not gateway.up:
            where = "the gateway is not answering (it routes nothing); the farm waits"
        else:
            where = "the farm is taking it out of the gateway (not confirmed yet), then waits"
        return (
            f"draining before a planned stop: {where} for its running and queued requests "
            "to finish, at most the drain budget ([gateway] drain_timeout), then stops it "
            "(and starts it again if this is a restart)"
        )
    if w.phase is Phase.READY and gateway is not None and held_out:
        # Issue 26: farmctl drain-host.
        return (
            "ready, and held out of the gateway with every worker of this host (farmctl "
            "drain-host): it serves no user until farmctl undrain-host"
        )
    if w.phase is Phase.READY and gateway is not None and not w.in_gateway:
        if not gateway.up:
            return (
                f"ready, but not in the gateway: the gateway at {gateway.url} is not answering"
                + (f" ({gateway.last_error})" if gateway.last_error else "")
                + "; the farm retries and adds it when the gateway is back"
            )
        return "ready, but not in the gateway yet: the farm is adding it"
    over = dict(gateway.overloaded) if gateway is not None else {}
    if w.phase is Phase.READY and w.in_gateway and w.id in over:
        # Issue 34 §3: smg lists it ready (so it is in), but routes it nothing new.
        return (
            "ready and in the gateway, but the gateway routes it no new request while it is "
            f"overloaded ({over[w.id]}; smg's overload protection, [gateway] overload_*): its "
            "queue drains into its running slots, and a drain of it waits for that queue"
        )
    return None


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
    return {"worker": w.id, "state": str(w.phase), "since": w.since, "elapsed_s": round(elapsed, 3)}


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


def describe_ids(ids: Sequence[int]) -> str:
    """`[0,1,2,3,5]` → "0-3, 5": for messages such as "no worker 9; workers are 0-7"."""
    if not ids:
        return "none"
    s = sorted(ids)
    parts: list[str] = []
    start = prev = s[0]
    for i in [*s[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ", ".join(parts)


# ---- settled (farmctl wait, issue 26) ----------------------------------------------------

# What holds a farm that will not settle by itself, in the order `farmctl wait` names
# them (its exit code is the first one's: docs/control-protocol.md).
FAILURE_KINDS = (
    "stage_failed",
    "rollout_halted",
    "canary_rolled_back",
    "canary_held",
    "host_drained",
    "worker_failed",
    "worker_quarantined",
)
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
                    "stage_failed",
                    f"the model could not be staged into {sg.target}: {sg.error}; what to "
                    f"do: {sg.fix}; then farmctl start all",
                )
            )
        else:
            waiting.append(_item("staging", f"the model is being staged into {sg.target}"))
    if view.rollout == "halted":
        failures.append(
            _item(
                "rollout_halted",
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
            kind = "canary_rolled_back" if cv.state is CanaryState.ROLLED_BACK else "canary_held"
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
                "host_drained",
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
        if w.phase is Phase.QUARANTINED or (
            w.quarantine is not None and w.phase is not Phase.READY
        ):
            q = w.quarantine
            what = f"GPU {q.gpu} is quarantined ({q.reason})" if q is not None else "quarantined"
            failures.append(
                _item(
                    "worker_quarantined",
                    f"worker {w.id}: {what}; farmctl why {w.id}, then {release_command(w)}",
                    w.id,
                )
            )
        elif w.phase is Phase.FAILED:
            why = w.last_failure.summary if w.last_failure else "gave up"
            failures.append(
                _item(
                    "worker_failed",
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
