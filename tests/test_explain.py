"""`sglang-farm explain` on sample SGLang logs, from a file and from stdin."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from sglang_farm.cli.explain import explain
from sglang_farm.sglang.explain import explain_lines, format_text
from sglang_farm.sglang.failures import Failure, FailureKind

LOGS = Path(__file__).parent / "data" / "logs"


def test_explain_file_prints_kind_lines_and_advice_and_exits_1() -> None:
    result = CliRunner().invoke(explain, [str(LOGS / "seed_deep_gemm.log")])
    assert result.exit_code == 1, result.output
    out = result.output
    assert out.startswith(f"1 failure found in {LOGS / 'seed_deep_gemm.log'}.")
    assert "[1] deep_gemm_no_cuda_home: deep_gemm found no CUDA toolkit" in out
    assert "      |     assert cuda_home is not None" in out
    assert "      | AssertionError" in out
    assert "what to do:" in out and "SGLANG_ENABLE_JIT_DEEPGEMM=0" in out


def test_explain_reads_stdin_by_default_and_with_dash() -> None:
    text = (LOGS / "journal_multi.log").read_text()
    for args in ([], ["-"]):
        result = CliRunner().invoke(explain, args, input=text)
        assert result.exit_code == 1, result.output
        assert "4 failures found in standard input." in result.output
        kinds = [
            line.split("]")[1].split(":")[0].strip()
            for line in result.output.splitlines()
            if line.startswith("[")
        ]
        assert kinds == ["bad_flag", "kv_cache_too_small", "cuda_oom_serving", "host_oom_kill"]


def test_explain_healthy_log_exits_0() -> None:
    result = CliRunner().invoke(explain, [str(LOGS / "healthy.log")])
    assert result.exit_code == 0, result.output
    assert result.output == f"No known failure found in {LOGS / 'healthy.log'}.\n"


def test_explain_json_is_failure_to_dict() -> None:
    path = LOGS / "cuda_oom_load.log"
    result = CliRunner().invoke(explain, ["--json", str(path)])
    assert result.exit_code == 1, result.output
    doc = json.loads(result.output)
    assert doc["source"] == str(path)
    expected = [f.to_dict() for f in explain_lines(path.read_text().splitlines())]
    assert doc["failures"] == expected
    (only,) = doc["failures"]
    assert only["kind"] == "cuda_oom_load"
    assert only["oom_kind"] == "cuda"
    assert any("torch.OutOfMemoryError" in line for line in only["lines"])


def test_explain_json_with_no_failure_exits_0() -> None:
    result = CliRunner().invoke(explain, ["--json"], input="hello\n")
    assert result.exit_code == 0
    assert json.loads(result.output) == {"source": "standard input", "failures": []}


def test_explain_missing_file_is_a_usage_error() -> None:
    result = CliRunner().invoke(explain, ["/nonexistent/sglang.log"])
    assert result.exit_code == 2
    assert "/nonexistent/sglang.log" in result.output


def test_explain_help_documents_exit_status() -> None:
    result = CliRunner().invoke(explain, ["--help"])
    assert result.exit_code == 0
    assert "0 when no known failure" in result.output
    assert "1 when at least one" in result.output


def test_format_text_indents_lines_and_numbers_failures() -> None:
    failures = [
        Failure(FailureKind.PORT_IN_USE, "port busy", "free it", ("line a", "line b")),
        Failure(FailureKind.CRASH, "it died", "look"),
    ]
    assert format_text(failures, source="x.log") == (
        "2 failures found in x.log.\n"
        "\n"
        "[1] port_in_use: port busy\n"
        "    the lines that show it:\n"
        "      | line a\n"
        "      | line b\n"
        "    what to do: free it\n"
        "\n"
        "[2] crash: it died\n"
        "    what to do: look\n"
    )
