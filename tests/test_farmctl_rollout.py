"""`farmctl reload` following a canary analysis, and `status`/`why` showing its verdict,
against a real control socket over a FakeOps whose views progress as a script says."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace

import pytest

from fake_ops import FakeOps
from ops_socket import Agent, serving
from sglang_farm.canary.view import CanaryState, CheckView, RolloutVerdictView
from sglang_farm.cli.ctl import reload
from sglang_farm.cli.ctl.exits import Exit
from sglang_farm.cli.ctl.status import format_status
from sglang_farm.control.farm_api import ReloadResult
from sglang_farm.farm_view import FarmView

FUTURE = 4e9  # a window that started after any reload of the test (the agent's clock)

ROLLED_BACK = (
    "rolled back: canary ITL p99 0.052 s = 5.2x the baseline's over 30 s, 412 vs 2,830 requests"
)
CHECKS = (
    CheckView("errors", 0.001, 0.0005, 2.0, 0.01, True),
    CheckView("itl_p50", 0.021, 0.02, 1.05, 1.4, True),
    CheckView("itl_p99", 0.052, 0.01, 5.2, 1.4, False),
    CheckView("ttft_p50", 0.4, None, None, 3.0, None),
)


def verdict(
    state: CanaryState,
    evidence: str = "",
    *,
    started_at: float = FUTURE,
    canary: int = 2,
    window: bool = True,
) -> RolloutVerdictView:
    """The canary analysis in `state`; analysing with `window` False: the canary is still
    restarting onto the change (no window end yet)."""
    analysing = state is CanaryState.ANALYSING
    return RolloutVerdictView(
        state=state,
        change="3f9a1c2e",
        canary=canary,
        started_at=started_at,
        window_s=30.0,
        ends_at=started_at + 30.0 if analysing and window else None,
        evidence=evidence,
        checks=() if analysing else CHECKS,
        rollbacks_total=1 if state is CanaryState.ROLLED_BACK else 0,
    )


class RolloutOps(FakeOps):
    """A farm whose canary analysis, at each read of the view (each `status`), is the next
    step of `script`, the last one kept; `reads` counts them. Its reloads restart workers
    1-3, the canary 2 first and the others gated on its verdict (FakeOps rolls them at
    once; the agent holds the waves for the verdict)."""

    def __init__(self, script: Sequence[RolloutVerdictView | None]) -> None:
        super().__init__(4)
        self.script = list(script)
        self.reads = 0
        self.reload_result = ReloadResult(applied=True, restarted=(1, 2, 3), gated_on=2)

    def view(self) -> FarmView:
        canary = self.script[min(self.reads, len(self.script) - 1)]
        self.reads += 1
        return replace(super().view(), canary=canary)


@pytest.fixture(autouse=True)
def fast_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reload, "ROLLOUT_POLL_S", 0.01)


@contextlib.contextmanager
def farm(script: Sequence[RolloutVerdictView | None]) -> Iterator[Agent]:
    with serving(RolloutOps(script)) as a:
        yield a


def ops(agent: Agent) -> RolloutOps:
    assert isinstance(agent.ops, RolloutOps)
    return agent.ops


RESTARTING = verdict(CanaryState.ANALYSING, "the canary restarts onto the change", window=False)
ANALYSING = verdict(CanaryState.ANALYSING, "analysis under way: nothing failed over 12 s")
PROMOTED = verdict(CanaryState.PROMOTED, "promoted: canary within limits over 30 s")
# Issue 31 item 2: it said "restarted workers 1, 2, 3" when only the canary was.
APPLIED = (
    "config applied: restarting canary worker 2 onto the change; workers 1, 3 follow "
    "in waves if its analysis passes (otherwise they keep the old config)"
)


def test_reload_waits_for_a_rollback_and_exits_5_with_the_evidence() -> None:
    script = [RESTARTING, ANALYSING, ANALYSING, verdict(CanaryState.ROLLED_BACK, ROLLED_BACK)]
    with farm(script) as agent:
        r = agent.run("reload")
        assert r.exit_code == 5 and Exit(5) is Exit.ROLLED_BACK, r.output
        lines = r.stdout.splitlines()
        assert lines[0] == APPLIED
        assert lines[1] == "canary 2: analysing (the canary restarts onto the change)"
        assert lines[2].startswith("canary 2: analysing, ")
        assert lines[2].endswith(" of 30 s left (analysis under way: nothing failed over 12 s)")
        assert lines[3] == f"canary 2: {ROLLED_BACK}"
        assert len(lines) == 4  # one line per phase: the second "analysing" is not repeated
        # The evidence once, without its "rolled back: " a second time.
        evidence = ROLLED_BACK.removeprefix("rolled back: ")
        assert r.stderr == (
            f"farmctl: change 3f9a1c2e rolled back on canary 2: {evidence}; the other "
            "workers kept the old config and the change is not retried (farmctl why 2)\n"
        )
        assert ops(agent).reads == 4  # it read the view until the verdict, and no more


def test_reload_waits_for_the_promotion_then_every_wave_and_exits_0() -> None:
    with farm([RESTARTING, ANALYSING, PROMOTED]) as agent:
        r = agent.run("reload")
        assert r.exit_code == Exit.OK, r.output
        lines = r.stdout.splitlines()
        assert lines[:3] == [
            APPLIED,
            "canary 2: analysing (the canary restarts onto the change)",
            lines[2],  # analysing, with the time left
        ]
        assert lines[3] == "canary 2: promoted: canary within limits over 30 s"
        # Then the waves, followed as `farmctl restart` follows them: each worker once.
        ready = sorted(ln.split(":")[0] for ln in lines[4:-1] if " ready after " in ln)
        assert ready == ["worker 1", "worker 2", "worker 3"]
        assert lines[-1] == "rollout done: change 3f9a1c2e promoted on canary 2, every wave ready"


def test_a_promoted_change_whose_wave_fails_exits_3() -> None:
    with farm([ANALYSING, PROMOTED]) as agent:
        ops(agent).fail_next = {3}
        r = agent.run("reload")
        assert r.exit_code == Exit.NOT_RUNNING, r.output
        assert "worker 3 failed: CUDA out of memory" in r.stderr


def test_a_held_change_exits_6() -> None:
    held = verdict(CanaryState.HELD, "held: too little traffic to judge: 12 canary requests")
    with farm([ANALYSING, held]) as agent:
        r = agent.run("reload")
        assert r.exit_code == 6 and Exit(6) is Exit.HELD, r.output
        assert r.stdout.splitlines()[-1] == (
            "canary 2: held: too little traffic to judge: 12 canary requests"
        )
        assert "farmctl: change 3f9a1c2e held on canary 2: too little traffic" in r.stderr


def test_no_wait_returns_before_any_verdict() -> None:
    with farm([ANALYSING]) as agent:
        r = agent.run("reload", "--no-wait")
        assert r.exit_code == 0 and r.stdout == f"{APPLIED}\n"
        assert ops(agent).reads == 0


def test_an_earlier_changes_verdict_is_not_this_reloads() -> None:
    """A rollback from before the reload stays in the view; this reload (no analysis:
    `analysis_window = "0s"`, or the canary not among its workers) rolls as before."""
    old = verdict(CanaryState.ROLLED_BACK, ROLLED_BACK, started_at=1000.0)
    with farm([old]) as agent:
        r = agent.run("reload")
        assert r.exit_code == 0, r.output
        assert "rolled back" not in r.output
        assert r.stdout.splitlines()[-1] == "rollout done"


def test_a_reload_of_the_change_under_analysis_waits_for_its_verdict() -> None:
    """The same change reloaded during its analysis (nothing to restart): the analysis
    under way, started before this reload, is the one it waits for (review item 11)."""
    running = verdict(CanaryState.ANALYSING, "analysis under way", started_at=1000.0)
    rolled = verdict(CanaryState.ROLLED_BACK, ROLLED_BACK, started_at=1000.0)
    with farm([running, running, rolled]) as agent:
        ops(agent).reload_result = ReloadResult(applied=True)
        r = agent.run("reload")
        assert r.exit_code == Exit.ROLLED_BACK, r.output
        assert "rollout done" not in r.stdout


def test_a_reload_that_changes_no_worker_returns_at_once() -> None:
    with farm([None]) as agent:
        ops(agent).reload_result = ReloadResult(applied=True)
        r = agent.run("reload")
        assert r.exit_code == 0 and r.stdout == "config applied: no worker changed\n"


def test_a_reload_without_a_canary_gate_says_it_restarts_every_changed_worker() -> None:
    """No analysis (window 0, or the change leaves the canary alone): every changed
    worker is being restarted in waves, none waits on a verdict."""
    with farm([None]) as agent:
        ops(agent).reload_result = ReloadResult(applied=True, restarted=(1, 3), added=(4,))
        r = agent.run("reload", "--no-wait")
        assert r.exit_code == 0, r.output
        assert r.stdout == "config applied: restarting workers 1, 3; added worker 4\n"


def test_an_analysis_superseded_by_another_reload_exits_1() -> None:
    with farm([ANALYSING, None]) as agent:
        r = agent.run("reload")
        assert r.exit_code == Exit.FAILED, r.output
        assert "another reload superseded it" in r.stderr


def test_no_verdict_within_the_timeout_exits_1() -> None:
    with farm([ANALYSING]) as agent:
        r = agent.run("reload", "--timeout", "0.2")
        assert r.exit_code == Exit.FAILED, r.output
        assert r.stderr.startswith("farmctl: no verdict after 0.2s: canary 2 is still analysing")


def test_reload_json_is_one_document_with_the_verdict_and_the_exit_code() -> None:
    with farm([ANALYSING, verdict(CanaryState.ROLLED_BACK, ROLLED_BACK)]) as agent:
        r = agent.run("reload", "--json")
        assert r.exit_code == Exit.ROLLED_BACK
        doc = json.loads(r.stdout)
        assert doc["applied"] is True and doc["restarted"] == [1, 2, 3]
        assert doc["canary"]["state"] == "rolled_back"
        assert doc["canary"]["evidence"] == ROLLED_BACK
        assert doc["canary"]["checks"][2] == {
            "name": "itl_p99",
            "canary": 0.052,
            "baseline": 0.01,
            "ratio": 5.2,
            "limit": 1.4,
            "passed": False,
        }
    with farm([ANALYSING, PROMOTED]) as agent:
        r = agent.run("reload", "--json")
        assert r.exit_code == Exit.OK, r.output
        assert json.loads(r.stdout)["canary"]["state"] == "promoted"  # the waves: silent


def test_status_shows_one_line_for_the_canary() -> None:
    with farm([verdict(CanaryState.ROLLED_BACK, ROLLED_BACK)]) as agent:
        lines = agent.run("status").stdout.splitlines()
        assert lines[1] == f"canary 2: {ROLLED_BACK}"
        assert lines[2] == ""  # then the table, as without a canary


def test_status_while_analysing_says_the_time_left() -> None:
    now = time.time()
    cv = verdict(CanaryState.ANALYSING, started_at=now - 18)
    st = {"farm": "f", "now": now, "workers": [], "canary": farmctl_json(cv)}
    assert format_status(st).splitlines()[1] == "canary 2: analysing, 12 s of 30 s left"


def farmctl_json(cv: RolloutVerdictView) -> dict[str, object]:
    from sglang_farm.control import results

    r = results.canary_result(cv)
    assert r is not None
    return json.loads(json.dumps(r))  # type: ignore[no-any-return]


def test_why_of_the_canary_gives_the_verdict_its_evidence_and_checks() -> None:
    with farm([verdict(CanaryState.ROLLED_BACK, ROLLED_BACK)]) as agent:
        out = agent.run("why", "2").stdout.splitlines()
        assert out[0] == "worker 2: ready"
        assert out[1] == f"canary 2: {ROLLED_BACK}"
        assert out[2].startswith("change 3f9a1c2e, window 30 s from ")
        assert out[2].endswith("; canary rollbacks since the agent started: 1")
        assert out[3].startswith("what the farm did: the canary was put back on the accepted")
        rows = [ln.split() for ln in out[4:9]]
        assert rows[0] == ["CHECK", "CANARY", "BASELINE", "RATIO", "LIMIT", "RESULT"]
        assert rows[3] == ["itl_p99", "0.052", "0.01", "5.20x", "1.4", "FAILED"]
        assert rows[4] == ["ttft_p50", "0.4", "-", "-", "3", "not", "judged"]
        # Another worker's why says nothing of the canary.
        assert "canary" not in agent.run("why", "1").stdout


def test_a_change_rejected_before_is_held_at_the_reload_with_exit_6() -> None:
    why = (
        "/etc/sglang-farm/farm.toml: change 3f9a1c2e was rejected by its canary at "
        "2026-12-01 18:00:00 UTC: canary crashed 10 s into the window; the farm stays on "
        "the accepted config: edit the config to retry"
    )
    with farm([None]) as agent:
        ops(agent).reload_result = ReloadResult(False, problems=(why,), held=why)
        r = agent.run("reload")
        assert r.exit_code == 6, r.output
        assert r.stderr == f"farmctl: reload held: {why}\n"
        assert ops(agent).reads == 0  # nothing rolls: nothing to follow
        doc = json.loads(agent.run("reload", "--json").stdout)
        assert doc["applied"] is False and doc["held"] == why


def test_reload_keeps_waiting_through_an_extension_and_says_so() -> None:
    starved = "too little traffic to judge: 12 canary requests in 30 s, 50 needed"
    extended = replace(
        verdict(CanaryState.ANALYSING, f"extended 1 of 2: {starved}"),
        window_s=60.0,
        ends_at=FUTURE + 60.0,
        extensions=1,
        max_extensions=2,
    )
    with farm([RESTARTING, ANALYSING, extended, extended, PROMOTED]) as agent:
        r = agent.run("reload")
        assert r.exit_code == Exit.OK, r.output
        lines = r.stdout.splitlines()
        assert lines[3].startswith("canary 2: analysing, extended 1 of 2, ")
        assert lines[3].endswith(f" of 60 s left ({starved})"), lines[3]
        assert lines[4] == "canary 2: promoted: canary within limits over 30 s"
    now = time.time()
    cv = replace(extended, started_at=now - 20, ends_at=now + 40)
    assert farmctl_json(cv)["extensions"] == 1 and farmctl_json(cv)["max_extensions"] == 2
    st = {"farm": "f", "now": now, "workers": [], "canary": farmctl_json(cv)}
    assert format_status(st).splitlines()[1] == (
        f"canary 2: analysing, extended 1 of 2, 40 s of 60 s left ({starved})"
    )
