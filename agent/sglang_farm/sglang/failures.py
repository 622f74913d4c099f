"""Pure: what went wrong with a worker, as data.

A `Failure` is produced by the log classifier (`classify`) from SGLang's own lines,
or by the supervisor from what it saw (a crash with nothing in the log, a hang, a
load that outran its deadline). It is the worker's "last failure" everywhere:
status, `why`, logs and metrics.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class FailureKind(StrEnum):
    # Classified from SGLang's log (docs/reference/sglang.md §11).
    CUDA_OOM_LOAD = "cuda_oom_load"
    CUDA_OOM_SERVING = "cuda_oom_serving"
    KV_CACHE_TOO_SMALL = "kv_cache_too_small"
    CUDA_GRAPH_CAPTURE = "cuda_graph_capture"
    KV_ALLOC_RUNTIME = "kv_alloc_runtime"
    HOST_OOM_KILL = "host_oom_kill"
    WATCHDOG_TIMEOUT = "watchdog_timeout"
    MISSING_KERNEL = "missing_kernel"
    DEEP_GEMM_NO_CUDA_HOME = "deep_gemm_no_cuda_home"
    ATTENTION_BACKEND = "attention_backend_unsupported"
    PORT_IN_USE = "port_in_use"
    BAD_FLAG = "bad_flag"
    FATAL_TRACEBACK = "fatal_traceback"
    # Observed by the farm itself.
    CRASH = "crash"  # the process exited and its log explains nothing
    HANG = "hang"  # liveness probe failed `failure_threshold` times
    LOAD_TIMEOUT = "load_timeout"  # not ready within startup.load_timeout
    PREFLIGHT = "preflight"  # the doctor's checks failed: not started at all
    # Another process listens on the worker's port: whatever answers there is not the
    # worker, so it is never called ready (docs/security.md).
    PORT_TAKEN = "port_taken"


class OomKind(StrEnum):
    """The OOM event kinds exported by metrics."""

    CUDA = "cuda"
    KV_CACHE = "kv_cache"
    CUDA_GRAPH = "cuda_graph"
    HOST = "host"


class RestartReason(StrEnum):
    CRASH = "crash"
    HANG = "hang"
    OOM = "oom"
    MANUAL = "manual"
    CONFIG = "config"


_OOM_KIND: dict[FailureKind, OomKind] = {
    FailureKind.CUDA_OOM_LOAD: OomKind.CUDA,
    FailureKind.CUDA_OOM_SERVING: OomKind.CUDA,
    FailureKind.KV_CACHE_TOO_SMALL: OomKind.KV_CACHE,
    FailureKind.KV_ALLOC_RUNTIME: OomKind.KV_CACHE,
    FailureKind.CUDA_GRAPH_CAPTURE: OomKind.CUDA_GRAPH,
    FailureKind.HOST_OOM_KILL: OomKind.HOST,
}

# Failures that repeat identically if the same command line is started again:
# retrying them only burns a model load (minutes of GPU time).
_DETERMINISTIC = frozenset(
    {
        FailureKind.MISSING_KERNEL,
        FailureKind.DEEP_GEMM_NO_CUDA_HOME,
        FailureKind.ATTENTION_BACKEND,
        FailureKind.BAD_FLAG,
        FailureKind.PREFLIGHT,
    }
)


@dataclass(frozen=True, slots=True)
class Failure:
    """One classified failure: its kind, the log lines that show it, and what to do."""

    kind: FailureKind
    summary: str  # one line: what happened
    advice: str  # what to do about it
    lines: tuple[str, ...] = ()  # the log lines that show it, verbatim

    @property
    def oom_kind(self) -> OomKind | None:
        """The OOM class of this failure, or None if it is not an out-of-memory failure."""
        return _OOM_KIND.get(self.kind)

    @property
    def deterministic(self) -> bool:
        """True when starting the same command line again would fail the same way."""
        return self.kind in _DETERMINISTIC

    @property
    def restart_reason(self) -> RestartReason:
        if self.oom_kind is not None:
            return RestartReason.OOM
        if self.kind in (FailureKind.HANG, FailureKind.WATCHDOG_TIMEOUT, FailureKind.LOAD_TIMEOUT):
            return RestartReason.HANG
        return RestartReason.CRASH

    def to_dict(self) -> dict[str, object]:
        return {
            "kind": str(self.kind),
            "summary": self.summary,
            "advice": self.advice,
            "lines": list(self.lines),
            "oom_kind": str(self.oom_kind) if self.oom_kind else None,
        }


def port_taken(port: int, holder: str, worker: int, *, launched: bool = True) -> Failure:
    """Another process (`holder`: "PID 4242 (user nobody)") listens on the worker's port.

    `launched`: found while the worker ran (its answers were someone else's), else at
    the launch gate (the worker was not started).
    """
    tail = "" if launched else "; not started"
    return Failure(
        FailureKind.PORT_TAKEN,
        f"port {port} is held by {holder}, not by worker {worker}{tail}",
        f"stop that process (`ss -ltnp 'sport = :{port}'` shows it) or change "
        f"[workers] base_port (or workers.overrides.{worker}.port); the farm never routes "
        "to it and starts the worker again after its back-off",
    )
