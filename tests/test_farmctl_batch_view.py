"""`farmctl batch`'s pure view (cli/batchview.py): progress figures, the bar, the lines it
prints, validation errors and the end line, from batch objects and sample times alone."""

from __future__ import annotations

from typing import Any

import pytest

from sglang_farm.cli import batchview as view
from sglang_farm.cli.batchview import Rates, Sample


def batch(
    status: str = "in_progress",
    total: int = 10_000,
    completed: int = 0,
    failed: int = 0,
    **extra: Any,
) -> dict[str, Any]:
    return {
        "id": "batch_abc",
        "object": "batch",
        "status": status,
        "endpoint": "/v1/chat/completions",
        "input_file_id": "file_in",
        "request_counts": {"total": total, "completed": completed, "failed": failed},
        **extra,
    }


def test_counts_and_tokens_read_the_batch_object_and_tolerate_what_is_missing() -> None:
    assert view.counts(batch(total=7, completed=3, failed=1)) == (7, 3, 1)
    assert view.counts({"status": "validating"}) == (0, 0, 0)
    assert view.counts({"request_counts": {"total": True, "completed": "3"}}) == (0, 0, 0)
    assert view.tokens(batch()) is None
    assert view.tokens(batch(usage={"total_tokens": 120})) == 120
    assert view.tokens(batch(usage={"input_tokens": 100, "output_tokens": 20})) == 120
    assert view.tokens(batch(usage={"output_tokens": 20})) == 20
    assert view.tokens(batch(usage={})) is None


def test_sample_prefers_the_batch_usage_over_tokens_from_elsewhere() -> None:
    assert view.sample(batch(completed=5, failed=2), 1.0, 999) == Sample(1.0, 10_000, 5, 2, 999)
    own = view.sample(batch(usage={"total_tokens": 50}), 1.0, 999)
    assert own.tokens == 50
    assert own.done == 0


def test_rates_over_the_window_of_recent_samples() -> None:
    samples = [
        Sample(0.0, 100, 0, 0, 0),  # older than the window: not used
        Sample(50.0, 100, 10, 0, 1_000),
        Sample(60.0, 100, 28, 2, 3_000),
        Sample(70.0, 100, 40, 10, 6_000),
    ]
    r = view.rates(samples, window=30.0)
    assert r.requests_per_s == pytest.approx((50 - 10) / 20)
    assert r.tokens_per_s == pytest.approx((6_000 - 1_000) / 20)
    # Exactly at the window's edge a sample still counts.
    assert view.rates(samples, window=70.0).requests_per_s == pytest.approx(50 / 70)


def test_rates_are_unknown_with_one_sample_no_time_or_no_tokens() -> None:
    assert view.rates([Sample(1.0, 10, 1, 0)]) == Rates(None, None)
    assert view.rates([Sample(1.0, 10, 1, 0), Sample(1.0, 10, 2, 0)]) == Rates(None, None)
    r = view.rates([Sample(0.0, 10, 1, 0), Sample(2.0, 10, 3, 0)])
    assert r == Rates(1.0, None)
    # A count that goes back (a new read after a restart of the service) is no negative rate.
    assert view.rates([Sample(0.0, 10, 5, 0, 100), Sample(1.0, 10, 4, 0, 90)]) == Rates(0.0, 0.0)


def test_add_sample_keeps_two_windows_and_starts_over_when_a_count_goes_back() -> None:
    kept = view.add_sample([], Sample(0.0, 10, 0, 0, 0))
    for t in (10.0, 30.0, 50.0):
        kept = view.add_sample(kept, Sample(t, 10, int(t // 10), 0, int(t)))
    assert [s.t for s in kept] == [0.0, 10.0, 30.0, 50.0]
    kept = view.add_sample(kept, Sample(65.0, 10, 6, 0, 65))
    assert [s.t for s in kept] == [10.0, 30.0, 50.0, 65.0]  # 0.0 is over 60 s old
    # The service restarted: its token counter is back near 0. The rate starts over.
    restarted = view.add_sample(kept, Sample(70.0, 10, 6, 0, 3))
    assert restarted == [Sample(70.0, 10, 6, 0, 3)]
    assert view.add_sample(kept, Sample(70.0, 10, 5, 0, 90)) == [Sample(70.0, 10, 5, 0, 90)]
    # No tokens known on either side: only the done count is compared.
    assert len(view.add_sample([Sample(0.0, 9, 1, 0)], Sample(1.0, 9, 1, 0))) == 2


def test_eta_is_the_services_own_else_what_is_left_at_the_rate() -> None:
    last = Sample(10.0, 1_000, 500, 100)
    assert view.eta_seconds(last, Rates(4.0, None)) == pytest.approx(100.0)
    assert view.eta_seconds(last, Rates(4.0, None), service_eta=30.0) == 30.0
    assert view.eta_seconds(last, Rates(None, None)) is None
    assert view.eta_seconds(last, Rates(0.0, None)) is None
    assert view.eta_seconds(last, Rates(None, None), service_eta=float("nan")) is None
    assert view.eta_seconds(last, Rates(None, None), service_eta=-1.0) is None
    assert view.eta_seconds(Sample(1.0, 5, 4, 1), Rates(None, None), service_eta=99.0) == 0.0
    # No requests known yet (validating): nothing to tell.
    assert view.eta_seconds(Sample(1.0, 0, 0, 0), Rates(None, None)) is None


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (None, "?"),
        (float("inf"), "?"),
        (0.0, "0s"),
        (-3.0, "0s"),
        (59.4, "59s"),
        (59.6, "1m00s"),
        (125.0, "2m05s"),
        (3_600.0, "1h00m"),
        (11_400.0, "3h10m"),
        (86_400.0 * 2 + 3_600 * 4, "2d04h"),
    ],
)
def test_duration(seconds: float | None, text: str) -> None:
    assert view.duration(seconds) == text


def test_bar_fills_by_the_share_done_and_keeps_its_width() -> None:
    assert view.bar(0, 100, 10) == "[----------]"
    assert view.bar(50, 100, 10) == "[#####-----]"
    assert view.bar(99, 100, 10) == "[#########-]"
    assert view.bar(100, 100, 10) == "[##########]"
    assert view.bar(120, 100, 10) == "[##########]"
    assert view.bar(0, 0, 4) == "[----]"


def test_progress_line_fits_the_terminal_with_every_figure() -> None:
    last = Sample(10.0, 10_000, 4_207, 3, 50_000)
    line = view.progress_line("in_progress", last, Rates(20.0, 812.4), 130.0, columns=80)
    assert line.startswith("in_progress [")
    assert line.endswith("] 4,210/10,000 · 3 failed · 812 tok/s · ETA 2m10s")
    assert len(line) == 80  # an 80-column terminal: the bar takes what is left
    inside = line[line.index("[") + 1 : line.index("]")]
    assert view.BAR_MIN <= len(inside) <= view.BAR_MAX
    assert inside.count("#") == len(inside) * 4_210 // 10_000
    # Wide terminals: the bar stops at BAR_MAX cells.
    wide = view.progress_line("in_progress", last, Rates(20.0, 812.4), 130.0, columns=300)
    assert wide.count("#") + wide.count("-") == view.BAR_MAX
    # Narrow ones: the figures alone, cut to the width.
    narrow = view.progress_line("in_progress", last, Rates(None, None), None, columns=40)
    assert "[" not in narrow and len(narrow) == 40
    assert narrow.startswith("in_progress 4,210/10,000 · 3 failed")


def test_progress_without_tokens_shows_requests_per_second_and_unknowns() -> None:
    last = Sample(10.0, 200, 7, 0)
    line = view.progress_line("in_progress", last, Rates(2.5, None), None, columns=120)
    assert line.endswith("7/200 · 0 failed · 2.5 req/s · ETA ?")
    first = view.progress_line("in_progress", last, Rates(None, None), None, columns=120)
    assert first.endswith("? req/s · ETA ?")


def test_plain_line_says_the_share_done() -> None:
    last = Sample(10.0, 10_000, 4_207, 3, 1)
    assert view.plain_line("batch_abc", "in_progress", last, Rates(20.0, 1_234.0), 130.0) == (
        "batch batch_abc: in_progress, 4,210/10,000 done (42.1 %), 3 failed, 1,234 tokens/s, "
        "ETA 2m10s"
    )
    empty = view.plain_line("b", "validating", Sample(0.0, 0, 0, 0), Rates(None, None), None)
    assert empty == "batch b: validating, 0/0 done, 0 failed, ? requests/s, ETA ?"


def test_validation_errors_name_line_field_and_what_to_do() -> None:
    b = batch(
        "failed",
        errors={
            "object": "list",
            "data": [
                {"code": "invalid_json", "message": "not JSON: fix the line", "line": 3},
                {
                    "code": "duplicate_custom_id",
                    "message": "custom_id 'a' repeats line 1",
                    "param": "custom_id",
                    "line": 7,
                },
                {"message": "the file is empty"},
                "junk",
            ],
        },
    )
    assert view.validation_errors(b) == [
        "line 3: not JSON: fix the line (invalid_json)",
        "line 7, custom_id: custom_id 'a' repeats line 1 (duplicate_custom_id)",
        "the file is empty",
    ]
    assert view.validation_errors(batch()) == []
    end = view.end_line("batch_abc", b)
    assert end.startswith("batch batch_abc failed validation, nothing was sent: line 3: ")
    assert end.endswith("; fix the file and submit it again")


def test_end_line_for_every_ending() -> None:
    results = "farmctl batch results batch_abc -o FILE"
    assert view.end_line("batch_abc", batch("completed", 10, 10)) == (
        f"batch batch_abc completed: 10 of 10 requests succeeded; fetch the results with: {results}"
    )
    assert view.end_line("batch_abc", batch("completed", 10, 9, 1)) == (
        "batch batch_abc completed: 9 of 10 requests succeeded, 1 failed (each is a line of "
        f"the error file); fetch both with: {results}"
    )
    assert "expired (its completion_window passed): 4 of 10 requests succeeded, 1 failed" in (
        view.end_line("batch_abc", batch("expired", 10, 4, 1))
    )
    assert view.end_line("batch_abc", batch("cancelled", 10, 4, 0)) == (
        "batch batch_abc cancelled: 4 of 10 requests succeeded, 0 failed; the results it "
        f"has: {results}"
    )
    assert view.end_line("x", batch("in_progress")) == "batch x: in_progress"


def test_end_line_lists_at_most_20_validation_errors() -> None:
    data = [{"message": "bad", "line": n} for n in range(1, 26)]
    end = view.end_line("b", batch("failed", errors={"data": data}))
    assert "line 20: bad" in end and "line 21:" not in end
    assert "(and 5 more: farmctl batch status b)" in end


def test_list_table_has_a_row_per_batch() -> None:
    rows = view.list_table(
        [
            batch("in_progress", 10_000, 4_000, 10, created_at=1_000),
            {**batch("completed", 5, 5), "id": "batch_old", "created_at": 0},
        ],
        now=1_125.0,
    ).splitlines()
    assert rows[0].split() == ["ID", "STATUS", "DONE", "FAILED", "ENDPOINT", "CREATED"]
    assert rows[1].split() == [
        "batch_abc",
        "in_progress",
        "4,010/10,000",
        "10",
        "/v1/chat/completions",
        "2m05s",
        "ago",
    ]
    assert rows[2].split()[:4] == ["batch_old", "completed", "5/5", "0"]
    assert rows[2].split()[-1] == "-"


def test_status_text_shows_counts_eta_files_times_and_the_end() -> None:
    running = view.status_text(
        batch(
            "in_progress",
            100,
            40,
            2,
            created_at=900,
            in_progress_at=950,
            expires_at=90_000,
            usage={"total_tokens": 4_321},
            metadata={"job": "seed"},
        ),
        now=1_000.0,
        eta=75.0,
    ).splitlines()
    assert running[0] == "batch batch_abc · in_progress · /v1/chat/completions"
    assert running[1] == "requests: 42/100 done (42.0 %) · 40 succeeded · 2 failed"
    assert "ETA: 1m15s" in running
    assert "tokens: 4,321" in running
    assert "input file: file_in" in running
    assert "created: 1m40s ago" in running and "in progress: 50s ago" in running
    assert "expires: in 1d00h" in running
    assert "metadata: job=seed" in running
    done = view.status_text(
        batch("completed", 100, 99, 1, output_file_id="file_out", error_file_id="file_err"),
        now=1.0,
        eta=5.0,
    ).splitlines()
    assert "output file: file_out" in done and "error file: file_err" in done
    assert not any(line.startswith("ETA") for line in done)
    assert done[-1].startswith("batch batch_abc completed: 99 of 100")


METRICS = """\
# HELP sglang_farm_batch_eta_seconds Seconds to the end of each running batch.
# TYPE sglang_farm_batch_eta_seconds gauge
sglang_farm_batch_eta_seconds{batch="batch_abc"} 130.5
sglang_farm_batch_eta_seconds{batch="batch_other"} 9.0
# TYPE sglang_farm_batch_tokens_total counter
sglang_farm_batch_tokens_total{kind="prompt"} 1000.0
sglang_farm_batch_tokens_total{kind="completion"} 234.0
sglang_farm_batch_tokens_created 17.0
sglang_farm_batch_in_flight 12
"""


def test_metric_sum_reads_the_services_exposition() -> None:
    assert view.metric_sum(METRICS, "sglang_farm_batch_eta_seconds", {"batch": "batch_abc"}) == (
        130.5
    )
    assert view.metric_sum(METRICS, "sglang_farm_batch_eta_seconds", {"batch": "nope"}) is None
    assert view.metric_sum(METRICS, "sglang_farm_batch_tokens_total") == 1234.0
    assert view.metric_sum(METRICS, "sglang_farm_batch_tokens_total", {"kind": "prompt"}) == 1000
    assert view.metric_sum(METRICS, "sglang_farm_batch_in_flight") == 12
    # A name that only starts like another is not it.
    assert view.metric_sum(METRICS, "sglang_farm_batch_tokens") is None
    assert view.metric_sum("", "x") is None
