"""Pure: the agent's own families: build info, snapshot time, each poll's outcome, the farm's
info, start time, rollout state, host drain and its state files.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric

from sglang_farm.farm_view import FarmView, Rollout
from sglang_farm.metrics.families import (
    MetricsState,
    new_counter,
    new_gauge,
)
from sglang_farm.state_alerts import AlertKind

ROLLOUT_STATES = tuple(str(r) for r in Rollout)  # the state set's label values


def agent(version: str, st: MetricsState) -> Iterator[Metric]:
    m = new_gauge("sglang_farm_build_info", "The agent's version; always 1.", ["version"])
    m.add_metric([version], 1)
    yield m
    m = new_gauge(
        "sglang_farm_snapshot_timestamp_seconds",
        "When the agent last rebuilt the state scrapes read (Unix time); old = stuck loop.",
    )
    m.add_metric([], st.snapshot_at)
    yield m
    ok = new_gauge(
        "sglang_farm_probe_success", "1 if the latest poll of a source succeeded.", ["source"]
    )
    dur = new_gauge(
        "sglang_farm_probe_duration_seconds",
        "How long the latest poll of a source took.",
        ["source"],
    )
    last = new_gauge(
        "sglang_farm_probe_last_success_timestamp_seconds",
        "When a poll of the source last succeeded (Unix time).",
        ["source"],
    )
    for source in sorted(st.probes):
        p = st.probes[source]
        ok.add_metric([source], 1 if p.success else 0)
        dur.add_metric([source], p.duration_s)
        if p.last_success_at is not None:
            last.add_metric([source], p.last_success_at)
    yield ok
    yield dur
    yield last
    if st.farm is not None:
        farm = st.farm
        m = new_gauge(
            "sglang_farm_info", "The farm's name and runtime; always 1.", ["farm", "runtime"]
        )
        m.add_metric([farm.name, farm.runtime], 1)
        yield m
        m = new_gauge("sglang_farm_start_time_seconds", "When the agent started (Unix time).")
        m.add_metric([], farm.started_at)
        yield m
        m = new_gauge("sglang_farm_rollout_state", "The rollout's state (a state set).", ["state"])
        for s in ROLLOUT_STATES:
            m.add_metric([s], 1 if farm.rollout == s else 0)
        yield m
        m = new_gauge(
            "sglang_farm_host_drained",
            "1 while farmctl drain-host holds this host's workers out of the gateway.",
        )
        m.add_metric([], 1 if farm.held_out_since is not None else 0)
        yield m
        yield from _state_files(farm)


def _state_files(farm: FarmView) -> Iterator[Metric]:
    """Issue 30: the farm's own state files (state.json, canary.json)."""
    c = new_counter(
        "sglang_farm_state_save_failures",
        "Failed writes of state.json (a full or read-only state_dir) since the agent started.",
        [],
    )
    c.add_metric([], farm.state_save_failures)
    yield c
    m = new_gauge(
        "sglang_farm_state_alerts",
        "Problems with the farm's state files now: not saved, or found damaged or refused at "
        "the agent's start (farmctl status names each); 0 when there is none.",
    )
    m.add_metric([], len(farm.state_alerts))
    yield m
    m = new_gauge(
        "sglang_farm_state_unsaved_since_timestamp_seconds",
        "Since when (Unix time) a state file's writes fail; only while they do.",
        ["file"],
    )
    for a in farm.state_alerts:
        if a.kind is AlertKind.NOT_SAVED:
            m.add_metric([a.file], a.since)
    yield m
