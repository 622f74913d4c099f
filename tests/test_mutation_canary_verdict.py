"""canary.verdict, what test_canary_verdict.py left unheld (issue 27's mutation run over
the canary's core): the policy's limits at their edges, the boundaries of the error and
latency checks, the bounds of a quantile, and the evidence's wording."""

from __future__ import annotations

import math

import pytest

from sglang_farm.canary.figures import Figures, Histogram
from sglang_farm.canary.verdict import (
    CanaryPolicy,
    Check,
    LivenessEvent,
    LivenessKind,
    Outcome,
    Verdict,
    error_p_value,
    judge,
    quantile_bounds,
    rank_bounds,
)

POLICY = CanaryPolicy()


@pytest.mark.parametrize(
    "fields",
    [
        {"min_requests": 1},
        {"itl_quantiles": (0.01, 0.99), "ttft_quantile": 0.99},
        {"itl_max_ratio": 1.01, "ttft_max_ratio": 1.01, "error_max_ratio": 1.0},
        {"confidence": 0.5},
        {"confidence": 0.999},
        {"error_floor": 0.0},
        {"error_floor": 0.99},
        {"min_errors": 1},
    ],
)
def test_policy_accepts_limits_at_their_edges(fields: dict[str, object]) -> None:
    CanaryPolicy(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"min_requests": 0}, "min_requests must be >= 1, got 0"),
        ({"itl_quantiles": (0.0,)}, "quantiles must lie strictly between 0 and 1"),
        ({"ttft_quantile": 1.0}, "quantiles must lie strictly between 0 and 1"),
        ({"itl_max_ratio": 1.0}, "ratio limits must be above 1"),
        ({"ttft_max_ratio": 1.0}, "ratio limits must be above 1"),
        ({"error_max_ratio": 0.99}, "ratio limits must be above 1"),
        ({"confidence": 0.49}, r"confidence must be in \[0.5, 1\), got 0.49"),
        ({"confidence": 1.0}, r"confidence must be in \[0.5, 1\), got 1.0"),
        ({"error_floor": -0.01}, r"error_floor must be in \[0, 1\), got -0.01"),
        ({"error_floor": 1.0}, r"error_floor must be in \[0, 1\), got 1.0"),
        ({"min_errors": 0}, "min_errors must be >= 1, got 0"),
    ],
)
def test_policy_refuses_each_limit_past_its_edge(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}$"):
        CanaryPolicy(**fields)  # type: ignore[arg-type]


def test_policy_names_every_problem_at_once() -> None:
    with pytest.raises(ValueError) as err:
        CanaryPolicy(min_requests=0, min_errors=0)
    assert str(err.value) == "min_requests must be >= 1, got 0; min_errors must be >= 1, got 0"


# -- the bounds of a quantile --------------------------------------------------------------

# 10 observations in each of 10 buckets of 10 ms: the q-quantile is q * 0.1 s, exactly.
LINEAR = Histogram.from_counts([0.01 * i for i in range(1, 11)], [10.0] * 10 + [0.0])


def test_quantile_bounds_are_the_binomial_order_statistics() -> None:
    # n 100, q 0.5, confidence 0.98: P(Bin(100, 0.5) <= 39) = 0.018 <= 0.02 < P(<= 40),
    # so the 40th smallest is the lower bound (rank 39/100, the bottom of its step);
    # P(<= 60) = 0.982 >= 0.98 > P(<= 59): the 61st is the upper one (rank 61/100).
    assert rank_bounds(0.5, 100, 0.98) == pytest.approx((0.39, 0.61))
    lo, est, hi = quantile_bounds(0.5, LINEAR, 100, 0.98)
    assert (lo, est, hi) == pytest.approx((0.039, 0.05, 0.061))


def test_too_few_observations_give_no_order_statistic_to_bound_a_quantile() -> None:
    # 5 observations: all 5 above the median happens 1 time in 32 (> 0.02): no lower
    # bound; all 5 below it too: no upper bound either.
    assert rank_bounds(0.5, 5, 0.98) == (None, None)
    assert quantile_bounds(0.5, LINEAR, 5, 0.98) == pytest.approx((0.0, 0.05, math.inf))
    # At 0.96 the smallest of 5 bounds it (rank 0) and the largest (rank 1: unbounded).
    assert rank_bounds(0.5, 5, 0.96) == pytest.approx((0.0, 1.0))
    assert quantile_bounds(0.5, LINEAR, 5, 0.96) == pytest.approx((0.0, 0.05, math.inf))
    one = Histogram((0.1, 0.2), (0.0, 1.0, 1.0), 0.15)  # a single observation
    assert quantile_bounds(0.5, one, 1, 0.98) == pytest.approx((0.0, 0.15, math.inf))


def test_a_chance_exactly_at_the_confidence_bounds_the_quantile() -> None:
    # n 1, q 0.5: P(Bin < 1) = 0.5 exactly: at confidence 0.5 the one observation is
    # the upper bound (rank 1) and nothing the lower one.
    assert rank_bounds(0.5, 1, 0.5) == (None, 1.0)
    # n 2, q 0.5: both above the median has a chance of 0.25: the smaller of the two is a
    # lower bound (rank 0) at a confidence up to 0.75, not above.
    assert rank_bounds(0.5, 2, 0.74) == (0.0, 1.0)
    assert rank_bounds(0.5, 2, 0.76) == (None, None)


def test_an_upper_bound_in_the_inf_bucket_is_unbounded_and_one_at_its_edge_is_not() -> None:
    # 10 % of the observations past the last finite bound (0.1 s).
    tail = Histogram.from_counts([0.01 * i for i in range(1, 11)], [9.0] * 10 + [10.0])
    assert quantile_bounds(0.92, tail, 10**4, 0.98) == pytest.approx((0.1, 0.1, math.inf))
    # 4 observations at 0.6: ranks 1/4 and 3/4, within the last finite bound (2 s).
    h = Histogram((1.0, 2.0), (1.0, 3.0, 4.0))
    assert quantile_bounds(0.5, h, 4, 0.6) == (1.0, 1.5, 2.0)


def test_no_bounds_without_observations_to_count() -> None:
    assert quantile_bounds(0.5, LINEAR, 0, 0.98) == pytest.approx((None, 0.05, None))
    assert quantile_bounds(0.5, LINEAR, 0.9, 0.98) == pytest.approx((None, 0.05, None))
    assert quantile_bounds(0.5, LINEAR, 1, 0.98) == pytest.approx((0.0, 0.05, math.inf))
    assert quantile_bounds(0.5, Histogram.empty((0.1,)), 10, 0.98) == (None, None, None)


# -- the checks, on figures built by hand ---------------------------------------------------


def figs(requests: float, errors: float = 0.0, itl: Histogram | None = None) -> Figures:
    return Figures(30.0, requests, errors, itl, None)


def check(v: Verdict, name: str) -> Check:
    return next(c for c in v.checks if c.name == name)


def test_a_latency_margin_equal_to_its_limit_passes() -> None:
    slower = Histogram.from_counts(LINEAR.bounds, [0.0] * 5 + [20.0] * 5 + [0.0])
    base = figs(1000, itl=LINEAR)
    p50 = CanaryPolicy(itl_quantiles=(0.5,))
    first = check(judge(figs(1000, itl=slower), base, [], p50), "itl_p50")
    margin = first.margin_ratio
    assert margin is not None and margin > 1
    at = CanaryPolicy(itl_quantiles=(0.5,), itl_max_ratio=margin)
    assert check(judge(figs(1000, itl=slower), base, [], at), "itl_p50").passed is True
    below = CanaryPolicy(itl_quantiles=(0.5,), itl_max_ratio=math.nextafter(margin, 0))
    assert check(judge(figs(1000, itl=slower), base, [], below), "itl_p50").passed is False


def test_a_sides_bounds_rest_on_the_fewer_of_its_requests_and_observations() -> None:
    # The canary: 25 requests of 4 tokens (n 25); the baseline: 100 observations of
    # 10,000 requests (n 100, its histogram holds no more). At confidence 0.98 the ranks
    # are 0.24 (the 7th smallest of 25, the bottom of its step) and 0.61 (the 61st of 100).
    v = judge(figs(25, itl=LINEAR), figs(10_000, itl=LINEAR), [], CanaryPolicy(min_requests=20))
    p50 = check(v, "itl_p50")
    assert p50.margin_ratio == pytest.approx(0.024 / 0.061)


def test_a_side_without_observations_is_not_judged_and_one_observation_is() -> None:
    empty = Histogram.empty(LINEAR.bounds)
    one = Histogram.from_counts(LINEAR.bounds, [0.0] * 4 + [1.0] + [0.0] * 6)
    for canary, baseline in ((empty, LINEAR), (LINEAR, empty), (None, LINEAR), (LINEAR, None)):
        c = check(judge(figs(100, itl=canary), figs(100, itl=baseline), [], POLICY), "itl_p50")
        assert (c.passed, c.text) == (None, "no ITL data")
    for canary, baseline in ((one, LINEAR), (LINEAR, one)):
        c = check(judge(figs(100, itl=canary), figs(100, itl=baseline), [], POLICY), "itl_p50")
        assert c.text.startswith("canary ITL p50 0.0")


def test_a_baseline_at_0_s_gives_no_ratio_and_is_not_judged() -> None:
    zero = Histogram((0.0, 0.1), (100.0, 100.0, 100.0))
    canary = Histogram((0.0, 0.1), (0.0, 100.0, 100.0))
    c = check(judge(figs(100, itl=canary), figs(100, itl=zero), [], POLICY), "itl_p50")
    assert (c.passed, c.ratio, c.margin_ratio) == (None, None, None)
    assert c.text == "canary ITL p50 0.05 s = (baseline 0) (too few to judge)"


def test_a_quantiles_name_has_one_decimal() -> None:
    v = judge(
        figs(100, itl=LINEAR), figs(100, itl=LINEAR), [], CanaryPolicy(itl_quantiles=(0.9975,))
    )
    assert [c.name for c in v.checks] == ["errors", "itl_p99.8", "ttft_p50"]


# -- errors ---------------------------------------------------------------------------------


def test_errors_at_exactly_min_errors_and_exactly_the_floor_fail() -> None:
    three = judge(figs(50, 3), figs(1000), [], POLICY)  # 3 errors, 6 %, baseline 0
    assert three.outcome is Outcome.ROLLBACK, three.evidence
    at_floor = judge(figs(400, 4), figs(1000), [], POLICY)  # 4 of 400: 1 % exactly
    assert at_floor.outcome is Outcome.ROLLBACK, at_floor.evidence


def test_errors_at_exactly_the_baselines_ratio_pass_with_their_figures() -> None:
    v = judge(figs(400, 8), figs(500, 5), [], POLICY)  # 2 % vs 1 %: 2x, not more
    assert v.outcome is Outcome.PROMOTE, v.evidence
    errors = check(v, "errors")
    assert (errors.passed, errors.canary, errors.baseline) == (True, 0.02, 0.01)
    assert (errors.ratio, errors.limit) == pytest.approx((2.0, 0.02))
    # The limit is the floor when the baseline's ratio would allow less.
    assert check(judge(figs(400), figs(500), [], POLICY), "errors").limit == 0.01


def test_without_a_baseline_errors_are_judged_against_0() -> None:
    v = judge(figs(400, 40), None, [], POLICY)
    assert v.outcome is Outcome.ROLLBACK
    assert v.evidence.startswith("canary errors 10.0 % (40 of 400) vs the baseline's 0.0 %")


def test_no_canary_request_is_no_error_check_and_one_request_is() -> None:
    none = check(judge(figs(0), figs(1000), [], POLICY), "errors")
    assert (none.passed, none.text) == (None, "no canary requests")
    one = check(judge(figs(1), figs(1000), [], POLICY), "errors")
    assert one.passed is True
    assert one.text == "canary errors 0.0 % (0 of 1) vs the baseline's 0.0 %"


# -- the verdict's outcome and evidence -----------------------------------------------------


def test_min_requests_exactly_is_enough_on_either_side() -> None:
    assert judge(figs(50), figs(1000), [], POLICY).outcome is Outcome.PROMOTE
    assert judge(figs(1000), figs(50), [], POLICY).outcome is Outcome.PROMOTE
    thin = judge(figs(50), figs(49), [], POLICY)
    assert thin.evidence.startswith("too little baseline traffic to judge: 49 requests")


def test_too_little_traffic_adds_a_failed_traffic_check() -> None:
    v = judge(figs(20), figs(1000), [], POLICY)
    assert v.outcome is Outcome.INCONCLUSIVE
    traffic = v.checks[-1]
    assert (traffic.name, traffic.passed, traffic.canary, traffic.limit) == (
        "traffic",
        False,
        20.0,
        50.0,
    )
    assert traffic.text == "20 canary requests, 50 needed"


def test_a_liveness_failure_is_a_failed_check() -> None:
    v = judge(figs(400), figs(1000), [LivenessEvent(LivenessKind.CRASHED, 3.0)], POLICY)
    assert [c.name for c in v.failed] == ["liveness"]
    assert v.evidence == "canary crashed 3 s into the window"


def test_a_promotion_names_the_first_two_judged_checks() -> None:
    # A baseline of 10,000 requests pins its p99 down: three checks are judged.
    many = Histogram.from_counts(LINEAR.bounds, [1000.0] * 10 + [0.0])
    v = judge(figs(400, itl=LINEAR), figs(10_000, itl=many), [], POLICY)
    assert v.outcome is Outcome.PROMOTE
    errors, p50 = check(v, "errors"), check(v, "itl_p50")
    assert [c.name for c in v.checks if c.passed] == ["errors", "itl_p50", "itl_p99"]
    assert v.evidence == (
        f"canary within limits ({errors.text}; {p50.text}) over 30 s, 400 vs 10,000 requests"
    )


# -- issue 23's second pass: observations per metric, exact ranks, the errors' test --------


def test_the_smallest_observation_bounds_a_quantile_at_its_buckets_lower_edge() -> None:
    # 6 observations, all in the bucket (0.03, 0.04]: the smallest of 6 is the lower
    # bound of the median (all 6 above it: 1 in 64 < 0.02), and it is at least 0.03.
    h = Histogram.from_counts(LINEAR.bounds, [0.0, 0.0, 0.0, 6.0] + [0.0] * 7)
    assert rank_bounds(0.5, 6, 0.98)[0] == 0.0
    assert quantile_bounds(0.5, h, 6, 0.98)[0] == pytest.approx(0.03)
    # ... and one past the last finite bound: that bound.
    inf = Histogram.from_counts(LINEAR.bounds, [0.0] * 10 + [6.0])
    assert quantile_bounds(0.5, inf, 6, 0.98)[0] == pytest.approx(0.1)


def test_a_metric_is_judged_from_min_observations_on_each_side() -> None:
    def itl(n: float) -> Histogram:  # n observations, all in (0.05, 0.06]
        return Histogram.from_counts(LINEAR.bounds, [0.0] * 5 + [n] + [0.0] * 5)

    base = figs(1000, itl=LINEAR)
    p50 = CanaryPolicy(itl_quantiles=(0.5,), min_observations=12)
    at = check(judge(figs(12, itl=itl(12)), base, [], p50), "itl_p50")
    assert at.passed is not None
    below = check(judge(figs(12, itl=itl(11)), base, [], p50), "itl_p50")
    assert below.passed is None
    assert below.text.endswith("(too few to judge: 11 observations, 12 needed)")
    thin_base = check(judge(figs(12, itl=itl(12)), figs(1000, itl=itl(11)), [], p50), "itl_p50")
    assert thin_base.passed is None
    with pytest.raises(ValueError, match=r"^min_observations must be >= 1, got 0$"):
        CanaryPolicy(min_observations=0)
    CanaryPolicy(min_observations=1)


def test_a_latency_failure_needs_no_min_requests() -> None:
    slow = Histogram.from_counts(LINEAR.bounds, [0.0] * 9 + [100.0, 0.0])
    v = judge(figs(10, itl=slow), figs(1000, itl=LINEAR), [], POLICY)  # 10 requests
    assert v.outcome is Outcome.ROLLBACK, v.evidence
    assert v.evidence.startswith("canary ITL p50 0.095 s = 1.9x the baseline's 0.05 s")


def test_error_p_value_is_the_binomial_tail_of_the_canarys_share() -> None:
    assert error_p_value(2, 161, 0, 1127) == pytest.approx(0.125**2)
    # P(Bin(5, 1/8) >= 2) = 1 - (7/8)^5 - 5 (1/8) (7/8)^4
    assert error_p_value(2, 161, 3, 1127) == pytest.approx(1 - 0.875**5 - 5 * 0.125 * 0.875**4)
    assert error_p_value(1.6, 161, 0.4, 1127) == pytest.approx(0.125**2)  # counts round
    assert error_p_value(0, 161, 3, 1127) == 1.0
    assert error_p_value(2, 161, 0, 0) == 1.0
    assert error_p_value(2, 0, 0, 1127) == 1.0


def test_errors_more_than_chance_fail_and_exactly_chance_does_not() -> None:
    lax = CanaryPolicy(min_errors=1, confidence=0.5)
    # 1 error of 100 vs 0 of 100: p = 0.5, not below 1 - 0.5: undecided (above the floor).
    assert check(judge(figs(100, 1), figs(100), [], lax), "errors").passed is None
    # 0 of 101: p = 100/201, below 0.5.
    assert check(judge(figs(100, 1), figs(101), [], lax), "errors").passed is False
    # Without baseline requests there is no test: the floors alone judge.
    assert check(judge(figs(100, 2), figs(0), [], POLICY), "errors").passed is False
    assert check(judge(figs(100, 2), None, [], POLICY), "errors").passed is False
    assert check(judge(figs(100, 1), None, [], POLICY), "errors").passed is None  # 1 < 2
    assert check(judge(figs(101, 1), None, [], POLICY), "errors").passed is True  # < 1 %


def test_the_bounds_edges_that_the_first_tests_left_unheld() -> None:
    # One observation, but 10 requests' worth of rank: its upper bound is read from it.
    one = Histogram((0.1, 0.2), (0.0, 1.0, 1.0), 0.15)
    assert rank_bounds(0.5, 10, 0.98)[1] == pytest.approx(0.9)
    assert quantile_bounds(0.5, one, 10, 0.98)[2] == pytest.approx(0.19)
    # Both of 2 observations above the median: 0.25 exactly, a lower bound at 0.75.
    assert rank_bounds(0.5, 2, 0.75)[0] == 0.0
    # A p99 of 4: no upper bound (all 4 below it is 96 %), the lower one the 3rd (rank 2/4).
    assert rank_bounds(0.99, 4, 0.98) == (0.5, None)
    # The smallest observation in the second bucket: its lower edge, the first bound.
    second = Histogram.from_counts(LINEAR.bounds, [0.0, 6.0] + [0.0] * 9)
    assert quantile_bounds(0.5, second, 6, 0.98)[0] == pytest.approx(0.01)


def test_the_errors_edges_that_the_first_tests_left_unheld() -> None:
    # One request each side: an error is the canary's with chance 1/2.
    assert error_p_value(1, 1, 0, 1) == pytest.approx(0.5)
    # Exactly twice the baseline's ratio passes even where chance is no explanation.
    assert check(judge(figs(10_000, 200), figs(10_000, 100), [], POLICY), "errors").passed
    # A baseline of 1 request is a baseline: 2 errors of 100 beside it are chance
    # (the canary has 100/101 of the requests): not failed, undecided.
    assert check(judge(figs(100, 2), figs(1), [], POLICY), "errors").passed is None
