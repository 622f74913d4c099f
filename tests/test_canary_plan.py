"""Pure tests of the canary driver's decisions (canary/plan.py, issue 32 §1): each
branch the driver used to take itself, from plain values."""

from __future__ import annotations

from dataclasses import replace

import pytest

from canary_sides import _worker, side
from sglang_farm.canary import figures, plan
from sglang_farm.canary.evalset import EvalVerdict
from sglang_farm.canary.figures import ProbePair, ProbeResult
from sglang_farm.canary.plan import Begin, Supersede
from sglang_farm.canary.record import Accepted, Rejection
from sglang_farm.canary.rollout import (
    Analysis,
    CanaryObs,
    EndWindow,
    Fail,
    Resolution,
    Stopped,
    Wait,
    observe,
)
from sglang_farm.canary.verdict import CanaryPolicy, Check, LivenessEvent, LivenessKind, Outcome
from sglang_farm.canary.view import CanaryState, CheckView, RolloutVerdictView
from sglang_farm.sglang.failures import Failure, FailureKind
from sglang_farm.workers.phase import Phase, StopIntent
from sglang_farm.workers.supervisor import WorkerState

CHANGE = "sha256:" + "ab" * 32
OTHER = "sha256:" + "cd" * 32
A = Analysis(CHANGE, canary=0, window_s=60.0, issued_at=100.0, failure_mark=None)
REJECTED = Rejection(CHANGE, "canary errors 9.0 %", at=0.0)  # 1970-01-01 00:00:00 UTC
OOM = Failure(FailureKind.CUDA_OOM_SERVING, "CUDA out of memory while serving", "")


# ---- the canary's state ---------------------------------------------------------------------


def test_the_canarys_failure_is_the_pending_one_while_it_is_stopped_for_it() -> None:
    old = Failure(FailureKind.CRASH, "exited with status 1", "")
    s = WorkerState(0, Phase.STOPPING, since=9.0, pending_failure=OOM, last_failure=old)
    assert plan.failure_of(replace(s, last_failure_at=2.0)) == (OOM, 9.0)
    assert plan.failure_of(replace(s, phase=Phase.READY, last_failure_at=2.0)) == (old, 2.0)
    assert plan.failure_of(replace(s, pending_failure=None, last_failure_at=2.0)) == (old, 2.0)


def test_the_canary_is_observed_as_its_state_says() -> None:
    s = WorkerState(
        0,
        Phase.READY,
        in_gateway=True,
        busy=True,
        last_failure=OOM,
        last_failure_at=3.0,
        stop_intent=StopIntent.RESTART,
    )
    assert plan.canary_obs(s) == CanaryObs(
        Phase.READY, True, True, False, OOM, 3.0, StopIntent.RESTART
    )


@pytest.mark.parametrize(
    ("phase", "intent", "stopping"),
    [
        (Phase.STOPPING, StopIntent.STOP, True),
        (Phase.DRAINING, StopIntent.STOP, True),
        (Phase.STOPPING, StopIntent.RESTART, False),
        (Phase.READY, StopIntent.STOP, False),
    ],
)
def test_only_an_operators_stop_under_way_is_stopping(
    phase: Phase, intent: StopIntent, stopping: bool
) -> None:
    assert plan.canary_obs(WorkerState(0, phase, stop_intent=intent)).stopping is stopping


def test_the_baseline_is_every_other_ready_worker_in_id_order() -> None:
    phases = {3: Phase.READY, 0: Phase.READY, 2: Phase.DRAINING, 1: Phase.READY}
    assert plan.baseline(0, phases) == [1, 3]
    assert plan.baseline(1, phases) == [0, 3]
    assert plan.baseline(0, {0: Phase.READY}) == []


# ---- a reload ---------------------------------------------------------------------------------


def test_a_rejected_change_is_refused_with_when_and_why() -> None:
    assert plan.rejection_text("farm.toml", CHANGE, None) is None
    text = plan.rejection_text("farm.toml", CHANGE, REJECTED)
    assert text == (
        f"farm.toml: change {CHANGE[:19]} was rejected by its canary at 1970-01-01 00:00:00"
        " UTC: canary errors 9.0 %; the farm stays on the accepted config: edit the config "
        "to retry"
    )


def test_a_change_held_at_start_is_shown_held_with_its_rejection() -> None:
    v = plan.held_view(CHANGE, 2, REJECTED)
    evidence = (
        f"held: change {CHANGE[:19]} was rejected at 1970-01-01 00:00:00 UTC: canary "
        "errors 9.0 %; edit the config to retry"
    )
    assert v == RolloutVerdictView(CanaryState.HELD, CHANGE[:19], 2, 0.0, 0.0, None, evidence)
    assert plan.held_evidence(CHANGE, REJECTED) == evidence
    assert plan.held_view(CHANGE, None, REJECTED).canary == -1
    assert plan.held_view(CHANGE, 0, REJECTED).canary == 0


def test_another_change_supersedes_the_one_analysed() -> None:
    assert plan.supersedes(CHANGE, OTHER)
    assert not plan.supersedes(CHANGE, CHANGE)
    assert not plan.supersedes(None, OTHER)


def _supersede(
    candidate: str | None = CHANGE,
    new: str = CHANGE,
    *,
    analysing: bool = False,
    canary: int | None = 0,
    phase: Phase | None = Phase.READY,
) -> Supersede:
    return plan.supersede_plan(
        candidate, new, analysing=analysing, canary=canary, canary_phase=phase
    )


def test_a_reload_with_nothing_analysed_supersedes_nothing() -> None:
    assert _supersede(None, OTHER) is Supersede.NOTHING


def test_a_reload_to_another_change_goes_back_to_the_accepted_config() -> None:
    assert _supersede(new=OTHER) is Supersede.BACK_TO_ACCEPTED
    assert _supersede(new=OTHER, analysing=True, canary=None) is Supersede.BACK_TO_ACCEPTED


def test_the_same_change_under_analysis_goes_on() -> None:
    assert _supersede(analysing=True) is Supersede.NOTHING


def test_the_same_change_held_is_judged_again_on_its_canary() -> None:
    assert _supersede() is Supersede.JUDGE_AGAIN
    assert _supersede(canary=0, phase=Phase.STARTING) is Supersede.JUDGE_AGAIN


def test_a_held_change_whose_canary_was_stopped_starts_it_again_to_judge() -> None:
    assert _supersede(phase=Phase.STOPPED) is Supersede.RESTART_AND_JUDGE


def test_a_held_change_without_its_canary_is_not_judged_again() -> None:
    assert _supersede(canary=None) is Supersede.NOTHING
    assert _supersede(phase=None) is Supersede.NOTHING


def _begin(
    restart: tuple[int, ...] = (0, 1),
    *,
    canary: int | None = 0,
    window_s: float = 60.0,
    same: bool = True,
    candidate: bool = False,
) -> Begin:
    return plan.begin_plan(
        restart, canary=canary, window_s=window_s, same_workers=same, candidate=candidate
    )


def test_a_reload_that_restarts_nothing_accepts_the_config_unless_a_change_is_analysed() -> None:
    assert _begin(()) is Begin.ACCEPT
    assert _begin((), candidate=True) is Begin.KEEP


def test_with_analysis_off_the_change_is_accepted_as_it_rolls() -> None:
    assert _begin(window_s=0.0) is Begin.ACCEPT
    assert _begin(window_s=-1.0, canary=None) is Begin.ACCEPT


def test_a_restart_without_the_canary_is_accepted_and_said() -> None:
    assert _begin((1, 2)) is Begin.SKIP_NOT_CANARY
    assert _begin(canary=None) is Begin.SKIP_NOT_CANARY
    assert _begin(window_s=0.001, canary=None) is Begin.SKIP_NOT_CANARY


def test_a_reload_that_adds_or_removes_workers_is_accepted_and_said() -> None:
    assert _begin(same=False) is Begin.SKIP_WORKERS_CHANGED


def test_the_canarys_restart_is_analysed_and_the_waves_after_it_gated() -> None:
    assert _begin((1, 0)) is Begin.ANALYSE_GATED
    assert _begin((0,)) is Begin.ANALYSE
    assert _begin((0,), candidate=True) is Begin.ANALYSE


def test_the_eval_gate_runs_with_a_loaded_set_only() -> None:
    assert plan.needs_eval("eval.jsonl", 1)
    assert not plan.needs_eval("eval.jsonl", 0)
    assert not plan.needs_eval(None, 40)


@pytest.mark.parametrize(
    ("worker", "on_candidate", "accepted", "on_change", "expected"),
    [
        (1, True, (0, 1), 0, True),  # a baseline worker keeps the accepted config
        (0, True, (0, 1), 0, False),  # the canary runs the change
        (1, False, (0, 1), 0, False),  # another config in force: as it says
        (1, True, None, 0, False),  # nothing accepted to run
        (2, True, (0, 1), 0, False),  # a worker the accepted config does not have
        (1, True, (0, 1), None, True),  # held with no canary on the change
    ],
)
def test_only_the_canary_runs_the_change_under_analysis(
    worker: int,
    on_candidate: bool,
    accepted: tuple[int, ...] | None,
    on_change: int | None,
    expected: bool,
) -> None:
    got = plan.runs_accepted(
        worker, on_candidate=on_candidate, accepted=accepted, on_change=on_change
    )
    assert got is expected


def test_a_rollback_restores_the_model_copy_only_for_a_change_of_model() -> None:
    assert plan.restores_model("new-model", "old-model")
    assert not plan.restores_model("old-model", "old-model")
    assert not plan.restores_model(None, "old-model")


# ---- the record ------------------------------------------------------------------------------


def test_a_rejected_change_is_never_recorded_as_accepted() -> None:
    got = plan.accept_plan(CHANGE, rejected=True, acc=None, loaded=(CHANGE, "text"))
    assert got == plan.NotAccepted()


def test_an_accepted_change_already_recorded_with_its_text_is_not_saved_again() -> None:
    acc = Accepted(CHANGE, "text", 1.0)
    assert plan.accept_plan(CHANGE, rejected=False, acc=acc, loaded=None) == (
        plan.AlreadyRecorded()
    )


def test_an_accepted_change_is_recorded_with_the_text_it_was_loaded_from() -> None:
    loaded = (CHANGE, "loaded text")
    for acc in (None, Accepted(OTHER, "old", 1.0), Accepted(CHANGE, None, 1.0)):
        got = plan.accept_plan(CHANGE, rejected=False, acc=acc, loaded=loaded)
        assert got == plan.RecordAccepted("loaded text")


def test_without_its_loaded_text_the_file_is_read_back_for_it() -> None:
    for loaded in (None, (OTHER, "another change's text")):
        got = plan.accept_plan(CHANGE, rejected=False, acc=None, loaded=loaded)
        assert got == plan.RecordAccepted(None)


# ---- every state change -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reroll", "done", "over", "due"),
    [
        (True, True, True, True),
        (False, True, True, False),
        (True, False, True, False),
        (True, True, False, False),
    ],
)
def test_the_held_back_change_rolls_once_the_startups_rollout_is_over(
    reroll: bool, done: bool, over: bool, due: bool
) -> None:
    assert plan.reroll_due(reroll, done, over) is due


def test_a_state_change_looks_at_the_analysis_of_a_worker_not_being_judged() -> None:
    assert plan.observed(A, False, [0, 1]) is A
    assert plan.observed(None, False, [0, 1]) is None
    assert plan.observed(A, True, [0, 1]) is None
    assert plan.observed(A, False, [1, 2]) is None


def test_a_canary_restarted_in_its_window_starts_it_over() -> None:
    analysing = replace(A, window_start=110.0)
    assert plan.restarted_in_window(analysing, A)
    assert not plan.restarted_in_window(analysing, analysing)
    assert not plan.restarted_in_window(A, A)
    assert not plan.restarted_in_window(A, analysing)


def test_a_failed_canarys_evidence_says_when_and_the_classifiers_kind() -> None:
    ev = LivenessEvent(LivenessKind.OOM, 12.4, OOM.summary)
    assert plan.fail_evidence(ev, True, OOM) == (
        "canary oom 12 s into the window: CUDA out of memory while serving [cuda_oom_serving]"
    )
    assert plan.fail_evidence(ev, False, None) == (
        "canary oom at start: CUDA out of memory while serving"
    )
    other = Failure(FailureKind.CRASH, "exited with status 1", "")
    assert plan.fail_evidence(ev, False, other) == (
        "canary oom at start: CUDA out of memory while serving"
    )


# ---- the eval gate ----------------------------------------------------------------------------


def test_no_eval_goes_to_a_canary_port_that_is_not_its_own() -> None:
    got = plan.eval_plan("port 30000 is held by pid 7", [1], None)
    assert got == plan.EvalFail("eval: not run on the canary: port 30000 is held by pid 7")


def test_without_a_baseline_to_compare_with_the_eval_is_skipped_and_says_why() -> None:
    assert plan.eval_plan(None, [], None) == plan.EvalSkip("no ready worker on the old config")
    assert plan.eval_plan(None, [1], "held by pid 7") == plan.EvalSkip("held by pid 7")


def test_the_eval_runs_on_the_canary_and_the_first_baseline_worker() -> None:
    assert plan.eval_plan(None, [2, 3], None) == plan.EvalRun(2)


def test_the_eval_verdict_is_a_check_with_both_scores_and_their_ratio() -> None:
    v = EvalVerdict(False, "eval: canary 50 % vs 80 %", 0.5, 0.8)
    assert plan.eval_check(v, 0.05) == Check(
        "eval", False, 0.5, 0.8, 0.625, None, 0.05, "eval: canary 50 % vs 80 %"
    )
    assert plan.eval_check(replace(v, baseline_score=0.0), 0.05).ratio is None


def test_an_eval_result_counts_only_for_the_analysis_that_ran_it() -> None:
    assert plan.same_change(replace(A, evaluated=True), A)
    assert not plan.same_change(None, A)
    assert not plan.same_change(replace(A, change=OTHER), A)


# ---- the window -------------------------------------------------------------------------------


def test_the_window_is_judged_early_ten_times_but_not_more_than_every_5_s() -> None:
    assert plan.poll_interval(300.0) == 30.0
    assert plan.poll_interval(100.0) == 10.0
    assert plan.poll_interval(30.0) == 5.0
    assert plan.poll_interval(55.0) == 5.5


def test_probes_run_with_a_concurrency_and_a_baseline_to_pair_with() -> None:
    assert plan.probes_wanted(1, [1])
    assert not plan.probes_wanted(0, [1])
    assert not plan.probes_wanted(4, [])


def _samples(
    canary_itl: float, *, baseline: tuple[int, ...] = (1,)
) -> tuple[dict[int, figures.WorkerSample], dict[int, figures.WorkerSample]]:
    c0, c1 = _worker(side(400, itl=canary_itl, seed=2), ok=400)
    start, end = {0: c0}, {0: c1}
    for w in baseline:
        b0, b1 = _worker(side(2800, seed=3 + w), ok=2800)
        start[w], end[w] = b0, b1
    return start, end


def _verdict(
    start: dict[int, figures.WorkerSample],
    end: dict[int, figures.WorkerSample],
    *,
    base: tuple[int, ...] = (1,),
    complete: bool = True,
    probes: list[ProbePair] | None = None,
) -> tuple[Outcome, str, tuple[Check, ...]]:
    return plan.window_verdict(
        0, base, start, end, 30.0, policy=CanaryPolicy(), complete=complete, probes=probes
    )


def test_a_canary_without_both_samples_is_inconclusive() -> None:
    start, end = _samples(0.02)
    why = "inconclusive: the canary's /metrics could not be read"
    del start[0]
    assert _verdict(start, end) == (Outcome.INCONCLUSIVE, why, ())
    start, end = _samples(0.02)
    del end[0]
    assert _verdict(start, end) == (Outcome.INCONCLUSIVE, why, ())


def test_a_harmless_change_is_promoted_and_a_slow_one_rolled_back() -> None:
    outcome, evidence, checks = _verdict(*_samples(0.02))
    assert outcome is Outcome.PROMOTE, evidence
    assert "vs 2,800 requests" in evidence and checks
    assert _verdict(*_samples(0.1))[0] is Outcome.ROLLBACK


def test_early_only_a_rollback_is_final() -> None:
    outcome, evidence, _ = _verdict(*_samples(0.02), complete=False)
    assert outcome is Outcome.INCONCLUSIVE, evidence


def test_the_baseline_is_the_workers_with_both_samples() -> None:
    start, end = _samples(0.02, baseline=(1, 2))
    assert "vs 5,600 requests" in _verdict(start, end, base=(1, 2))[1]
    for samples in (start, end):
        lost = dict(samples)
        del lost[2]
        ends = (lost, end) if samples is start else (start, lost)
        assert "vs 2,800 requests" in _verdict(*ends, base=(1, 2))[1]
    assert "vs 2,800 requests" in _verdict(start, end, base=(1,))[1]


def test_the_paired_probes_are_judged_when_they_ran() -> None:
    slow = [
        ProbePair(ProbeResult(2.0 + i / 100, True), ProbeResult(0.2 + i / 1000, True))
        for i in range(80)
    ]
    start, end = _samples(0.02)
    assert _verdict(start, end)[0] is Outcome.PROMOTE
    outcome, evidence, _ = _verdict(start, end, probes=slow)
    assert "on 80 paired probes" in evidence, evidence
    assert outcome is Outcome.ROLLBACK, evidence


@pytest.mark.parametrize(
    ("outcome", "current", "judging", "early"),
    [
        (Outcome.ROLLBACK, A, False, True),
        (Outcome.INCONCLUSIVE, A, False, False),
        (Outcome.ROLLBACK, None, False, False),
        (Outcome.ROLLBACK, replace(A, change=OTHER), False, False),
        (Outcome.ROLLBACK, A, True, False),
    ],
)
def test_an_early_judgement_rolls_back_only_when_certain_and_current(
    outcome: Outcome, current: Analysis | None, judging: bool, early: bool
) -> None:
    assert plan.rolls_back_early(outcome, current, A, judging) is early


ENDED = replace(A, window_start=110.0)  # ends at 170
SERVING = CanaryObs(Phase.READY, in_gateway=True)
STARVED = (Check("traffic", False, 10.0, 2800.0, None, None, 100.0, "too little traffic"),)


def _judge(
    current: Analysis | None = ENDED,
    obs: CanaryObs | None = SERVING,
    *,
    outcome: Outcome = Outcome.PROMOTE,
    checks: tuple[Check, ...] = (),
    a: Analysis = ENDED,
    on_inconclusive: str = "hold",
) -> plan.JudgePlan:
    return plan.judge_plan(
        a,
        current,
        obs,
        180.0,
        gateway=True,
        outcome=outcome,
        checks=checks,
        on_inconclusive=on_inconclusive,
    )


def test_a_judgement_of_an_analysis_superseded_meanwhile_is_dropped() -> None:
    assert _judge(current=None) == plan.Superseded()
    assert _judge(current=replace(ENDED, change=OTHER)) == plan.Superseded()
    assert _judge(current=replace(ENDED)) == plan.Resolve(Resolution.PROMOTE)


def test_a_canary_that_failed_while_its_end_was_scraped_fails_it_before_any_verdict() -> None:
    crashed = CanaryObs(Phase.BACKOFF, in_gateway=False)
    got = _judge(obs=crashed)
    assert isinstance(got, plan.Act) and isinstance(got.step, Fail)
    assert got.analysis == ENDED


def test_a_canary_stopped_meanwhile_is_acted_on_not_judged() -> None:
    got = _judge(obs=CanaryObs(Phase.STOPPING, in_gateway=False, stopping=True))
    assert got == plan.Act(ENDED, Stopped())


def test_a_canary_restarted_meanwhile_starts_its_window_over() -> None:
    restarting = CanaryObs(Phase.STOPPING, in_gateway=False, stop_intent=StopIntent.RESTART)
    got = _judge(obs=restarting)
    assert got == plan.Act(replace(ENDED, window_start=None), Wait())


def test_a_verdict_on_a_canary_that_still_serves_is_resolved() -> None:
    assert _judge() == plan.Resolve(Resolution.PROMOTE)
    assert _judge(obs=None) == plan.Resolve(Resolution.PROMOTE)
    assert _judge(outcome=Outcome.ROLLBACK) == plan.Resolve(Resolution.ROLLBACK)
    got = _judge(outcome=Outcome.INCONCLUSIVE, on_inconclusive="rollback")
    assert got == plan.Resolve(Resolution.ROLLBACK)


def test_a_window_short_of_traffic_is_extended() -> None:
    a = replace(ENDED, max_extensions=1)
    got = _judge(current=a, a=a, outcome=Outcome.INCONCLUSIVE, checks=STARVED)
    assert got == plan.Extend(replace(a, extensions=1))
    assert isinstance(observe(a, SERVING, 180.0, gateway=True)[1], EndWindow)


# ---- the view ---------------------------------------------------------------------------------


def test_an_analysis_under_way_is_shown_with_its_end_on_the_wall_clock() -> None:
    views = (CheckView("itl_p99", 0.05, 0.01, 5.0, 1.5, False),)
    a = replace(ENDED, extensions=1, max_extensions=2)
    v = plan.verdict_view(CanaryState.ANALYSING, a, "extended", views, to_wall=1000.0, rollbacks=3)
    assert v == RolloutVerdictView(
        state=CanaryState.ANALYSING,
        change=CHANGE[:19],
        canary=0,
        started_at=1110.0,
        window_s=120.0,
        ends_at=1230.0,
        evidence="extended",
        checks=views,
        rollbacks_total=3,
        extensions=1,
        max_extensions=2,
    )


def test_a_decided_or_waiting_analysis_has_no_end() -> None:
    done = plan.verdict_view(CanaryState.PROMOTED, ENDED, "p", (), to_wall=1000.0, rollbacks=0)
    assert done.ends_at is None and done.started_at == 1110.0
    waiting = plan.verdict_view(CanaryState.ANALYSING, A, "w", (), to_wall=1000.0, rollbacks=0)
    assert waiting.ends_at is None and waiting.started_at == 1100.0
