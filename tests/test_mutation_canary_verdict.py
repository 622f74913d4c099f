"""canary.verdict, what test_canary_verdict.py left unheld (issue 27's mutation run over
the canary's core): the policy's limits at their edges, the boundaries of the error and
latency checks, the bounds of a quantile, and the evidence's wording."""

from __future__ import annotations

import math

import pytest

from sglang_farm.canary.figures import Figures, Histogram
from sglang_farm.canary.verdict import (
    CanaryPolicy,
    LivenessEvent,
    LivenessKind,
    Outcome,
    judge,
    quantile_bounds,
)


@pytest.mark.parametrize(
    "fields",
    [
        {"min_requests": 1},
        {"itl_quantiles": (0.01, 0.99), "ttft_quantile": 0.99},
        {"itl_max_ratio": 1.01, "ttft_max_ratio": 1.01, "error_max_ratio": 1.0},
        {"confidence": 0.5},
        {"confidence": 0.999},
        {"error_floor": 0.0},
        {"error_floor": 0.99},
        {"min_errors": 1},
    ],
)
def test_policy_accepts_limits_at_their_edges(fields: dict[str, object]) -> None:
    CanaryPolicy(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"min_requests": 0}, "min_requests must be >= 1, got 0"),
        ({"itl_quantiles": (0.0,)}, "quantiles must lie strictly between 0 and 1"),
        ({"ttft_quantile": 1.0}, "quantiles must lie strictly between 0 and 1"),
        ({"itl_max_ratio": 1.0}, "ratio limits must be above 1"),
        ({"ttft_max_ratio": 1.0}, "ratio limits must be above 1"),
        ({"error_max_ratio": 0.99}, "ratio limits must be above 1"),
        ({"confidence": 0.49}, r"confidence must be in \[0.5, 1\), got 0.49"),
        ({"confidence": 1.0}, r"confidence must be in \[0.5, 1\), got 1.0"),
        ({"error_floor": -0.01}, r"error_floor must be in \[0, 1\), got -0.01"),
        ({"error_floor": 1.0}, r"error_floor must be in \[0, 1\), got 1.0"),
        ({"min_errors": 0}, "min_errors must be >= 1, got 0"),
    ],
)
def test_policy_refuses_each_limit_past_its_edge(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}$"):
        CanaryPolicy(**fields)  # type: ignore[arg-type]


def test_policy_names_every_problem_at_once() -> None:
    with pytest.raises(ValueError) as err:
        CanaryPolicy(min_requests=0, min_errors=0)
    assert str(err.value) == "min_requests must be >= 1, got 0; min_errors must be >= 1, got 0"
