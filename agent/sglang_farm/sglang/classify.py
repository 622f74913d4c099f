"""Pure: SGLang log lines -> classified failures (docs/reference/sglang.md §10-§13, log lines;
docs/reference/seed-host.md §3-§5, the seed host's failures).

SGLang nearly always ends a failure by SIGKILLing itself (exit -9 whatever went
wrong), so the log is the only place that says what happened. This module turns
lines into `Failure`s, each with a summary, concrete advice and the lines that
show it:

- `LogClassifier` follows one worker lifetime line by line (`feed`) and, when
  the process has exited, names the failure that explains it (`finish`).
- `classify_lines` reads a whole log (possibly several lifetimes, e.g.
  `journalctl -u sglang@3 -o cat`) for `sglang-farm explain`.

Lines may carry journal prefixes (`journalctl -o short`/`short-iso`) and SGLang's
own `[2026-11-29 10:00:00 TP0] ` prefix, or neither; both are stripped before
matching, while `Failure.lines` keep the lines verbatim.

Tracebacks are followed as a small state machine: the frames (indented lines, never
matched against signatures since they are source code), the final exception line,
then the exception message's continuation lines (unprefixed lines, e.g. the
sgl_kernel report after `ImportError:`). A specific signature seen on the exception
line or its continuation claims the traceback; a traceback nobody claims becomes a
generic FATAL_TRACEBACK once it is over (the next log record, a new unchained
traceback, 40 continuation lines, or `finish`).
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from sglang_farm.sglang.failures import Failure, FailureKind
from sglang_farm.sglang.flags import SGLANG_MODULE, flag_key, log_advice

READY_TEXT = "The server is fired up and ready to roll!"

# When two failures were seen in one lifetime, the higher rank explains the exit.
# Deterministic environment/config problems first (retrying cannot help and they are
# the root cause), then memory classes from most to least targeted advice, then the
# generic ones. A capture failure usually *contains* a CUDA OOM text: it wins.
_RANK: dict[FailureKind, int] = {
    FailureKind.HOST_OOM_KILL: 95,  # only from systemd's own verdict; see _HOST_OOM_HINT_RANK
    FailureKind.BAD_FLAG: 90,
    FailureKind.PORT_IN_USE: 85,
    FailureKind.DEEP_GEMM_NO_CUDA_HOME: 80,
    FailureKind.MISSING_KERNEL: 80,
    FailureKind.ATTENTION_BACKEND: 80,
    FailureKind.KV_CACHE_TOO_SMALL: 70,
    FailureKind.CUDA_GRAPH_CAPTURE: 65,
    FailureKind.KV_ALLOC_RUNTIME: 60,
    FailureKind.CUDA_OOM_LOAD: 55,
    FailureKind.CUDA_OOM_SERVING: 55,
    FailureKind.WATCHDOG_TIMEOUT: 50,
    FailureKind.FATAL_TRACEBACK: 10,
}
# SGLang's "exit code: -9" is a hint, not proof (its own teardown is SIGKILL too).
_HOST_OOM_HINT_RANK = 40
_ABI_RANK = 81  # the ABI diagnosis refines the generic sgl_kernel one

_MAX_CONTINUATION = 40  # exception-message lines followed after a traceback ends
_MAX_FRAMES = 400  # a traceback without an exception line after this many lines is dropped
_MAX_TAIL_EVIDENCE = 3
_MAX_FRAME_EVIDENCE = 4
_MAX_SUMMARY = 300

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_JOURNAL_PREFIX = re.compile(
    r"^(?:[A-Z][a-z]{2} [ \d]\d \d{2}:\d{2}:\d{2}(?:\.\d+)?"
    r"|\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?:Z|[+-]\d{2}:?\d{2})?)"
    r" \S+ [^\s:\[]+(?:\[\d+\])?: ?"
)
_SGLANG_PREFIX = re.compile(r"^\[\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?: [^\]]*)?\] ")
# Other record starts: uvicorn (`ERROR:    ...`) and logging.basicConfig (`DEBUG:name:...`).
_LEVEL_PREFIX = re.compile(r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL):")
_EXC_LINE = re.compile(
    r"^(?P<exc>(?:[A-Za-z_]\w*\.)*(?:[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt|Failure)"
    r"|Exception|AssertionError))(?::(?P<msg>.*))?$"
)
_CHAIN_MARKERS = (
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)
_TRACEBACK = "Traceback (most recent call last):"
_LAUNCH = re.compile(r"server_args=ServerArgs\(|^Start(?:ing|ed) \S+\.service")


def strip_prefixes(line: str) -> str:
    """The message of a log line: without newline, colour codes, journal or SGLang prefix."""
    text = _ANSI.sub("", line.rstrip("\r\n"))
    text = _JOURNAL_PREFIX.sub("", text, count=1)
    return _SGLANG_PREFIX.sub("", text, count=1)


def _is_record_start(raw: str) -> bool:
    """True when the line opens a new log record (so it cannot continue an exception message)."""
    text = _ANSI.sub("", raw.rstrip("\r\n"))
    text = _JOURNAL_PREFIX.sub("", text, count=1)
    return bool(_SGLANG_PREFIX.match(text) or _LEVEL_PREFIX.match(text))


def _clip(text: str) -> str:
    text = text.strip()
    return text if len(text) <= _MAX_SUMMARY else text[: _MAX_SUMMARY - 3] + "..."


# --------------------------------------------------------------------------- signatures


@dataclass(frozen=True, slots=True)
class _Hit:
    kind: FailureKind
    summary: str
    advice: str
    rank: int


_Matcher = Callable[[str, bool], _Hit | None]

_ARGPARSE = re.compile(
    r"(?:^|: )error: (?P<what>unrecognized arguments|ambiguous option|argument |"
    r"the following arguments are required)(?P<rest>.*)$"
)


def _bad_flag(text: str, serving: bool) -> _Hit | None:
    m = _ARGPARSE.search(text)
    if m is None:
        return None
    what, rest = m.group("what"), m.group("rest")
    check = (
        " `sglang-farm doctor` checks every command line against the installed SGLang "
        f"before a start; `<python> -m {SGLANG_MODULE} --help` lists the flags."
    )
    if what == "unrecognized arguments":
        flags = [flag_key(tok) for tok in rest.lstrip(":").split() if tok.startswith("--")]
        names = ", ".join(f"--{f.replace('_', '-')}" for f in flags) or rest.strip(": ")
        # The log does not say which SGLang wrote it: the advice names both spellings.
        tips = [t for t in (log_advice(f) for f in flags) if t]
        if not tips:
            tips = [
                "Remove "
                + ", ".join(f"`{f}`" for f in flags)
                + " from the farm config or fix the spelling."
            ]
        return _Hit(
            FailureKind.BAD_FLAG,
            f"SGLang does not know the flag {names} (argparse: unrecognized arguments, exit 2)",
            " ".join(tips) + check,
            _RANK[FailureKind.BAD_FLAG],
        )
    if what == "ambiguous option":
        am = re.match(r":\s*(?P<opt>\S+) could match (?P<cands>.*)$", rest)
        opt = am.group("opt").split("=", 1)[0] if am else rest.strip(": ")
        cands = [c.strip() for c in am.group("cands").split(",")] if am else []
        flag = flag_key(opt)
        tip = log_advice(flag) or (
            f"`{flag}` is only a prefix of several SGLang flags: write one of them in full"
            + (": " + ", ".join(f"`{flag_key(c)}`" for c in cands) if cands else "")
            + "."
        )
        return _Hit(
            FailureKind.BAD_FLAG,
            f"the flag {opt} is ambiguous"
            + (f" (could match {', '.join(cands)})" if cands else "")
            + " (argparse, exit 2)",
            tip + check,
            _RANK[FailureKind.BAD_FLAG],
        )
    if what == "argument ":
        am = re.match(r"(?P<opt>[^:]+): (?P<detail>.*)$", rest)
        if am is None:
            return None
        opt = am.group("opt").split("/")[-1].strip()
        flag = flag_key(opt)
        detail = am.group("detail").strip()
        if "invalid int value" in detail:
            tip = f"`{flag}` takes a plain integer: write the number in full (e.g. 8192, not 8k)."
        elif "invalid choice" in detail:
            tip = f"`{flag}` accepts only the values argparse lists above; pick one of them."
        else:
            tip = f"Give `{flag}` a value SGLang accepts ({detail})."
        return _Hit(
            FailureKind.BAD_FLAG,
            _clip(f"SGLang rejected the value of {opt}: {detail} (argparse, exit 2)"),
            tip + check,
            _RANK[FailureKind.BAD_FLAG],
        )
    missing = rest.lstrip(":").strip()
    return _Hit(
        FailureKind.BAD_FLAG,
        _clip(f"SGLang needs the argument(s) {missing} (argparse, exit 2)"),
        "Set "
        + ", ".join(f"`{flag_key(m)}`" for m in missing.replace(",", " ").split())
        + " in the farm config."
        + check,
        _RANK[FailureKind.BAD_FLAG],
    )


_BACKEND_ADVICE = (
    'Set attention_backend = "flashinfer" for this worker (it runs on SM 8.x, 9.x, 10.x and '
    '12.x), or attention_backend = "auto" to let the farm pick per GPU architecture; '
    "`sglang-farm doctor` checks the backend against each GPU's compute capability."
)


def _attention_backend(text: str, serving: bool) -> _Hit | None:
    if "FlashAttention v3 Backend requires SM>=80 and SM<=90" in text:
        what = "the fa3 attention backend cannot run on this GPU (needs SM 8.x or 9.0)"
    elif m := re.search(r"TRTLLM MHA backend for (\w+) is only supported on", text):
        what = f"the trtllm_mha attention backend ({m.group(1)}) cannot run on this GPU"
    elif m := re.search(r"Only (\{.*?\}) backends are supported on Blackwell GPUs", text):
        what = (
            "this attention backend is not supported on Blackwell for this model "
            f"(only {m.group(1)})"
        )
    else:
        return None
    return _Hit(
        FailureKind.ATTENTION_BACKEND, what, _BACKEND_ADVICE, _RANK[FailureKind.ATTENTION_BACKEND]
    )


_DEEP_GEMM_ADVICE = (
    "deep_gemm needs a CUDA toolkit at import on SM >= 9.0: set CUDA_HOME to one in the "
    'worker\'s environment (e.g. env = { CUDA_HOME = "/usr/local/cuda" }), or turn DeepGEMM '
    "off with SGLANG_ENABLE_JIT_DEEPGEMM=0 in the same env table."
)


def _deep_gemm_hit() -> _Hit:
    return _Hit(
        FailureKind.DEEP_GEMM_NO_CUDA_HOME,
        "deep_gemm found no CUDA toolkit (assert cuda_home is not None): CUDA_HOME is unset "
        "and no nvcc or /usr/local/cuda exists",
        _DEEP_GEMM_ADVICE,
        _RANK[FailureKind.DEEP_GEMM_NO_CUDA_HOME],
    )


def _deep_gemm(text: str, serving: bool) -> _Hit | None:
    return _deep_gemm_hit() if "assert cuda_home is not None" in text else None


_ABI = re.compile(r"undefined symbol: (?P<sym>_ZN\w*?(?:3c10|2at|5torch)\w*)")


def _missing_kernel(text: str, serving: bool) -> _Hit | None:
    if m := _ABI.search(text):
        return _Hit(
            FailureKind.MISSING_KERNEL,
            _clip(
                "a compiled kernel library does not match the installed torch (torch ABI "
                f"mismatch: undefined symbol {m.group('sym')})"
            ),
            "Install the torch version sglang-kernel was built for (`pip show sglang-kernel` "
            "lists its torch pin) in the worker's Python environment, or reinstall "
            "sglang-kernel for this torch; a dependency resolution that moved torch is the "
            "usual cause. `sglang-farm doctor` shows torch's version and CUDA build.",
            _ABI_RANK,
        )
    if "[sgl_kernel] CRITICAL: Could not load any common_ops library!" in text:
        return _Hit(
            FailureKind.MISSING_KERNEL,
            "sgl_kernel could not load its common_ops library: no kernel binary for this "
            "GPU's architecture, or a broken install",
            "Install an sglang-kernel build that ships binaries for this GPU's compute "
            "capability (`pip install --upgrade sglang-kernel` in the worker's environment); "
            "`sglang-farm doctor` lists the architectures the installed package ships "
            "against each GPU.",
            _RANK[FailureKind.MISSING_KERNEL],
        )
    return None


def _port_advice(port: str | None) -> str:
    find = f"`ss -ltnp 'sport = :{port}'`" if port else "`ss -ltnp`"
    return (
        f"Another process holds the port: find it with {find} and stop it, or give this "
        "worker another port / nccl_port (every worker needs its own). SGLang only binds "
        "its HTTP port after loading the model, so the doctor's port check saves a load."
    )


def _port_in_use(text: str, serving: bool) -> _Hit | None:
    if m := re.search(r"\[Errno 98\] error while attempting to bind on address \((.*?)\)", text):
        port = m.group(1).rsplit(",", 1)[-1].strip()
        return _Hit(
            FailureKind.PORT_IN_USE,
            f"the HTTP port is already in use (bind on ({m.group(1)}) failed)",
            _port_advice(port if port.isdigit() else None),
            _RANK[FailureKind.PORT_IN_USE],
        )
    if m := re.search(r"(?P<name>\S[^:]*?) at (?P<port>\d+) is not available in \d+ seconds", text):
        return _Hit(
            FailureKind.PORT_IN_USE,
            f"{m.group('name')} port {m.group('port')} is already in use",
            _port_advice(m.group("port")),
            _RANK[FailureKind.PORT_IN_USE],
        )
    if re.search(r"address already in use", text, re.IGNORECASE):
        return _Hit(
            FailureKind.PORT_IN_USE,
            "a port is already in use",
            _port_advice(None),
            _RANK[FailureKind.PORT_IN_USE],
        )
    return None


def _kv_cache_too_small(text: str, serving: bool) -> _Hit | None:
    tail = (
        " Do not lower it: that shrinks the KV pool further (the OOM ladder does not step "
        "here). If it is already near 0.95, the model does not fit one GPU: use tp_size 2 "
        "or a smaller/quantized checkpoint, or lower context_length."
    )
    if "Not enough memory. Please try to increase --mem-fraction-static" in text:
        m = re.search(r"mem_fraction_static=([\d.]+)", text)
        cur = m.group(1) if m else None
        return _Hit(
            FailureKind.KV_CACHE_TOO_SMALL,
            "the KV cache does not fit: no GPU memory is left for the KV pool"
            + (f" at mem_fraction_static={cur}" if cur else ""),
            "Raise mem_fraction_static"
            + (f" above {cur} (e.g. {min(float(cur) + 0.05, 0.95):.2f})" if cur else "")
            + "."
            + tail,
            _RANK[FailureKind.KV_CACHE_TOO_SMALL],
        )
    if "Loaded weights leave no GPU memory for the KV cache" in text:
        cur_m = re.search(r"under --mem-fraction-static=([\d.]+)", text)
        min_m = re.search(r"Raise --mem-fraction-static above ([\d.]+)", text)
        cur = cur_m.group(1).rstrip(".") if cur_m else None
        low = min_m.group(1).rstrip(".") if min_m else None
        return _Hit(
            FailureKind.KV_CACHE_TOO_SMALL,
            "the loaded weights leave no GPU memory for the KV cache"
            + (f" at mem_fraction_static={cur}" if cur else ""),
            "Raise mem_fraction_static" + (f" above {low}" if low else "") + "." + tail,
            _RANK[FailureKind.KV_CACHE_TOO_SMALL],
        )
    return None


def _cuda_graph_capture(text: str, serving: bool) -> _Hit | None:
    if m := re.search(r"Capture cuda graph failed: ?(.*)$", text):
        return _Hit(
            FailureKind.CUDA_GRAPH_CAPTURE,
            _clip(f"CUDA graph capture failed: {m.group(1)}"),
            "Lower cuda_graph_max_bs_decode (e.g. 16), or lower mem_fraction_static (e.g. 0.8 "
            "or 0.7) to leave room for the graphs, or disable decode graphs with "
            'cuda_graph_backend_decode = "disabled" (slower decode).',
            _RANK[FailureKind.CUDA_GRAPH_CAPTURE],
        )
    if m := re.search(r"Fail when using backend: ?(\S+?) for (\w+) runner", text):
        role = m.group(2)
        return _Hit(
            FailureKind.CUDA_GRAPH_CAPTURE,
            f"CUDA graph capture failed for the {role} runner (backend {m.group(1)})",
            f"Lower cuda_graph_max_bs_{role} or mem_fraction_static, or disable {role} graphs "
            f'with cuda_graph_backend_{role} = "disabled".',
            _RANK[FailureKind.CUDA_GRAPH_CAPTURE],
        )
    return None


def _kv_alloc_runtime(text: str, serving: bool) -> _Hit | None:
    if m := re.search(r"\b(Prefill|Decode) out of memory", text):
        phase = m.group(1).lower()
        return _Hit(
            FailureKind.KV_ALLOC_RUNTIME,
            f"the KV cache pool ran out during {phase} (runtime KV allocation failed)",
            "Fewer tokens in flight: lower max_running_requests and/or chunked_prefill_size. "
            "If the GPU has head-room, a larger mem_fraction_static gives a larger KV pool.",
            _RANK[FailureKind.KV_ALLOC_RUNTIME],
        )
    if "alloc_req_slots runs out of memory" in text:
        return _Hit(
            FailureKind.KV_ALLOC_RUNTIME,
            "request slots ran out (alloc_req_slots runs out of memory)",
            "Lower max_running_requests.",
            _RANK[FailureKind.KV_ALLOC_RUNTIME],
        )
    return None


_CUDA_OOM = re.compile(
    r"OutOfMemoryError|CUDA out of memory|CUDA error: out of memory"
    r"|Triton Error \[CUDA\]: out of memory"
)
_CUDA_OOM_DETAIL = re.compile(
    r"Tried to allocate (?P<want>[\d.]+ \w+)\. GPU (?P<gpu>\d+) has a total capacity of "
    r"(?P<total>[\d.]+ \w+) of which (?P<free>[\d.]+ \w+) is free"
)


def _cuda_oom(text: str, serving: bool) -> _Hit | None:
    if not _CUDA_OOM.search(text):
        return None
    m = _CUDA_OOM_DETAIL.search(text)
    detail = (
        f": tried to allocate {m['want']} on GPU {m['gpu']} ({m['free']} free of {m['total']})"
        if m
        else ""
    )
    ladder = " With [oom] enabled the farm steps down its ladder and restarts the worker."
    if serving:
        return _Hit(
            FailureKind.CUDA_OOM_SERVING,
            f"CUDA out of memory while serving{detail}",
            "Lower mem_fraction_static (more head-room for activations), and/or lower "
            "max_running_requests or chunked_prefill_size (fewer tokens in flight)." + ladder,
            _RANK[FailureKind.CUDA_OOM_SERVING],
        )
    return _Hit(
        FailureKind.CUDA_OOM_LOAD,
        f"CUDA out of memory while loading{detail}",
        "Check with nvidia-smi that no other process holds memory on this GPU. Then lower "
        "mem_fraction_static (e.g. by 0.02-0.05) or cuda_graph_max_bs_decode so activations "
        "and CUDA graphs fit; if the weights alone do not fit, the model needs tp_size 2 or "
        "a quantized checkpoint." + ladder,
        _RANK[FailureKind.CUDA_OOM_LOAD],
    )


def _watchdog(text: str, serving: bool) -> _Hit | None:
    if "Scheduler watchdog timeout" not in text:
        return None
    m = re.search(r"watchdog_timeout=([\d.]+)", text)
    secs = f" (watchdog_timeout={m.group(1)} s)" if m else ""
    return _Hit(
        FailureKind.WATCHDOG_TIMEOUT,
        f"the scheduler hung: one forward batch ran longer than the watchdog allows{secs}",
        "The lines before this one hold a py-spy dump of the scheduler: see where it "
        "stuck. Check `nvidia-smi` and `dmesg -T | grep -i xid` for a GPU fault. If batches "
        "are legitimately this long, raise watchdog_timeout.",
        _RANK[FailureKind.WATCHDOG_TIMEOUT],
    )


_HOST_OOM_ADVICE = (
    "Host RAM ran out and the kernel OOM killer struck: confirm with `dmesg -T | grep -i oom` "
    "or `journalctl -k | grep -i oom`. Start fewer workers at once ([startup] parallel), "
    "remember a model in /dev/shm counts against RAM, raise the unit's MemoryMax= if a "
    "limit was hit, or add RAM."
)


def _host_oom(text: str, serving: bool) -> _Hit | None:
    if m := re.search(r"Rank (\d+) scheduler died during initialization \(exit code: -9\)", text):
        return _Hit(
            FailureKind.HOST_OOM_KILL,
            f"scheduler rank {m.group(1)} was SIGKILLed while initializing (exit code -9), "
            "usually by the kernel OOM killer",
            _HOST_OOM_ADVICE,
            _HOST_OOM_HINT_RANK,
        )
    if m := re.search(r"Subprocess (\S+) \(pid=\d+\) crashed with exit code -9", text):
        return _Hit(
            FailureKind.HOST_OOM_KILL,
            f"the SGLang subprocess {m.group(1)} was SIGKILLed (exit code -9), usually by the "
            "kernel OOM killer",
            _HOST_OOM_ADVICE,
            _HOST_OOM_HINT_RANK,
        )
    # systemd's own lines, present in `journalctl -u sglang@N`.
    if "Failed with result 'oom-kill'" in text or "killed by the OOM killer" in text:
        return _Hit(
            FailureKind.HOST_OOM_KILL,
            "the kernel OOM killer killed the worker (systemd: result oom-kill)",
            _HOST_OOM_ADVICE,
            _RANK[FailureKind.HOST_OOM_KILL],
        )
    return None


# Order matters only where one line matches several: the capture failure's message
# carries the CUDA OOM text, so it is tried first.
_MATCHERS: tuple[_Matcher, ...] = (
    _bad_flag,
    _attention_backend,
    _deep_gemm,
    _missing_kernel,
    _port_in_use,
    _kv_cache_too_small,
    _cuda_graph_capture,
    _kv_alloc_runtime,
    _cuda_oom,
    _watchdog,
    _host_oom,
)

# Hints for generic tracebacks whose last line SGLang words in a known way.
_TRACEBACK_HINTS: tuple[tuple[str, str], ...] = (
    (
        "The memory capacity is unbalanced",
        "Another process holds memory on one of this worker's GPUs: check `nvidia-smi`.",
    ),
    (
        "do not support overlap schedule",
        'mamba_radix_cache_strategy = "no_buffer" needs disable_overlap_schedule = true '
        "(and page_size 1, and a backend other than trtllm_mha).",
    ),
    (
        "served_model_name cannot contain a colon",
        "Remove the ':' from served_model_name.",
    ),
    (
        "is less than the minimum required version",
        "Upgrade the named package in the worker's Python environment.",
    ),
)


def _fatal_advice(exc_text: str) -> str:
    for needle, hint in _TRACEBACK_HINTS:
        if needle in exc_text:
            return hint
    return (
        "The worker raised an unhandled exception: the lines shown end the traceback; read "
        "the whole one with `journalctl -u sglang@N` (or the worker's log file). Fix its "
        "cause before restarting: an identical start fails the same way."
    )


# --------------------------------------------------------------------------- state machine


@dataclass(slots=True)
class _Traceback:
    header: str
    frames: deque[str] = field(default_factory=lambda: deque(maxlen=_MAX_FRAME_EVIDENCE))
    n_lines: int = 0
    exc_raw: str | None = None
    exc_text: str | None = None
    tail: list[str] = field(default_factory=list)
    n_tail: int = 0
    claimed: bool = False
    chained: bool = False  # a chain marker followed the exception line
    cause_raw: str | None = None  # the exception line of the previous section of a chain
    saw_deep_gemm: bool = False
    saw_cuda_home_assert: bool = False

    def evidence(self, extra: str | None = None) -> tuple[str, ...]:
        out: list[str] = [self.header, *self.frames]
        if self.cause_raw is not None:
            out.append(self.cause_raw)
        if self.exc_raw is not None:
            out.append(self.exc_raw)
        out.extend(self.tail[:_MAX_TAIL_EVIDENCE])
        if extra is not None:
            out.append(extra)
        return tuple(dict.fromkeys(out))  # drop repeats, keep order


class LogClassifier:
    """Streaming classifier for one worker lifetime (one process, from start to exit).

    `feed` each line as it arrives; it returns a `Failure` the moment a signature
    completes (None otherwise, including for duplicates of an already reported
    failure). `finish` names the failure that explains the exit.

    `serving` is False until "The server is fired up and ready to roll!" (or until
    the owner sets it, e.g. when adopting a worker whose start it did not see): the
    same CUDA OOM text is CUDA_OOM_LOAD before and CUDA_OOM_SERVING after.
    Memory is bounded: a traceback keeps its header, its last frames and its
    exception line, never the whole log.
    """

    def __init__(self, *, serving: bool = False) -> None:
        self.serving = serving
        self.ready_seen = False
        self._tb: _Traceback | None = None
        self._reports: list[tuple[int, Failure]] = []
        self._seen: set[tuple[FailureKind, str]] = set()

    @property
    def failures(self) -> tuple[Failure, ...]:
        """Every failure reported so far, in order (including ones `feed` returned None for)."""
        return tuple(f for _, f in self._reports)

    def feed(self, line: str) -> Failure | None:
        """Classify one line; return the failure it completes, if any."""
        raw = line.rstrip("\r\n")
        text = strip_prefixes(raw)
        pending: Failure | None = None
        tb = self._tb

        if tb is not None and tb.exc_raw is None:
            # Inside the frames. Indented lines are source code: never matched.
            tb.n_lines += 1
            if text[:1].isspace():
                if text.strip(" \t^~"):  # Python 3.11+ caret lines add nothing for people
                    tb.frames.append(raw)
                if "deep_gemm" in text:
                    tb.saw_deep_gemm = True
                if "assert cuda_home is not None" in text:
                    tb.saw_cuda_home_assert = True
                return None
            if (m := _EXC_LINE.match(text)) is not None:
                tb.exc_raw, tb.exc_text = raw, text
                hit = self._match(text)
                if hit is None and (
                    tb.saw_cuda_home_assert or (m["exc"] == "AssertionError" and tb.saw_deep_gemm)
                ):
                    hit = _deep_gemm_hit()
                if hit is not None:
                    tb.claimed = True
                    return self._report(hit, tb.evidence())
                return None
            if tb.n_lines > _MAX_FRAMES:
                self._tb = tb = None  # never ended: drop it, classify the line afresh
            # else: an interleaved record from another process; classified below.
        elif tb is not None:
            # After the exception line: continuation of its message, or the next record.
            if text.strip() in _CHAIN_MARKERS:
                tb.chained = True
                return None
            if tb.chained and not text.strip():
                return None
            if tb.chained and _TRACEBACK in text:
                # The next section of a chain: its exception line is the one that escaped.
                self._tb = _Traceback(header=raw, claimed=tb.claimed, cause_raw=tb.exc_raw)
                return None
            continues = (
                not tb.chained
                and not _is_record_start(raw)
                and _TRACEBACK not in text
                and tb.n_tail < _MAX_CONTINUATION
            )
            if continues:
                tb.n_tail += 1
                hit = self._match(text)
                if hit is not None:
                    tb.claimed = True
                    return self._report(hit, tb.evidence(raw))
                if text.strip():
                    tb.tail.append(raw)
                return None
            pending = self._close_traceback()

        if _TRACEBACK in text:
            if self._tb is not None and self._tb.exc_raw is None:
                # A new traceback while one had no exception line yet: drop the old one.
                self._tb = None
            self._tb = _Traceback(header=raw)
            hit = None
        else:
            if READY_TEXT in text:
                self.ready_seen = True
                self.serving = True
            hit = self._match(text)
        found = self._report(hit, (raw,)) if hit is not None else None
        # One line can close a traceback and match a signature: return the specific one.
        return found or pending

    def finish(
        self, exit_status: int | None = None, systemd_result: str | None = None
    ) -> Failure | None:
        """The failure that best explains this lifetime's end; None if the log explains nothing.

        `exit_status`: the process's exit status if known (-9 for SIGKILL); it appears
        in the evidence only, since SGLang SIGKILLs itself after nearly every failure.
        `systemd_result`: the unit's `Result` property; "oom-kill" is the kernel's
        own verdict and wins over anything the log said. Otherwise the highest-ranked
        failure seen wins (a CUDA OOM beats the generic traceback that wraps it);
        between equals, the first, as later ones are usually its consequences.
        None means: the supervisor records a plain CRASH.
        """
        self._close_traceback()
        if systemd_result == "oom-kill":
            evidence = [f"systemd: Result={systemd_result}"]
            if exit_status is not None:
                evidence.append(f"exit status: {exit_status}")
            for _, f in self._reports:
                if f.kind is FailureKind.HOST_OOM_KILL:
                    evidence.extend(f.lines)
            return Failure(
                FailureKind.HOST_OOM_KILL,
                "the kernel OOM killer killed the worker (systemd: Result=oom-kill)",
                _HOST_OOM_ADVICE,
                tuple(evidence),
            )
        best: tuple[int, Failure] | None = None
        for rank, f in self._reports:
            if best is None or rank > best[0]:
                best = (rank, f)
        return best[1] if best is not None else None

    # ------------------------------------------------------------------ internals

    def _match(self, text: str) -> _Hit | None:
        for matcher in _MATCHERS:
            hit = matcher(text, self.serving)
            if hit is not None:
                return hit
        return None

    def _report(self, hit: _Hit, lines: tuple[str, ...]) -> Failure | None:
        key = (hit.kind, hit.summary)
        if key in self._seen:
            return None
        self._seen.add(key)
        failure = Failure(hit.kind, hit.summary, hit.advice, lines)
        self._reports.append((hit.rank, failure))
        return failure

    def _close_traceback(self) -> Failure | None:
        """End the current traceback; an unclaimed one with an exception line is FATAL_TRACEBACK."""
        tb, self._tb = self._tb, None
        if tb is None or tb.claimed or tb.exc_text is None:
            return None
        return self._report(
            _Hit(
                FailureKind.FATAL_TRACEBACK,
                _clip(tb.exc_text),
                _fatal_advice(tb.exc_text),
                _RANK[FailureKind.FATAL_TRACEBACK],
            ),
            tb.evidence(),
        )


def _reduce_lifetime(reports: list[tuple[int, Failure]]) -> list[Failure]:
    """The distinct failures of one lifetime, in order of first appearance.

    One per kind (the higher-ranked if a kind appears twice, e.g. the torch ABI
    diagnosis over the generic sgl_kernel one); generic tracebacks only when
    nothing specific explains the lifetime (they are then kept per message).
    """
    specific = [(r, f) for r, f in reports if f.kind is not FailureKind.FATAL_TRACEBACK]
    if not specific:
        return [f for _, f in reports]
    slots: dict[FailureKind, tuple[int, Failure]] = {}
    for rank, f in specific:
        if f.kind not in slots or rank > slots[f.kind][0]:
            slots[f.kind] = (rank, f)  # dict keeps the first insertion's position
    return [f for _, f in slots.values()]


def classify_lines(lines: Iterable[str]) -> list[Failure]:
    """Every distinct failure in a whole log, in order.

    A log may hold several worker lifetimes (a journal across restarts): a new one
    starts at SGLang's `server_args=ServerArgs(` line or systemd's "Starting/Started
    <unit>.service", which resets the serving state. Within a lifetime each kind is
    reported once; across lifetimes, each lifetime's failures are reported.
    """
    out: list[Failure] = []
    clf = LogClassifier()
    active = False
    for line in lines:
        if active and _LAUNCH.search(strip_prefixes(line)):
            clf.finish()
            out.extend(_reduce_lifetime(clf._reports))
            clf, active = LogClassifier(), False
        clf.feed(line)
        active = True
    clf.finish()
    out.extend(_reduce_lifetime(clf._reports))
    return out
