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
    judge,
    quantile_bounds,
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


def test_quantile_bounds_are_the_quantiles_at_q_plus_and_minus_z_sigma() -> None:
    # n 100, q 0.5: sigma = sqrt(0.5 * 0.5 / 100) = 0.05; z 2: ranks 0.4 and 0.6.
    lo, est, hi = quantile_bounds(0.5, LINEAR, 100, 2.0)
    assert (lo, est, hi) == pytest.approx((0.04, 0.05, 0.06))


def test_a_lower_bound_before_rank_0_is_0_and_an_upper_one_past_rank_1_unbounded() -> None:
    # n 1: sigma 0.5, z 2: ranks -0.5 and 1.5.
    assert quantile_bounds(0.5, LINEAR, 1, 2.0) == pytest.approx((0.0, 0.05, math.inf))
    one = Histogram((0.1, 0.2), (0.0, 1.0, 1.0), 0.15)  # a single observation
    assert quantile_bounds(0.5, one, 1, 2.0) == pytest.approx((0.0, 0.15, math.inf))
    # Rank 1 exactly (sigma 0.5, z 1): unbounded too, not the highest bucket's bound.
    assert quantile_bounds(0.5, LINEAR, 1, 1.0)[2] == math.inf


def test_an_upper_bound_in_the_inf_bucket_is_unbounded_and_one_at_its_edge_is_not() -> None:
    # 10 % of the observations past the last finite bound (0.1 s).
    tail = Histogram.from_counts([0.01 * i for i in range(1, 11)], [9.0] * 10 + [10.0])
    assert quantile_bounds(0.92, tail, 10**6, 2.0) == pytest.approx((0.1, 0.1, math.inf))
    # Rank 0.75 of 4 observations is 3, all of them within the last finite bound (2 s).
    h = Histogram((1.0, 2.0), (1.0, 3.0, 4.0))
    assert quantile_bounds(0.5, h, 1, 0.5) == (1.0, 1.5, 2.0)


def test_no_bounds_without_observations_to_count() -> None:
    assert quantile_bounds(0.5, LINEAR, 0, 2.0) == pytest.approx((None, 0.05, None))
    assert quantile_bounds(0.5, Histogram.empty((0.1,)), 10, 2.0) == (None, None, None)


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
    # 10,000 requests (n 100, its histogram holds no more). z = 2.054 (confidence 0.98).
    v = judge(figs(25, itl=LINEAR), figs(10_000, itl=LINEAR), [], CanaryPolicy(min_requests=20))
    p50 = check(v, "itl_p50")
    c_lo = 0.05 - 2.053748910631822 * 0.1 * 0.1  # 0.1 s per unit of rank, sigma 0.1
    b_hi = 0.05 + 2.053748910631822 * 0.05 * 0.1
    assert p50.margin_ratio == pytest.approx(c_lo / b_hi)


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
