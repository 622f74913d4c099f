"""The canary verdict (issue 23 #1) on synthetic histograms: latency ratios with their
noise margin, TTFT weighed less, the error floors, too little traffic, liveness."""

from __future__ import annotations

import pytest

from canary_sides import _worker, hist, side
from sglang_farm.canary import figures
from sglang_farm.canary.figures import Figures
from sglang_farm.canary.rollout import starved_of_traffic
from sglang_farm.canary.verdict import (
    CanaryPolicy,
    LivenessEvent,
    LivenessKind,
    Outcome,
    judge,
    liveness_event,
    quantile_bounds,
)
from sglang_farm.sglang.failures import Failure, FailureKind
from sglang_farm.sim.engine import ITL_BUCKETS

POLICY = CanaryPolicy()


def test_harmless_change_is_promoted_with_its_figures() -> None:
    v = judge(side(400, seed=2), side(2800, seed=3), [], POLICY)
    assert v.outcome is Outcome.PROMOTE, v.evidence
    assert v.evidence.startswith("canary within limits")
    assert v.evidence.endswith("over 30 s, 400 vs 2,800 requests")
    names = {c.name: c for c in v.checks}
    assert set(names) == {"errors", "itl_p50", "itl_p99", "ttft_p50"}
    assert names["itl_p50"].passed is True
    assert names["itl_p50"].ratio == pytest.approx(1.0, abs=0.1)


def test_five_times_slower_tokens_roll_back_with_the_ratio_in_one_line() -> None:
    v = judge(side(400, itl=0.1, seed=2), side(2800, seed=3), [], POLICY)
    assert v.outcome is Outcome.ROLLBACK
    assert v.evidence.startswith("canary ITL p50 0.")
    assert "x the baseline's 0.0" in v.evidence
    assert v.evidence.endswith("over 30 s, 400 vs 2,800 requests")
    assert "\n" not in v.evidence
    failed = v.failed[0]
    assert failed.name == "itl_p50"
    assert failed.ratio is not None and 4.0 < failed.ratio < 6.0
    assert failed.margin_ratio is not None and failed.margin_ratio > POLICY.itl_max_ratio


@pytest.mark.parametrize(("factor", "outcome"), [(1.15, Outcome.PROMOTE), (2.0, Outcome.ROLLBACK)])
def test_latency_is_judged_against_the_limit_with_its_margin(
    factor: float, outcome: Outcome
) -> None:
    v = judge(side(400, itl=0.02 * factor, seed=4), side(2800, seed=5), [], POLICY)
    assert v.outcome is outcome, v.evidence


def test_p99_of_few_baseline_requests_is_not_judged_but_its_figure_is_kept() -> None:
    # The baseline's p99 of 60 requests has no upper bound: p99 is not judged. (A canary's
    # p99 needs only its lower bound, which few requests do give.)
    v = judge(side(60, seed=6), side(60, seed=7), [], POLICY)
    p99 = next(c for c in v.checks if c.name == "itl_p99")
    assert p99.passed is None
    assert p99.canary is not None and "too few to judge" in p99.text
    assert v.outcome is Outcome.PROMOTE


def test_quantile_bounds_widen_with_fewer_observations() -> None:
    h = hist(ITL_BUCKETS, [0.01 + 0.0001 * i for i in range(300)])
    lo_few, est, hi_few = quantile_bounds(0.5, h, 30, 0.98)
    lo_many, est2, hi_many = quantile_bounds(0.5, h, 3000, 0.98)
    assert est == est2
    assert lo_few is not None and lo_many is not None and hi_few is not None
    assert hi_many is not None
    assert lo_few < lo_many <= est <= hi_many < hi_few  # type: ignore[operator]
    assert quantile_bounds(0.99, h, 50, 0.98)[2] == float("inf")


def test_ttft_is_weighed_less_than_itl() -> None:
    base = side(2800, seed=3)
    cold = judge(side(400, ttft=0.3 * 2.5, seed=2), base, [], POLICY)
    assert cold.outcome is Outcome.PROMOTE, cold.evidence  # a cold cache's 2.5x passes
    broken = judge(side(400, ttft=0.3 * 8, seed=2), base, [], POLICY)
    assert broken.outcome is Outcome.ROLLBACK
    assert broken.evidence.startswith("canary TTFT p50")


def test_errors_fail_above_both_floors_and_never_on_a_handful() -> None:
    base = side(2800, errors=3, seed=3)  # 0.1 %
    ten = judge(side(400, errors=40, seed=2), base, [], POLICY)
    assert ten.outcome is Outcome.ROLLBACK
    assert ten.evidence.startswith("canary errors 10.0 % (40 of 400) vs the baseline's 0.1 %")
    below_floor = judge(side(400, errors=3, seed=2), base, [], POLICY)  # 0.75 %
    assert below_floor.outcome is Outcome.PROMOTE
    noisy_base = side(2800, errors=140, seed=3)  # 5 %: the canary's 6 % is within 2x
    assert judge(side(400, errors=24, seed=2), noisy_base, [], POLICY).outcome is Outcome.PROMOTE
    assert judge(side(400, errors=48, seed=2), noisy_base, [], POLICY).outcome is Outcome.ROLLBACK


def test_too_little_traffic_is_inconclusive_unless_errors_already_fail_it() -> None:
    few = judge(side(20, seed=2), side(2800, seed=3), [], POLICY)
    assert few.outcome is Outcome.INCONCLUSIVE  # nothing failed, but only 20 requests
    assert few.evidence == "too little traffic to judge: 20 canary requests in 30 s, 50 needed"
    one_error = judge(side(20, errors=1, seed=2), side(2800, seed=3), [], POLICY)
    assert one_error.outcome is Outcome.INCONCLUSIVE  # 5 %, but 1 error proves little
    mostly_failing = judge(side(20, errors=16, seed=2), side(2800, seed=3), [], POLICY)
    assert mostly_failing.outcome is Outcome.ROLLBACK
    thin_base = judge(side(400, seed=2), side(30, seed=3), [], POLICY)
    assert thin_base.outcome is Outcome.INCONCLUSIVE
    assert thin_base.evidence.startswith("too little baseline traffic to judge: 30 requests")


def test_any_liveness_failure_rolls_back_at_once_whatever_the_figures() -> None:
    events = [
        LivenessEvent(LivenessKind.HUNG, 14.0),
        LivenessEvent(LivenessKind.OOM, 10.2, "CUDA out of memory while serving"),
    ]
    v = judge(side(5, seed=2), side(2800, seed=3), events, POLICY, complete=False)
    assert v.outcome is Outcome.ROLLBACK
    assert v.evidence == "canary oom 10.2 s into the window: CUDA out of memory while serving"
    assert [c.name for c in v.checks] == ["liveness"]


def test_the_farms_failures_map_onto_liveness_events() -> None:
    def kind(k: FailureKind) -> LivenessKind:
        return liveness_event(Failure(k, "what happened", "advice"), 3.0).kind

    assert kind(FailureKind.CUDA_OOM_SERVING) is LivenessKind.OOM
    assert kind(FailureKind.HOST_OOM_KILL) is LivenessKind.OOM
    assert kind(FailureKind.HANG) is LivenessKind.HUNG
    assert kind(FailureKind.CRASH) is LivenessKind.CRASHED
    assert kind(FailureKind.WATCHDOG_TIMEOUT) is LivenessKind.CRASHED
    event = liveness_event(Failure(FailureKind.CRASH, "exited 1", "see the log"), 7.5)
    assert (event.after_s, event.detail) == (7.5, "exited 1")


def test_before_the_window_ends_only_a_rollback_is_final() -> None:
    good = judge(side(400, seed=2), side(2800, seed=3), [], POLICY, complete=False)
    assert good.outcome is Outcome.INCONCLUSIVE
    assert good.evidence.startswith("analysis under way")
    bad = judge(side(400, itl=0.1, seed=2), side(2800, seed=3), [], POLICY, complete=False)
    assert bad.outcome is Outcome.ROLLBACK


def test_without_a_baseline_only_liveness_and_errors_are_judged() -> None:
    v = judge(side(400, itl=0.1, seed=2), None, [], POLICY)
    assert v.outcome is Outcome.PROMOTE
    assert [c.name for c in v.checks] == ["errors"]
    assert v.evidence.endswith("400 vs 0 requests")


def test_policy_refuses_thresholds_that_cannot_work() -> None:
    with pytest.raises(ValueError, match="ratio limits must be above 1"):
        CanaryPolicy(itl_max_ratio=0.9)
    with pytest.raises(ValueError, match="min_requests must be >= 1"):
        CanaryPolicy(min_requests=0)
    with pytest.raises(ValueError, match="quantiles"):
        CanaryPolicy(itl_quantiles=(0.5, 1.0))


# -- issue 23's matrix misses (docs/benchmarks.md, "Canary analysis: the matrix") ----------


def test_a_slow_canary_starved_of_traffic_is_rolled_back_on_its_tokens() -> None:
    # The matrix's held ITL 5x: smg sent the slowed canary 28 requests of 8 tokens in 30 s
    # (7 inter-token latencies each: 196 observations) against ~3,500 for the baseline.
    # The bounds, on 28 requests, already exclude a harmless canary: roll it back without
    # waiting for the 50 requests that promoting would need, and before the window ends.
    canary, baseline = side(28, itl=0.05, tokens=7, seed=2), side(3500, itl=0.01, seed=3)
    for complete in (True, False):
        v = judge(canary, baseline, [], POLICY, complete=complete)
        assert v.outcome is Outcome.ROLLBACK, v.evidence
        assert v.evidence.startswith("canary ITL p50 0.0")
        assert v.evidence.endswith("over 30 s, 28 vs 3,500 requests")
    twice = judge(side(35, itl=0.02, tokens=7, seed=4), baseline, [], POLICY)  # ITL 2x
    assert twice.outcome is Outcome.ROLLBACK, twice.evidence


def test_latency_counts_observations_per_metric_and_bounds_them_by_requests() -> None:
    baseline = side(3500, itl=0.01, seed=3)
    # 6 requests of 8 tokens: 42 observations, fewer than Kayenta's 50 per metric.
    few = judge(side(6, itl=0.05, tokens=7, seed=2), baseline, [], POLICY)
    assert few.outcome is Outcome.INCONCLUSIVE, few.evidence
    p50 = next(c for c in few.checks if c.name == "itl_p50")
    assert p50.passed is None and "42 observations, 50 needed" in p50.text
    # 3 requests of 200 tokens: 600 observations, but one request's tokens share its
    # batch and its stalls: 3 requests are the effective sample, too few to bound p50
    # (all 3 above the median happens 1 time in 8).
    p50_only = CanaryPolicy(itl_quantiles=(0.5,))
    long = judge(side(3, itl=0.05, tokens=200, seed=2), baseline, [], p50_only)
    assert long.outcome is Outcome.INCONCLUSIVE, long.evidence
    assert judge(side(6, itl=0.05, tokens=200, seed=2), baseline, [], p50_only).outcome is (
        Outcome.ROLLBACK  # 6 requests: all 6 above it happens 1 time in 64
    )
    # A harmless canary as starved as the slow one is not rolled back (nor promoted).
    same = judge(side(28, itl=0.01, tokens=7, seed=2), baseline, [], POLICY)
    assert same.outcome is Outcome.INCONCLUSIVE, same.evidence


def test_two_errors_in_161_requests_at_a_clean_baseline_roll_back() -> None:
    # The matrix's promoted errors 2 %: 2 of 161 canary requests failed, 0 of 1,127 on
    # the baseline. If the canary were as good as the baseline, each of the 2 errors would
    # land on it with its share of the requests (1/8): both, with p = 0.016 < 0.02.
    v = judge(side(161, errors=2, seed=2), side(1127, seed=3), [], POLICY)
    assert v.outcome is Outcome.ROLLBACK, v.evidence
    assert v.evidence.startswith("canary errors 1.2 % (2 of 161) vs the baseline's 0.0 %")
    # The same 2 errors against a baseline with 3 stray ones of its own (0.27 %, a
    # quarter of the canary's ratio): 2 of 5 errors on an eighth of the traffic happens
    # by chance (p = 0.12): a harmless change is not rolled back for them.
    # Nor promoted on them: 1.2 % is above the floor and 4.6x the baseline's; more traffic
    # decides (the window is extended: its traffic check failed).
    stray = judge(side(161, errors=2, seed=2), side(1127, errors=3, seed=3), [], POLICY)
    assert stray.outcome is Outcome.INCONCLUSIVE, stray.evidence
    assert starved_of_traffic(stray.checks), stray.checks
    three = judge(side(161, errors=3, seed=2), side(1127, errors=4, seed=3), [], POLICY)
    assert three.outcome is Outcome.INCONCLUSIVE, three.evidence  # p = 0.046
    assert three.evidence.startswith("too little traffic to judge the canary's errors: ")


def test_one_error_in_a_starved_canarys_55_requests_is_not_promoted() -> None:
    # The rerun matrix's promoted errors 2 %: smg sent the canary 55 requests in 90 s (two
    # extensions), 1 failed (1.8 %), the baseline none of 16,879. Too few to fail it
    # (min_errors), but above the 1 % floor: neither a rollback nor a promotion.
    v = judge(side(55, errors=1, seed=2), side(16879, seed=3), [], POLICY)
    assert v.outcome is Outcome.INCONCLUSIVE, v.evidence
    assert v.evidence.startswith(
        "too little traffic to judge the canary's errors: canary errors 1.8 % (1 of 55)"
    ), v.evidence
    assert starved_of_traffic(v.checks)
    # One error in 300 (0.33 %, under the floor) is nothing to hold a change for.
    assert judge(side(300, errors=1, seed=2), side(16879, seed=3), [], POLICY).outcome is (
        Outcome.PROMOTE
    )
    # Before the window's end it is still only "under way".
    early = judge(side(55, errors=1, seed=2), side(16879, seed=3), [], POLICY, complete=False)
    assert early.outcome is Outcome.INCONCLUSIVE and "under way" in early.evidence


# -- issue 30 #1 and #2: one error source, aborts count for nothing -------------------------


def test_aborted_streams_on_the_canary_do_not_veto_a_harmless_change() -> None:
    """The audit's veto (issue 30 #1): `nobody` aborted streams straight to the canary's
    port and a harmless change was `rolled back: canary errors 33.3 % (12 of 36)`. Scaled
    to a canary with enough requests to promote: 120 answered, 60 aborted on top."""
    c0, c1 = _worker(side(120, seed=2), ok=120, aborted=60)
    b0, b1 = _worker(side(2800, seed=3), ok=2800)
    v = judge(figures.window(c0, c1, 30.0), figures.window(b0, b1, 30.0), [], POLICY)
    assert v.outcome is Outcome.PROMOTE, v.evidence
    assert "vs 2,800 requests" in v.evidence


def test_aborted_streams_on_the_baseline_do_not_promote_a_bad_change() -> None:
    """The audit's promotion: 7,674 aborts on the baseline's workers made its "errors"
    59.3 %, and a canary failing 10 of 153 requests (6.5 %) was promoted to all 8."""
    c0, c1 = _worker(side(153, seed=2), ok=143, failed=10)
    b0, b1 = _worker(side(12_940, seed=3), ok=12_940, aborted=7_674)
    v = judge(figures.window(c0, c1, 30.0), figures.window(b0, b1, 30.0), [], POLICY)
    assert v.outcome is Outcome.ROLLBACK, v.evidence
    assert v.evidence.startswith("canary errors 6.5 % (10 of 153) vs the baseline's 0.0 %")


def test_with_no_error_source_a_change_is_not_promoted_and_the_verdict_says_so() -> None:
    """Issue 30 #2: behind external gateways with workers that count no HTTP responses,
    nothing counts a 500; a 20 %-error change was `promoted: canary errors 0.0 %`. With no
    error source the errors are not judged, and the change is held (inconclusive, not for
    too little traffic: a longer window would see no more)."""
    c0, c1 = _worker(side(157, seed=2), ok=157, gateway=False)
    b0, b1 = _worker(side(1100, seed=3), ok=1100, gateway=False)
    canary, baseline = figures.window(c0, c1, 30.0), figures.window(b0, b1, 30.0)
    v = judge(canary, baseline, [], POLICY)
    assert v.outcome is Outcome.INCONCLUSIVE, v.evidence
    assert v.evidence.startswith("not promoted: the canary's errors are not judged: no error")
    assert v.evidence.endswith("over 30 s, 157 vs 1,100 requests")
    errors = next(c for c in v.checks if c.name == "errors")
    assert errors.passed is None and errors.canary is None
    assert not starved_of_traffic(v.checks)
    # Without a baseline either, the same; and a slow canary is still rolled back.
    assert judge(canary, None, [], POLICY).outcome is Outcome.INCONCLUSIVE
    s0, s1 = _worker(side(157, itl=0.1, seed=2), ok=157, gateway=False)
    slow = judge(figures.window(s0, s1, 30.0), baseline, [], POLICY)
    assert slow.outcome is Outcome.ROLLBACK and slow.evidence.startswith("canary ITL p50")
    early = judge(canary, baseline, [], POLICY, complete=False)
    assert early.outcome is Outcome.INCONCLUSIVE


def test_the_canary_is_judged_on_the_source_the_baseline_shares() -> None:
    """A canary on SGLang 0.5.23 (its own response counter) against a baseline still on
    0.5.12 (none): both judged on the gateway's outcomes, never 5xx of one against the
    other's outcomes."""
    own = figures.Counts(figures.ErrorSource.WORKERS, 200.0, 0.0)
    outcomes = figures.Counts(figures.ErrorSource.GATEWAY, 200.0, 20.0)
    base = side(200, seed=2)
    canary = Figures(
        30.0, 200.0, 0.0, base.itl, base.ttft, figures.ErrorSource.WORKERS, (own, outcomes)
    )
    v = judge(canary, side(2800, seed=3), [], POLICY)
    assert v.outcome is Outcome.PROMOTE  # hand-built sides: both on their own source
    old = side(2800, seed=3)
    old = Figures(
        30.0, 2800.0, 0.0, old.itl, old.ttft, figures.ErrorSource.GATEWAY,
        (figures.Counts(figures.ErrorSource.GATEWAY, 2800.0, 0.0),),
    )  # fmt: skip
    v = judge(canary, old, [], POLICY)
    assert v.outcome is Outcome.ROLLBACK, v.evidence
    assert v.evidence.startswith("canary errors 10.0 % (20 of 200)")
