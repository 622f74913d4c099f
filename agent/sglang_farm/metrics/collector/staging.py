"""Pure: the model stage's families (only with a [model])."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric

from sglang_farm.metrics.families import (
    new_counter,
    new_gauge,
)
from sglang_farm.staging.failure import StageFailureKind
from sglang_farm.staging.state import StageState, StagingView

# A stop while staging is no failure of the stage: not counted.
STAGE_FAILURE_KINDS = tuple(str(k) for k in StageFailureKind if k is not StageFailureKind.CANCELLED)


def staging(sg: StagingView) -> Iterator[Metric]:
    # Only with a [model]: a farm that does not stage its model has no staging series.
    state = new_gauge(
        "sglang_farm_model_stage_state",
        "The model stage's state (a state set); failed holds the rollout.",
        ["state"],
    )
    for s in StageState:
        state.add_metric([s.value], 1 if sg.state is s else 0)
    yield state
    staged = new_counter(
        "sglang_farm_model_staged_bytes",
        "Bytes copied into the workers' model path by completed stages since the agent started.",
        [],
    )
    staged.add_metric([], sg.staged_bytes_total)
    yield staged
    stages = new_counter(
        "sglang_farm_model_stages",
        "Completed model stages since the agent started (a current copy counts, copying nothing).",
        [],
    )
    stages.add_metric([], sg.stages_total)
    yield stages
    failures = new_counter(
        "sglang_farm_model_stage_failures",
        "Failed model stages since the agent started, by what failed.",
        ["kind"],
    )
    for kind in STAGE_FAILURE_KINDS:
        failures.add_metric([kind], sg.failures_by_kind.get(kind, 0))
    yield failures
    if sg.last_duration_s is not None:
        took = new_gauge(
            "sglang_farm_model_stage_duration_seconds",
            "How long the last model stage took (completed or failed).",
        )
        took.add_metric([], sg.last_duration_s)
        yield took
    if sg.state is StageState.STAGING and sg.bytes_total:
        done = new_gauge(
            "sglang_farm_model_stage_progress_bytes",
            "Bytes done of the stage step under way (download, copy or warm-up).",
            ["step"],
        )
        total = new_gauge(
            "sglang_farm_model_stage_size_bytes",
            "Bytes the stage step under way handles in all.",
            ["step"],
        )
        done.add_metric([sg.step or ""], sg.bytes_done)
        total.add_metric([sg.step or ""], sg.bytes_total)
        yield done
        yield total
