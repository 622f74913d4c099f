"""Pure: what every collector of the farm's `/metrics` reads and writes with: the state a
scrape shows (`MetricsState`), a `Section` of families, the labels' spellings
(`gpu_label`, from `spec`; `public_url`, `model_from_argv`) and the family builders.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from urllib.parse import urlsplit, urlunsplit

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from sglang_farm.farm_view import FarmView
from sglang_farm.gpus.snapshot import FleetSnapshot
from sglang_farm.sglang.load import WorkerStats
from sglang_farm.spec import gpu_label as gpu_label  # re-exported: the collectors' label


@dataclass(frozen=True, slots=True)
class ProbeStatus:
    """The outcome of the latest poll of one source ("gpu", "workers", "runtime", ...)."""

    success: bool
    duration_s: float
    last_success_at: float | None = None  # wall clock


def _no_stats() -> Mapping[int, WorkerStats]:
    return MappingProxyType({})


def _no_pids() -> Mapping[int, frozenset[int]]:
    return MappingProxyType({})


def _no_probes() -> Mapping[str, ProbeStatus]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class MetricsState:
    """Everything a scrape shows. Immutable; the agent replaces it as a whole."""

    snapshot_at: float  # wall clock when the agent built this state
    farm: FarmView | None = None
    fleet: FleetSnapshot | None = None  # None when [metrics] gpu_source = "none"
    workers: Mapping[int, WorkerStats] = field(default_factory=_no_stats)
    # Worker id -> its main pid and descendants (gpu_snapshot.process_tree), for memory attribution.
    worker_pids: Mapping[int, frozenset[int]] = field(default_factory=_no_pids)
    probes: Mapping[str, ProbeStatus] = field(default_factory=_no_probes)


def model_from_argv(argv: tuple[str, ...]) -> str | None:
    """The model name on a worker's command line: --served-model-name, else --model-path."""
    found: dict[str, str] = {}
    for i, arg in enumerate(argv):
        for flag in ("--served-model-name", "--model-path", "--model"):
            if arg == flag and i + 1 < len(argv):
                found.setdefault(flag, argv[i + 1])
            elif arg.startswith(flag + "="):
                found.setdefault(flag, arg.split("=", 1)[1])
    return found.get("--served-model-name") or found.get("--model-path") or found.get("--model")


def public_url(url: str) -> str:
    """`url` without any user:password part, for a label that anyone scraping can read."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


def new_gauge(name: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels or [])


def new_counter(name: str, doc: str, labels: list[str]) -> CounterMetricFamily:
    # CounterMetricFamily appends `_total` to the sample name.
    return CounterMetricFamily(name, doc, labels=labels)


@dataclass(frozen=True, slots=True)
class Section:
    """A run of families drawn from some parts of the state only.

    `parts` names them; while each is the same object as at the last format, the
    section's text is the same too (the state and its parts are immutable).
    """

    name: str
    parts: Callable[[MetricsState], tuple[object, ...]]
    families: Callable[[MetricsState], Iterator[Metric]]


WORKER_LABELS = ["worker", "gpu"]


def add_counts(
    fam: CounterMetricFamily, lv: list[str], counts: Mapping[str, int], known: list[str]
) -> None:
    # Every known key is exported, 0 included, so rate()/increase() see the first event.
    for key in [*known, *sorted(k for k in counts if k not in known)]:
        fam.add_metric([*lv, key], counts.get(key, 0))
