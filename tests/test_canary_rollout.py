"""Pure tests of the canary analysis state machine (canary/rollout.py) and the
`[rollout]` config that drives it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from farmtoml import sim_farm, toml_text
from sglang_farm.canary import record
from sglang_farm.canary.figures import Figures
from sglang_farm.canary.rollout import (
    WINDOW_OVER_UNHEALTHY,
    Analysis,
    CanaryObs,
    EndWindow,
    Fail,
    Inconclusive,
    Resolution,
    StartWindow,
    Stopped,
    Wait,
    conclude,
    kept_out_of_gateway,
    observe,
    policy,
    resolve,
    spec_change,
    starved_of_traffic,
)
from sglang_farm.canary.verdict import CanaryPolicy, LivenessKind, Outcome, Verdict, judge
from sglang_farm.config import load_spec
from sglang_farm.errors import ConfigError
from sglang_farm.sglang.failures import Failure, FailureKind
from sglang_farm.spec import RolloutSpec
from sglang_farm.workers.phase import Phase

A = Analysis("sha256:" + "0" * 64, canary=0, window_s=60.0, issued_at=100.0, failure_mark=None)


def _obs(phase: Phase = Phase.READY, **kw: object) -> CanaryObs:
    return CanaryObs(phase=phase, in_gateway=kw.pop("in_gateway", True), **kw)  # type: ignore[arg-type]


def test_the_window_starts_once_the_canary_is_ready_and_in_the_gateway() -> None:
    assert observe(A, _obs(Phase.STARTING), 110.0, gateway=True) == (A, Wait())
    assert observe(A, _obs(in_gateway=False), 110.0, gateway=True) == (A, Wait())
    a, step = observe(A, _obs(), 120.0, gateway=True)
    assert step == StartWindow() and a.window_start == 120.0 and a.ends_at == 180.0
    # Without a gateway, ready is enough.
    _, step = observe(A, _obs(in_gateway=False), 120.0, gateway=False)
    assert step == StartWindow()


def test_the_window_ends_after_analysis_window_and_not_before() -> None:
    a, _ = observe(A, _obs(), 120.0, gateway=False)
    assert observe(a, _obs(), 179.9, gateway=False)[1] == Wait()
    assert observe(a, _obs(), 180.0, gateway=False)[1] == EndWindow()


def test_a_new_failure_of_the_canary_fails_it_at_once_before_or_during_the_window() -> None:
    oom = Failure(FailureKind.CUDA_OOM_SERVING, "CUDA out of memory while serving", "")
    a, _ = observe(A, _obs(), 120.0, gateway=False)
    _, step = observe(
        a, _obs(Phase.BACKOFF, last_failure=oom, last_failure_at=130.0), 130.0, gateway=False
    )
    assert isinstance(step, Fail) and step.event.kind is LivenessKind.OOM
    assert step.event.after_s == 10.0
    # Before the window: a crash while loading the change fails it too.
    crash = Failure(FailureKind.CRASH, "exited with status 1", "")
    _, step = observe(
        A, _obs(Phase.BACKOFF, last_failure=crash, last_failure_at=105.0), 105.0, gateway=False
    )
    assert isinstance(step, Fail) and step.event.kind is LivenessKind.CRASHED


def test_a_failure_from_before_the_change_does_not_count() -> None:
    old = Failure(FailureKind.CRASH, "exited with status 1", "")
    a = Analysis(A.change, 0, 60.0, 100.0, failure_mark=50.0)
    obs = _obs(last_failure=old, last_failure_at=50.0)
    assert observe(a, obs, 120.0, gateway=False)[1] == StartWindow()


def test_failed_health_leaving_serving_quarantine_and_a_stop() -> None:
    a, _ = observe(A, _obs(), 120.0, gateway=False)
    # One missed probe in the window is the supervisor's to judge, as for every worker
    # (`[health] failure_threshold` in a row restarts it, and that restart fails the change
    # below): a harmless canary on a loaded host misses one now and then (CI rolled back
    # harmless changes "health_failed 1 s into the window" on 2 busy cores).
    assert observe(a, _obs(Phase.UNHEALTHY), 125.0, gateway=False)[1] == Wait()
    assert observe(a, _obs(Phase.UNHEALTHY, busy=True), 125.0, gateway=False)[1] == Wait()
    # The window does not end on an unhealthy canary: it waits for the supervisor's
    # threshold (a restart, a failure) or for the canary to answer again.
    ended = observe(a, _obs(Phase.UNHEALTHY), a.ends_at or 0.0, gateway=False)
    assert ended[1] == Wait(WINDOW_OVER_UNHEALTHY)  # and the view says why
    assert observe(a, _obs(Phase.READY), a.ends_at or 0.0, gateway=False)[1] == EndWindow()
    # ... a busy one is answering (its counters advance): its window ends as usual.
    busy_end = observe(a, _obs(Phase.UNHEALTHY, busy=True), a.ends_at or 0.0, gateway=False)
    assert busy_end[1] == EndWindow()
    # Before the window (no traffic served yet) likewise.
    assert observe(A, _obs(Phase.UNHEALTHY), 125.0, gateway=False)[1] == Wait()
    hung = Failure(FailureKind.HANG, "no answer to 3 health probes", "")
    restarted = _obs(Phase.STOPPING, last_failure=hung, last_failure_at=126.0)
    _, step = observe(A, restarted, 126.0, gateway=False)
    assert isinstance(step, Fail) and step.event.kind is LivenessKind.HUNG
    _, step = observe(a, _obs(Phase.FAILED), 125.0, gateway=False)
    assert isinstance(step, Fail) and step.event.kind is LivenessKind.CRASHED
    assert isinstance(observe(a, _obs(Phase.QUARANTINED), 125.0, gateway=False)[1], Inconclusive)
    stopping = _obs(Phase.DRAINING, stopping=True)
    assert observe(a, stopping, 125.0, gateway=False)[1] == Stopped()
    _, step = observe(A, _obs(Phase.FAILED), 105.0, gateway=False)
    assert isinstance(step, Fail)


@pytest.mark.parametrize(
    ("outcome", "on_inconclusive", "expected"),
    [
        (Outcome.PROMOTE, "rollback", Resolution.PROMOTE),
        (Outcome.ROLLBACK, "promote", Resolution.ROLLBACK),
        (Outcome.INCONCLUSIVE, "hold", Resolution.HOLD),
        (Outcome.INCONCLUSIVE, "rollback", Resolution.ROLLBACK),
        (Outcome.INCONCLUSIVE, "promote", Resolution.PROMOTE),
    ],
)
def test_resolve(outcome: Outcome, on_inconclusive: str, expected: Resolution) -> None:
    assert resolve(outcome, on_inconclusive) is expected


def test_the_policy_defaults_are_the_verdicts() -> None:
    assert policy(RolloutSpec()) == CanaryPolicy()


def _spec(**tables: dict[str, object]) -> str:
    return toml_text(sim_farm(2, "/usr/bin/python3", **tables))


def test_spec_change_follows_what_workers_run_and_nothing_else() -> None:
    base = load_spec(_spec(), source="a.toml")
    assert spec_change(base) == spec_change(load_spec(_spec(), source="b.toml"))
    # A drain budget or the window itself is no change of what the workers run ...
    same = load_spec(
        _spec(rollout={"analysis_window": "30s"}, restart={"stop_timeout": "9s"}), source="a.toml"
    )
    assert spec_change(same) == spec_change(base)
    # ... an environment variable, a flag or the interpreter is.
    for other in (
        _spec(farm={"env": {"X": "1"}}),
        _spec(sglang={"model_path": "sim/model", "max_running_requests": 8}),
    ):
        assert spec_change(load_spec(other, source="a.toml")) != spec_change(base)
    assert spec_change(base).startswith(record.PREFIX)


def test_rollout_config_defaults_and_keys() -> None:
    spec = load_spec(
        toml_text(sim_farm(1, "/usr/bin/python3", rollout={"analysis_window": None})),
        source="a.toml",
    )
    assert spec.rollout == RolloutSpec()
    assert spec.rollout.analysis_window == 300.0 and spec.rollout.on_inconclusive == "hold"
    text = _spec(
        rollout={
            "analysis_window": "30s",
            "on_inconclusive": "rollback",
            "eval": "/etc/sglang-farm/eval/arith.jsonl",
            "eval_tolerance": 0.1,
            "min_requests": 20,
            "itl_max_ratio": 2,
            "error_floor": 0.02,
        }
    )
    r = load_spec(text, source="a.toml").rollout
    assert (r.analysis_window, r.on_inconclusive, r.eval) == (
        30.0,
        "rollback",
        "/etc/sglang-farm/eval/arith.jsonl",
    )
    assert (r.eval_tolerance, r.min_requests, r.itl_max_ratio, r.error_floor) == (
        0.1,
        20,
        2.0,
        0.02,
    )


def test_rollout_config_problems_name_the_key() -> None:
    text = _spec(
        rollout={
            "analysis_window": "-1s",
            "on_inconclusive": "maybe",
            "eval": "relative.jsonl",
            "itl_max_ratio": 1.0,
            "confidence": 1,
            "error_floor": True,
            "bogus": 1,
        }
    )
    with pytest.raises(ConfigError) as err:
        load_spec(text, source="a.toml")
    problems = "\n".join(err.value.problems)
    for key in (
        "analysis_window",
        "on_inconclusive",
        "eval",
        "itl_max_ratio",
        "confidence",
        "error_floor",
        "bogus",
    ):
        assert f"rollout.{key}" in problems, key


def test_a_gated_rolling_restart_issues_the_canary_alone_and_waits_for_its_release() -> None:
    """supervisor.RollingRestart.gated: the canary's wave is issued, the next one is not,
    however long it takes (no wave timeout), until the driver clears the gate."""
    from dataclasses import replace

    from sglang_farm.sglang.failures import RestartReason
    from sglang_farm.spec import HealthPolicy, RestartPolicy, StartupPolicy
    from sglang_farm.workers.supervisor import (
        HealthPassed,
        Launch,
        Launched,
        Policy,
        ProcessExited,
        Supervisor,
    )

    p = Policy(
        StartupPolicy(canary=0, parallel=2, load_timeout=100.0),
        HealthPolicy(period=1.0, timeout=1.0, failure_threshold=3),
        RestartPolicy(backoff_initial=1.0, backoff_max=8.0, reset_after=50.0, max_failures=3),
    )
    sup = Supervisor(range(4), p)
    sup.start(list(range(4)), 0.0)
    for w in range(4):
        sup.handle(w, Launched(pid=1000 + w), 1.0)
        sup.handle(w, HealthPassed(), 1.0)
    assert all(s.phase is Phase.READY for s in sup.workers.values())
    assert not sup.gated()
    sup.restart_rolling([0, 1, 2, 3], RestartReason.CONFIG, 10.0, gated=True)
    assert sup.gated()  # the agent keeps the old model copy while it is
    sup.handle(0, ProcessExited(status=-15), 11.0)
    sup.handle(0, Launched(pid=2000), 11.0)
    actions = sup.handle(0, HealthPassed(), 12.0)
    actions += sup.tick(10_000.0)  # far past any wave timeout
    assert not [a for a in actions if isinstance(a, Launch)]
    assert all(sup.workers[w].phase is Phase.READY for w in (1, 2, 3))
    assert sup.next_deadline(10_000.0) is None  # no busy ticking on a gated wave
    sup.rolling = tuple(replace(r, gated=False) for r in sup.rolling)
    assert not sup.gated()
    actions = sup.tick(10_001.0)
    assert any(a for a in actions if getattr(a, "event", None) == "rolling_restart_wave")
    assert {w for w in (1, 2) if sup.workers[w].phase is not Phase.READY} == {1, 2}


# ---- extending a starved window (`[rollout] max_extensions`) ---------------------------------


def _verdict(canary_requests: int, *, errors: int = 0, itl: float = 0.02) -> Verdict:
    """The real verdict on a canary of `canary_requests` against a busy baseline."""
    from canary_sides import side

    return judge(
        side(canary_requests, errors=errors, itl=itl, seed=2),
        side(2800, seed=3),
        [],
        CanaryPolicy(),
    )


def _ended(max_extensions: int) -> Analysis:
    a = replace(A, max_extensions=max_extensions)
    a, _ = observe(a, _obs(), 120.0, gateway=False)
    return a


def test_a_starved_canary_is_judged_for_another_window_and_promoted_when_it_gets_enough() -> None:
    a = _ended(2)
    starved = _verdict(12)
    assert starved.outcome is Outcome.INCONCLUSIVE and starved_of_traffic(starved.checks)
    a1 = conclude(a, starved.outcome, starved.checks, "hold")
    assert isinstance(a1, Analysis)
    assert a1.extensions == 1 and a1.window_start == 120.0  # figures from the start
    assert a1.span_s == 120.0 and a1.ends_at == 240.0
    assert observe(a1, _obs(), 180.0, gateway=False)[1] == Wait()  # the first end is past
    assert observe(a1, _obs(), 240.0, gateway=False)[1] == EndWindow()
    enough = _verdict(80)
    assert conclude(a1, enough.outcome, enough.checks, "hold") is Resolution.PROMOTE


def test_a_canary_still_starved_after_max_extensions_follows_on_inconclusive() -> None:
    starved = _verdict(12)
    a = _ended(2)
    for n in (1, 2):
        nxt = conclude(a, starved.outcome, starved.checks, "hold")
        assert isinstance(nxt, Analysis) and nxt.extensions == n
        a = nxt
    assert a.ends_at == 120.0 + 3 * 60.0  # at most 3 windows
    assert conclude(a, starved.outcome, starved.checks, "hold") is Resolution.HOLD
    assert conclude(a, starved.outcome, starved.checks, "rollback") is Resolution.ROLLBACK


def test_max_extensions_0_holds_at_the_first_window_as_before() -> None:
    starved = _verdict(12)
    a = _ended(0)
    assert conclude(a, starved.outcome, starved.checks, "hold") is Resolution.HOLD
    assert conclude(a, starved.outcome, starved.checks, "promote") is Resolution.PROMOTE
    assert A.max_extensions == 0  # the Analysis's own default: no extension


def test_a_failure_inside_an_extension_rolls_back_at_once() -> None:
    starved = _verdict(12)
    a1 = conclude(_ended(2), starved.outcome, starved.checks, "hold")
    assert isinstance(a1, Analysis)
    crash = Failure(FailureKind.CRASH, "exited with status 1", "")
    _, step = observe(
        a1, _obs(Phase.BACKOFF, last_failure=crash, last_failure_at=200.0), 200.0, gateway=False
    )
    assert isinstance(step, Fail) and step.event.after_s == 80.0  # from the window's start
    failing = _verdict(20, errors=16)  # a figure that fails, however few the requests
    assert failing.outcome is Outcome.ROLLBACK
    assert conclude(a1, failing.outcome, failing.checks, "hold") is Resolution.ROLLBACK


def test_only_too_little_traffic_is_extended() -> None:
    a = _ended(2)
    # Inconclusive for another reason (a /metrics that could not be read, no checks): not
    # starved, so on_inconclusive applies at once.
    assert not starved_of_traffic(())
    assert conclude(a, Outcome.INCONCLUSIVE, (), "hold") is Resolution.HOLD
    thin_base = judge(side_of(400), side_of(30), [], CanaryPolicy())
    assert thin_base.outcome is Outcome.INCONCLUSIVE
    assert isinstance(conclude(a, thin_base.outcome, thin_base.checks, "hold"), Analysis)
    promoted = _verdict(80)
    assert conclude(a, promoted.outcome, promoted.checks, "rollback") is Resolution.PROMOTE


def side_of(requests: int) -> Figures:
    from canary_sides import side

    return side(requests, seed=requests)


def test_max_extensions_config() -> None:
    assert RolloutSpec().max_extensions == 2
    r = load_spec(_spec(rollout={"max_extensions": 0}), source="a.toml").rollout
    assert r.max_extensions == 0
    with pytest.raises(ConfigError) as err:
        load_spec(_spec(rollout={"max_extensions": -1}), source="a.toml")
    assert "rollout.max_extensions" in "\n".join(err.value.problems)


def test_an_operators_restart_inside_an_extension_starts_the_analysis_over() -> None:
    from sglang_farm.workers.supervisor import StopIntent

    starved = _verdict(12)
    a1 = conclude(_ended(2), starved.outcome, starved.checks, "hold")
    assert isinstance(a1, Analysis)
    a2, step = observe(
        a1, _obs(Phase.DRAINING, stop_intent=StopIntent.RESTART), 200.0, gateway=False
    )
    assert step == Wait() and a2.window_start is None and a2.extensions == 0


def test_only_a_canary_waiting_for_its_eval_gate_is_kept_out_of_the_gateway() -> None:
    """rollout.kept_out_of_gateway: the canary while its eval gate has not passed, no one
    once it has, or with no gate, or with no analysis (issue 32 §1: a set of workers the
    gateways leave out, not a phase shown as STARTING)."""
    a = Analysis("sha256:c", 3, 60.0, 0.0, None, needs_eval=True)
    assert kept_out_of_gateway(a) == frozenset({3})
    assert kept_out_of_gateway(replace(a, evaluated=True)) == frozenset()
    assert kept_out_of_gateway(replace(a, needs_eval=False)) == frozenset()
    assert kept_out_of_gateway(None) == frozenset()
