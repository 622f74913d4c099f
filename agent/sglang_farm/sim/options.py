"""Pure: the simulator's command line (the SGLang flags it models); its environment knobs
are `settings`.

The parser mimics SGLang 0.5.23's (`prog="sglang serve"`, `allow_abbrev=True`, so
`--tp 2` works and `--cuda-graph-max-bs 8` is ambiguous exactly as in SGLang), but
unknown flags are ignored, except the ones SGLang removed: those fail with SGLang's
own `error: unrecognized arguments: ...` and exit status 2.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass, fields

from sglang_farm.sim.usage import help_text

# Pretend hardware, used only to print plausible numbers in the load log lines.
GPU_TOTAL_GB = 139.80
WEIGHTS_GB = 15.30
BYTES_PER_TOKEN = 131072  # Llama-3-8B in bf16: 32 layers x 2 x 8 heads x 128 x 2 bytes
DEFAULT_CONTEXT_LEN = 32768
DEFAULT_MAX_RUNNING = 1024

# Flags SGLang 0.5.23 no longer knows (docs/reference/sglang.md §4); other unknown ones are ignored.
REMOVED_FLAGS = ("--mamba-scheduler-strategy",)


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
    disable_radix_cache: bool = False  # no prefix cache: every prompt token is prefilled
    enable_cache_report: bool = False  # usage.prompt_tokens_details.cached_tokens in answers

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
    add(
        "--disable-radix-cache",
        action="store_true",
        help="no prefix cache: every prompt token is prefilled, no cached_tokens",
    )
    add(
        "--enable-cache-report",
        action="store_true",
        help="answers report usage.prompt_tokens_details.cached_tokens",
    )
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
        disable_radix_cache=ns.disable_radix_cache,
        enable_cache_report=ns.enable_cache_report,
    )
    return opts, unknown
