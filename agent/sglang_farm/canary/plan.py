"""Pure: what the canary driver does next, from plain values (issue 32 §1).

The driver (canary/driver.py) is an executor: it reads the record, the states and the
clock, asks these functions, and carries out their answer (the log lines, the scrapes,
the commands it submits). Each function here is one of its former branches: whether a
reload's rolling restart is analysed and gated (`begin_plan`), what a reload during an
analysis does (`supersedes`, `supersede_plan`), which workers keep the accepted config
(`runs_accepted`), the baseline, the eval gate's plan and its check, the window's
polls and verdicts, what the end of a window means (`judge_plan`), whether an accepted
change is recorded and from which text (`accept_plan`), and the view readers see.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from sglang_farm.canary import figures, record
from sglang_farm.canary.evalset import EvalVerdict
from sglang_farm.canary.record import Accepted, Rejection
from sglang_farm.canary.rollout import (
    Analysis,
    CanaryObs,
    EndWindow,
    Resolution,
    Step,
    conclude,
    observe,
)
from sglang_farm.canary.startchoice import utc
from sglang_farm.canary.verdict import CanaryPolicy, Check, LivenessEvent, Outcome, judge
from sglang_farm.canary.view import CanaryState, CheckView, RolloutVerdictView
from sglang_farm.sglang.failures import Failure
from sglang_farm.workers.phase import Phase, StopIntent
from sglang_farm.workers.phase_sets import LEAVING
from sglang_farm.workers.supervisor import WorkerState

# Inside the window the canary is judged early (only a certain rollback acts) this many
# times, but not more often than every EARLY_POLL_MIN_S: a 5-minute window polls every
# 30 s, each poll one /metrics scrape per worker.
EARLY_POLLS = 10
EARLY_POLL_MIN_S = 5.0


# ---- the canary's state ---------------------------------------------------------------------


def failure_of(s: WorkerState) -> tuple[Failure | None, float | None]:
    """The canary's latest failure and when: the one the farm is stopping it for (a CUDA
    OOM its log showed while it served: recorded only once the process is gone; also
    when a restart was asked meanwhile), else its last one. Issue 31: the first was
    missed, the verdict said "left serving". A pending failure outside STOPPING is an
    earlier stop's leftover, never news."""
    if s.phase is Phase.STOPPING and s.pending_failure is not None:
        return s.pending_failure, s.since  # since: when the farm began stopping it for it
    return s.last_failure, s.last_failure_at


def canary_obs(s: WorkerState) -> CanaryObs:
    """What rollout.observe needs of the canary's supervisor state."""
    stopping = s.stop_intent is StopIntent.STOP and s.phase in LEAVING
    failure, failure_at = failure_of(s)
    return CanaryObs(
        phase=s.phase,
        in_gateway=s.in_gateway,
        busy=s.busy,
        stopping=stopping,
        last_failure=failure,
        last_failure_at=failure_at,
        stop_intent=s.stop_intent,
    )


def baseline(canary: int, phases: Mapping[int, Phase]) -> list[int]:
    """The workers compared with the canary: every other READY one, in id order."""
    return [w for w, p in sorted(phases.items()) if w != canary and p is Phase.READY]


# ---- a reload ---------------------------------------------------------------------------------


def rejection_text(source: str, desired: str, rejection: Rejection | None) -> str | None:
    """Why a config whose change is `desired` must not run (`rejection`: the record's
    for that change), or None."""
    if rejection is None:
        return None
    return (
        f"{source}: change {record.short(desired)} was rejected by its canary at "
        f"{utc(rejection.at)}: "
        f"{rejection.evidence}; the farm stays on the accepted config: edit the config "
        "to retry"
    )


def held_evidence(desired: str, rejection: Rejection) -> str:
    """The held change's line at an agent's start (`status` shows it)."""
    return (
        f"held: change {record.short(desired)} was rejected at "
        f"{utc(rejection.at)}: {rejection.evidence}; edit the config to "
        "retry"
    )


def held_view(desired: str, canary: int | None, rejection: Rejection) -> RolloutVerdictView:
    """The view of a change held at an agent's start (`canary` None: the farm has none)."""
    return RolloutVerdictView(
        CanaryState.HELD,
        record.short(desired),
        canary if canary is not None else -1,
        rejection.at,
        0.0,
        None,
        held_evidence(desired, rejection),
    )


def supersedes(candidate: str | None, new: str) -> bool:
    """A reload to the change `new` puts the farm back on the accepted config first:
    a change is analysed or held (`candidate`, None: none, or no accepted config to go
    back to) and `new` is another one."""
    return candidate is not None and new != candidate


class Supersede(StrEnum):
    NOTHING = "nothing"  # no change under analysis, or the same one still judged
    JUDGE_AGAIN = "judge_again"  # the same change, held: a new window on its canary
    RESTART_AND_JUDGE = "restart_and_judge"  # as JUDGE_AGAIN, its stopped canary started
    BACK_TO_ACCEPTED = "back_to_accepted"  # another change: the accepted config first


def supersede_plan(
    candidate: str | None,
    new: str,
    *,
    analysing: bool,
    canary: int | None,
    canary_phase: Phase | None,
) -> Supersede:
    """What a reload to the change `new` does while `candidate` is analysed or held
    (`supersedes`'s terms). The same change while held (`analysing` False: inconclusive,
    or its canary stopped) is judged again on the canary that runs it (`canary_phase`:
    its phase, None when the farm has no such worker); a canary stopped by the operator
    starts again onto the change first (a stopped one is not a canary that failed)."""
    if candidate is None:
        return Supersede.NOTHING
    if new != candidate:
        return Supersede.BACK_TO_ACCEPTED
    if analysing or canary is None or canary_phase is None:
        return Supersede.NOTHING
    if canary_phase is Phase.STOPPED:
        return Supersede.RESTART_AND_JUDGE
    return Supersede.JUDGE_AGAIN


class Begin(StrEnum):
    KEEP = "keep"  # nothing restarts and a change is analysed: it stays as it is
    ACCEPT = "accept"  # the new config is accepted as it is (nothing to judge)
    SKIP_NOT_CANARY = "skip_not_canary"  # accepted, and said: the canary is not restarted
    SKIP_WORKERS_CHANGED = "skip_workers_changed"  # accepted, and said: no like baseline
    ANALYSE = "analyse"  # the canary alone restarts: analysed, nothing to gate
    ANALYSE_GATED = "analyse_gated"  # analysed, the waves after the canary's gated


def begin_plan(
    restart: Sequence[int],
    *,
    canary: int | None,
    window_s: float,
    same_workers: bool,
    candidate: bool,
) -> Begin:
    """What a reload's rolling restart of `restart` starts: an analysis when it takes
    the `[startup] canary` and analysis is on (`window_s` > 0) with the same workers
    before and after (`same_workers`); `candidate`: a change is analysed or held now."""
    if not restart:
        return Begin.KEEP if candidate else Begin.ACCEPT  # e.g. workers added
    if window_s <= 0:
        return Begin.ACCEPT
    if canary is None or canary not in restart:
        return Begin.SKIP_NOT_CANARY
    if not same_workers:
        return Begin.SKIP_WORKERS_CHANGED
    return Begin.ANALYSE_GATED if len(restart) > 1 else Begin.ANALYSE


def needs_eval(eval_path: str | None, items: int) -> bool:
    """The canary answers the eval set before it takes traffic: a set is configured and
    loaded with `items` problems."""
    return eval_path is not None and items > 0


def runs_accepted(
    worker: int,
    *,
    on_candidate: bool,
    accepted: Sequence[int] | None,
    on_change: int | None,
) -> bool:
    """`worker` runs the accepted config though the candidate is in force
    (`on_candidate`): every worker of the accepted config (`accepted`: its ids, None:
    none) but the canary that runs the change (`on_change`), also when it restarts."""
    return on_candidate and accepted is not None and worker != on_change and worker in accepted


def restores_model(candidate_model: object | None, accepted_model: object) -> bool:
    """A rollback puts the previous model copy back: the change was one of [model]
    (`candidate_model` None: no change under analysis)."""
    return candidate_model is not None and candidate_model != accepted_model


# ---- the record ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NotAccepted:
    """Never: a rejected change is not the baseline (the last guard)."""


@dataclass(frozen=True, slots=True)
class AlreadyRecorded:
    """The record already holds the change with its text: nothing to save."""


@dataclass(frozen=True, slots=True)
class RecordAccepted:
    """Record the change as accepted with `text` (None: read the file back for it)."""

    text: str | None


AcceptPlan = NotAccepted | AlreadyRecorded | RecordAccepted


def accept_plan(
    change: str,
    *,
    rejected: bool,
    acc: Accepted | None,
    loaded: tuple[str, str] | None,
) -> AcceptPlan:
    """Whether and how `change` is recorded as accepted: `rejected`, the record rejects
    it; `acc`, the record's accepted change; `loaded`, the last reload's (change, text)
    as it was read at its load (the file may have been edited since)."""
    if rejected:
        return NotAccepted()
    if acc is not None and acc.change == change and acc.text is not None:
        return AlreadyRecorded()
    return RecordAccepted(loaded[1] if loaded is not None and loaded[0] == change else None)


# ---- every state change -----------------------------------------------------------------------


def reroll_due(reroll: bool, startup_done: bool, rollout_over: bool) -> bool:
    """The file's change, held back at the agent's start, rolls now (as a reload would):
    the start-up's rollout on the accepted config is over."""
    return reroll and startup_done and rollout_over


def observed(a: Analysis | None, judging: bool, workers: Sequence[int]) -> Analysis | None:
    """The analysis a state change looks at (None: none, its end is being judged, or its
    canary is not a worker of the farm)."""
    if a is None or judging or a.canary not in workers:
        return None
    return a


def restarted_in_window(before: Analysis, after: Analysis) -> bool:
    """The canary restarted in its window: a new window once it serves again."""
    return before.analysing and not after.analysing


def fail_evidence(ev: LivenessEvent, analysing: bool, failure: Failure | None) -> str:
    """The rollback's line for a failed canary, with the classifier's kind (as `why`
    shows it) when its failure is the one the event names."""
    after = f"{ev.after_s:.0f} s into the window" if analysing else "at start"
    evidence = f"canary {ev.kind} {after}: {ev.detail}"
    if failure is not None and failure.summary == ev.detail:
        evidence += f" [{failure.kind}]"
    return evidence


# ---- the eval gate ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EvalRun:
    """Run the eval set on the canary and on `baseline`."""

    baseline: int


@dataclass(frozen=True, slots=True)
class EvalSkip:
    """Nothing to compare with: the gate passes and says why it did not run."""

    why: str


@dataclass(frozen=True, slots=True)
class EvalFail:
    """The gate fails without a request: no eval is sent to the canary's port."""

    evidence: str


EvalPlan = EvalRun | EvalSkip | EvalFail


def eval_plan(
    canary_refusal: str | None, base: Sequence[int], base_refusal: str | None
) -> EvalPlan:
    """The eval gate on the canary and the first baseline worker (`base`); a refusal is
    why that worker's key must not go to its port now (host.keyguard)."""
    if canary_refusal is not None:
        return EvalFail(f"eval: not run on the canary: {canary_refusal}")
    if not base or base_refusal is not None:
        return EvalSkip(base_refusal or "no ready worker on the old config")
    return EvalRun(base[0])


def eval_check(v: EvalVerdict, tolerance: float) -> Check:
    """The eval gate's verdict as one of the analysis's compared figures."""
    return Check(
        "eval",
        v.passed,
        v.canary_score,
        v.baseline_score,
        v.canary_score / v.baseline_score if v.baseline_score else None,
        None,
        tolerance,
        v.evidence_line,
    )


def same_change(current: Analysis | None, a: Analysis) -> bool:
    """The analysis that ran a slow step (`a`) is still the one in force (`current`)."""
    return current is not None and current.change == a.change


# ---- the window -------------------------------------------------------------------------------


def poll_interval(window_s: float) -> float:
    """Seconds between the window's early judgements."""
    return max(EARLY_POLL_MIN_S, window_s / EARLY_POLLS)


def window_verdict(
    canary: int,
    baseline: Sequence[int],
    start: Mapping[int, figures.WorkerSample],
    end: Mapping[int, figures.WorkerSample],
    seconds: float,
    *,
    policy: CanaryPolicy,
    complete: bool,
    probes: Sequence[figures.ProbePair] | None,
) -> tuple[Outcome, str, tuple[Check, ...]]:
    """The verdict on the window between the `start` and `end` samples: the canary's
    figures against its `baseline`'s combined (a worker with no sample at either end is
    left out); `probes`, the paired probes' pairs (None: no probes ran)."""
    if canary not in start or canary not in end:
        return Outcome.INCONCLUSIVE, "inconclusive: the canary's /metrics could not be read", ()
    canary_f = figures.window(start[canary], end[canary], seconds)
    base = figures.combined(
        [figures.window(start[w], end[w], seconds) for w in baseline if w in start and w in end]
    )
    probed = figures.probe_figures(probes) if probes is not None else None
    v = judge(canary_f, base, [], policy, complete=complete, probes=probed)
    return v.outcome, v.evidence, v.checks


def probes_wanted(concurrency: int, base: Sequence[int]) -> bool:
    """Paired probes run in the window: `[rollout] probe_concurrency` > 0 and a baseline
    worker to pair the canary with."""
    return concurrency > 0 and bool(base)


def rolls_back_early(
    outcome: Outcome, current: Analysis | None, a: Analysis, judging: bool
) -> bool:
    """An early judgement rolls back: certain, on the analysis still in force, and its
    end not being judged meanwhile."""
    return outcome is Outcome.ROLLBACK and current == a and not judging


@dataclass(frozen=True, slots=True)
class Superseded:
    """The analysis changed while its end was scraped: this judgement is dropped."""


@dataclass(frozen=True, slots=True)
class Act:
    """The canary changed while its end was scraped: `step` on `analysis`, no verdict."""

    analysis: Analysis
    step: Step


@dataclass(frozen=True, slots=True)
class Extend:
    """The window ended short of traffic: `analysis` runs another window."""

    analysis: Analysis


@dataclass(frozen=True, slots=True)
class Resolve:
    resolution: Resolution


JudgePlan = Superseded | Act | Extend | Resolve


def judge_plan(
    a: Analysis,
    current: Analysis | None,
    obs: CanaryObs | None,
    now: float,
    *,
    gateway: bool,
    outcome: Outcome,
    checks: Sequence[Check],
    on_inconclusive: str,
) -> JudgePlan:
    """What the verdict at the end of `a`'s window means, once its end scrape returned:
    `current`, the analysis in force now; `obs`, the canary now (None: not a worker).
    A crash, stop, restart or quarantine of the canary meanwhile is seen first (the state
    changes were not looked at while the scrape ran), before any verdict."""
    if current is not a and current != a:
        return Superseded()
    if obs is not None:
        a2, step = observe(a, obs, now, gateway=gateway)
        if a2 != a or not isinstance(step, EndWindow):
            return Act(a2, step)
    res = conclude(a, outcome, checks, on_inconclusive)
    if isinstance(res, Analysis):
        return Extend(res)
    return Resolve(res)


# ---- the view ---------------------------------------------------------------------------------


def verdict_view(
    state: CanaryState,
    a: Analysis,
    evidence: str,
    checks: tuple[CheckView, ...],
    *,
    to_wall: float,
    rollbacks: int,
) -> RolloutVerdictView:
    """`a` as readers see it; `to_wall`: the wall clock less the supervisor's clock. Only
    an analysis under way has an end."""
    start = a.window_start if a.window_start is not None else a.issued_at
    return RolloutVerdictView(
        state=state,
        change=record.short(a.change),
        canary=a.canary,
        started_at=start + to_wall,
        window_s=a.span_s,
        ends_at=a.ends_at + to_wall
        if a.ends_at is not None and state is CanaryState.ANALYSING
        else None,
        evidence=evidence,
        checks=checks,
        rollbacks_total=rollbacks,
        extensions=a.extensions,
        max_extensions=a.max_extensions,
    )
