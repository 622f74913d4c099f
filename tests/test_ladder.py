"""The OOM ladder: cumulative steps, rounding, clamping, int/float handling, direction."""

from __future__ import annotations

import pytest

from sglang_farm.sglang.failures import Failure, FailureKind
from sglang_farm.sglang.ladder import (
    STEP_DOWN_KINDS,
    FlagChange,
    apply_ladder,
    describe_step,
    next_step,
)
from sglang_farm.spec import FlagValue, OomAdjust, OomStep

BASE: dict[str, FlagValue] = {
    "mem_fraction_static": 0.88,
    "max_running_requests": 64,
    "chunked_prefill_size": 4096,
    "mamba_radix_cache_strategy": "extra_buffer",
    "trust_remote_code": True,
}

# The seed's experience: no_buffer first (doubled concurrency), then memory, then requests.
STEPS = (
    OomStep(
        "no_buffer",
        (
            OomAdjust("mamba_radix_cache_strategy", set="no_buffer"),
            OomAdjust("disable_overlap_schedule", set=True),
        ),
    ),
    OomStep("less static memory", (OomAdjust("mem_fraction_static", add=-0.02, min=0.84),)),
    OomStep(
        "fewer requests",
        (
            OomAdjust("max_running_requests", multiply=0.5, min=8),
            OomAdjust("chunked_prefill_size", multiply=0.5, min=1024),
        ),
    ),
    OomStep("less static memory again", (OomAdjust("mem_fraction_static", add=-0.02, min=0.84),)),
    OomStep("even less static memory", (OomAdjust("mem_fraction_static", add=-0.02, min=0.84),)),
)


def _failure(kind: FailureKind) -> Failure:
    return Failure(kind, "summary", "advice")


def test_step_zero_is_the_base_flags_unchanged() -> None:
    flags, changes = apply_ladder(BASE, STEPS, 0)
    assert flags == BASE
    assert flags is not BASE
    assert changes == []


def test_steps_apply_cumulatively_and_record_every_change() -> None:
    flags, changes = apply_ladder(BASE, STEPS, 3)
    assert flags == {
        "mem_fraction_static": 0.86,
        "max_running_requests": 32,
        "chunked_prefill_size": 2048,
        "mamba_radix_cache_strategy": "no_buffer",
        "disable_overlap_schedule": True,
        "trust_remote_code": True,
    }
    assert changes == [
        FlagChange("mamba_radix_cache_strategy", "extra_buffer", "no_buffer", "no_buffer"),
        FlagChange("disable_overlap_schedule", None, True, "no_buffer"),
        FlagChange("mem_fraction_static", 0.88, 0.86, "less static memory"),
        FlagChange("max_running_requests", 64, 32, "fewer requests"),
        FlagChange("chunked_prefill_size", 4096, 2048, "fewer requests"),
    ]
    assert [str(c) for c in changes] == [
        "mamba_radix_cache_strategy extra_buffer -> no_buffer",
        "disable_overlap_schedule (unset) -> true",
        "mem_fraction_static 0.88 -> 0.86",
        "max_running_requests 64 -> 32",
        "chunked_prefill_size 4096 -> 2048",
    ]


def test_float_adds_are_rounded_and_clamped_to_min() -> None:
    flags, changes = apply_ladder(BASE, STEPS, 5)
    assert flags["mem_fraction_static"] == 0.84  # 0.88 -0.02 x3 = 0.82, clamped to 0.84
    assert repr(flags["mem_fraction_static"]) == "0.84"
    fraction_changes = [str(c) for c in changes if c.flag == "mem_fraction_static"]
    assert fraction_changes == [
        "mem_fraction_static 0.88 -> 0.86",
        "mem_fraction_static 0.86 -> 0.84",
    ]  # the step that hit the bound changed nothing, so it is not listed


def test_int_multiply_floors_stays_int_and_clamps() -> None:
    steps = (
        OomStep("a", (OomAdjust("max_running_requests", multiply=0.7, min=8),)),
        OomStep("b", (OomAdjust("max_running_requests", multiply=0.1, min=8.5),)),
    )
    flags, _ = apply_ladder({"max_running_requests": 37}, steps, 1)
    assert flags["max_running_requests"] == 25  # floor(25.9)
    assert type(flags["max_running_requests"]) is int
    flags, _ = apply_ladder({"max_running_requests": 37}, steps, 2)
    assert flags["max_running_requests"] == 9  # min 8.5 made integral inward
    assert type(flags["max_running_requests"]) is int


def test_int_add_and_max_clamp() -> None:
    steps = (OomStep("up", (OomAdjust("watchdog_timeout_steps", add=2.5, max=10),)),)
    flags, _ = apply_ladder({"watchdog_timeout_steps": 9}, steps, 1)
    assert flags["watchdog_timeout_steps"] == 10
    assert type(flags["watchdog_timeout_steps"]) is int
    flags, _ = apply_ladder({"watchdog_timeout_steps": 3}, steps, 1)
    assert flags["watchdog_timeout_steps"] == 5  # floor(5.5)


def test_float_multiply_rounds_to_four_decimals() -> None:
    steps = (OomStep("x", (OomAdjust("mem_fraction_static", multiply=0.97),)),)
    flags, _ = apply_ladder({"mem_fraction_static": 0.873}, steps, 1)
    assert flags["mem_fraction_static"] == 0.8468  # 0.84681


def test_adjusting_an_absent_flag_is_a_clear_error() -> None:
    with pytest.raises(
        ValueError, match=r"oom.steps\[1\] \('less static memory'\).*mem_fraction_static"
    ):
        apply_ladder({"max_running_requests": 64}, STEPS, 2)


def test_adjusting_a_non_number_is_an_error() -> None:
    steps = (OomStep("x", (OomAdjust("mamba_radix_cache_strategy", add=1),)),)
    with pytest.raises(ValueError, match="not a number"):
        apply_ladder({"mamba_radix_cache_strategy": "auto"}, steps, 1)
    bool_steps = (OomStep("x", (OomAdjust("trust_remote_code", multiply=0.5),)),)
    with pytest.raises(ValueError, match="not a number"):
        apply_ladder({"trust_remote_code": True}, bool_steps, 1)


def test_malformed_adjust_is_an_error() -> None:
    steps = (OomStep("x", (OomAdjust("mem_fraction_static", add=-0.02, multiply=0.5),)),)
    with pytest.raises(ValueError, match="exactly one of set/add/multiply"):
        apply_ladder(BASE, steps, 1)


@pytest.mark.parametrize("step", [-1, len(STEPS) + 1])
def test_step_out_of_range_is_an_error(step: int) -> None:
    with pytest.raises(ValueError, match="out of range"):
        apply_ladder(BASE, STEPS, step)


@pytest.mark.parametrize(
    "kind",
    [
        FailureKind.CUDA_OOM_LOAD,
        FailureKind.CUDA_OOM_SERVING,
        FailureKind.CUDA_GRAPH_CAPTURE,
        FailureKind.KV_ALLOC_RUNTIME,
        FailureKind.HOST_OOM_KILL,
    ],
)
def test_oom_class_failures_step_down(kind: FailureKind) -> None:
    assert next_step(0, STEPS, _failure(kind)) == 1
    assert next_step(3, STEPS, _failure(kind)) == 4


def test_kv_cache_too_small_never_steps_down() -> None:
    # The static fraction is too small: stepping down (lower fraction) would fail sooner.
    failure = _failure(FailureKind.KV_CACHE_TOO_SMALL)
    assert failure.oom_kind is not None  # it is an OOM class for metrics ...
    assert next_step(0, STEPS, failure) is None  # ... but not for the ladder
    assert FailureKind.KV_CACHE_TOO_SMALL not in STEP_DOWN_KINDS


@pytest.mark.parametrize(
    "kind",
    [
        FailureKind.BAD_FLAG,
        FailureKind.MISSING_KERNEL,
        FailureKind.FATAL_TRACEBACK,
        FailureKind.CRASH,
        FailureKind.WATCHDOG_TIMEOUT,
    ],
)
def test_non_oom_failures_do_not_step(kind: FailureKind) -> None:
    assert next_step(0, STEPS, _failure(kind)) is None


def test_exhausted_ladder_returns_none() -> None:
    failure = _failure(FailureKind.CUDA_OOM_SERVING)
    assert next_step(len(STEPS), STEPS, failure) is None
    assert next_step(0, (), failure) is None


def test_describe_step() -> None:
    assert describe_step(STEPS, 0) == "step 0/5: base flags"
    assert (
        describe_step(STEPS, 1) == "step 1/5 'no_buffer': mamba_radix_cache_strategy = no_buffer; "
        "disable_overlap_schedule = true"
    )
    assert (
        describe_step(STEPS, 2)
        == "step 2/5 'less static memory': mem_fraction_static -0.02 (min 0.84)"
    )
    assert (
        describe_step(STEPS, 3) == "step 3/5 'fewer requests': max_running_requests x0.5 (min 8); "
        "chunked_prefill_size x0.5 (min 1024)"
    )
    with pytest.raises(ValueError, match="out of range"):
        describe_step(STEPS, 6)
