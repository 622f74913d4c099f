"""The classifier's rules that mutation testing found unheld (issue 27): clipping,
argparse's messages, the traceback's limits and evidence, ties between equal ranks, and
whole logs (`classify_lines`)."""

from __future__ import annotations

from sglang_farm.sglang.classify import LogClassifier, classify_lines
from sglang_farm.sglang.failures import Failure
from sglang_farm.sglang.failures import FailureKind as K

TB = "Traceback (most recent call last):"
FRAME = '  File "/opt/sglang/srt/managers/scheduler.py", line 10, in run'
OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"


def feed(lines: list[str]) -> LogClassifier:
    clf = LogClassifier()
    for line in lines:
        clf.feed(line)
    return clf


def kinds(failures: tuple[Failure, ...] | list[Failure]) -> list[K]:
    return [f.kind for f in failures]


def one(line: str) -> Failure:
    (f,) = classify_lines([line])
    return f


# ---- summaries and advice --------------------------------------------------------------


def test_a_long_exception_is_clipped_to_300_characters() -> None:
    def summary(n: int) -> str:
        exc = "RuntimeError: " + "x" * (n - len("RuntimeError: "))
        (f,) = classify_lines([TB, FRAME, exc])
        return f.summary

    assert len(summary(300)) == 300 and not summary(300).endswith("...")
    clipped = summary(301)
    assert len(clipped) == 300 and clipped.endswith("x" * 10 + "...")


def test_argparse_messages_name_the_flag() -> None:
    f = one("sglang: error: unrecognized arguments: --foo-bar 3")
    assert f.summary == (
        "SGLang does not know the flag --foo-bar (argparse: unrecognized arguments, exit 2)"
    )
    assert f.advice.startswith("Remove `foo_bar` from the farm config or fix the spelling. ")
    amb = "sglang: error: ambiguous option: --mem=3 could match --mem-fraction-static, --mem-x"
    assert one(amb).summary == (
        "the flag --mem is ambiguous (could match --mem-fraction-static, --mem-x) "
        "(argparse, exit 2)"
    )
    assert one("sglang: error: ambiguous option: --mem").summary == (
        "the flag --mem is ambiguous (argparse, exit 2)"
    )
    choice = one(
        "sglang: error: argument --attention-backend: invalid choice: 'x' (choose from 'a')"
    )
    assert choice.advice.startswith(
        "`attention_backend` accepts only the values argparse lists above; pick one of them."
    )


def test_a_bind_failure_without_a_port_still_classifies() -> None:
    f = one("[Errno 98] error while attempting to bind on address (/tmp/sock)")
    assert f.kind is K.PORT_IN_USE
    assert f.summary == "the HTTP port is already in use (bind on (/tmp/sock) failed)"


def test_a_graph_capture_failure_names_the_runner_and_backend() -> None:
    f = one("Fail when using backend: fa3 for decode runner")
    assert f.summary == "CUDA graph capture failed for the decode runner (backend fa3)"


def test_a_too_small_kv_cache_suggests_a_fraction_up_to_095() -> None:
    line = "Not enough memory. Please try to increase --mem-fraction-static. "
    assert one(line + "mem_fraction_static=0.85").advice.startswith(
        "Raise mem_fraction_static above 0.85 (e.g. 0.90). "
    )
    assert one(line + "mem_fraction_static=0.93").advice.startswith(
        "Raise mem_fraction_static above 0.93 (e.g. 0.95). "
    )


def test_systemds_oom_killer_line_is_a_host_oom() -> None:
    f = one("sglang@0.service: A process of this unit has been killed by the OOM killer.")
    assert f.kind is K.HOST_OOM_KILL


# ---- tracebacks ------------------------------------------------------------------------


def test_deep_gemm_is_named_only_from_its_own_frames() -> None:
    dg = '  File "/opt/sglang/site-packages/deep_gemm/jit.py", line 3, in build'
    assert kinds(classify_lines([TB, dg, "AssertionError"])) == [K.DEEP_GEMM_NO_CUDA_HOME]
    # One space of indent is a frame line too.
    one_space = ' File "/opt/sglang/site-packages/deep_gemm/jit.py", line 3'
    assert kinds(classify_lines([TB, one_space, "AssertionError"])) == [K.DEEP_GEMM_NO_CUDA_HOME]
    assert kinds(classify_lines([TB, "    assert cuda_home is not None", "AssertionError"])) == [
        K.DEEP_GEMM_NO_CUDA_HOME
    ]
    # Another assertion, or deep_gemm's frames with another exception: a plain traceback.
    assert kinds(classify_lines([TB, FRAME, "    x = 1", "AssertionError"])) == [K.FATAL_TRACEBACK]
    assert kinds(classify_lines([TB, dg, "RuntimeError: boom"])) == [K.FATAL_TRACEBACK]


def test_a_traceback_is_followed_for_400_lines_without_its_exception() -> None:
    def failures(interleaved: int) -> list[K]:
        return kinds(classify_lines([TB] + ["INFO: step"] * interleaved + ["RuntimeError: x"]))

    assert failures(250) == [K.FATAL_TRACEBACK]
    assert failures(400) == [K.FATAL_TRACEBACK]
    assert failures(401) == []  # dropped at line 401: the exception line stands alone


def test_an_exception_message_continues_for_40_lines() -> None:
    def reported(plain: int) -> list[K]:
        clf = feed([TB, FRAME, "RuntimeError: boom"] + ["detail"] * plain + [OOM])
        clf.finish()  # a claimed traceback is not reported again at the end
        return kinds(clf.failures)

    # A signature in the message's continuation claims the traceback...
    assert reported(25) == [K.CUDA_OOM_LOAD]
    assert reported(39) == [K.CUDA_OOM_LOAD]
    # ...past 40 lines the traceback ends as a plain one, and the line stands alone.
    assert reported(40) == [K.FATAL_TRACEBACK, K.CUDA_OOM_LOAD]


def test_a_traceback_keeps_three_message_lines_as_evidence() -> None:
    lines = [TB, FRAME, "RuntimeError: boom", "one", "", "two", "three", "four"]
    (f,) = classify_lines(lines)
    assert f.lines == (TB, FRAME, "RuntimeError: boom", "one", "two", "three")
    claimed = feed([TB, FRAME, "RuntimeError: boom", "one", OOM])
    assert claimed.failures[0].lines == (TB, FRAME, "RuntimeError: boom", "one", OOM)


def test_a_log_ending_inside_a_traceback_reports_it() -> None:
    assert kinds(classify_lines(["INFO: start", TB, FRAME, "RuntimeError: boom"])) == [
        K.FATAL_TRACEBACK
    ]
    # ...and so does a lifetime that ends inside one (the next one starts).
    launch = "server_args=ServerArgs(model_path='/models/m')"
    assert kinds(classify_lines([TB, FRAME, "RuntimeError: boom", launch])) == [K.FATAL_TRACEBACK]


# ---- which failure explains the end ----------------------------------------------------

KERNEL = "[sgl_kernel] CRITICAL: Could not load any common_ops library!"
DEEP_GEMM = "    assert cuda_home is not None"
FA3 = (
    "AssertionError: FlashAttention v3 Backend requires SM>=80 and SM<=90. Please use "
    "--attention-backend flashinfer."
)


def test_between_equal_ranks_the_first_failure_explains_the_end() -> None:
    for first, then in ((KERNEL, DEEP_GEMM), (DEEP_GEMM, FA3), (KERNEL, FA3)):
        clf = feed([first, then])
        best = clf.finish()
        assert best is not None and best == clf.failures[0]


def test_an_oom_while_loading_outranks_one_while_serving() -> None:
    clf = feed([OOM, "The server is fired up and ready to roll!", OOM])
    assert kinds(clf.failures) == [K.CUDA_OOM_LOAD, K.CUDA_OOM_SERVING]
    best = clf.finish()
    assert best is not None and best.kind is K.CUDA_OOM_LOAD


def test_the_oom_killers_verdict_carries_only_the_host_oom_lines() -> None:
    hint = "Rank 0 scheduler died during initialization (exit code: -9)"
    clf = feed([KERNEL, hint])
    best = clf.finish(-9, "oom-kill")
    assert best is not None and best.lines == (
        "systemd: Result=oom-kill",
        "exit status: -9",
        hint,
    )


def test_a_whole_log_reports_a_plain_traceback_only_when_nothing_specific_explains() -> None:
    flag = "sglang: error: unrecognized arguments: --foo-bar"
    assert kinds(classify_lines([TB, FRAME, "RuntimeError: boom", "INFO: x", flag])) == [K.BAD_FLAG]
    # One per kind: the first of two equal ones.
    other = "sglang: error: unrecognized arguments: --baz"
    (f,) = classify_lines([flag, other])
    assert "--foo-bar" in f.summary
