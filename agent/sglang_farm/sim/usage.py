"""Pure: the simulator's own `--help`: what it is, the SGLang flags it models, its
environment controls and its failure modes (docs/simulator.md is the long form).

`python -m sglang_farm.sim --help` (and `sglang-farm sim --help`) print this instead of
argparse's `usage: sglang serve ...`; parse errors keep SGLang's wording (options.py).
"""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

from sglang_farm.sim.settings import FailMode, SimSettings

_WIDTH = 88
_FLAG_COLUMN = 34


@dataclass(frozen=True, slots=True)
class Control:
    """One environment variable the simulator reads."""

    name: str
    # The SimSettings field whose default it sets; None: the default is spelled in `unset`.
    field: str | None
    meaning: str
    unset: str = "unset"


CONTROLS: tuple[Control, ...] = (
    Control(
        "SGLANG_SIM_LOAD_SECONDS",
        "load_seconds",
        "seconds of simulated model load (weights 60 %, KV cache 10 %, CUDA graphs "
        "30 %); the port is bound only after it",
    ),
    Control(
        "SGLANG_SIM_WARMUP_SECONDS",
        "warmup_seconds",
        "seconds of warm-up after the bind, while /health answers 503",
    ),
    Control(
        "SGLANG_SIM_HEALTH_DELAY",
        "health_delay",
        "seconds a healthy /health takes to answer (SGLang sleeps 1 s first)",
    ),
    Control(
        "SGLANG_HEALTH_CHECK_TIMEOUT",
        "health_timeout",
        "SGLang's own: seconds /health waits for the scheduler (hung, or busy with "
        "SGLANG_SIM_HEALTH_QUEUES) before answering 503",
    ),
    Control(
        "SGLANG_SIM_TOKEN_SECONDS",
        "token_seconds",
        "seconds per generated token, per request",
    ),
    Control(
        "SGLANG_SIM_PREFILL_TOKEN_SECONDS",
        "prefill_token_seconds",
        "seconds of prefill per prompt token the prefix cache did not hold, before a "
        "request's first token (0: prefill is free); a cache hit makes the time to first "
        "token shorter, as in SGLang",
    ),
    Control(
        "SGLANG_SIM_PREFIX_CACHE_TOKENS",
        None,
        "N: the prefix (radix) cache holds N tokens of prompts, least recently used "
        "evicted, in blocks of 16 tokens (4 characters a token); 0 or --disable-radix-cache: "
        "none. Hits show in sglang:cache_hit_rate and, with --enable-cache-report, in "
        "usage.prompt_tokens_details.cached_tokens",
        unset="unset: the KV pool's --max-total-tokens",
    ),
    Control(
        "SGLANG_SIM_DRAIN_SECONDS",
        None,
        "the most seconds a SIGTERM drain waits for in-flight requests",
        unset="unset: no bound, as SGLang",
    ),
    Control(
        "SGL_FORCE_SHUTDOWN",
        None,
        "SGLang's own: 1 or true makes SIGTERM skip the drain (in-flight requests are cut)",
    ),
    Control(
        "SGLANG_SIM_FAIL",
        None,
        "MODE: fail while starting, in one of the failure modes below",
        unset="unset: start normally",
    ),
    Control(
        "SGLANG_SIM_FAIL_AFTER",
        None,
        "T: T seconds after 'fired up', the scheduler dies of a CUDA out-of-memory while "
        "serving (torch.OutOfMemoryError in the log); the server exits -9. The farm "
        "classifies it as an OOM and steps its OOM ladder",
    ),
    Control(
        "SGLANG_SIM_HANG_AFTER",
        None,
        "T: T seconds after 'fired up', the scheduler hangs: /health and /server_info stop "
        "answering, /metrics and /v1/loads answer frozen values, /ready stays 200",
    ),
    Control(
        "SGLANG_SIM_WEDGE_AFTER",
        None,
        "T: T seconds after 'fired up', the engine wedges (as a CUDA error can leave it): "
        "running requests make no more tokens and never finish, queued ones never start, "
        "/metrics and /v1/loads freeze, but /health, /server_info and /ready answer 200",
    ),
    Control(
        "SGLANG_SIM_HEALTH_QUEUES",
        None,
        "1, true or yes: /health is SGLang's generating check: a one-token request queued "
        "like any other, 200 once any output reached the tokenizer (a streamed token, a "
        "finished request, its own token), else 503 after SGLANG_HEALTH_CHECK_TIMEOUT; so it "
        "is slow behind a full batch of long non-streamed requests while their tokens flow",
        unset="unset: /health takes SGLANG_SIM_HEALTH_DELAY",
    ),
    Control(
        "SGLANG_SIM_ERROR_RATE",
        "error_rate",
        "F in 0..1: that fraction of generation requests (/generate, /v1/chat/completions, "
        "/v1/completions) is answered HTTP 500 at once, with SGLang's error body; counted "
        'as SGLang 0.5.20+ counts them, in sglang:http_responses_total{status_code="500"} '
        "only (and in the gateway's per-worker outcomes)",
    ),
    Control(
        "SGLANG_SIM_NO_HTTP_METRICS",
        None,
        "1, true or yes: /metrics has no sglang:http_requests_total and "
        "sglang:http_responses_total, as SGLang before 0.5.20 (e.g. 0.5.12)",
        unset="unset: both counters, as SGLang 0.5.20+",
    ),
    Control(
        "SGLANG_SIM_WRONG_RATE",
        "wrong_rate",
        "F in 0..1: arithmetic mode's wrong answers. A prompt asking 'What is A + B?' is "
        "always answered with one token, the sum (finish_reason 'stop'); at this rate, fixed "
        "per question, the sum is off by 1 to 9",
    ),
    Control(
        "SGLANG_SIM_SEED",
        "seed",
        "N: fixes which requests SGLANG_SIM_ERROR_RATE fails (the n-th to arrive) and which "
        "questions SGLANG_SIM_WRONG_RATE answers wrong: the same seed, the same choices",
    ),
    Control(
        "SGLANG_SIM_IGNORE_SIGTERM",
        None,
        "1, true or yes: ignore SIGTERM (tests a supervisor's SIGKILL deadline)",
    ),
    Control(
        "SGLANG_SIM_VERSION",
        "version",
        "X.Y.Z: the SGLang version answered as (/server_info's version); before 0.5.20 "
        "(e.g. 0.5.12, the seed host's) /ready does not exist (404)",
    ),
    Control(
        "SGLANG_SIM_GPU_MEM_GIB",
        None,
        "N: each scheduler really holds N GiB on its CUDA device (needs torch with CUDA; "
        "without it, a warning and nothing held)",
    ),
)

# SGLANG_SIM_FAIL modes: (where it fails, what it prints, exit status).
FAILURES: dict[FailMode, tuple[str, str, str]] = {
    FailMode.CUDA_OOM: (
        "weight load",
        "Scheduler hit an exception ... torch.OutOfMemoryError: CUDA out of memory",
        "-9",
    ),
    FailMode.REAL_CUDA_OOM: (
        "weight load",
        "torch's own CUDA OOM message, from really allocating until OOM (GPU only)",
        "-9",
    ),
    FailMode.NOT_ENOUGH_MEMORY: (
        "KV sizing",
        "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static.",
        "-9",
    ),
    FailMode.WEIGHTS_LEAVE_NO_MEMORY: (
        "KV sizing",
        "ValueError: Loaded weights leave no GPU memory for the KV cache",
        "-9",
    ),
    FailMode.ATTENTION_BACKEND: (
        "backend init",
        "AssertionError: FlashAttention v3 Backend requires SM>=80 and SM<=90",
        "-9",
    ),
    FailMode.CUDA_GRAPH: (
        "graph capture",
        "Capture cuda graph failed: ... Possible solutions: ...",
        "-9",
    ),
    FailMode.DEEP_GEMM: (
        "scheduler import",
        "traceback ending in assert cuda_home is not None (DeepGEMM)",
        "-9",
    ),
    FailMode.SGL_KERNEL: (
        "launcher import",
        "ImportError: [sgl_kernel] CRITICAL: Could not load any common_ops library!",
        "1",
    ),
    FailMode.HOST_OOM: (
        "weight load",
        "the scheduler is SIGKILLed (host OOM): Rank 0 scheduler died during initialization",
        "1",
    ),
    FailMode.BAD_FLAG: (
        "argv parsing",
        "sglang serve: error: unrecognized arguments: --mamba-scheduler-strategy ...",
        "2",
    ),
    FailMode.PORT_IN_USE: (
        "bind",
        "[Errno 98] error while attempting to bind on address (...): address already in use",
        "3",
    ),
}

_INTRO = """\
The farm's SGLang simulator: a stand-in for an SGLang 0.5.23 server (python -m
sglang.launch_server) where there is no GPU (the demo, CI, a laptop). It takes SGLang's
argv, starts SGLang's process tree (sglang::scheduler, or sglang::scheduler_TPn per rank with
--tp-size above 1, and sglang::detokenizer; `ps` shows the module after the title), serves
SGLang's HTTP routes (/health, /metrics, /v1/models, /generate, /v1/chat/completions,
/v1/completions ...), writes SGLang's log lines and exits with SGLang's exit statuses.
It is not SGLang: there is no model (every token is " sim"), and its figures (load
times, memory, KV cache size, throughput, latencies) are made up, not SGLang's."""

_FLAGS_HEAD = """\
SGLang flags it models (prefixes work, as in SGLang: --tp 2). Any other flag is
ignored, except flags SGLang 0.5.23 removed (--mamba-scheduler-strategy): those exit 2
with SGLang's "unrecognized arguments", as do ambiguous prefixes (--cuda-graph-max-bs):"""

_ENV_HEAD = """\
Environment (SGLANG_SIM_* are the simulator's own; the other two are SGLang's). In a
farm, set them in farm.toml's [farm] env, or [workers.overrides.N] env for one worker.
A bad value exits 2 naming the variable:"""

_FAIL_HEAD = """\
Failure modes. SGLANG_SIM_FAIL=MODE fails while starting, printing SGLang's own text
and exiting as SGLang does (docs/reference/sglang.md §11, §13):"""

_FAIL_TAIL = """\
While serving, SGLANG_SIM_FAIL_AFTER=T dies of a CUDA OOM (exit -9),
SGLANG_SIM_HANG_AFTER=T hangs (/health stops answering) and SGLANG_SIM_WEDGE_AFTER=T
wedges (no token, frozen counters, /health still 200); SGLANG_SIM_HEALTH_QUEUES=1 makes
a busy server's /health slow while its tokens flow. Regressions a canary must catch:
slow tokens (SGLANG_SIM_TOKEN_SECONDS), 500s (SGLANG_SIM_ERROR_RATE), wrong sums
(SGLANG_SIM_WRONG_RATE), a crash (SGLANG_SIM_FAIL_AFTER).

Without SGLANG_SIM_FAIL the same exits come from real causes: a removed or ambiguous
flag exits 2, a served model name with ':' exits 1, a taken port exits 3, a scheduler
killed by someone exits 1 while loading and -9 while serving. SIGTERM (or SIGINT)
drains as SGLang does: /health turns 503, in-flight requests finish, exit 0.

Details: docs/simulator.md."""


def _default(control: Control) -> str:
    if control.field is None:
        return control.unset
    value = getattr(SimSettings(), control.field)
    return f"{value:g}" if isinstance(value, float) else str(value)


def _flag_line(action: argparse.Action) -> str:
    """`  --tp-size, --tensor-parallel-size N   help`, wrapped at _WIDTH."""
    names = ", ".join(action.option_strings)
    if action.nargs != 0:
        names += f" {action.metavar or action.dest.upper()}"
    head = f"  {names}"
    body = textwrap.wrap(action.help or "", _WIDTH - _FLAG_COLUMN)
    if len(head) + 2 > _FLAG_COLUMN:
        return "\n".join([head, *(" " * _FLAG_COLUMN + line for line in body)])
    first, *rest = body or [""]
    lines = [head.ljust(_FLAG_COLUMN) + first, *(" " * _FLAG_COLUMN + line for line in rest)]
    return "\n".join(lines)


def help_text(actions: Sequence[argparse.Action]) -> str:
    """The whole `--help` text, for the parser's `actions` (its own -h/--help left out)."""
    parts = [
        "usage: python -m sglang_farm.sim --model-path PATH [SGLang flags ...]\n"
        "       sglang-farm sim --model-path PATH [SGLang flags ...]",
        _INTRO,
        _FLAGS_HEAD,
        "\n".join(_flag_line(a) for a in actions if a.option_strings and a.dest != "help"),
    ]
    env_lines = [_ENV_HEAD]
    for c in CONTROLS:
        env_lines.append(f"  {c.name}  (default {_default(c)})")
        env_lines += textwrap.wrap(
            c.meaning, _WIDTH, initial_indent="      ", subsequent_indent="      "
        )
    parts.append("\n".join(env_lines))
    mode_width = max(len(m.value) for m in FailMode) + 2
    fail_lines = [_FAIL_HEAD]
    for mode in FailMode:
        where, text, code = FAILURES[mode]
        fail_lines.append(f"  {mode.value.ljust(mode_width)}{where}, exit {code}")
        fail_lines += textwrap.wrap(
            text, _WIDTH, initial_indent="      ", subsequent_indent="      "
        )
    parts += ["\n".join(fail_lines), _FAIL_TAIL]
    return "\n\n".join(parts) + "\n"
