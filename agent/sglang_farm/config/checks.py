"""Pure: the second pass, cross-field rules over the resolved workers and the sections.

One worker per GPU, distinct ports (HTTP, NCCL, metrics, the gateway), the canary is a
worker, SGLang's model path, the OOM ladder adjusts configured numbers, `[model]`
stages into one model path; and the warning for workers open to the network.
"""

from __future__ import annotations

from collections.abc import Mapping

from sglang_farm.config.lines import _Path
from sglang_farm.config.reader import _Reader
from sglang_farm.config.values import _is_number
from sglang_farm.config.workers import _Claim
from sglang_farm.gateway.managed import is_loopback
from sglang_farm.sglang import flags as sglang_flags
from sglang_farm.sglang.flags import SGLANG_MODULE
from sglang_farm.spec import (
    FarmSection,
    FlagValue,
    GatewaySpec,
    MetricsSpec,
    ModelSpec,
    OomPolicy,
    StartupPolicy,
    WorkerSpec,
)


def _cross_check(
    reader: _Reader,
    farm: FarmSection,
    workers: list[WorkerSpec],
    claims: dict[int, _Claim],
    startup: StartupPolicy,
    oom: OomPolicy,
    oom_indices: tuple[int, ...],
    metrics: MetricsSpec,
    gateway: GatewaySpec,
) -> None:
    # One worker per GPU. Workers that keep their default GPUs claim first, so a clash
    # is reported on the override that moved a worker, where the fix is.
    order = sorted(workers, key=lambda w: (claims[w.id].gpus_path[1] == "overrides", w.id))
    gpu_owner: dict[int, int] = {}
    for w in order:
        for g in w.gpus:
            if g in gpu_owner:
                reader.problems.add(
                    claims[w.id].gpus_path,
                    f"GPU {g} is already used by worker "
                    f"{gpu_owner[g]}; each GPU belongs to one worker",
                )
            else:
                gpu_owner[g] = w.id
    # HTTP and NCCL ports share the host's port space (NCCL binds all interfaces), and
    # so does the metrics listener.
    port_owner: dict[int, str] = {metrics.listen.port: "the metrics listener"}
    if gateway.mode == "managed":
        for listen, who in (
            (gateway.listen, "the gateway ([gateway] listen)"),
            (gateway.metrics_listen, "the gateway's metrics listener"),
        ):
            port = listen.port
            if port in port_owner:
                reader.problems.add(
                    ("gateway", "listen" if "listen)" in who else "metrics_listen"),
                    f"port {port} for {who} is already used by {port_owner[port]}",
                )
            else:
                port_owner[port] = who
    port_claims: list[tuple[int, str, _Path]] = []
    for w in workers:
        port_claims.append((w.port, f"worker {w.id} (HTTP)", claims[w.id].port_path))
        port_claims.append((w.nccl_port, f"worker {w.id} (NCCL)", claims[w.id].nccl_path))
    # Defaults claim before overrides, HTTP before NCCL: the clash lands on the knob
    # that made it.
    port_claims.sort(key=lambda c: (c[2][1] == "overrides", "NCCL" in c[1]))
    for port, who, cpath in port_claims:
        if port in port_owner:
            reader.problems.add(
                cpath,
                f"port {port} for {who} is already used by {port_owner[port]}; "
                "every HTTP, NCCL and metrics port must be distinct",
            )
        else:
            port_owner[port] = who
    ids = [w.id for w in workers]
    if startup.canary is not None and startup.canary not in ids:
        reader.problems.add(
            ("startup", "canary"),
            f"no worker {startup.canary}; workers are "
            f"0..{len(ids) - 1} (or write canary = false for none)",
        )
    if farm.module == SGLANG_MODULE:
        missing = [w.id for w in workers if "model_path" not in w.flags]
        if missing:
            reader.problems.add(
                ("sglang", "model_path"),
                "missing: SGLang requires --model-path; set "
                "model_path = '/path/to/model' in [sglang]"
                + ("" if len(missing) == len(workers) else f" (workers {missing} lack it)"),
            )
    _check_no_buffer(reader, workers)
    _check_oom_flags(reader, workers, oom, oom_indices)
    _warn_exposed(reader, workers, claims)


def _ids_text(ids: list[int]) -> str:
    """`worker 3`, `workers 0-7` or `workers [0, 2, 5]`."""
    if len(ids) == 1:
        return f"worker {ids[0]}"
    if ids == list(range(ids[0], ids[-1] + 1)):
        return f"workers {ids[0]}-{ids[-1]}"
    return f"workers {ids}"


def _warn_exposed(reader: _Reader, workers: list[WorkerSpec], claims: dict[int, _Claim]) -> None:
    # Without --api-key SGLang serves every route, admin ones included, to whoever reaches
    # the port (docs/reference/sglang.md §6.2); on a non-loopback address that is the network.
    exposed: dict[tuple[_Path, str], list[int]] = {}
    for w in workers:
        if not is_loopback(w.host) and not w.flags.get("api_key"):
            exposed.setdefault((claims[w.id].host_path, w.host), []).append(w.id)
    for (path, host), ids in exposed.items():
        listen, them = ("listens", "it") if len(ids) == 1 else ("listen", "them")
        reader.problems.warn(
            path,
            f"{_ids_text(ids)} {listen} on {host!r} (not loopback) without api_key: "
            f"anyone who can reach this host can use {them}, admin routes included; bind "
            f'{them} to host = "127.0.0.1" and serve through the gateway ([gateway]), or '
            "set api_key and keep it out of world-readable files (docs/config.md, "
            '"Exposure and keys")',
        )


def _no_buffer_key(flags: Mapping[str, FlagValue]) -> str | None:
    """The key that sets an explicit mamba `no_buffer` (either SGLang's spelling), or None."""
    found = sglang_flags.mamba_strategy(flags)
    return found[0] if found is not None and found[1] == "no_buffer" else None


def _check_no_buffer(reader: _Reader, workers: list[WorkerSpec]) -> None:
    # SGLang 0.5.23 asserts --disable-overlap-schedule for an explicit no_buffer
    # (mamba_hook.py::validate_mamba_no_buffer): fail here, not after a model load.
    bad: dict[str, list[int]] = {}
    for w in workers:
        key = _no_buffer_key(w.flags)
        if key is not None and w.flags.get("disable_overlap_schedule") is not True:
            bad.setdefault(key, []).append(w.id)
    for key, ids in bad.items():
        reader.problems.add(
            ("sglang", key),
            "'no_buffer' makes SGLang 0.5.23 "
            "assert --disable-overlap-schedule; add disable_overlap_schedule = true"
            + ("" if len(ids) == len(workers) else f" (workers {ids})"),
        )


def _check_oom_flags(
    reader: _Reader, workers: list[WorkerSpec], oom: OomPolicy, indices: tuple[int, ...]
) -> None:
    set_so_far: dict[str, FlagValue] = {}
    for i, step in zip(indices, oom.steps, strict=True):
        spath: _Path = ("oom", "steps", i)
        for a in step.adjust:
            if a.set is not None:
                set_so_far[a.flag] = a.set
                continue
            op = "add" if a.add is not None else "multiply"
            if a.flag in set_so_far and _is_number(set_so_far[a.flag]):
                continue
            lacking = [w.id for w in workers if not _is_number(w.flags.get(a.flag))]
            if lacking:
                who = "" if len(lacking) == len(workers) else f" for workers {lacking}"
                reader.problems.add(
                    (*spath, op, a.flag),
                    f"{op} changes the configured value, but "
                    f"{a.flag} is not set to a number in [sglang]{who}; set it there, "
                    f"e.g. {a.flag} = <number>",
                )
        key = _no_buffer_key(set_so_far)
        if key is not None:
            overlap_off = set_so_far.get("disable_overlap_schedule") is True or all(
                w.flags.get("disable_overlap_schedule") is True for w in workers
            )
            if not overlap_off and any(a.flag == key for a in step.adjust):
                reader.problems.add(
                    (*spath, "set", key),
                    "'no_buffer' makes "
                    "SGLang 0.5.23 assert --disable-overlap-schedule; add "
                    "disable_overlap_schedule = true to this step's set",
                )


def _check_model(reader: _Reader, model: ModelSpec | None, workers: list[WorkerSpec]) -> None:
    """[model] stages into the workers' one model path: absolute, the same for all."""
    if model is None or not workers:
        return
    paths = {w.flags.get("model_path") for w in workers}
    target = workers[0].flags.get("model_path")
    if len(paths) != 1 or not isinstance(target, str):
        reader.problems.add(
            ("sglang", "model_path"),
            "[model] stages one copy for every worker: set "
            "model_path in [sglang] (not per worker) to where workers load it from, "
            "e.g. '/dev/shm/model'",
        )
        return
    if not target.startswith("/") or target.rstrip("/") in ("", "/dev/shm", "/tmp"):
        reader.problems.add(
            ("sglang", "model_path"),
            f"[model] stages into model_path: expected an "
            f"absolute directory of its own (e.g. '/dev/shm/Qwen3.6-27B'), got {target!r}",
        )
        return
    t = target.rstrip("/")
    if model.is_local and (
        t == model.source or t.startswith(model.source + "/") or model.source.startswith(t + "/")
    ):
        reader.problems.add(
            ("model", "source"),
            f"the source {model.source!r} and the workers' "
            f"model_path {target!r} overlap; the source must be another directory",
        )
