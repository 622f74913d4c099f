"""control.facts: the phases it names are the supervisor's, the agent sends each fact,
and farmctl's fallback for an older agent (the rule over `state`) says the same."""

from __future__ import annotations

from farm_views import _view, _worker
from sglang_farm.cli.ctl.wait import WAIT_EXITS
from sglang_farm.control import facts, results, wire
from sglang_farm.staging.state import StageState
from sglang_farm.workers.phase import Phase

_PHASES = {str(p) for p in Phase}


def test_facts_name_only_the_supervisors_phases() -> None:
    for named in (facts.NO_PROCESS, facts.FAILURE_SHOWN, facts.ENDS_WAIT, facts.TIMED):
        assert named <= _PHASES
    assert str(StageState.FAILED) == facts.STAGE_FAILED


def test_wait_maps_every_failure_kind_to_an_exit_and_no_other() -> None:
    assert set(WAIT_EXITS) == set(wire.FAILURE_KINDS)
    assert len(set(wire.FAILURE_KINDS)) == len(wire.FAILURE_KINDS)


def test_the_sent_fact_and_the_fallback_agree_for_every_phase() -> None:
    for phase in Phase:
        w = _worker(phase, in_gateway=False)
        sent = results.worker_result(w)
        old = {k: v for k, v in sent.items() if k not in ("has_process", "failure_shown")}
        assert (
            facts.has_process_of(sent)
            == facts.has_process_of(old)
            == (
                phase not in (Phase.STOPPED, Phase.PENDING, Phase.BACKOFF, Phase.QUARANTINED)
                and phase is not Phase.FAILED
            )
        )
        assert facts.failure_shown_of(sent) == facts.failure_shown_of(old)
        p = results.phase_payload(w, 1.0)
        assert facts.ends_wait_of(p) == facts.ends_wait_of({"state": p["state"]})
        why = results.why_result(w)
        assert facts.state_timed_of(why) == facts.state_timed_of({"state": why["state"]})


def test_a_failed_worker_sends_its_failure_as_news() -> None:
    sent = results.worker_result(_view().worker(1))  # failed, with a last failure
    assert sent["failure_shown"] is True and sent["has_process"] is False


def test_the_sent_fact_wins_over_the_state() -> None:
    assert facts.has_process_of({"state": "stopped", "has_process": True})
    assert not facts.stage_failed_of({"state": "failed", "failed": False})
    assert facts.stage_failed_of({"state": "failed"})  # an agent older than the key
