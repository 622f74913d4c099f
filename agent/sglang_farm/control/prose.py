"""Pure: the sentences the control socket's results carry about a worker.

What its state means now where the state name alone does not say (`state_note`,
`staging_note`), what holds a quarantined worker and the way out (`quarantine_next_step`,
`quarantined_refusal`, the one `release_command`), and a list of workers for a message
(`describe_ids`). Built only from the views; `control.results` puts them in `why`, the
handlers in their refusals, `control.settled` in what holds the farm.
"""

from __future__ import annotations

from collections.abc import Sequence

from sglang_farm.control import release
from sglang_farm.farm_view import GatewayStatus, Phase, Quarantine, WorkerView
from sglang_farm.gpus import xid
from sglang_farm.staging.state import StageState, StagingView


def _xid_code(reason: str) -> int | None:
    """The XID code of a quarantine reason such as "xid 79"; None for NVML's reasons."""
    kind, _, code = reason.partition(" ")
    return int(code) if kind == "xid" and code.isdigit() else None


def release_command(w: WorkerView) -> str:
    """The farmctl command that ends `w`'s quarantine: by GPU when the quarantine names a
    GPU the worker uses, else by worker (a reload moved the worker to another GPU; the
    GPUs checked are then the ones it will run on)."""
    return release.release_command(w.id, w.quarantine.gpu if w.quarantine else None, w.gpus)


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
