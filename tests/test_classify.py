"""The log classifier on SGLang's real failure texts (docs/reference/sglang.md §11, nvml.md §8)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sglang_farm.sglang.classify import READY_TEXT, LogClassifier, classify_lines, strip_prefixes
from sglang_farm.sglang.failures import FailureKind

LOGS = Path(__file__).parent / "data" / "logs"

# docs/reference/nvml.md §8, verbatim.
CUDA_OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 372.53 GiB. GPU 0 has a total "
    "capacity of 139.80 GiB of which 139.29 GiB is free. Including non-PyTorch memory, this "
    "process has 518.00 MiB memory in use. ..."
)

K = FailureKind

# (line, kind, fragments that must appear in summary+advice)
SIGNATURES: list[tuple[str, FailureKind, tuple[str, ...]]] = [
    (
        "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. "
        "Current value: mem_fraction_static=0.55",
        K.KV_CACHE_TOO_SMALL,
        ("mem_fraction_static=0.55", "Raise mem_fraction_static above 0.55"),
    ),
    (
        "ValueError: Loaded weights leave no GPU memory for the KV cache under "
        "--mem-fraction-static=0.7. Raise --mem-fraction-static above 0.74 (minimum viable = "
        "1 - available/pre = 0.7312)...",
        K.KV_CACHE_TOO_SMALL,
        ("mem_fraction_static=0.7", "Raise mem_fraction_static above 0.74"),
    ),
    (CUDA_OOM, K.CUDA_OOM_LOAD, ("372.53 GiB", "GPU 0", "139.29 GiB free", "lower")),
    ("Triton Error [CUDA]: out of memory", K.CUDA_OOM_LOAD, ("mem_fraction_static",)),
    ("RuntimeError: CUDA error: out of memory", K.CUDA_OOM_LOAD, ("mem_fraction_static",)),
    (
        "Exception: Capture cuda graph failed: CUDA out of memory. Tried to allocate 1.00 GiB. "
        "GPU 0 has a total capacity of 47.37 GiB of which 512.00 MiB is free.",
        K.CUDA_GRAPH_CAPTURE,
        ("cuda_graph_max_bs_decode", 'cuda_graph_backend_decode = "disabled"'),
    ),
    (
        "Fail when using backend: full for prefill runner.",
        K.CUDA_GRAPH_CAPTURE,
        ("prefill", "cuda_graph_max_bs_prefill"),
    ),
    (
        "RuntimeError: Prefill out of memory. Try to lower your batch size.",
        K.KV_ALLOC_RUNTIME,
        ("prefill", "max_running_requests", "chunked_prefill_size"),
    ),
    (
        "RuntimeError: Decode out of memory. Try to lower your batch size.",
        K.KV_ALLOC_RUNTIME,
        ("decode", "max_running_requests"),
    ),
    (
        "RuntimeError: alloc_req_slots runs out of memory. Please set a smaller number for "
        "--max-running-requests.",
        K.KV_ALLOC_RUNTIME,
        ("Lower max_running_requests",),
    ),
    (
        "RuntimeError: Rank 0 scheduler died during initialization (exit code: -9). If exit "
        "code is -9 (SIGKILL), a common cause is the OS OOM killer. Run dmesg -T | grep -i oom "
        "to check.",
        K.HOST_OOM_KILL,
        ("rank 0", "dmesg -T | grep -i oom"),
    ),
    (
        "Subprocess scheduler_0 (pid=4242) crashed with exit code -9. Triggering SIGQUIT for "
        "cleanup...",
        K.HOST_OOM_KILL,
        ("scheduler_0", "SIGKILLed", "dmesg -T | grep -i oom"),
    ),
    (
        "sglang@3.service: Failed with result 'oom-kill'.",
        K.HOST_OOM_KILL,
        ("OOM killer",),
    ),
    (
        "Scheduler watchdog timeout (self.watchdog_timeout=300, self.soft=False)",
        K.WATCHDOG_TIMEOUT,
        ("watchdog_timeout=300", "py-spy"),
    ),
    (
        "[sgl_kernel] CRITICAL: Could not load any common_ops library!",
        K.MISSING_KERNEL,
        ("sglang-kernel", "sglang-farm doctor"),
    ),
    (
        "- ImportError: /opt/sglang/lib/python3.12/site-packages/sgl_kernel/sm90/"
        "common_ops.abi3.so: undefined symbol: _ZNK3c106SymInt22maybe_as_int_slow_pathEv",
        K.MISSING_KERNEL,
        ("torch ABI mismatch", "_ZNK3c106SymInt22maybe_as_int_slow_pathEv", "torch version"),
    ),
    (
        "    assert cuda_home is not None",
        K.DEEP_GEMM_NO_CUDA_HOME,
        ("CUDA_HOME", "SGLANG_ENABLE_JIT_DEEPGEMM=0"),
    ),
    (
        "AssertionError: FlashAttention v3 Backend requires SM>=80 and SM<=90. Please use "
        "--attention-backend flashinfer.",
        K.ATTENTION_BACKEND,
        ("fa3", 'attention_backend = "flashinfer"'),
    ),
    (
        "ValueError: TRTLLM MHA backend for decode is only supported on Hopper (SM90), Blackwell "
        "(SM100) and (SM120) GPUs.",
        K.ATTENTION_BACKEND,
        ("trtllm_mha", 'attention_backend = "flashinfer"'),
    ),
    (
        "AssertionError: Only {'triton', 'trtllm_mha', 'flashinfer'} backends are supported on "
        "Blackwell GPUs for hybrid GDN models.",
        K.ATTENTION_BACKEND,
        ("Blackwell", 'attention_backend = "flashinfer"'),
    ),
    (
        "ERROR:    [Errno 98] error while attempting to bind on address ('0.0.0.0', 30000): "
        "address already in use",
        K.PORT_IN_USE,
        ("0.0.0.0", "ss -ltnp 'sport = :30000'"),
    ),
    (
        "Detokenizer port at 30011 is not available in 30 seconds. Please check the port.",
        K.PORT_IN_USE,
        ("30011", "ss -ltnp 'sport = :30011'"),
    ),
    (
        "OSError: [Errno 98] Address already in use",
        K.PORT_IN_USE,
        ("port",),
    ),
    (
        "launch_server.py: error: unrecognized arguments: --mamba-scheduler-strategy extra_buffer",
        K.BAD_FLAG,
        ("--mamba-scheduler-strategy", "mamba_radix_cache_strategy"),
    ),
    (
        # SGLang 0.5.12 (the seed host) knows only the older spelling.
        "sglang serve: error: unrecognized arguments: --mamba-radix-cache-strategy extra_buffer",
        K.BAD_FLAG,
        ("--mamba-radix-cache-strategy", "SGLang <= 0.5.22 calls it `mamba_scheduler_strategy`"),
    ),
    (
        "launch_server.py: error: ambiguous option: --cuda-graph-max-bs could match "
        "--cuda-graph-max-bs-decode, --cuda-graph-max-bs-prefill",
        K.BAD_FLAG,
        ("--cuda-graph-max-bs", "cuda_graph_max_bs_decode", "cuda_graph_max_bs_prefill"),
    ),
    (
        "launch_server.py: error: ambiguous option: --enable-metric could match --enable-metrics, "
        "--enable-metrics-for-all-schedulers",
        K.BAD_FLAG,
        ("--enable-metric", "write one of them in full", "`enable_metrics`"),
    ),
    (
        "launch_server.py: error: argument --chunked-prefill-size: invalid int value: '8k'",
        K.BAD_FLAG,
        ("--chunked-prefill-size", "'8k'", "plain integer"),
    ),
    (
        "launch_server.py: error: the following arguments are required: --model-path",
        K.BAD_FLAG,
        ("--model-path", "`model_path`"),
    ),
]

PREFIXES = [
    "",
    "[2026-11-29 10:00:00] ",
    "[2026-11-29 10:00:00 TP0] ",
    "Nov 29 10:00:00 gpu-host-07 python3[4242]: ",
    "2026-11-29T10:00:00+0000 gpu-host-07 python3[4242]: [2026-11-29 10:00:00 DP0 TP1] ",
]


@pytest.mark.parametrize("prefix", PREFIXES, ids=["bare", "sglang", "sglang-tp", "journal", "both"])
@pytest.mark.parametrize(
    ("line", "kind", "fragments"),
    SIGNATURES,
    ids=[f"{k}-{i}" for i, (_, k, _) in enumerate(SIGNATURES)],
)
def test_signature_is_classified_with_advice(
    prefix: str, line: str, kind: FailureKind, fragments: tuple[str, ...]
) -> None:
    clf = LogClassifier()
    failure = clf.feed(prefix + line + "\n")
    assert failure is not None
    assert failure.kind is kind
    text = failure.summary + " " + failure.advice
    for fragment in fragments:
        assert fragment in text
    assert failure.lines == (prefix + line,)  # verbatim, newline removed
    assert clf.finish(-9) == failure


@pytest.mark.parametrize(
    "line",
    [
        "KV cache pool is full. Retract requests. #retracted_reqs: 3, #new_token_ratio: 0.4 -> 0.6",
        "KV pool holds 4096 tokens, fewer than --context-length 8192. Longer requests wait.",
        "Decode batch, #running-req: 64, #token: 843120, token usage: 0.99, cuda graph: True, "
        "gen throughput (token/s): 2712.44, #queue-req: 12",
        "server_args=ServerArgs(model_path='/m', mem_fraction_static=0.88, watchdog_timeout=300)",
        "Received sigquit from a child process. It usually means the child failed.",
        READY_TEXT,
    ],
)
def test_ordinary_lines_and_warnings_are_not_failures(line: str) -> None:
    clf = LogClassifier()
    assert clf.feed("[2026-11-29 10:00:00 TP0] " + line) is None
    assert clf.finish(0) is None
    assert classify_lines([line]) == []


def test_strip_prefixes_removes_journal_and_sglang_prefix_only() -> None:
    line = "Nov 29 10:00:00 host python3[1]: [2026-11-29 10:00:00 TP0] Load weight begin.\n"
    assert strip_prefixes(line) == "Load weight begin."
    assert strip_prefixes('  File "x.py", line 1') == '  File "x.py", line 1'


def test_same_cuda_oom_text_is_load_before_ready_and_serving_after() -> None:
    clf = LogClassifier()
    first = clf.feed(CUDA_OOM)
    assert first is not None and first.kind is K.CUDA_OOM_LOAD
    assert not clf.ready_seen and not clf.serving
    assert clf.feed(f"[2026-11-29 10:01:23] {READY_TEXT}") is None
    assert clf.ready_seen and clf.serving
    second = clf.feed(CUDA_OOM)
    assert second is not None and second.kind is K.CUDA_OOM_SERVING
    assert "while serving" in second.summary
    assert "max_running_requests" in second.advice


def test_serving_can_be_set_by_the_owner_for_an_adopted_worker() -> None:
    clf = LogClassifier(serving=True)
    failure = clf.feed(CUDA_OOM)
    assert failure is not None and failure.kind is K.CUDA_OOM_SERVING
    assert not clf.ready_seen


def test_kv_too_small_advice_says_raise_and_cuda_oom_advice_says_lower() -> None:
    kv = LogClassifier().feed(SIGNATURES[0][0])
    oom = LogClassifier().feed(CUDA_OOM)
    assert kv is not None and oom is not None
    assert kv.advice.startswith("Raise mem_fraction_static")
    assert "Do not lower it" in kv.advice
    assert "lower mem_fraction_static" in oom.advice


def test_traceback_failure_is_reported_on_its_exception_line_with_context() -> None:
    clf = LogClassifier()
    lines = (LOGS / "cuda_oom_load.log").read_text().splitlines()
    oom_at = next(i for i, line in enumerate(lines) if "OutOfMemoryError" in line)
    for line in lines[:oom_at]:
        assert clf.feed(line) is None
    failure = clf.feed(lines[oom_at])
    assert failure is not None and failure.kind is K.CUDA_OOM_LOAD
    assert "Scheduler hit an exception: Traceback" in failure.lines[0]
    assert failure.lines[-1] == lines[oom_at]
    assert not any(set(line.strip()) <= {"^"} for line in failure.lines)  # no caret lines
    assert len(failure.lines) <= 8
    for line in lines[oom_at + 1 :]:
        assert clf.feed(line) is None  # the sigquit teardown adds nothing
    assert clf.finish(-9) == failure


def test_unclaimed_traceback_becomes_fatal_traceback_with_its_last_exception_line() -> None:
    clf = LogClassifier()
    tb = [
        "[2026-11-29 10:00:19] Scheduler hit an exception: Traceback (most recent call last):",
        '  File "/opt/sglang/srt/managers/scheduler.py", line 3101, in run_scheduler_process',
        '    raise Exception(f"Capture cuda graph failed: {e}")',  # source code: never matched
        "KeyError: 'model.layers.0.mlp.gate_proj.weight'",
    ]
    for line in tb:
        assert clf.feed(line) is None  # not yet: the message might continue
    failure = clf.feed("[2026-11-29 10:00:19] Received sigquit from a child process.")
    assert failure is not None
    assert failure.kind is K.FATAL_TRACEBACK
    assert failure.summary == "KeyError: 'model.layers.0.mlp.gate_proj.weight'"
    assert failure.lines[0] == tb[0] and failure.lines[-1] == tb[-1]
    assert clf.finish(-9) == failure


def test_finish_flushes_a_traceback_that_ends_the_log() -> None:
    clf = LogClassifier()
    for line in ["Traceback (most recent call last):", '  File "a.py", line 1', "ValueError: boom"]:
        assert clf.feed(line) is None
    failure = clf.finish(1)
    assert failure is not None
    assert (failure.kind, failure.summary) == (K.FATAL_TRACEBACK, "ValueError: boom")


def test_chained_traceback_reports_the_outer_exception_once_with_its_cause() -> None:
    lines = [
        "Traceback (most recent call last):",
        '  File "a.py", line 1, in f',
        "OSError: disk on fire",
        "",
        "During handling of the above exception, another exception occurred:",
        "",
        "Traceback (most recent call last):",
        '  File "b.py", line 2, in g',
        "RuntimeError: could not read the checkpoint",
    ]
    failures = classify_lines(lines)
    assert [f.summary for f in failures] == ["RuntimeError: could not read the checkpoint"]
    assert "OSError: disk on fire" in failures[0].lines


def test_deep_gemm_assertion_is_classified_from_the_frames() -> None:
    lines = [
        "Traceback (most recent call last):",
        '  File "/opt/sglang/lib/python3.12/site-packages/deep_gemm/__init__.py", line 27',
        "    _C.init(os.path.dirname(os.path.abspath(__file__)), find_cuda_home())",
        "AssertionError",
    ]
    clf = LogClassifier()
    results = [clf.feed(line) for line in lines]
    assert results[:3] == [None, None, None]
    assert results[3] is not None and results[3].kind is K.DEEP_GEMM_NO_CUDA_HOME
    assert results[3].lines[-1] == "AssertionError"


def test_sgl_kernel_report_after_bare_import_error_claims_the_traceback() -> None:
    failures = classify_lines((LOGS / "seed_sgl_kernel.log").read_text().splitlines())
    assert [f.kind for f in failures] == [K.MISSING_KERNEL]
    assert "ImportError:" in failures[0].lines
    assert "torch" not in failures[0].summary  # not an ABI problem in this log


def test_torch_abi_detail_refines_the_sgl_kernel_failure() -> None:
    clf = LogClassifier()
    for line in [
        "ImportError:",
        "[sgl_kernel] CRITICAL: Could not load any common_ops library!",
        "Error details from previous import attempts:",
        "- ImportError: /x/sgl_kernel/sm90/common_ops.abi3.so: undefined symbol: "
        "_ZN3c104cuda9SetDeviceEab",
    ]:
        clf.feed(line)
    best = clf.finish(1)
    assert best is not None and best.kind is K.MISSING_KERNEL
    assert "torch ABI mismatch" in best.summary
    assert len(clf.failures) == 2


def test_finish_prefers_cuda_oom_over_generic_traceback_and_sigquit_and_exit_hint() -> None:
    clf = LogClassifier()
    for line in [
        "[2026-11-29 10:00:19] Scheduler hit an exception: Traceback (most recent call last):",
        '  File "scheduler.py", line 1',
        CUDA_OOM,
        "[2026-11-29 10:00:19] Received sigquit from a child process. It usually means the "
        "child failed.",
        "Traceback (most recent call last):",
        '  File "engine.py", line 9',
        "RuntimeError: Rank 0 scheduler died during initialization (exit code: -9). If exit code "
        "is -9 (SIGKILL), a common cause is the OS OOM killer.",
        "Traceback (most recent call last):",
        '  File "launch_server.py", line 9',
        "RuntimeError: Initialization failed. Please see the error messages above.",
    ]:
        clf.feed(line)
    best = clf.finish(-9)
    assert best is not None and best.kind is K.CUDA_OOM_LOAD
    kinds = [f.kind for f in clf.failures]
    assert kinds == [K.CUDA_OOM_LOAD, K.HOST_OOM_KILL, K.FATAL_TRACEBACK]


def test_first_generic_traceback_wins_over_its_consequences() -> None:
    clf = LogClassifier()
    for line in [
        "Traceback (most recent call last):",
        '  File "a.py", line 1',
        "KeyError: 'weight'",
        "[2026-11-29 10:00:19] Received sigquit from a child process.",
        "Traceback (most recent call last):",
        '  File "b.py", line 1',
        "RuntimeError: Initialization failed. Please see the error messages above.",
    ]:
        clf.feed(line)
    best = clf.finish(-9)
    assert best is not None and best.summary == "KeyError: 'weight'"


def test_systemd_oom_kill_result_wins_and_shows_in_evidence() -> None:
    clf = LogClassifier()
    clf.feed("Scheduler watchdog timeout (self.watchdog_timeout=300, self.soft=False)")
    best = clf.finish(-9, systemd_result="oom-kill")
    assert best is not None and best.kind is K.HOST_OOM_KILL
    assert "systemd: Result=oom-kill" in best.lines
    assert "exit status: -9" in best.lines


def test_exit_without_any_signature_is_none_so_the_supervisor_records_crash() -> None:
    clf = LogClassifier()
    clf.feed("[2026-11-29 10:00:01] Load weight begin. avail mem=139.29 GB")
    assert clf.finish(-9, systemd_result="signal") is None


def test_port_in_use_after_another_servers_ready_line_is_still_port_in_use() -> None:
    clf = LogClassifier()
    clf.feed(f"[2026-11-29 10:01:23] {READY_TEXT}")
    clf.feed(
        "ERROR:    [Errno 98] error while attempting to bind on address ('0.0.0.0', 30000): "
        "address already in use"
    )
    best = clf.finish(3)
    assert best is not None and best.kind is K.PORT_IN_USE


def test_repeated_identical_failure_is_reported_once() -> None:
    clf = LogClassifier()
    assert clf.feed(CUDA_OOM) is not None
    assert clf.feed(CUDA_OOM) is None
    assert len(clf.failures) == 1


def test_a_huge_traceback_keeps_bounded_evidence() -> None:
    clf = LogClassifier()
    clf.feed("Traceback (most recent call last):")
    for i in range(300):
        clf.feed(f'  File "f{i}.py", line {i}, in g')
    clf.feed("RecursionError: maximum recursion depth exceeded")
    best = clf.finish(1)
    assert best is not None and best.kind is K.FATAL_TRACEBACK
    assert len(best.lines) <= 6
    assert best.lines[-2] == '  File "f299.py", line 299, in g'


def test_generic_traceback_hint_for_known_sglang_messages() -> None:
    clf = LogClassifier()
    for line in [
        "Traceback (most recent call last):",
        '  File "bootstrap.py", line 1',
        "RuntimeError: The memory capacity is unbalanced. Some GPUs may be occupied by other "
        "processes.",
    ]:
        clf.feed(line)
    best = clf.finish(-9)
    assert best is not None and "nvidia-smi" in best.advice


@pytest.mark.parametrize(
    ("name", "kinds"),
    [
        ("cuda_oom_load.log", [K.CUDA_OOM_LOAD]),
        ("seed_deep_gemm.log", [K.DEEP_GEMM_NO_CUDA_HOME]),
        ("seed_sgl_kernel.log", [K.MISSING_KERNEL]),
        ("attention_fa3_sm120.log", [K.ATTENTION_BACKEND]),
        ("healthy.log", []),
        (
            "journal_multi.log",
            [K.BAD_FLAG, K.KV_CACHE_TOO_SMALL, K.CUDA_OOM_SERVING, K.HOST_OOM_KILL],
        ),
    ],
)
def test_classify_lines_on_sample_logs(name: str, kinds: list[FailureKind]) -> None:
    failures = classify_lines((LOGS / name).read_text().splitlines())
    assert [f.kind for f in failures] == kinds


def test_classify_lines_resets_serving_state_per_lifetime() -> None:
    lines = [
        "[2026-11-29 10:00:00] server_args=ServerArgs(model_path='/m')",
        f"[2026-11-29 10:01:00] {READY_TEXT}",
        CUDA_OOM,
        "[2026-11-29 10:05:00] server_args=ServerArgs(model_path='/m')",
        CUDA_OOM,
    ]
    assert [f.kind for f in classify_lines(lines)] == [K.CUDA_OOM_SERVING, K.CUDA_OOM_LOAD]
