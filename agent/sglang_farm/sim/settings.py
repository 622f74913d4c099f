"""Pure: the simulator's environment knobs (SGLANG_SIM_*, and SGLang's own
SGLANG_HEALTH_CHECK_TIMEOUT and SGL_FORCE_SHUTDOWN) read into `SimSettings`.

Apart from the command line (`options`), so that the `--help` text (`usage`), which
spells out these defaults, needs only this module and `options` can print it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum


class FailMode(StrEnum):
    """Values of SGLANG_SIM_FAIL; where and how each one fails is in the package docstring."""

    CUDA_OOM = "cuda_oom"
    NOT_ENOUGH_MEMORY = "not_enough_memory"
    WEIGHTS_LEAVE_NO_MEMORY = "weights_leave_no_memory"
    CUDA_GRAPH = "cuda_graph"
    DEEP_GEMM = "deep_gemm"
    SGL_KERNEL = "sgl_kernel"
    ATTENTION_BACKEND = "attention_backend"
    BAD_FLAG = "bad_flag"
    PORT_IN_USE = "port_in_use"
    HOST_OOM = "host_oom"
    REAL_CUDA_OOM = "real_cuda_oom"


class SettingsError(ValueError):
    """A SGLANG_SIM_* variable holds a value the simulator cannot use."""


@dataclass(frozen=True, slots=True)
class SimSettings:
    """SGLANG_SIM_* knobs (and SGLang's own SGLANG_HEALTH_CHECK_TIMEOUT and SGL_FORCE_SHUTDOWN)."""

    load_seconds: float = 2.0
    warmup_seconds: float = 0.5
    health_delay: float = 1.0
    health_timeout: float = 20.0
    token_seconds: float = 0.01
    # The prefill of each prompt token the prefix cache did not hold (0: prefill is free).
    prefill_token_seconds: float = 0.0
    # The prefix cache's capacity in tokens; None: the KV pool's (--max-total-tokens).
    prefix_cache_tokens: int | None = None
    drain_seconds: float | None = None  # None: drain with no bound, as SGLang does
    force_shutdown: bool = False  # SGLang's SGL_FORCE_SHUTDOWN: SIGTERM skips the drain
    fail: FailMode | None = None
    fail_after: float | None = None
    hang_after: float | None = None
    wedge_after: float | None = None
    health_queues: bool = False
    ignore_sigterm: bool = False
    # The SGLang version the simulator answers as: before 0.5.20 (the seed's 0.5.12) there
    # is no /ready route (404).
    version: str = "0.5.23"
    gpu_mem_gib: float | None = None
    error_rate: float = 0.0  # the fraction of generation requests answered 500
    wrong_rate: float = 0.0  # the fraction of arithmetic questions answered wrong
    seed: int = 0  # fixes which requests err and which questions are answered wrong
    # SGLang before 0.5.20 (the seed host's 0.5.12): no sglang:http_requests_total and
    # sglang:http_responses_total on /metrics.
    no_http_metrics: bool = False


def _float(env: Mapping[str, str], name: str, default: float | None) -> float | None:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(
            f"{name}={raw!r} is not a number of seconds/GiB; unset it or give e.g. 1.5"
        ) from None
    if value < 0:
        raise SettingsError(f"{name}={raw!r} is negative; give a value >= 0")
    return value


def _fraction(env: Mapping[str, str], name: str) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise SettingsError(f"{name}={raw!r} is not a fraction; give a number in 0..1, e.g. 0.1")
    return value


def _seed(env: Mapping[str, str], name: str) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return 0
    try:
        return int(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not an integer; give e.g. 42") from None


def _tokens(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise SettingsError(f"{name}={raw!r} is not a number of tokens; give e.g. 65536 (0: none)")
    return int(raw)


_YES = frozenset({"1", "true", "yes"})
_NO = frozenset({"", "0", "false", "no"})


READY_ROUTE_SINCE = (0, 5, 20)


def version_tuple(version: str) -> tuple[int, ...]:
    """`0.5.12` -> (0, 5, 12)."""
    return tuple(int(p) for p in version.split("."))


def has_ready_route(settings: SimSettings) -> bool:
    """True when the simulated SGLang serves /ready (0.5.20 and newer)."""
    return version_tuple(settings.version) >= READY_ROUTE_SINCE


def _version(env: Mapping[str, str], name: str, default: str) -> str:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    parts = raw.split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise SettingsError(f"{name}={raw!r} is not a version; give one as 0.5.12")
    return raw


def _switch(env: Mapping[str, str], name: str) -> bool:
    raw = env.get(name, "").strip()
    if raw.lower() in _YES:
        return True
    if raw.lower() in _NO:
        return False
    raise SettingsError(f"{name}={raw!r} is not a switch; give 1, true or yes (0, false, no: off)")


def load_settings(env: Mapping[str, str]) -> SimSettings:
    """Read the SGLANG_SIM_* variables.

    Raises SettingsError naming the variable, its bad value and what is accepted.
    """
    d = SimSettings()
    fail_raw = env.get("SGLANG_SIM_FAIL", "").strip()
    fail: FailMode | None = None
    if fail_raw:
        try:
            fail = FailMode(fail_raw)
        except ValueError:
            modes = ", ".join(m.value for m in FailMode)
            raise SettingsError(
                f"SGLANG_SIM_FAIL={fail_raw!r} is not a failure mode; use one of: {modes}"
            ) from None

    def num(name: str, default: float) -> float:
        value = _float(env, name, default)
        assert value is not None
        return value

    return SimSettings(
        load_seconds=num("SGLANG_SIM_LOAD_SECONDS", d.load_seconds),
        warmup_seconds=num("SGLANG_SIM_WARMUP_SECONDS", d.warmup_seconds),
        health_delay=num("SGLANG_SIM_HEALTH_DELAY", d.health_delay),
        health_timeout=num("SGLANG_HEALTH_CHECK_TIMEOUT", d.health_timeout),
        token_seconds=num("SGLANG_SIM_TOKEN_SECONDS", d.token_seconds),
        prefill_token_seconds=num("SGLANG_SIM_PREFILL_TOKEN_SECONDS", d.prefill_token_seconds),
        prefix_cache_tokens=_tokens(env, "SGLANG_SIM_PREFIX_CACHE_TOKENS"),
        drain_seconds=_float(env, "SGLANG_SIM_DRAIN_SECONDS", d.drain_seconds),
        force_shutdown=env.get("SGL_FORCE_SHUTDOWN", "").strip().lower() in {"1", "true"},
        fail=fail,
        fail_after=_float(env, "SGLANG_SIM_FAIL_AFTER", None),
        hang_after=_float(env, "SGLANG_SIM_HANG_AFTER", None),
        wedge_after=_float(env, "SGLANG_SIM_WEDGE_AFTER", None),
        health_queues=_switch(env, "SGLANG_SIM_HEALTH_QUEUES"),
        ignore_sigterm=_switch(env, "SGLANG_SIM_IGNORE_SIGTERM"),
        version=_version(env, "SGLANG_SIM_VERSION", d.version),
        gpu_mem_gib=_float(env, "SGLANG_SIM_GPU_MEM_GIB", None),
        error_rate=_fraction(env, "SGLANG_SIM_ERROR_RATE"),
        wrong_rate=_fraction(env, "SGLANG_SIM_WRONG_RATE"),
        seed=_seed(env, "SGLANG_SIM_SEED"),
        no_http_metrics=_switch(env, "SGLANG_SIM_NO_HTTP_METRICS"),
    )
