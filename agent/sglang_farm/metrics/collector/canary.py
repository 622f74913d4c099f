"""Pure: the canary analysis's families (once a change has been judged), and the rollbacks
counted since the agent started.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from prometheus_client.core import Metric

from sglang_farm.canary.view import CanaryState, RolloutVerdictView
from sglang_farm.farm_view import FarmView
from sglang_farm.metrics.families import (
    gpu_label,
    new_counter,
    new_gauge,
)


def canary(farm: FarmView, cv: RolloutVerdictView) -> Iterator[Metric]:
    # Only once a change has been judged on a canary (docs/canary.md): the latest one's
    # state, its window, and the figures compared, as `farmctl why` shows them.
    state = new_gauge(
        "sglang_farm_canary_state",
        "The latest change's canary analysis (a state set); rolled_back and held keep the "
        "farm on the accepted config.",
        ["state"],
    )
    for s in CanaryState:
        state.add_metric([s.value], 1 if cv.state is s else 0)
    yield state
    try:
        gpus = gpu_label(farm.worker(cv.canary).gpus)
    except KeyError:  # a reload removed the worker since
        gpus = ""
    info = new_gauge(
        "sglang_farm_canary_info",
        "The change judged (its short hash) and its canary worker; always 1.",
        ["change", "worker", "gpu"],
    )
    info.add_metric([cv.change, str(cv.canary), gpus], 1)
    yield info
    window = new_gauge(
        "sglang_farm_canary_window_seconds",
        "The canary's analysis window, with its extensions so far.",
    )
    window.add_metric([], cv.window_s)
    yield window
    extended = new_gauge(
        "sglang_farm_canary_window_extensions",
        "How many times the window ended short of traffic and was extended (of at most "
        "[rollout] max_extensions).",
    )
    extended.add_metric([], cv.extensions)
    yield extended
    if cv.ends_at is not None:
        ends = new_gauge(
            "sglang_farm_canary_window_end_timestamp_seconds",
            "While the canary is analysed: when its window ends (Unix time).",
        )
        ends.add_metric([], cv.ends_at)
        yield ends
    figure = new_gauge(
        "sglang_farm_canary_figure",
        "A figure the verdict compared, for the canary and for the baseline (seconds for "
        "itl_* and ttft_*, a ratio for errors, requests for traffic, a score for eval).",
        ["check", "side"],
    )
    ratio = new_gauge(
        "sglang_farm_canary_check_ratio", "A compared figure, canary / baseline.", ["check"]
    )
    limit = new_gauge(
        "sglang_farm_canary_check_limit", "The limit a check is judged against.", ["check"]
    )
    passed = new_gauge(
        "sglang_farm_canary_check_passed",
        "1 if the check passed, 0 if it failed; absent while not judged (too little data).",
        ["check"],
    )
    for c in cv.checks:
        for side, value in (("canary", c.canary), ("baseline", c.baseline)):
            if value is not None and math.isfinite(value):
                figure.add_metric([c.name, side], value)
        if c.ratio is not None and math.isfinite(c.ratio):
            ratio.add_metric([c.name], c.ratio)
        if c.limit is not None and math.isfinite(c.limit):
            limit.add_metric([c.name], c.limit)
        if c.passed is not None:
            passed.add_metric([c.name], 1 if c.passed else 0)
    yield figure
    yield ratio
    yield limit
    yield passed


def canary_rollbacks(farm: FarmView) -> Metric:
    # From the agent's start, at 0 before any change is judged (unlike the other canary
    # series): a canary that fails within one scrape interval must still show as a step
    # from 0, or the rollback alert's increase() never sees it (etc/prometheus/alerts.yml).
    rollbacks = new_counter(
        "sglang_farm_canary_rollbacks",
        "Changes rolled back from their canary since the agent started.",
        [],
    )
    rollbacks.add_metric([], farm.canary.rollbacks_total if farm.canary is not None else 0)
    return rollbacks
