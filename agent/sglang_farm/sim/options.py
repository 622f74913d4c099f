"""Pure: the simulator's command line (the SGLang flags it models) and its environment knobs.

The parser mimics SGLang 0.5.23's (`prog="sglang serve"`, `allow_abbrev=True`, so
`--tp 2` works and `--cuda-graph-max-bs 8` is ambiguous exactly as in SGLang), but
unknown flags are ignored, except the ones SGLang removed: those fail with SGLang's
own `error: unrecognized arguments: ...` and exit status 2.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from enum import StrEnum

# Pretend hardware, used only to print plausible numbers in the load log lines.
GPU_TOTAL_GB = 139.80
WEIGHTS_GB = 15.30
BYTES_PER_TOKEN = 131072  # Llama-3-8B in bf16: 32 layers x 2 x 8 heads x 128 x 2 bytes
DEFAULT_CONTEXT_LEN = 32768
DEFAULT_MAX_RUNNING = 1024

# Flags SGLang 0.5.23 no longer knows (docs/reference/sglang.md §4); other unknown ones are ignored.
REMOVED_FLAGS = ("--mamba-scheduler-strategy",)


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
class ServerOptions:
    """The SGLang flags the simulator models, resolved the way SGLang resolves them."""

    model_path: str
    tokenizer_path: str
    served_model_name: str
    host: str
    port: int
    nccl_port: int | None
    tp_size: int
    dp_size: int
    pp_size: int
    base_gpu_id: int
    mem_fraction_static: float
    max_running_requests: int
    max_queued_requests: int | None
    max_total_tokens: int
    context_length: int
    chunked_prefill_size: int
    page_size: int
    enable_metrics: bool
    extra_metric_labels: tuple[tuple[str, str], ...]
    api_key: str | None
    skip_server_warmup: bool
    attention_backend: str | None
    kv_cache_dtype: str
    log_level: str
    log_level_http: str | None
    uvicorn_access_log_exclude_prefixes: tuple[str, ...]
    watchdog_timeout: float

    def server_args_repr(self) -> str:
        """The `ServerArgs(...)` text SGLang logs at startup (secrets redacted)."""
        parts = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "api_key" and value is not None:
                value = "<redacted>"
            if isinstance(value, tuple):
                value = dict(value) if f.name == "extra_metric_labels" else list(value)
            parts.append(f"{f.name}={value!r}")
        return "ServerArgs(" + ", ".join(parts) + ")"

    @property
    def kv_cache_gb(self) -> float:
        return self.max_total_tokens * BYTES_PER_TOKEN / 1e9


@dataclass(frozen=True, slots=True)
class SimSettings:
    """SGLANG_SIM_* knobs (and SGLang's own SGLANG_HEALTH_CHECK_TIMEOUT and SGL_FORCE_SHUTDOWN)."""

    load_seconds: float = 2.0
    warmup_seconds: float = 0.5
    health_delay: float = 1.0
    health_timeout: float = 20.0
    token_seconds: float = 0.01
    drain_seconds: float | None = None  # None: drain with no bound, as SGLang does
    force_shutdown: bool = False  # SGLang's SGL_FORCE_SHUTDOWN: SIGTERM skips the drain
    fail: FailMode | None = None
    fail_after: float | None = None
    hang_after: float | None = None
    wedge_after: float | None = None
    health_queues: bool = False
    ignore_sigterm: bool = False
    gpu_mem_gib: float | None = None
    error_rate: float = 0.0  # the fraction of generation requests answered 500
    wrong_rate: float = 0.0  # the fraction of arithmetic questions answered wrong
    seed: int = 0  # fixes which requests err and which questions are answered wrong


def human_readable_int(text: str) -> int:
    """SGLang's `human_readable_int`: `32k` = 32000 (SI), `32Ki` = 32768, `32000` = 32000."""
    units = {"k": 10**3, "M": 10**6, "G": 10**9, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    for suffix in sorted(units, key=len, reverse=True):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * units[suffix])
    return int(text)


def _json_labels(text: str) -> dict[str, str]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return {str(k): str(v) for k, v in value.items()}


class _SimHelp(argparse.Action):
    """`-h`/`--help`: the simulator's own help (usage.py), not argparse's `usage: sglang serve`."""

    def __init__(self, option_strings: Sequence[str], dest: str, **_: object) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, nargs=0, help="this help")

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        from sglang_farm.sim.usage import help_text  # usage.py imports this module

        # argparse keeps no public list of a parser's arguments; `_actions` is typed in typeshed.
        print(help_text(parser._actions), end="")
        parser.exit(0)


def build_parser() -> argparse.ArgumentParser:
    """The modelled subset of SGLang's parser; `parse_known_args` ignores the rest.

    Its `help=` texts are the simulator's, shown by `--help` (usage.py); errors keep SGLang's
    `usage: sglang serve ...` and `sglang serve: error: ...`.
    """
    p = argparse.ArgumentParser(prog="sglang serve", add_help=False)
    add = p.add_argument
    add("-h", "--help", action=_SimHelp)
    shown = "reported only (ServerArgs log line, /server_info)"
    add(
        "--model-path",
        "--model",
        dest="model_path",
        required=True,
        help="required; reported by /model_info and /server_info",
    )
    add("--tokenizer-path", help="reported by /model_info (default: the model path)")
    add(
        "--served-model-name",
        help="the model id on every route (default: the model path; a ':' in it exits 1)",
    )
    add("--host", default="127.0.0.1", help="where HTTP listens (default 127.0.0.1)")
    add(
        "--port",
        type=int,
        default=30000,
        help="HTTP port (default 30000), bound only after the simulated load",
    )
    add("--nccl-port", type=int, help=shown)
    add(
        "--tp-size",
        "--tensor-parallel-size",
        dest="tp_size",
        type=int,
        default=1,
        help=(
            "one scheduler child process per rank: sglang::scheduler, or sglang::scheduler_TPn"
            " when above 1 (default 1)"
        ),
    )
    add("--dp-size", "--data-parallel-size", dest="dp_size", type=int, default=1, help=shown)
    add("--pp-size", type=int, default=1, help=shown)
    add("--base-gpu-id", type=int, default=0, help=shown)
    add(
        "--mem-fraction-static",
        type=float,
        help="sizes the reported KV cache (default 0.88 of a pretend 139.8 GB GPU)",
    )
    add(
        "--max-running-requests",
        type=int,
        help="requests generating at once (default 1024); the rest wait in the queue",
    )
    add(
        "--max-queued-requests",
        type=int,
        help="queue bound; beyond it 503 'The request queue is full.' (default: none)",
    )
    add(
        "--max-total-tokens",
        type=human_readable_int,
        help="reported in logs, /metrics, /v1/loads, /server_info (32k, 32Ki accepted)",
    )
    add("--context-length", type=human_readable_int, help="reported (default 32768)")
    add("--chunked-prefill-size", type=int, help="reported (default 8192)")
    add("--page-size", type=int, default=1, help="reported (default 1)")
    add(
        "--enable-metrics",
        action="store_true",
        help="/metrics with SGLang's names and labels (404 without it)",
    )
    add("--enable-metrics-for-all-schedulers", action="store_true", help="accepted, no effect")
    add(
        "--extra-metric-labels",
        type=_json_labels,
        help="JSON object of labels added to every /metrics sample",
    )
    add(
        "--api-key",
        help="every route but /health*, /ready*, /metrics* needs 'Authorization: Bearer KEY'",
    )
    add(
        "--skip-server-warmup",
        action="store_true",
        help="no warm-up: /health is 200 as soon as the port is bound",
    )
    add("--attention-backend", help=shown)
    add("--kv-cache-dtype", default="auto", help=shown)
    add("--log-level", default="info", help="'info' or 'debug' logs HTTP access lines")
    add("--log-level-http", help="overrides --log-level for the access lines")
    add(
        "--uvicorn-access-log-exclude-prefixes",
        nargs="*",
        default=[],
        help="paths whose access lines are not logged",
    )
    add("--watchdog-timeout", type=float, default=300.0, help=shown)
    # Modelled only so that the removed `--cuda-graph-max-bs` is ambiguous, as in SGLang.
    ambiguity = "accepted, no effect (makes --cuda-graph-max-bs ambiguous, as in SGLang)"
    add("--cuda-graph-max-bs-decode", type=int, help=ambiguity)
    add("--cuda-graph-max-bs-prefill", type=int, help=ambiguity)
    add("--mamba-radix-cache-strategy", default="auto", help="accepted, no effect")
    add("--trust-remote-code", action="store_true", help="accepted, no effect")
    return p


def removed_flags_used(unknown: Sequence[str]) -> list[str]:
    """The removed flags (and their values) among the ignored items, as argparse lists them."""
    found: list[str] = []
    for i, item in enumerate(unknown):
        name = item.split("=", 1)[0]
        if name in REMOVED_FLAGS:
            found.append(item)
            nxt = unknown[i + 1] if i + 1 < len(unknown) else None
            if "=" not in item and nxt is not None and not nxt.startswith("--"):
                found.append(nxt)
    return found


def parse_options(argv: Sequence[str]) -> tuple[ServerOptions, list[str]]:
    """Parse SGLang flags; returns the options and the ignored argv items.

    Raises SystemExit(2) with argparse's message on stderr, as SGLang does.
    """
    parser = build_parser()
    ns, unknown = parser.parse_known_args(list(argv))
    removed = removed_flags_used(unknown)
    if removed:
        parser.error("unrecognized arguments: " + " ".join(removed))
    mfs = ns.mem_fraction_static if ns.mem_fraction_static is not None else 0.88
    kv_gb = max(GPU_TOTAL_GB * mfs - WEIGHTS_GB, 1.0)
    max_total = ns.max_total_tokens or int(kv_gb * 1e9 / BYTES_PER_TOKEN)
    opts = ServerOptions(
        model_path=ns.model_path,
        tokenizer_path=ns.tokenizer_path or ns.model_path,
        served_model_name=ns.served_model_name or ns.model_path,
        host=ns.host,
        port=ns.port,
        nccl_port=ns.nccl_port,
        tp_size=ns.tp_size,
        dp_size=ns.dp_size,
        pp_size=ns.pp_size,
        base_gpu_id=ns.base_gpu_id,
        mem_fraction_static=mfs,
        max_running_requests=ns.max_running_requests or DEFAULT_MAX_RUNNING,
        max_queued_requests=ns.max_queued_requests,
        max_total_tokens=max_total,
        context_length=ns.context_length or DEFAULT_CONTEXT_LEN,
        chunked_prefill_size=ns.chunked_prefill_size or 8192,
        page_size=ns.page_size,
        enable_metrics=ns.enable_metrics,
        extra_metric_labels=tuple(sorted((ns.extra_metric_labels or {}).items())),
        api_key=ns.api_key,
        skip_server_warmup=ns.skip_server_warmup,
        attention_backend=ns.attention_backend,
        kv_cache_dtype=ns.kv_cache_dtype,
        log_level=ns.log_level,
        log_level_http=ns.log_level_http,
        uvicorn_access_log_exclude_prefixes=tuple(ns.uvicorn_access_log_exclude_prefixes),
        watchdog_timeout=ns.watchdog_timeout,
    )
    return opts, unknown


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


_YES = frozenset({"1", "true", "yes"})
_NO = frozenset({"", "0", "false", "no"})


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
        drain_seconds=_float(env, "SGLANG_SIM_DRAIN_SECONDS", d.drain_seconds),
        force_shutdown=env.get("SGL_FORCE_SHUTDOWN", "").strip().lower() in {"1", "true"},
        fail=fail,
        fail_after=_float(env, "SGLANG_SIM_FAIL_AFTER", None),
        hang_after=_float(env, "SGLANG_SIM_HANG_AFTER", None),
        wedge_after=_float(env, "SGLANG_SIM_WEDGE_AFTER", None),
        health_queues=_switch(env, "SGLANG_SIM_HEALTH_QUEUES"),
        ignore_sigterm=_switch(env, "SGLANG_SIM_IGNORE_SIGTERM"),
        gpu_mem_gib=_float(env, "SGLANG_SIM_GPU_MEM_GIB", None),
        error_rate=_fraction(env, "SGLANG_SIM_ERROR_RATE"),
        wrong_rate=_fraction(env, "SGLANG_SIM_WRONG_RATE"),
        seed=_seed(env, "SGLANG_SIM_SEED"),
    )
