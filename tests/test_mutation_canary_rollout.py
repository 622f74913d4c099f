"""canary.rollout, what test_canary_rollout.py left unheld (issue 27's mutation run over
the canary's core): the eval gate's step, when a liveness failure happened, whether an
analysis is under way, and the compute capabilities in a change's hash."""

from __future__ import annotations

from dataclasses import replace

from farmtoml import sim_farm, toml_text
from sglang_farm.canary.rollout import (
    Analysis,
    CanaryObs,
    Fail,
    RunEval,
    StartWindow,
    Wait,
    observe,
    spec_change,
)
from sglang_farm.canary.verdict import LivenessKind
from sglang_farm.config import load_spec
from sglang_farm.sglang.failures import Failure, FailureKind
from sglang_farm.workers.phase import Phase

A = Analysis("sha256:" + "0" * 64, canary=0, window_s=60.0, issued_at=100.0, failure_mark=None)


def test_with_an_eval_the_ready_canary_is_evaluated_before_its_window() -> None:
    gated = replace(A, needs_eval=True)
    assert not gated.evaluated  # a new analysis has not run its eval yet
    ready = CanaryObs(Phase.READY, in_gateway=False)
    assert observe(gated, ready, 110.0, gateway=True) == (gated, RunEval())
    # Not ready yet: nothing to evaluate.
    loading = CanaryObs(Phase.STARTING, in_gateway=False)
    assert observe(gated, loading, 110.0, gateway=True) == (gated, Wait())
    # Evaluated: the window starts once the canary is in the gateway, as without an eval.
    passed = replace(gated, evaluated=True)
    assert observe(passed, ready, 110.0, gateway=True) == (passed, Wait())
    a, step = observe(passed, CanaryObs(Phase.READY, in_gateway=True), 111.0, gateway=True)
    assert step == StartWindow() and a.window_start == 111.0


def test_an_analysis_is_under_way_once_its_window_started() -> None:
    assert not A.analysing and A.ends_at is None
    a, _ = observe(A, CanaryObs(Phase.READY, in_gateway=True), 120.0, gateway=True)
    assert a.analysing and a.ends_at == 180.0


def test_a_failure_before_the_window_happened_0_s_into_it() -> None:
    crash = Failure(FailureKind.CRASH, "exited with status 1", "")
    obs = CanaryObs(Phase.BACKOFF, in_gateway=False, last_failure=crash, last_failure_at=105.0)
    _, step = observe(A, obs, 105.0, gateway=False)
    assert isinstance(step, Fail) and step.event.after_s == 0.0
    _, step = observe(A, CanaryObs(Phase.FAILED, in_gateway=False), 105.0, gateway=False)
    assert isinstance(step, Fail) and step.event.kind is LivenessKind.CRASHED
    assert step.event.after_s == 0.0
    assert step.event.detail == "the canary is failed before it served"


def test_a_failure_half_a_second_into_the_window_is_at_half_a_second() -> None:
    a, _ = observe(A, CanaryObs(Phase.READY, in_gateway=False), 120.0, gateway=False)
    oom = Failure(FailureKind.CUDA_OOM_SERVING, "CUDA out of memory while serving", "")
    obs = CanaryObs(Phase.BACKOFF, in_gateway=False, last_failure=oom, last_failure_at=120.5)
    _, step = observe(a, obs, 120.5, gateway=False)
    assert isinstance(step, Fail) and step.event.after_s == 0.5
    # At the window's start itself (a clock read twice): 0, never negative.
    obs = CanaryObs(Phase.BACKOFF, in_gateway=False, last_failure=oom, last_failure_at=121.0)
    _, step = observe(a, obs, 119.0, gateway=False)
    assert isinstance(step, Fail) and step.event.after_s == 0.0


def test_the_gpus_compute_capability_is_part_of_the_change() -> None:
    # attention_backend = "auto" is resolved per GPU: another GPU generation runs another
    # backend, so the same config is another change there.
    text = toml_text(
        sim_farm(2, "/usr/bin/python3", sglang={"model_path": "sim/m", "attention_backend": "auto"})
    )
    spec = load_spec(text, source="a.toml")
    hopper = spec_change(spec, {0: (9, 0), 1: (9, 0)})
    assert hopper != spec_change(spec, {0: (8, 0), 1: (8, 0)})
    assert hopper != spec_change(spec)  # unknown: the flag is left to SGLang
    assert hopper == spec_change(spec, {0: (9, 0), 1: (9, 0)})


def test_starved_means_the_traffic_check_failed_not_any_check() -> None:
    """`starved_of_traffic` reads the traffic check alone: a failed check of another kind
    (a rollback's) is no reason to extend, nor is a traffic check not failed."""
    from sglang_farm.canary.rollout import starved_of_traffic
    from sglang_farm.canary.verdict import Check

    def check(name: str, passed: bool | None) -> Check:
        return Check(name, passed, 1.0, 1.0, 1.0, 1.0, 1.4, name)

    assert starved_of_traffic([check("errors", True), check("traffic", False)])
    assert not starved_of_traffic([check("itl_p99", False), check("errors", True)])
    assert not starved_of_traffic([check("traffic", None)])
