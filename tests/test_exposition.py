"""The farm's own encoder writes every body byte for byte as prometheus_client does.

Each state below is formatted for each Accept header a scraper may send, once by
`exposition.choose` (the exporter's path) and once by the library's `choose_encoder`;
the two must be equal, Content-Type included. Where the fast path cannot be exact
(`dots` escaping, OpenMetrics 2.0.0, a family of another shape), the answer is still
the library's.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable, Iterator
from types import MappingProxyType
from typing import cast

import pytest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.samples import Sample

from metrics_fixtures import NOW, gateway_state, state
from sglang_farm.farm_view import Phase
from sglang_farm.metrics import exposition
from sglang_farm.metrics.collectors import MetricsState, Section, build_registry
from sglang_farm.metrics.exposition import PROMETHEUS_ACCEPT
from sglang_farm.sglang.load import WorkerStats
from sglang_farm.staging.state import StageState, StagingView

ALLOW_UTF8_TEXT = "text/plain;version=1.0.0;escaping=allow-utf-8"
ALLOW_UTF8_OM = "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8"

ACCEPTS = [
    "",
    PROMETHEUS_ACCEPT,
    "text/plain;version=0.0.4",
    "text/plain;version=1.0.0;escaping=allow-utf-8",
    "text/plain;version=1.0.0;escaping=underscores",
    "application/openmetrics-text",
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8",
    "application/openmetrics-text;version=1.0.0;escaping=values",
    "application/openmetrics-text;version=1.0.0;escaping=dots",
    "text/plain;version=1.0.0;escaping=dots",
    "application/openmetrics-text;version=2.0.0",
]


def odd_state() -> MetricsState:
    """Label values that need escaping, values the float writer treats specially, a
    staging farm behind a gateway with a password in its URL."""
    st = gateway_state()
    assert st.farm is not None and st.farm.gateway is not None
    odd = 'm\\o"d\nel ü'
    stats = {
        **st.workers,
        0: dataclasses.replace(
            st.workers[0],
            model_name=odd,
            sglang_version="",
            queued=math.inf,
            running=-0.0,
            token_usage=math.nan,
            gen_throughput=12345678.9,
            cache_hit_rate=1e-9,
        ),
    }
    staging = StagingView(
        source='/srv/"models"',
        target="/dev/shm/model",
        state=StageState.STAGING,
        since=NOW,
        step="copying",
        bytes_done=3 * 1024**3,
        bytes_total=16 * 1024**3,
        last_duration_s=0.5,
        staged_bytes_total=10**12,
        stages_total=1023,
        failures_by_kind=MappingProxyType({"checksum": 1024, "no space": 1}),
    )
    farm = dataclasses.replace(
        st.farm,
        name="lab\\1",
        staging=staging,
        gateway=dataclasses.replace(st.farm.gateway, url="http://u:pw@gw:8000"),
    )
    return dataclasses.replace(st, farm=farm, workers=MappingProxyType(stats))


STATES = {"plain": state, "gateway": gateway_state, "odd": odd_state}


@pytest.mark.parametrize("accept", ACCEPTS)
@pytest.mark.parametrize("make", STATES.values(), ids=STATES.keys())
def test_every_body_is_the_librarys_byte_for_byte(
    accept: str, make: Callable[[], MetricsState]
) -> None:
    st = make()
    registry = build_registry(lambda: st)
    library, content_type = choose_encoder(accept)
    fmt = exposition.choose(accept)
    assert fmt.content_type == content_type
    assert fmt.encode(registry) == library(registry)


def test_the_fast_path_serves_what_prometheus_asks_for() -> None:
    """Not the library behind the same answer: the farm's encoder, and it is exact."""
    for accept in ["", PROMETHEUS_ACCEPT, "text/plain;version=1.0.0;escaping=allow-utf-8"]:
        encode = exposition.choose(accept).encode
        assert getattr(encode, "func", None) is exposition.encode, accept
    for accept in [
        "text/plain;version=1.0.0;escaping=dots",
        "application/openmetrics-text;version=2.0.0",
    ]:
        assert getattr(exposition.choose(accept).encode, "func", None) is not exposition.encode


class _Extra(Collector):
    """Families of shapes the fast path does not write: each must reach the library."""

    def __init__(self, family: Metric) -> None:
        self.family = family

    def collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily("sglang_farm_ok", "A plain gauge first.", labels=["worker"])
        g.add_metric(["0"], 1)
        yield g
        yield self.family


def _histogram() -> Metric:
    h = HistogramMetricFamily("x_seconds", "A histogram.", labels=["worker"])
    h.add_metric(["0"], buckets=[("1.0", 2), ("+Inf", 3)], sum_value=4.5)
    return h


def _timestamped() -> Metric:
    g = GaugeMetricFamily("x", "A gauge with a timestamp.", labels=["worker"])
    g.add_metric(["0"], 1, timestamp=NOW)
    return g


def _colon() -> Metric:
    return CounterMetricFamily("x:rate", "A colon in the name.", value=3)


def _unit() -> Metric:
    return GaugeMetricFamily("x_bytes", "With a unit.", value=3, unit="bytes")


def _created() -> Metric:
    return CounterMetricFamily("x", "A counter with its created time.", value=3, created=NOW)


def _reserved_label_name() -> Metric:
    g = GaugeMetricFamily("x", "A label name starting with two underscores.", labels=["__a"])
    g.add_metric(["v"], 1)
    return g


def _no_value() -> Metric:
    g = GaugeMetricFamily("x", "A sample without a value.", labels=["worker"])
    g.samples.append(Sample("x", {"worker": "0"}, None))  # type: ignore[arg-type]  # what the library accepts
    return g


def _odd_label_name() -> Metric:
    g = GaugeMetricFamily("x", "A label name with a dot.", labels=["a.b"])
    g.add_metric(["v"], 1)
    return g


@pytest.mark.parametrize(
    "family",
    [_histogram, _timestamped, _colon, _unit, _created, _odd_label_name, _reserved_label_name],
)
@pytest.mark.parametrize("accept", ["", PROMETHEUS_ACCEPT, ALLOW_UTF8_TEXT, ALLOW_UTF8_OM])
def test_a_family_of_another_shape_is_written_by_the_library(family: type, accept: str) -> None:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Extra(family()))
    library, _ = choose_encoder(accept)
    assert exposition.choose(accept).encode(registry) == library(registry)


def test_a_sample_without_a_value_is_written_by_the_library() -> None:
    """OpenMetrics writes an empty value (the text format cannot write one at all)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Extra(_no_value()))
    library, _ = choose_encoder(ALLOW_UTF8_OM)
    assert exposition.choose(ALLOW_UTF8_OM).encode(registry) == library(registry)


def test_equal_formats_are_one_cache_key() -> None:
    a, b = exposition.choose(PROMETHEUS_ACCEPT), exposition.choose(PROMETHEUS_ACCEPT)
    assert a == b and hash(a) == hash(b)
    assert a != exposition.choose("")


def test_a_64_worker_body_is_the_librarys() -> None:
    """At the size the benchmark measures (bench/synthetic.py's hand-built farm)."""
    # Imported by name: bench/ imports tests/ as a package, which mypy must not see twice.
    synthetic = importlib.import_module("bench.synthetic")
    st = synthetic.state(64)
    registry = build_registry(lambda: st)
    for accept in ["", PROMETHEUS_ACCEPT]:
        library, _ = choose_encoder(accept)
        assert exposition.choose(accept).encode(registry) == library(registry)
    assert isinstance(st.workers[0], WorkerStats)


# --- the farm's registry re-formats only what a swap replaced ---------------------------


def _swaps(st: MetricsState) -> Iterator[tuple[str, MetricsState]]:
    """A run of swaps as the agent makes them: each replaces one or two parts."""
    assert st.farm is not None and st.fleet is not None
    stats = dict(st.workers)
    stats[0] = dataclasses.replace(stats[0], queued=11, taken_at=NOW + 5)
    st = dataclasses.replace(st, snapshot_at=NOW + 5, workers=MappingProxyType(stats))
    yield "worker poll", st
    assert st.fleet is not None
    gpus = (dataclasses.replace(st.fleet.gpus[0], power_w=555.5), *st.fleet.gpus[1:])
    pids = {**st.worker_pids, 1: frozenset({200, 201})}
    st = dataclasses.replace(
        st,
        snapshot_at=NOW + 6,
        fleet=dataclasses.replace(st.fleet, gpus=gpus),
        worker_pids=MappingProxyType(pids),
    )
    yield "gpu poll", st
    assert st.farm is not None
    first = dataclasses.replace(st.farm.workers[0], phase=Phase.UNHEALTHY, since=NOW + 7)
    st = dataclasses.replace(
        st,
        snapshot_at=NOW + 7,
        farm=dataclasses.replace(st.farm, workers=(first, *st.farm.workers[1:])),
    )
    yield "view change", st
    yield "no swap", st


@pytest.mark.parametrize("accept", ["", PROMETHEUS_ACCEPT])
def test_each_body_after_a_swap_is_the_librarys_for_the_new_state(accept: str) -> None:
    start = current = gateway_state()
    registry = build_registry(lambda: current)
    library, _ = choose_encoder(accept)
    fmt = exposition.choose(accept)
    assert fmt.encode(registry) == library(registry)
    for what, current in _swaps(start):  # noqa: B007  # the getter reads `current`
        assert fmt.encode(registry) == library(registry), what


def test_a_swap_re_formats_only_the_sections_whose_parts_it_replaced() -> None:
    start = current = gateway_state()
    registry = build_registry(lambda: current)
    formatted: list[str] = []

    def counting(section: Section) -> Section:
        def families(st: MetricsState) -> Iterator[Metric]:
            formatted.append(section.name)
            return section.families(st)

        return dataclasses.replace(section, families=families)

    registry.farm.sections = tuple(counting(s) for s in registry.farm.sections)
    fmt = exposition.choose(PROMETHEUS_ACCEPT)
    fmt.encode(registry)
    assert len(formatted) == len(registry.farm.sections)  # the first body formats every one
    assert len(formatted) == 8
    want = {
        "worker poll": ["agent", "worker_stats"],
        "gpu poll": ["agent", "gpus", "worker_memory", "quarantines"],
        "view change": [
            "agent",
            "farm",
            "worker_phases",
            "worker_starts",
            "worker_stats",
            "worker_memory",
            "quarantines",
        ],
        "no swap": [],
    }
    for what, current in _swaps(start):  # noqa: B007  # the getter reads `current`
        formatted.clear()
        fmt.encode(registry)
        assert formatted == want[what], what


class _Reads:
    """A `MetricsState` that records which of its fields are read."""

    def __init__(self, st: MetricsState) -> None:
        self._st = st
        self.read: set[str] = set()

    def __getattr__(self, name: str) -> object:
        self.read.add(name)
        return getattr(self._st, name)


@pytest.mark.parametrize("make", STATES.values(), ids=STATES.keys())
def test_every_section_names_every_part_of_the_state_it_reads(
    make: Callable[[], MetricsState],
) -> None:
    """A part read but not named would leave the section's cached text stale after a
    swap of that part."""
    for section in build_registry(make).farm.sections:
        named = _Reads(make())
        parts = section.parts(cast(MetricsState, named))
        reading = _Reads(make())
        list(section.families(cast(MetricsState, reading)))
        if any(p is named for p in parts):  # the whole state: anything may be read
            continue
        assert reading.read <= named.read, section.name


def test_the_farms_registry_takes_no_other_collector() -> None:
    registry = build_registry(state)
    with pytest.raises(ValueError, match="collector alone"):
        registry.register(_Extra(_histogram()))
