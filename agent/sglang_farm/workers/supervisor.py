"""Pure: the farm's planner. Events and a clock reading in, new state and actions out.

`Supervisor` owns the rollout (canary first, then at most `parallel` workers loading at
once), turns PENDING workers into launches, issues rolling restarts wave by wave
(`plan_waves`), spreads an OOM step, adopts workers a restarted agent finds, holds the
host out of the gateway. Each worker's own transitions are `machine.step`; the events
and actions are `events` and `actions`, the records `records`, the time rules
`budgets` (all re-exported here, so callers keep one name). Nothing here awaits, reads
a clock or touches a process: the agent (`agent.py`) feeds events from the runtime and
the health probes, passes `now` (monotonic seconds), and carries out the returned
actions.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from sglang_farm.sglang.failures import RestartReason
from sglang_farm.sglang.ladder import next_step
from sglang_farm.spec import FarmSpec
from sglang_farm.workers.actions import Action, Drain, Launch, Note, Terminate
from sglang_farm.workers.budgets import (
    STOP_SLACK_S,
    backoff_delay,
    backoff_reset_due,
    drain_deadline_due,
    load_deadline_due,
    stop_budget,
    wave_budget,
    wave_timeout_due,
)
from sglang_farm.workers.commands import (
    FarmCommand,
    HoldOut,
    Reconfigure,
    Release,
    ReleaseGate,
    ResetOom,
    RestartRolling,
    RollBack,
    Start,
    Stop,
)
from sglang_farm.workers.events import (
    Drained,
    Event,
    FailureSeen,
    GatewayMembership,
    GpuFailing,
    HealthFailed,
    HealthPassed,
    Launched,
    PortTaken,
    ProcessExited,
    ProgressSeen,
    ReleaseRequested,
    RemapsPending,
    RestartRequested,
    RolledBack,
    StartRequested,
    StopRequested,
    Tick,
    Wedged,
)
from sglang_farm.workers.machine import (
    RESTART_HISTORY,
    Decision,
    IllegalTransition,
    launch,
    reset_past,
    restored_quarantine,
    step,
    wants_in_gateway,
)
from sglang_farm.workers.phase import Phase, StopIntent
from sglang_farm.workers.phase_sets import HELD, LEAVING, RUNNING
from sglang_farm.workers.records import (
    FailurePast,
    GpuQuarantine,
    Policy,
    RollingRestart,
    WorkerState,
)

# Every public name the supervisor had before issue 32 §3 split it: callers keep one import.
__all__ = [
    "RESTART_HISTORY",
    "STOP_SLACK_S",
    "Action",
    "Adoption",
    "Decision",
    "Drain",
    "Drained",
    "Event",
    "FailurePast",
    "FailureSeen",
    "GatewayMembership",
    "GpuFailing",
    "GpuQuarantine",
    "HealthFailed",
    "HealthPassed",
    "IllegalTransition",
    "Launch",
    "Launched",
    "Note",
    "Policy",
    "PortTaken",
    "ProcessExited",
    "ProgressSeen",
    "ReleaseRequested",
    "RemapsPending",
    "RestartRequested",
    "RolledBack",
    "RollingRestart",
    "Rollout",
    "StartRequested",
    "StopIntent",
    "StopRequested",
    "Supervisor",
    "Terminate",
    "Tick",
    "Wedged",
    "WorkerState",
    "backoff_delay",
    "backoff_reset_due",
    "drain_deadline_due",
    "drifted_workers",
    "farm_policy",
    "launch",
    "load_deadline_due",
    "plan_waves",
    "restored_quarantine",
    "step",
    "stop_budget",
    "wants_in_gateway",
    "wave_budget",
    "wave_timeout_due",
]


class Rollout(StrEnum):
    IDLE = "idle"  # the farm has not been started
    CANARY = "canary"  # only the canary may load
    ROLLING = "rolling"  # the others load, at most `parallel` at once
    DONE = "done"  # every wanted worker has settled (ready or failed)
    HALTED = "halted"  # the canary failed: nothing else starts until an operator starts again


def plan_waves(
    worker_ids: Sequence[int], canary: int | None, parallel: int
) -> tuple[tuple[int, ...], ...]:
    """Pure: the canary alone first (as in a first rollout), then waves of `parallel`.

    Without the canary among them, a wave never takes all of `worker_ids` at once.
    """
    ids = list(worker_ids)
    waves: list[tuple[int, ...]] = []
    if canary is not None and canary in ids and len(ids) > 1:
        ids.remove(canary)
        waves.append((canary,))
        size = max(1, parallel)
    else:
        size = max(1, min(parallel, len(ids) - 1))
    waves += [tuple(ids[i : i + size]) for i in range(0, len(ids), size)]
    return tuple(waves)


@dataclass(frozen=True, slots=True)
class Adoption:
    """What a restarted agent found: workers it adopted and workers it keeps held."""

    adopted: frozenset[int]
    held: frozenset[int]  # failed or stopped before the agent restarted: not started again
    actions: tuple[Action, ...] = ()


def drifted_workers(
    adopted: Collection[int],
    argv: Mapping[int, Sequence[str] | None],
    argv_now: Callable[[int], Sequence[str]],
    secrets_changed: Collection[int] = (),
) -> list[int]:
    """Pure: the adopted workers to restart onto the config as it is now: those running
    another command line than it renders (`argv`: each one's as found; None: the runtime
    cannot tell), and those whose secrets changed while the agent was down (the argv
    does not show them)."""
    return sorted(
        w
        for w in adopted
        if w in secrets_changed or ((found := argv.get(w)) is not None and found != argv_now(w))
    )


def _tag(worker_id: int, actions: Sequence[Action]) -> list[Action]:
    """Notes name their worker, so every logged event does."""
    return [
        Note(a.event, {"worker": worker_id, **a.fields}) if isinstance(a, Note) else a
        for a in actions
    ]


def farm_policy(spec: FarmSpec) -> Policy:
    """The policy `spec` puts in force: its start-up, health and restart rules, its OOM
    ladder (`sglang.ladder.next_step` over `[oom] steps`) and its drain budget."""
    steps = spec.oom.steps
    return Policy.from_spec(spec, lambda current, failure: next_step(current, steps, failure))


class Supervisor:
    """The farm: worker states plus the rollout. Deterministic; the clock comes in as `now`."""

    def __init__(self, worker_ids: Sequence[int], policy: Policy) -> None:
        self.policy = policy
        self.workers: dict[int, WorkerState] = {w: WorkerState(w) for w in worker_ids}
        self.rollout = Rollout.IDLE
        self.rollout_reason: str | None = None
        self.rolling: tuple[RollingRestart, ...] = ()  # planned multi-worker restarts in flight
        # Issue 26: the host is held out of the gateway (drain-host) since this time.
        self.held_out_since: float | None = None

    # -- commands ---------------------------------------------------------------------

    def submit(self, command: FarmCommand, now: float) -> list[Action]:
        """One farm-level command (`workers.commands`): what it does, as actions."""
        match command:
            case Start(workers=ws, fresh=fresh):
                return self.start(list(ws), now, fresh=fresh)
            case Stop(workers=ws, drain=drain):
                return self._each(ws, StopRequested(drain), now)
            case RestartRolling(workers=ws, reason=reason, drain=drain, gated=gated):
                return self.restart_rolling(list(ws), reason, now, drain=drain, gated=gated)
            case Release(workers=ws):
                return self._each(ws, ReleaseRequested(), now)
            case HoldOut(held=held):
                return self.hold_out(held, now)
            case ReleaseGate():
                return self.release_gate(now)
            case RollBack(canary=canary, oom_step=oom_step):
                self.drop_gated()
                if canary is None or canary not in self.workers:
                    return []
                return self.handle(canary, RolledBack(oom_step), now)
            case ResetOom(worker=w):
                if w in self.workers:  # removed by a reload meanwhile: nothing to reset
                    self.reset_oom(w)
                return []
            case Reconfigure(spec=spec, added=added, removed=removed):
                self.reconfigure(farm_policy(spec), added, removed)
                return []

    def _each(self, worker_ids: Sequence[int], event: Event, now: float) -> list[Action]:
        """`event` fed to each of `worker_ids` still configured, in turn."""
        actions: list[Action] = []
        for w in worker_ids:
            if w in self.workers:
                actions += self.handle(w, event, now)
        return actions

    def start(self, worker_ids: Sequence[int], now: float, *, fresh: bool = True) -> list[Action]:
        """Want these workers running; from idle or a halt, this begins a rollout."""
        canary = self.policy.startup.canary
        begin = self.rollout in (Rollout.IDLE, Rollout.HALTED) or (
            canary is not None
            and canary in worker_ids
            and self.workers[canary].phase in (Phase.STOPPED, Phase.FAILED)
        )
        actions: list[Action] = []
        for w in worker_ids:
            actions += self._apply(w, StartRequested(fresh), now)
        if begin:
            if (
                canary is not None
                and canary in self.workers
                and self.workers[canary].phase is Phase.PENDING
            ):
                self.rollout = Rollout.CANARY
                self.workers[canary] = replace(self.workers[canary], halt_on_failure=True)
            else:
                self.rollout = Rollout.ROLLING
            self.rollout_reason = None
            actions.append(Note("rollout_started", {"phase": str(self.rollout), "canary": canary}))
        return actions + self._plan(now)

    def adopt(
        self,
        running: Mapping[int, int],
        remembered: Mapping[int, Phase | None],
        now: float,
        *,
        serving: Collection[int] = (),
    ) -> Adoption:
        """A restarted agent found `running` workers (id -> pid) still up.

        Those in `serving` passed their readiness gate before (an `active` unit): READY at
        once, so the gateway keeps routing to them through the agent's restart (liveness
        probes judge them from the next period on). The others are STARTING until their
        health answers. A worker that had given up, or
        that an operator stopped (`remembered`), and that is not running stays so: it is
        not this restart's to start. With nothing running, nothing is held (a cold start).
        A running worker with a quarantine recorded (the agent went while stopping it for
        its GPU) is stopped: the stop goes on, and it ends QUARANTINED.
        """
        held: set[int] = set()
        for wid, phase in remembered.items():
            if wid not in self.workers or wid in running or phase not in HELD:
                continue
            if running or phase is Phase.QUARANTINED:
                # (remembered) -> FAILED/STOPPED/QUARANTINED: kept as it was before the agent
                # restarted. A quarantine is kept even at a cold start: the GPU is still bad.
                self.workers[wid] = self.workers[wid].enter(phase, now)
                held.add(wid)
        adopted: set[int] = set()
        actions: list[Action] = []
        for wid, pid in running.items():
            if wid not in self.workers:
                continue
            if self.workers[wid].quarantine is not None:
                # (remembered quarantine) -> STOPPING: the agent went while stopping it
                # for its GPU and the process outlived it; the stop goes on, then
                # QUARANTINED. Never READY again on the GPU it was set aside from.
                self.workers[wid] = self.workers[wid].enter(
                    Phase.STOPPING, now, pid=pid, stop_intent=StopIntent.QUARANTINE
                )
                actions += [Terminate(wid), Note("quarantine_stop_resumed", {"worker": wid})]
                adopted.add(wid)
                continue
            if wid in serving:
                # (any) -> READY: it served before the agent restarted and its unit says so.
                self.workers[wid] = self.workers[wid].enter(
                    Phase.READY,
                    now,
                    pid=pid,
                    launched_at=now,
                    ready_since=now,
                    ever_ready=True,
                    health_failures=0,
                )
            else:
                # (any) -> STARTING: a live process of ours; READY once its health answers.
                self.workers[wid] = self.workers[wid].enter(
                    Phase.STARTING, now, pid=pid, launched_at=now
                )
            adopted.add(wid)
        if held:
            actions.append(
                Note(
                    "workers_held",
                    {
                        "workers": sorted(held),
                        "why": "failed or stopped before the agent restarted",
                    },
                )
            )
        return Adoption(frozenset(adopted), frozenset(held), tuple(actions))

    @property
    def held_out(self) -> bool:
        """The host is held out of the gateway (`farmctl drain-host`)."""
        return self.held_out_since is not None

    def hold_out(self, held: bool, now: float) -> list[Action]:
        """Hold every worker of the host out of the gateway (`farmctl drain-host`), or let
        them back in (`undrain-host`). Nothing stops or restarts: a ready worker stays
        ready, out of the gateway (`wants_in_gateway`), until the hold ends; planned stops,
        restarts and rollouts go on as usual meanwhile (their waves do not wait for a
        gateway the workers may not join). Persisted in state.json by the agent."""
        if held == self.held_out:
            return []
        self.held_out_since = now if held else None
        for wid, s in self.workers.items():
            self.workers[wid] = replace(s, held_out=held)
        ids = sorted(self.workers)
        return [Note("host_held_out" if held else "host_back_in", {"workers": ids})]

    def gated(self) -> bool:
        """A rolling restart waits on its canary's verdict (issue 23)."""
        return any(r.gated for r in self.rolling)

    def release_gate(self, now: float) -> list[Action]:
        """The canary's verdict passed: the gated rolling restarts go on (their next
        waves from here, as `tick` issues them)."""
        self.rolling = tuple(replace(r, gated=False) for r in self.rolling)
        return self.tick(now)

    def drop_gated(self) -> None:
        """The canary's verdict failed (or its change was superseded): the gated rolling
        restarts are dropped, their later waves never issued; other restarts go on."""
        self.rolling = tuple(r for r in self.rolling if not r.gated)

    def restart_rolling(
        self,
        worker_ids: Sequence[int],
        reason: RestartReason,
        now: float,
        *,
        drain: bool = True,
        gated: bool = False,  # issue 23: hold the waves after the first (canary analysis)
    ) -> list[Action]:
        """Restart these workers: canary first, then waves of `startup.parallel`.

        One worker alone restarts at once. `drain` False skips the gateway drain.
        """
        ids = tuple(w for w in worker_ids if w in self.workers)
        if not ids:
            return []
        if len(ids) == 1:
            return self.handle(ids[0], RestartRequested(reason, drain), now)
        waves = plan_waves(ids, self.policy.startup.canary, self.policy.startup.parallel)
        self.rolling = (*self.rolling, RollingRestart(reason, waves, drain=drain, gated=gated))
        return self._plan(now)

    def reconfigure(self, policy: Policy, added: Sequence[int], removed: Sequence[int]) -> None:
        """A reload: the new policy; removed workers (already stopped) go, added ones arrive
        STOPPED (the caller starts them)."""
        self.policy = policy
        for wid in removed:
            self.workers.pop(wid, None)
        self.rolling = tuple(
            replace(
                r,
                waves=tuple(
                    left
                    for wave in r.waves
                    if (left := tuple(w for w in wave if w in self.workers))
                ),
                wave=tuple(w for w in r.wave if w in self.workers),
            )
            for r in self.rolling
        )
        for wid in added:
            self.workers.setdefault(wid, WorkerState(wid, held_out=self.held_out))

    def handle(self, worker_id: int, event: Event, now: float) -> list[Action]:
        """Feed one event about one worker."""
        step_before = self.workers[worker_id].oom_step
        actions = self._apply(worker_id, event, now)
        step_after = self.workers[worker_id].oom_step
        # A rolled-back canary's step is the one it had before the change, no new OOM.
        if self.policy.oom_all and step_after > step_before and not isinstance(event, RolledBack):
            actions += self._spread_oom_step(worker_id, step_after, now)
        return actions + self._plan(now)

    def _spread_oom_step(self, source: int, step: int, now: float) -> list[Action]:
        """scope = "all": every other worker takes the same OOM step.

        Running ones are restarted with it in a rolling restart (waves of `parallel`); the
        others take it at their next start.
        """
        running: list[int] = []
        for wid, s in self.workers.items():
            if wid == source or s.oom_step >= step:
                continue
            self.workers[wid] = replace(s, oom_step=step)
            if s.phase in RUNNING:
                running.append(wid)
        note = Note("oom_step_spread", {"worker": source, "step": step, "restart": running})
        if running:
            # The source is restarting already: the canary rule does not hold it back.
            waves = plan_waves(running, self.policy.startup.canary, self.policy.startup.parallel)
            self.rolling = (*self.rolling, RollingRestart(RestartReason.OOM, waves))
        return [note]

    def tick(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for w in list(self.workers):
            actions += self._apply(w, Tick(), now)
        return actions + self._plan(now)

    def stopped(self, worker_ids: Collection[int]) -> bool:
        """Each of `worker_ids` still configured runs nothing and starts nothing by itself:
        STOPPED, FAILED or QUARANTINED (what a wait for a stop waits for)."""
        return all(self.workers[w].phase in HELD for w in worker_ids if w in self.workers)

    def stopping(self) -> bool:
        """A stop is under way for some worker: it drains or its process tree is stopping."""
        return any(s.phase in LEAVING for s in self.workers.values())

    def reset_oom(self, worker_id: int) -> None:
        s = self.workers[worker_id]
        self.workers[worker_id] = replace(s, oom_step=0, failure_past=reset_past(s))

    def restore_remembered(
        self, states: Mapping[int, WorkerState], held_out_since: float | None
    ) -> None:
        """What a restarted agent remembers (`state.StateStore.restore`), put back: each
        worker's state, then the host's hold out of the gateway (it marks every worker)."""
        for wid, state in states.items():
            self.restore(wid, state)
        if held_out_since is not None:
            self.hold_out(True, held_out_since)

    def restore(self, worker_id: int, state: WorkerState) -> None:
        """Put back a worker's remembered state (restarts, back-off, OOM step) at agent start."""
        if state.id != worker_id or worker_id not in self.workers:
            raise ValueError(f"worker {worker_id}: not a worker of this farm")
        self.workers[worker_id] = state

    # -- internals --------------------------------------------------------------------

    def _apply(self, worker_id: int, event: Event, now: float) -> list[Action]:
        decision = step(self.workers[worker_id], event, now, self.policy)
        self.workers[worker_id] = decision.state
        return _tag(worker_id, decision.actions)

    def _settled(self, worker: int) -> bool:
        """A worker of a rolling wave is done: serving again (and back in the gateway when
        there is one, unless its host is held out of it), or failed, or stopped."""
        s = self.workers.get(worker)
        if s is None or s.phase in HELD:
            return True
        return s.phase is Phase.READY and (
            self.policy.drain_timeout is None or s.in_gateway or s.held_out
        )

    def _advance_rolling(self, now: float) -> list[Action]:
        """Issue the next wave of each rolling restart whose current wave has settled."""
        actions: list[Action] = []
        kept: list[RollingRestart] = []
        for r in self.rolling:
            settled = all(self._settled(w) for w in r.wave)
            timeout_at = wave_timeout_due(r, self.policy)
            if timeout_at is not None and not settled and now < timeout_at:
                kept.append(r)
                continue
            if r.gated and r.wave:  # issue 23: the canary's verdict releases the next wave
                kept.append(r)
                continue
            if not r.waves:
                actions.append(Note("rolling_restart_done", {"reason": str(r.reason)}))
                continue  # the last wave settled (or timed out): this rolling restart is over
            wave, rest = r.waves[0], r.waves[1:]
            # next wave: the previous one serves again (or gave up, or ran out of time).
            kept.append(replace(r, waves=rest, wave=wave, wave_started=now))
            actions.append(Note("rolling_restart_wave", {"workers": list(wave)}))
            for w in wave:
                if w in self.workers:
                    actions += self._apply(w, RestartRequested(r.reason, r.drain), now)
        self.rolling = tuple(kept)
        return actions

    def _plan(self, now: float) -> list[Action]:
        """Advance rolling restarts and the rollout; give loading slots to PENDING workers."""
        actions: list[Action] = self._advance_rolling(now) if self.rolling else []
        canary = self.policy.startup.canary
        if self.rollout in (Rollout.CANARY, Rollout.HALTED) and canary is not None:
            c = self.workers[canary]
            if c.phase is Phase.READY:
                # CANARY/HALTED -> ROLLING: the canary serves (again, after a fix and a restart).
                self.rollout = Rollout.ROLLING
                self.rollout_reason = None
                actions.append(Note("rollout_canary_ready", {"canary": canary}))
            elif self.rollout is Rollout.CANARY and c.phase is Phase.QUARANTINED:
                # CANARY -> ROLLING: a failing GPU says nothing about the config; go on.
                self.rollout = Rollout.ROLLING
                actions.append(Note("rollout_canary_quarantined", {"canary": canary}))
            elif self.rollout is Rollout.CANARY and c.phase in (Phase.FAILED, Phase.STOPPED):
                self.rollout = Rollout.HALTED
                why = c.last_failure.summary if c.last_failure else "the canary was stopped"
                self.rollout_reason = f"canary worker {canary} {c.phase}: {why}"
                actions.append(
                    Note("rollout_halted", {"canary": canary, "why": self.rollout_reason})
                )
        if self.rollout is Rollout.IDLE:
            return actions
        loading = sum(1 for s in self.workers.values() if s.phase is Phase.STARTING)
        for wid in sorted(self.workers):
            s = self.workers[wid]
            if s.phase is not Phase.PENDING:
                continue
            if self.rollout in (Rollout.CANARY, Rollout.HALTED) and wid != canary:
                continue  # nothing but the canary loads until it is ready
            if loading >= max(1, self.policy.startup.parallel):
                break
            decision = launch(s, now)
            self.workers[wid] = decision.state
            actions += _tag(wid, decision.actions)
            loading += 1
        if self.rollout is Rollout.ROLLING and not any(
            s.phase in (Phase.PENDING, Phase.STARTING) for s in self.workers.values()
        ):
            self.rollout = Rollout.DONE
            ready = sum(1 for s in self.workers.values() if s.phase is Phase.READY)
            actions.append(Note("rollout_done", {"ready": ready, "workers": len(self.workers)}))
        return actions

    def next_deadline(self, now: float) -> float | None:
        """The earliest time a Tick could change something (back-off end, load deadline,
        drain budget, back-off reset, wave timeout)."""
        times: list[float] = []
        for s in self.workers.values():
            reset_at = backoff_reset_due(s, self.policy)
            if reset_at is not None:
                times.append(reset_at)
            if s.phase is Phase.BACKOFF and s.retry_at is not None:
                times.append(s.retry_at)
            load_at = load_deadline_due(s, self.policy)
            if load_at is not None:
                times.append(load_at)
            drain_at = drain_deadline_due(s, self.policy)
            if drain_at is not None:
                times.append(drain_at)
        for r in self.rolling:
            timeout_at = wave_timeout_due(r, self.policy)
            # Issue 23: a gated wave waits for a verdict, not time.
            if timeout_at is not None and not r.gated:
                times.append(timeout_at)
        return min(times) if times else None
