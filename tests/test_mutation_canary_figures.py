"""canary.figures, what test_canary_figures.py left unheld (issue 27's mutation run over
the canary's core): histograms' edges (bounds that do not ascend, a bucket count at or
below 0, one observation, an equal sum), the resets, a series without `le` or outside
the match, a window whose first sample had no gateway figures, and the figures' sums."""

from __future__ import annotations

import math

import pytest

from sglang_farm.canary import figures, promtext
from sglang_farm.canary.figures import Figures, Histogram, quantile


def test_bounds_must_strictly_ascend() -> None:
    for bounds in ((0.1, 0.1), (0.1, 0.3, 0.2)):
        with pytest.raises(ValueError, match="histogram bounds must ascend"):
            Histogram(bounds, (1.0,) * (len(bounds) + 1))
    Histogram((0.1, 0.2, 0.3), (1.0, 1.0, 1.0, 1.0))


def test_from_counts_has_no_sum_unless_given() -> None:
    assert Histogram.from_counts((0.1,), (1.0, 2.0)) == Histogram((0.1,), (1.0, 3.0), 0.0)


def test_adding_histograms_adds_their_sums_and_needs_the_same_bounds() -> None:
    a = Histogram((0.1, 0.2), (1.0, 2.0, 2.0), 0.3)
    b = Histogram((0.1, 0.2), (2.0, 4.0, 5.0), 1.2)
    both = a.plus(b)
    assert both.cumulative == (3.0, 6.0, 7.0) and both.total == pytest.approx(1.5)
    with pytest.raises(ValueError, match="different buckets"):
        a.plus(Histogram((0.1, 0.3), (1.0, 2.0, 2.0)))


def test_a_delta_with_an_empty_bucket_or_an_equal_sum_is_still_a_delta() -> None:
    earlier = Histogram((0.1, 0.2, 0.4), (10.0, 20.0, 30.0, 30.0), 4.5)
    # Nothing new in the first bucket: a delta of 0 there is no reset.
    later = Histogram((0.1, 0.2, 0.4), (10.0, 25.0, 35.0, 35.0), 5.5)
    delta = later.since(earlier)
    assert delta.cumulative == (0.0, 5.0, 5.0, 5.0) and delta.total == pytest.approx(1.0)
    # Observations of 0 s leave the sum as it was: still a delta, with a sum of 0.
    zeros = Histogram((0.1, 0.2, 0.4), (12.0, 22.0, 32.0, 32.0), 4.5)
    assert zeros.since(earlier) == Histogram((0.1, 0.2, 0.4), (2.0, 2.0, 2.0, 2.0), 0.0)


def test_any_count_or_the_sum_going_down_is_a_reset() -> None:
    earlier = Histogram((0.1, 0.2), (10.0, 20.0, 30.0), 4.5)
    one_bucket_down = Histogram((0.1, 0.2), (5.0, 25.0, 35.0), 9.0)
    assert one_bucket_down.since(earlier) is one_bucket_down
    sum_down = Histogram((0.1, 0.2), (11.0, 21.0, 31.0), 0.2)
    assert sum_down.since(earlier) is sum_down


def test_a_delta_never_has_a_bucket_below_the_one_before_it() -> None:
    # Rounding of float counters: 5 new in the first bucket, "4" cumulative in the next.
    earlier = Histogram((0.1, 0.2), (10.0, 20.0, 20.0), 1.0)
    later = Histogram((0.1, 0.2), (15.0, 24.0, 24.0), 2.0)
    assert later.since(earlier).cumulative == (5.0, 5.0, 5.0)


def test_quantile_edges_zero_one_observation_and_a_negative_first_bound() -> None:
    h = Histogram((0.1, 0.2, 0.4), (10.0, 20.0, 30.0, 30.0), 4.5)
    assert quantile(0.0, h) == 0.0  # rank 0: the first bucket's lower edge, not -inf
    # An empty first bucket at rank 0: its lower edge (no division by its 0 count).
    assert quantile(0.0, Histogram((0.1, 0.2), (0.0, 5.0, 5.0))) == 0.0
    one = Histogram((0.1, 0.2), (0.0, 1.0, 1.0), 0.15)
    assert quantile(0.5, one) == pytest.approx(0.15)  # a single observation, interpolated
    assert quantile(math.nan, one) is None
    # A first bound at or below 0: its bound (no interpolation from 0 upwards).
    assert quantile(0.2, Histogram((-1.0, 1.0), (5.0, 10.0, 10.0))) == -1.0


def test_a_counter_that_did_not_move_increased_by_0() -> None:
    assert figures.counter_since(5.0, 5.0) == 0.0


def _scrape(*lines: str) -> promtext.Scrape:
    return promtext.parse("\n".join(lines))


def test_histogram_of_sums_only_matching_series_with_le_and_reads_a_missing_sum_as_0() -> None:
    s = _scrape(
        'h_bucket{m="b",le="0.1"} 100',
        'h_bucket{m="b",le="+Inf"} 100',
        'h_bucket{m="a",le="0.1"} 1',
        'h_bucket{m="a",le="+Inf"} 2',
        'h_bucket{m="a"} 50',
        'h_sum{m="a"} 0.5',
        'h_sum{m="b"} 9',
    )
    assert figures.histogram_of(s, "h", m="a") == Histogram((0.1,), (1.0, 2.0), 0.5)
    no_sum = _scrape('h_bucket{le="0.1"} 1', 'h_bucket{le="+Inf"} 2')
    assert figures.histogram_of(no_sum, "h") == Histogram((0.1,), (1.0, 2.0), 0.0)


def test_a_worker_with_no_counters_yet_has_0_requests() -> None:
    sample = figures.worker_sample(_scrape("other 1"), None, "http://w:1")
    assert (sample.requests, sample.aborted) == (0.0, 0.0)
    assert sample.itl is None and sample.ttft is None


def _sample(
    requests: float, aborted: float, ok: float | None, failed: float | None, itl: Histogram | None
) -> figures.WorkerSample:
    return figures.WorkerSample(itl, None, requests, aborted, ok, failed)


def test_a_window_without_gateway_figures_at_its_start_counts_sglangs() -> None:
    h = Histogram((0.1,), (4.0, 5.0), 0.3)
    f = figures.window(_sample(10, 1, None, None, None), _sample(30, 2, 100, 7, h), 30.0)
    # SGLang's 20 finished requests; no error source (an abort is none).
    assert (f.requests, f.errors, f.source) == (20.0, 0.0, figures.ErrorSource.NONE)
    assert f.itl == h  # the histogram appeared inside the window: all of it is new
    rebucketed = Histogram((0.2,), (1.0, 1.0))
    f = figures.window(_sample(0, 0, None, None, h), _sample(0, 0, None, None, rebucketed), 1.0)
    assert f.itl == rebucketed


def test_aborts_are_never_errors_whatever_the_source() -> None:
    # The gateway answered 2 (both failed) while SGLang aborted 5: 2 of 2 failed.
    f = figures.window(_sample(0, 0, 0, 0, None), _sample(0, 5, 0, 2, None), 30.0)
    assert (f.requests, f.errors) == (2.0, 2.0)
    # No request answered through the gateway: 3 aborts are no error.
    f = figures.window(_sample(0, 0, 0, 0, None), _sample(0, 3, 0, 0, None), 30.0)
    assert (f.requests, f.errors) == (0.0, 0.0)


def _responding(answered: float | None, errors: float | None) -> figures.WorkerSample:
    return figures.WorkerSample(None, None, 0.0, 0.0, None, None, answered, errors)


def test_the_workers_counter_needs_both_figures_at_both_ends_and_errors_stay_within() -> None:
    f = figures.window(_responding(10, 1), _responding(30, 4), 30.0)
    assert (f.source, f.requests, f.errors) == (figures.ErrorSource.WORKERS, 20.0, 3.0)
    one_missing = (((None, 1), (30, 4)), ((10, None), (30, 4)), ((10, 1), (None, 4)))
    for a, b in (((None, None), (30, 4)), ((10, 1), (None, None)), *one_missing):
        f = figures.window(_responding(*a), _responding(*b), 30.0)
        assert f.source is figures.ErrorSource.NONE
    f = figures.window(_responding(10, 1), _responding(30, None), 30.0)
    assert f.source is figures.ErrorSource.NONE
    f = figures.window(_responding(10, None), _responding(30, 4), 30.0)
    assert f.source is figures.ErrorSource.NONE
    # A restart between the scrapes: the later counts whole, errors never above answers.
    f = figures.window(_responding(100, 1), _responding(5, 9), 30.0)
    assert (f.requests, f.errors) == (5.0, 5.0)


def test_a_side_without_a_source_in_common_counts_its_requests_with_no_errors() -> None:
    a = Figures(30.0, 5.0, 1.0, None, None, figures.ErrorSource.WORKERS)
    b = Figures(30.0, 7.0, 2.0, None, None, figures.ErrorSource.GATEWAY)
    both = a.plus(b)
    assert (both.source, both.requests, both.errors) == (figures.ErrorSource.NONE, 12.0, 0.0)
    same = a.plus(a)
    assert (same.source, same.requests, same.errors) == (figures.ErrorSource.WORKERS, 10.0, 2.0)


def test_error_ratio_with_no_request_and_with_one() -> None:
    assert Figures(30.0, 0.0, 0.0, None, None).error_ratio == 0.0
    assert Figures(30.0, 0.0, 2.0, None, None).error_ratio == 0.0
    assert Figures(30.0, 1.0, 1.0, None, None).error_ratio == 1.0


def test_a_side_of_two_workers_covers_the_longer_window() -> None:
    a = Figures(30.0, 1.0, 0.0, None, None)
    b = Figures(31.0, 1.0, 0.0, None, None)
    assert a.plus(b).seconds == 31.0 and b.plus(a).seconds == 31.0
