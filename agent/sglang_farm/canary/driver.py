"""I/O: the agent's side of the canary analysis (issue 23; docs/canary.md).

Its surface, each call a line or two in agent.py and reloader.py and nothing else:
- at construction, `CanaryDriver(spec, host, ...)` and its `spec`: the config a
  (re)started agent runs (the accepted one when the file's change was rejected or not
  yet judged; ConfigError when the change was rejected and no accepted config can run
  instead); `host` is what it may do to the farm and read of it (`Host`);
- at a reload: `loaded` (the file's text as it was loaded, for the record), `held`
  (refused: rejected before), `eval_problems` (refused: an unusable eval set),
  `superseded_by` and `supersede` (a reload during an analysis), `rejected` again after
  the reload's last await (a verdict meanwhile), then `begin`, which says whether the
  rolling restart is gated;
- on every state change, `observe`; for each launch, `spec_for` (the baseline keeps the
  accepted config); for the gateway's membership, `kept_out_of_gateway` (a canary waiting
  for its eval gate is kept out); for the farm's view, `view`. (`close` cancels its window
  task; nothing calls it yet: the agent's shutdown leaves the task to the loop's end.)
The decisions are canary/plan.py's, canary/rollout.py's, canary/startchoice.py's and
canary/verdict.py's, and the gate's is the core's (issue 32 §1: it holds none); this
shell scrapes /metrics (a `Scrape` function: the tests feed synthetic Prometheus text),
keeps the window's timer, and acts through the agent's one entry (`Host.farm`'s
`submit`, the core's commands): it releases the gated waves (`ReleaseGate`: promote), or
puts the farm back on the accepted config (`Reconfigure`) and restarts the canary alone
(`RollBack`: rollback), and keeps the record in the state directory (canary/store.py).
Its rollback does not take the agent's `changes` lock: the
reloader asks `rejected` again after its awaits, and `_accept` never records a rejected
change.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import structlog

from sglang_farm.canary import (
    evalfile,
    evalrun,
    evalset,
    figures,
    plan,
    probe,
    promtext,
    record,
    rollout,
    startchoice,
    store,
)
from sglang_farm.canary.plan import EARLY_POLL_MIN_S, EARLY_POLLS
from sglang_farm.canary.plan import canary_obs as _obs
from sglang_farm.canary.plan import failure_of as _failure
from sglang_farm.canary.rollout import (
    Analysis,
    EndWindow,
    Fail,
    Inconclusive,
    Resolution,
    RunEval,
    StartWindow,
    Stopped,
    Wait,
)
from sglang_farm.canary.verdict import Check, Outcome
from sglang_farm.canary.view import CanaryState, RolloutVerdictView, check_view
from sglang_farm.config import load_spec
from sglang_farm.errors import ConfigError
from sglang_farm.host.keyguard import KeyGuard
from sglang_farm.sglang.argv import worker_api_key
from sglang_farm.spec import FarmSpec, gpu_field
from sglang_farm.state_alerts import AlertKind, StateAlert
from sglang_farm.workers.commands import FarmEntry, Reconfigure, ReleaseGate, RollBack, Start

log = structlog.get_logger("sglang_farm.canary")

# (url, bearer key or None) -> the /metrics body; raises on any failure.
Scrape = Callable[[str, str | None], Awaitable[str]]
# evalrun.run_gate's signature (tests give a fake).
Gate = Callable[..., Awaitable[evalrun.EvalGate]]

SCRAPE_TIMEOUT_S = 5.0
__all__ = ["EARLY_POLLS", "EARLY_POLL_MIN_S", "CanaryDriver", "Host", "http_scrape"]


async def http_scrape(url: str, key: str | None) -> str:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(trust_env=False, timeout=SCRAPE_TIMEOUT_S) as client:
        r = await client.get(url, headers=headers)
        r.raise_for_status()
        return r.text


@dataclass(frozen=True, slots=True)
class Host:
    """What the driver needs of the agent (given at construction; each a call into the
    agent made only once it runs): what it does to the farm goes to the agent's one
    entry (`submit`); it reads the workers' states."""

    farm: FarmEntry  # the config in force, the workers' states, and `submit`
    rollout_over: Callable[[], bool]  # the rollout is done, no rolling restart in flight
    spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task[Any]]
    refresh: Callable[[], None]  # the canary's view changed: the farm's view is rebuilt
    reload: Callable[[], Coroutine[Any, Any, Any]]
    startup_done: Callable[[], bool]
    clock: Callable[[], float]
    wall: Callable[[], float]
    gateway: Callable[[], bool]  # a gateway: the canary's window starts once it routes to it
    # A rolled-back change of [model]: the previous copy back in model_path (kept beside
    # it since the reload's swap: staging.driver.StageDriver.restore_old_copy).
    restore_model: Callable[[FarmSpec], None]
    # Every request carrying a worker's key (probes, scrapes, the eval gate) goes only to
    # the worker's own listener (host.keyguard); None: no check (tests without /proc's).
    key_guard: KeyGuard | None = None


def _read_text(spec: FarmSpec, change: str, caps: Mapping[int, tuple[int, int]]) -> str | None:
    """The config file's text, if it still says what `spec` says (read back at once, so
    an edit in between is noticed: then None, and a restart cannot use it)."""
    try:
        text = Path(spec.source).read_text(encoding="utf-8")
        again = _load(text, spec.source, _gpu_count(spec))
    except (OSError, UnicodeDecodeError, ConfigError):
        return None
    return text if rollout.spec_change(again, caps) == change else None


def _gpu_count(spec: FarmSpec) -> int:
    """What `workers.gpus = "all"` resolved to (the GPUs the farm uses: 0..n-1 then)."""
    return 1 + max(g for w in spec.workers for g in w.gpus)


def _load(text: str, source: str, gpu_count: int) -> FarmSpec:
    return load_spec(text, source=source, agent_python=sys.executable, gpu_count=gpu_count)


def _gpu(spec: FarmSpec, worker: int) -> str | int:
    return gpu_field(spec.worker(worker).gpus)


class CanaryDriver:
    def __init__(
        self,
        spec: FarmSpec,
        host: Host,
        *,
        scrape: Scrape | None = None,
        caps: Mapping[int, tuple[int, int]] | None = None,
        gate: Gate | None = None,
        send: probe.Send | None = None,
    ) -> None:
        self._scrape = scrape or http_scrape
        self._send = send  # the paired probes' requests (None: HTTP; tests give a fake)
        self._prober: probe.Prober | None = None
        self._probe_task: asyncio.Task[Any] | None = None
        self._gate = gate or evalrun.run_gate
        self._eval_items: tuple[evalset.EvalItem, ...] = ()
        self._evaluating = False
        self._caps = dict(caps or {})
        self._host = host
        self._record = store.load(spec.farm.state_dir)
        self._not_saved: StateAlert | None = None
        self._state_dir = spec.farm.state_dir
        self._accepted: FarmSpec | None = None  # the config the baseline runs
        self._candidate: FarmSpec | None = None  # the change under analysis (or held)
        self._analysis: Analysis | None = None
        self._on_change: int | None = None  # the canary running the candidate, if one does
        self._view: RolloutVerdictView | None = None
        self._oom_step = 0  # the canary's OOM step before the change (a rollback restores it)
        self._task: asyncio.Task[Any] | None = None
        self._judging = False
        self._reroll = False
        self._rollbacks = 0
        self._start: dict[int, figures.WorkerSample] = {}  # the window's first scrape
        self._base: list[int] = []  # the baseline workers, as the window started
        # The last reload's (change, config text), read back as it was loaded: what is
        # recorded as accepted at its promotion (the file may be edited in its window).
        self._loaded: tuple[str, str] | None = None
        self.spec = self._start_spec(spec)

    # ---- agent start -----------------------------------------------------------------------

    def _start_spec(self, spec: FarmSpec) -> FarmSpec:
        """The config the agent starts on (canary.startchoice decides), with its log line
        and, for a held change, the verdict `status` shows."""
        desired = rollout.spec_change(spec, self._caps)
        choice = startchoice.start_choice(
            spec,
            desired,
            self._record.accepted,
            self._record.rejected,
            lambda text: _load(text, spec.source, _gpu_count(spec)),
            str(Path(self._state_dir) / store.FILE),
        )
        match choice:
            case startchoice.Refused(problem=problem):
                log.error(
                    "canary_rejected_change_not_started",
                    change=record.short(desired),
                    problem=problem,
                )
                raise ConfigError(spec.source, [problem])
            case startchoice.OnFile(unjudged=why):
                if why is not None:
                    log.error(
                        "canary_accepted_config_unusable",
                        change=record.short(desired),
                        why=why,
                        hint="the config file runs as it is: its change is not judged by a canary",
                    )
                self._accept(spec, desired)
                return spec
            case startchoice.OnAccepted(accepted=accepted, held=rejection):
                pass
        self._accepted = accepted
        if rejection is not None:
            self._candidate = spec
            self._view = plan.held_view(desired, spec.startup.canary, rejection)
            log.warning(
                "canary_change_held", change=record.short(desired), evidence=self._view.evidence
            )
        else:
            log.warning(
                "canary_change_pending",
                change=record.short(desired),
                why="the config file's change was not accepted before the agent restarted: "
                "the farm starts on the accepted config and rolls the change canary first",
            )
            self._reroll = True
        return accepted

    def _accept(self, spec: FarmSpec, change: str | None = None) -> None:
        change = change or rollout.spec_change(spec, self._caps)
        what = plan.accept_plan(
            change,
            rejected=self._record.rejected.rejection(change) is not None,
            acc=self._record.accepted,
            loaded=self._loaded,
        )
        if isinstance(what, plan.NotAccepted):
            # Never: a rejected change is not the baseline (the reloader re-asks
            # `rejected` after its awaits; this is the last guard).
            log.error("canary_rejected_change_not_accepted", change=record.short(change))
            return
        self._accepted, self._candidate, self._on_change = spec, None, None
        if isinstance(what, plan.AlreadyRecorded):
            return
        text = what.text
        if text is None:
            text = _read_text(spec, change, self._caps)
        self._record = replace(self._record, accepted=record.Accepted(change, text, time.time()))
        self._save()

    def _save(self) -> None:
        try:
            store.save(self._state_dir, self._record)
            self._not_saved = None
        except OSError as exc:
            log.error("canary_record_not_saved", error=str(exc), state_dir=self._state_dir)
            self._not_saved = StateAlert(  # issue 30: farmctl status says so
                str(Path(self._state_dir) / store.FILE),
                AlertKind.NOT_SAVED,
                exc.strerror or str(exc),
                self._not_saved.since if self._not_saved is not None else time.time(),
                then="an agent restart would forget the latest accepted or rejected change",
            )

    def alerts(self) -> tuple[StateAlert, ...]:
        """What is wrong with canary.json: found refused or damaged, or not saved."""
        return (*self._record.alerts, *((self._not_saved,) if self._not_saved else ()))

    def spec_for(self, worker: int, current: FarmSpec) -> FarmSpec:
        """The config `worker` runs when the agent's `current` one is in force: while a
        change is analysed (or held), only the canary runs it; every other worker keeps
        the accepted config, also when it restarts (a crash, an operator's restart)."""
        acc = self._accepted
        if plan.runs_accepted(
            worker,
            on_candidate=current is self._candidate,
            accepted=acc.worker_ids if acc is not None else None,
            on_change=self._on_change,
        ):
            assert acc is not None  # runs_accepted: an accepted config
            return acc
        return current

    def loaded(self, new: FarmSpec) -> None:
        """A reload just loaded `new` from its file: keep the file's text now (read back
        and checked to say what `new` says), for the record at its promotion. Blocking:
        call it in a thread."""
        change = rollout.spec_change(new, self._caps)
        text = _read_text(new, change, self._caps)
        self._loaded = None if text is None else (change, text)

    # ---- a reload ----------------------------------------------------------------------------

    def held(self, new: FarmSpec) -> str | None:
        """Why a reload to `new` is held (its change was rejected by a canary before), or
        None. An unusable eval set is not "held" but a config problem (`eval_problems`)."""
        return self.rejected(new)

    def eval_problems(self, new: FarmSpec) -> tuple[str, ...]:
        """Why `new`'s eval set cannot be used (a reload refused like any config problem:
        farmctl exit 1), or (); loads the set for the canary's gate."""
        if new.rollout.analysis_window <= 0:
            return ()
        self._eval_items = ()
        if new.rollout.eval is not None:
            try:
                text = evalfile.read(new.rollout.eval)  # root's trust rule (review B8)
                self._eval_items = evalset.load(text, source=new.rollout.eval)
            except evalfile.EvalFileRefused as exc:
                return (f"{new.source}: rollout.eval: {exc}",)
            except (OSError, UnicodeDecodeError) as exc:
                return (
                    f"{new.source}: rollout.eval: cannot read {new.rollout.eval}: {exc}; fix "
                    "the path or remove the key",
                )
            except evalset.EvalSetError as exc:
                return tuple(f"{new.rollout.eval}: {p}" for p in exc.problems)
        return ()

    def rejected(self, new: FarmSpec) -> str | None:
        """Why `new` must not run: its change was rejected by a canary (whatever its
        `analysis_window`: a window of 0 s does not roll a rejected change), or None.
        Asked again after a reload's last await: a verdict may have come meanwhile."""
        desired = rollout.spec_change(new, self._caps)
        return plan.rejection_text(new.source, desired, self._record.rejected.rejection(desired))

    def superseded_by(self, new: FarmSpec) -> FarmSpec | None:
        """The config `supersede(new)` would put the farm back on (the accepted one),
        or None when it would change nothing: a reload checks its refusals against it
        before it supersedes anything."""
        if plan.supersedes(self._candidate_change(), rollout.spec_change(new, self._caps)):
            return self._accepted
        return None

    def _candidate_change(self) -> str | None:
        """The change analysed or held, when there is an accepted config to go back to."""
        if self._candidate is None or self._accepted is None:
            return None
        return rollout.spec_change(self._candidate, self._caps)

    def supersede(self, new: FarmSpec) -> None:
        """A reload while a change is analysed (or held): unless it is the same change,
        the farm goes back to the accepted config first (the canary restarts on it), and
        the reload is then planned from there. Not a rejection: nothing is recorded."""
        h = self._host
        change = self._candidate_change()
        canary = self._on_change
        s = h.farm.states().get(canary) if change is not None and canary is not None else None
        what = plan.supersede_plan(
            change,
            rollout.spec_change(new, self._caps),
            analysing=self._analysis is not None,
            canary=canary,
            canary_phase=s.phase if s is not None else None,
        )
        if what is plan.Supersede.NOTHING:
            return
        assert change is not None  # supersede_plan: a change analysed or held
        if what is not plan.Supersede.BACK_TO_ACCEPTED:
            # The same change again while it is held (inconclusive, or its canary
            # stopped): judged again, on the canary that runs it, in a new window.
            assert canary is not None  # supersede_plan: its canary is a worker
            if what is plan.Supersede.RESTART_AND_JUDGE:
                log.info("canary_restarted_to_judge", worker=canary, gpu=_gpu(new, canary))
                h.farm.submit(Start([canary]))
            s = h.farm.states()[canary]
            window = new.rollout.analysis_window
            self._analysis = Analysis(
                change,
                canary,
                window,
                h.clock(),
                s.last_failure_at,
                max_extensions=new.rollout.max_extensions,
            )
            self._show(CanaryState.ANALYSING, "judged again: the window starts")
            return
        log.info("canary_superseded", change=record.short(change), worker=canary)
        self._back_to_accepted(canary)
        self._view = None

    def begin(self, old: FarmSpec, new: FarmSpec, restart: Sequence[int]) -> bool:
        """The reload's rolling restart of `restart` is about to be issued: start an
        analysis when it takes the canary and analysis is on. True: gate the waves."""
        h = self._host
        canary = new.startup.canary
        window = new.rollout.analysis_window
        what = plan.begin_plan(
            restart,
            canary=canary,
            window_s=window,
            same_workers=old.worker_ids == new.worker_ids,
            candidate=self._candidate is not None,
        )
        if what is plan.Begin.KEEP:
            return False
        if what is plan.Begin.ACCEPT:
            self._accept(new)  # e.g. workers added: what runs is the new config's
            return False
        if what is plan.Begin.SKIP_NOT_CANARY:
            self._accept(new)
            log.info(
                "canary_analysis_skipped",
                why="the change does not restart the canary worker ([startup] canary)",
                workers=list(restart),
            )
            return False
        if what is plan.Begin.SKIP_WORKERS_CHANGED:
            self._accept(new)
            log.warning(
                "canary_analysis_skipped",
                why="the reload adds or removes workers: no baseline on the same workers",
            )
            return False
        assert canary is not None  # begin_plan: the canary restarts
        if self._accepted is None:
            self._accepted = old
        self._candidate, self._on_change = new, canary
        s = h.farm.states()[canary]
        self._oom_step = s.oom_step
        change = rollout.spec_change(new, self._caps)
        self._analysis = Analysis(
            change,
            canary,
            window,
            h.clock(),
            s.last_failure_at,
            needs_eval=plan.needs_eval(new.rollout.eval, len(self._eval_items)),
            max_extensions=new.rollout.max_extensions,
        )
        self._show(CanaryState.ANALYSING, "the canary restarts onto the change")
        return what is plan.Begin.ANALYSE_GATED

    # ---- every state change ------------------------------------------------------------------

    def observe(self) -> None:
        """The farm's state changed: the analysis looks at its canary. Re-entered when an
        act's command publishes the view (`submit`, `Host.refresh`): every act sets
        the analysis before it calls back (a verdict clears it first), so a nested call
        looks at a settled analysis, as the next change's call would (no guard needed)."""
        h = self._host
        if plan.reroll_due(self._reroll, h.startup_done(), h.rollout_over()):
            # The start-up's rollout (on the accepted config) is over: the file's change
            # now rolls as a reload would, canary first, judged.
            self._reroll = False
            h.spawn(h.reload())
        states = h.farm.states()
        a = plan.observed(self._analysis, self._judging, list(states))
        if a is None:
            return
        obs = _obs(states[a.canary])
        a2, step = rollout.observe(a, obs, h.clock(), gateway=h.gateway())
        self._analysis = a2
        if plan.restarted_in_window(a, a2):
            self._cancel()  # restarted in its window: a new window once it serves
            self._show(CanaryState.ANALYSING, "the canary restarts: judged again once it serves")
        self._act(a2, step)

    def _act(self, a2: Analysis, step: rollout.Step) -> None:
        h = self._host
        match step:
            case RunEval():
                if not self._evaluating:
                    self._evaluating = True
                    h.spawn(self._eval(a2))
            case StartWindow():
                self._start_window(a2)
            case EndWindow():
                self._judging = True
                self._cancel()
                self._task = h.spawn(self._judge(a2))
            case Fail(event=ev):
                s = h.farm.states().get(a2.canary)
                failure = _failure(s)[0] if s is not None else None
                evidence = plan.fail_evidence(ev, a2.analysing, failure)
                self._resolve(Resolution.ROLLBACK, evidence, ())
            case Stopped():
                self._stopped(a2)
            case Inconclusive(why=why):
                spec = self._candidate or h.farm.spec
                self._resolve(
                    rollout.resolve(Outcome.INCONCLUSIVE, spec.rollout.on_inconclusive),
                    f"inconclusive: {why}",
                    (),
                )
            case Wait(why=why) if why and (self._view is None or self._view.evidence != why):
                # Said once (the refresh's publish observes again, and waits the same).
                self._show(CanaryState.ANALYSING, why, a=a2)
                h.refresh()
            case _:
                pass

    def kept_out_of_gateway(self) -> frozenset[int]:
        """The workers no gateway routes to whatever their state (rollout.kept_out_of_gateway)."""
        return rollout.kept_out_of_gateway(self._analysis)

    async def _eval(self, a: Analysis) -> None:
        """The eval gate on the canary and one baseline worker; passed -> the canary may
        join the gateway; failed -> rolled back like a failed window."""
        h = self._host
        try:
            spec = self._candidate or h.farm.spec
            base = self._baseline(a.canary)
            wlog = log.bind(worker=a.canary, gpu=_gpu(spec, a.canary))
            checks: tuple[Check, ...] = ()
            refused = await self._refusal(a.canary, spec) if base else None
            base_refused = await self._refusal(base[0], spec) if base else None
            match plan.eval_plan(refused, base, base_refused):
                case plan.EvalFail(evidence=evidence):
                    # The canary's port is not its own: no eval is sent there, and no
                    # eval passes.
                    passed = False
                case plan.EvalSkip(why=why):
                    wlog.warning("canary_eval_skipped", why=why)
                    passed, evidence = True, ""
                case plan.EvalRun(baseline=b):
                    flags = spec.worker(a.canary).flags.get("served_model_name")
                    gate = await self._gate(
                        self._eval_items,
                        canary_url=spec.worker(a.canary).base_url,
                        baseline_url=spec.worker(b).base_url,
                        tolerance=spec.rollout.eval_tolerance,
                        canary_key=worker_api_key(spec, a.canary),
                        baseline_key=worker_api_key(spec, b),
                        options=evalrun.EvalOptions(
                            model=flags if isinstance(flags, str) else None
                        ),
                        canary_worker=a.canary,
                        baseline_worker=b,
                    )
                    v = gate.verdict
                    passed, evidence = v.passed, v.evidence_line  # "eval: ...", said once
                    checks = (plan.eval_check(v, spec.rollout.eval_tolerance),)
            if not plan.same_change(self._analysis, a):
                return  # superseded, or failed otherwise, meanwhile
            assert self._analysis is not None  # same_change: an analysis in force
            if passed:
                self._analysis = replace(self._analysis, evaluated=True)
                wlog.info("canary_eval_passed", evidence=evidence)
                self._show(CanaryState.ANALYSING, evidence or "eval skipped", checks)
            else:
                self._resolve(Resolution.ROLLBACK, evidence, checks)
            h.refresh()  # the gateway's membership follows: the canary joins it
        finally:
            self._evaluating = False

    def _start_window(self, a: Analysis) -> None:
        h = self._host
        spec = h.farm.spec
        base = self._baseline(a.canary)
        h_log = log.bind(worker=a.canary, gpu=_gpu(spec, a.canary))
        h_log.info(
            "canary_analysis_started",
            change=record.short(a.change),
            window_s=a.window_s,
            baseline=list(base),
        )
        self._show(CanaryState.ANALYSING, f"the window runs: {a.window_s:g} s")
        self._prober = None
        self._task = h.spawn(self._window(a))
        self._start_probes(a, base)
        h.refresh()

    def _start_probes(self, a: Analysis, base: Sequence[int]) -> None:
        """`[rollout] probe_concurrency` > 0: paired probes to the canary and the baseline
        for the window (canary/probe.py); an extension goes on with the same pairs."""
        h = self._host
        spec = self._candidate or h.farm.spec
        n = spec.rollout.probe_concurrency
        if not plan.probes_wanted(n, base) or self._probe_task is not None:
            return
        if self._prober is None:
            flags = spec.worker(a.canary).flags.get("served_model_name")
            self._prober = probe.Prober(
                record.short(a.change),
                probe.Target(
                    a.canary, spec.worker(a.canary).base_url, worker_api_key(spec, a.canary)
                ),
                [probe.Target(w, spec.worker(w).base_url, worker_api_key(spec, w)) for w in base],
                concurrency=n,
                model=flags if isinstance(flags, str) else None,
                send=self._send,
                guard=h.key_guard,
            )
            log.bind(worker=a.canary, gpu=_gpu(spec, a.canary)).info(
                "canary_probes_started", concurrency=n, baseline=list(base)
            )
        self._probe_task = h.spawn(self._prober.run())

    def _stop_probes(self) -> None:
        t, self._probe_task = self._probe_task, None
        if t is not None and not t.done():
            t.cancel()

    def _stopped(self, a: Analysis) -> None:
        """The canary stopped on purpose: no verdict, nothing recorded, the waves stay
        gated (HELD): a reload judges the change again; an agent restart starts on the
        accepted config and rolls the change canary first."""
        h = self._host
        self._cancel()
        why = "the canary was stopped during the analysis: reload to judge the change again"
        log.bind(worker=a.canary, gpu=_gpu(h.farm.spec, a.canary)).warning(
            "canary_held", change=record.short(a.change), evidence=why
        )
        self._show(CanaryState.HELD, f"held: {why}", (), a)
        self._analysis = None
        h.refresh()

    def _baseline(self, canary: int) -> list[int]:
        return plan.baseline(canary, {w: s.phase for w, s in self._host.farm.states().items()})

    async def _samples(self, workers: Sequence[int]) -> dict[int, figures.WorkerSample]:
        h = self._host
        spec = h.farm.spec
        gw = None
        if spec.gateway.mode == "managed":
            try:
                body = await self._scrape(f"http://{spec.gateway.metrics_listen}/metrics", None)
                gw = promtext.parse(body, source="gateway")
            except Exception as exc:  # any failure: no gateway figures
                log.warning("canary_scrape_failed", target="gateway", error=repr(exc))
        out: dict[int, figures.WorkerSample] = {}
        for w in workers:
            try:
                ws = spec.worker(w)
                refused = await self._refusal(w, spec)
                if refused is not None:
                    log.warning("canary_scrape_failed", worker=w, error=refused)
                    continue
                body = await self._scrape(ws.base_url + "/metrics", worker_api_key(spec, w))
                url = spec.gateway_url_of(w)
                out[w] = figures.worker_sample(promtext.parse(body, source=f"worker {w}"), gw, url)
            except Exception as exc:  # a worker without a sample is left out
                log.warning("canary_scrape_failed", worker=w, error=repr(exc))
        return out

    async def _refusal(self, worker: int, spec: FarmSpec) -> str | None:
        """Why `worker`'s key must not go to its port now (`KeyGuard.refusal`), or None."""
        h = self._host
        if h.key_guard is None:
            return None
        return await h.key_guard.refusal(worker, spec.worker(worker).base_url)

    async def _window(self, a: Analysis, fresh: bool = True) -> None:
        """Wait out `a`'s window, judging early; `fresh`: scrape the window's start (an
        extension keeps the first scrape: its figures cover the whole analysis)."""
        h = self._host
        if fresh:
            base = self._baseline(a.canary)
            self._start = await self._samples([a.canary, *base])
            self._base = base
        end = a.ends_at if a.ends_at is not None else h.clock()
        poll = plan.poll_interval(a.window_s)
        while (left := end - h.clock()) > poll:
            # Early: a rollback as soon as one is certain (judge, complete=False).
            await asyncio.sleep(poll)
            assert a.window_start is not None
            now = await self._samples([a.canary, *self._base])
            outcome, evidence, checks = self._verdict(a, now, h.clock() - a.window_start, False)
            if plan.rolls_back_early(outcome, self._analysis, a, self._judging):
                self._task = None
                self._resolve(Resolution.ROLLBACK, evidence, checks)
                return
        # A millisecond past the end: a timer may fire a float's hair early.
        await asyncio.sleep(max(0.0, left) + 0.001)
        self._task = None
        self.observe()

    def _verdict(
        self,
        a: Analysis,
        end: Mapping[int, figures.WorkerSample],
        seconds: float,
        complete: bool,
    ) -> tuple[Outcome, str, tuple[Check, ...]]:
        spec = self._candidate or self._host.farm.spec
        return plan.window_verdict(
            a.canary,
            self._base,
            self._start,
            end,
            seconds,
            policy=rollout.policy(spec.rollout),
            complete=complete,
            probes=self._prober.pairs if self._prober is not None else None,
        )

    async def _judge(self, a: Analysis) -> None:
        h = self._host
        extended: Analysis | None = None
        try:
            end = await self._samples([a.canary, *self._base])
            spec = self._candidate or h.farm.spec
            verdict_outcome, evidence, checks = self._verdict(a, end, a.span_s, True)
            # observe() looked away while the end scrape ran: a crash, stop, restart or
            # quarantine of the canary meanwhile is seen now, before any verdict.
            states = h.farm.states()
            match plan.judge_plan(
                a,
                self._analysis,
                _obs(states[a.canary]) if a.canary in states else None,
                h.clock(),
                gateway=h.gateway(),
                outcome=verdict_outcome,
                checks=checks,
                on_inconclusive=spec.rollout.on_inconclusive,
            ):
                case plan.Superseded():
                    return
                case plan.Act(analysis=a2, step=step):
                    self._judging = False
                    self._analysis = a2
                    self._act(a2, step)
                case plan.Extend(analysis=res):
                    extended = res  # judged again at its new end, from the same start
                    self._analysis = res
                    self._extended(res, evidence, checks)
                case plan.Resolve(resolution=res):
                    self._resolve(res, evidence, checks)
        finally:
            self._judging = False
            self._task = None
            if extended is not None and self._analysis is extended:
                self._task = h.spawn(self._window(extended, fresh=False))
                self._start_probes(extended, self._base)

    def _extended(self, a: Analysis, evidence: str, checks: Sequence[Any]) -> None:
        """The window ended short of traffic: say so, and judge for another window."""
        h = self._host
        spec = h.farm.spec
        log.bind(worker=a.canary, gpu=_gpu(spec, a.canary)).warning(
            "canary_analysis_extended",
            change=record.short(a.change),
            extension=a.extensions,
            max_extensions=a.max_extensions,
            window_s=a.window_s,
            evidence=evidence,
        )
        views = tuple(check_view(c) for c in checks)
        text = f"extended {a.extensions} of {a.max_extensions}: {evidence}"
        self._show(CanaryState.ANALYSING, text, views, a)
        h.refresh()

    # ---- acting on a verdict -------------------------------------------------------------

    def _resolve(self, res: Resolution, evidence: str, checks: Sequence[Any]) -> None:
        h = self._host
        a = self._analysis
        assert a is not None
        self._cancel()
        spec = h.farm.spec
        wlog = log.bind(worker=a.canary, gpu=_gpu(spec, a.canary), change=record.short(a.change))
        views = tuple(check_view(c) for c in checks)
        if res is Resolution.PROMOTE:
            self._analysis = None
            assert self._candidate is not None
            self._accept(self._candidate, a.change)
            wlog.info("canary_promoted", evidence=evidence)
            self._show(CanaryState.PROMOTED, f"promoted: {evidence}", views, a)
            h.farm.submit(ReleaseGate())
        elif res is Resolution.ROLLBACK:
            self._rollbacks += 1
            self._record = replace(
                self._record, rejected=self._record.rejected.reject(a.change, evidence, h.wall())
            )
            self._save()
            wlog.warning("canary_rolled_back", evidence=evidence)
            self._show(CanaryState.ROLLED_BACK, f"rolled back: {evidence}", views, a)
            self._back_to_accepted(a.canary)
        else:
            wlog.warning("canary_held", evidence=evidence)
            self._show(CanaryState.HELD, f"held: {evidence}", views, a)
            self._analysis = None  # the gate stays closed until the next reload
        h.refresh()

    def _back_to_accepted(self, canary: int | None) -> None:
        """The farm on the accepted config again: the gated waves dropped, the old model
        copy back in model_path (a change of [model]), the canary restarted alone (its OOM
        step as before the change), every other worker untouched."""
        h = self._host
        assert self._accepted is not None
        self._cancel()
        candidate = self._candidate
        self._analysis, self._candidate, self._on_change = None, None, None
        h.farm.submit(Reconfigure(self._accepted))
        if plan.restores_model(
            candidate.model if candidate is not None else None, self._accepted.model
        ):
            h.restore_model(self._accepted)  # before the canary's relaunch below
        # The gated waves dropped; the canary's OOM step as before the change, restarted
        # onto the accepted config (drained first) unless an operator's stop stands.
        h.farm.submit(RollBack(canary, self._oom_step))

    def _cancel(self) -> None:
        self._stop_probes()
        t, self._task = self._task, None
        if t is not None and not t.done() and t is not asyncio.current_task():
            t.cancel()

    # ---- the view ---------------------------------------------------------------------------

    def _show(
        self,
        state: CanaryState,
        evidence: str,
        checks: tuple[Any, ...] = (),
        a: Analysis | None = None,
    ) -> None:
        h = self._host
        a = a or self._analysis
        if a is None:
            return
        self._view = plan.verdict_view(
            state, a, evidence, checks, to_wall=h.wall() - h.clock(), rollbacks=self._rollbacks
        )

    def view(self) -> RolloutVerdictView | None:
        return self._view

    async def close(self) -> None:
        t = self._task
        self._cancel()
        if t is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
