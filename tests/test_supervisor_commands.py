"""Pure: the farm-level commands (`workers.commands`) as the core takes them
(`Supervisor.submit`): each does what the operator's, the reload's or the canary's call
did before issue 32 §1 gave the agent one entry, and a command for a worker a reload
removed meanwhile does nothing."""

from __future__ import annotations

import sys
from dataclasses import replace

from sglang_farm.config import load_spec
from sglang_farm.sglang.failures import RestartReason
from sglang_farm.workers.commands import (
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
from sglang_farm.workers.phase import Phase
from sglang_farm.workers.supervisor import (
    HealthPassed,
    Launch,
    Launched,
    ProcessExited,
    Rollout,
    Supervisor,
    Terminate,
    farm_policy,
)

TOML = f"""
[farm]
python = "{sys.executable}"
module = "sglang_farm.sim"
[workers]
gpus = [0, 1, 2]
host = "127.0.0.1"
base_port = 30000
[startup]
canary = 0
parallel = 2
[metrics]
gpu_source = "none"
[sglang]
model_path = "sim/model"
"""


def _ready(n: int = 3) -> Supervisor:
    sup = Supervisor(range(n), farm_policy(load_spec(TOML, source="t.toml")))
    sup.submit(Start(list(range(n))), 0.0)
    for w in range(n):
        sup.handle(w, Launched(pid=100 + w), 1.0)
        sup.handle(w, HealthPassed(), 1.0)
        sup.tick(1.0)
    return sup


def _gated() -> Supervisor:
    """3 ready workers; a gated rolling restart whose canary (0) is ready on the change."""
    sup = _ready()
    sup.submit(RestartRolling([0, 1, 2], RestartReason.CONFIG, gated=True), 10.0)
    sup.handle(0, ProcessExited(status=-15), 11.0)
    sup.handle(0, Launched(pid=200), 11.0)
    sup.handle(0, HealthPassed(), 12.0)
    sup.tick(10_000.0)
    assert sup.gated() and all(sup.workers[w].phase is Phase.READY for w in (1, 2))
    return sup


def test_start_begins_the_rollout_canary_first() -> None:
    sup = Supervisor(range(3), farm_policy(load_spec(TOML, source="t.toml")))
    actions = sup.submit(Start([0, 1, 2]), 0.0)
    assert sup.rollout is Rollout.CANARY
    assert [a.worker for a in actions if isinstance(a, Launch)] == [0]


def test_stop_stops_each_worker_still_configured() -> None:
    sup = _ready()
    actions = sup.submit(Stop([1, 7], drain=False), 5.0)
    assert [a for a in actions if isinstance(a, Terminate)] == [Terminate(1)]
    assert sup.workers[1].phase is Phase.STOPPING


def test_restart_rolling_is_the_rolling_restart_with_its_gate() -> None:
    sup = _ready()
    sup.submit(RestartRolling([0, 1, 2], RestartReason.CONFIG, gated=True), 5.0)
    assert sup.gated() and sup.rolling[0].reason is RestartReason.CONFIG


def test_release_gate_and_roll_back() -> None:
    sup = _gated()
    actions = sup.submit(ReleaseGate(), 10_001.0)
    assert not sup.gated() and any(isinstance(a, Terminate) for a in actions)  # next wave
    sup = _gated()
    actions = sup.submit(RollBack(0, oom_step=0), 10_001.0)
    assert not sup.gated() and sup.rolling == ()
    assert sup.workers[0].phase is not Phase.READY and actions  # the canary restarts
    assert all(sup.workers[w].phase is Phase.READY for w in (1, 2))  # nobody else
    sup = _gated()
    assert sup.submit(RollBack(None, oom_step=0), 10_001.0) == [] and sup.rolling == ()
    sup = _gated()  # a canary a reload removed meanwhile: the gate dropped, nothing else
    assert sup.submit(RollBack(9, oom_step=0), 10_001.0) == [] and sup.rolling == ()


def test_hold_out_reset_oom_release_and_reconfigure() -> None:
    sup = _ready()
    sup.submit(HoldOut(True), 5.0)
    assert sup.held_out_since == 5.0
    sup.submit(HoldOut(False), 6.0)
    assert sup.held_out_since is None
    sup.workers[2] = replace(sup.workers[2], oom_step=2)
    assert sup.submit(ResetOom(2), 7.0) == [] and sup.workers[2].oom_step == 0
    assert sup.submit(ResetOom(9), 7.0) == []  # removed meanwhile: nothing
    assert sup.submit(Release([1]), 8.0) == []  # not quarantined: nothing to release
    spec = load_spec(TOML.replace("parallel = 2", "parallel = 1"), source="t.toml")
    sup.handle(2, ProcessExited(status=0), 9.0)
    sup.submit(Stop([2]), 9.0)
    assert sup.submit(Reconfigure(spec, added=[3], removed=[2]), 10.0) == []
    assert sorted(sup.workers) == [0, 1, 3] and sup.policy.startup.parallel == 1
    assert sup.workers[3].phase is Phase.STOPPED
