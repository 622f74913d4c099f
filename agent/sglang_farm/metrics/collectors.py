"""Pure: Prometheus collectors over the agent's latest snapshots.

The agent keeps one `MetricsState` reference and swaps in a new one whenever a
poll finishes. A scrape calls `collect()`, which reads that reference once and
only formats it: no NVML call, no HTTP request to a worker, no lock. A hung
worker or GPU therefore cannot slow a scrape.

Conventions (docs/metrics.md lists every family):
- names start `sglang_farm_`, carry their unit, counters end `_total`;
- `gpu` is the GPU index; a worker spanning several GPUs (tensor parallel) has
  `gpu` = its indices joined with commas in worker order, e.g. "0,1";
- `worker` is the worker id; `uuid` the GPU UUID;
- the gateway's series (and each worker's `in_gateway`) exist only when the config
  has a [gateway]: absent, not 0, on a farm without one; the model stage's only
  with a [model]; the canary analysis's only once a change has been judged (but
  `sglang_farm_canary_rollbacks_total`, 0 from the agent's start);
- a reading that is unknown (NotSupported, worker not polled yet) is absent,
  never 0 or NaN.

The families come in `Section`s, each drawn from named parts of the state (the fleet,
the farm view, the worker stats). A swap replaces one or two parts, so `FarmRegistry`
re-formats only the sections whose parts are new objects and reuses the text of the
others: the first scrape after a worker poll formats the stats of 64 workers, not the
whole farm.

Each section's families are a module of `metrics.collector` (one per section, as
node_exporter has one file per collector); what they share (the state, the labels' spellings,
the family builders) is `metrics.families`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from functools import partial

from prometheus_client.core import Metric
from prometheus_client.registry import Collector, CollectorRegistry

from sglang_farm import __version__
from sglang_farm.metrics import exposition
from sglang_farm.metrics.collector.agent import agent
from sglang_farm.metrics.collector.canary import canary, canary_rollbacks
from sglang_farm.metrics.collector.gateway import gateway
from sglang_farm.metrics.collector.gpus import gpus
from sglang_farm.metrics.collector.quarantines import quarantines
from sglang_farm.metrics.collector.staging import staging
from sglang_farm.metrics.collector.worker_memory import worker_memory
from sglang_farm.metrics.collector.worker_phases import worker_phases
from sglang_farm.metrics.collector.worker_starts import worker_starts
from sglang_farm.metrics.collector.worker_stats import worker_stats

# Re-exported: the exporter, the pollers and the tests take the state's shapes from here.
from sglang_farm.metrics.families import MetricsState as MetricsState
from sglang_farm.metrics.families import ProbeStatus as ProbeStatus
from sglang_farm.metrics.families import Section as Section
from sglang_farm.metrics.families import gpu_label as gpu_label
from sglang_farm.metrics.families import model_from_argv as model_from_argv
from sglang_farm.metrics.families import public_url as public_url


def sections(version: str) -> tuple[Section, ...]:
    """Every family the farm exports, in exposition order, grouped by what they read."""
    return (
        Section("agent", lambda st: (st,), partial(agent, version)),
        Section("farm", lambda st: (st.farm,), _farm_extras),
        Section("gpus", lambda st: (st.fleet,), _gpus_of),
        Section("worker_phases", lambda st: (st.farm,), worker_phases),
        Section("worker_starts", lambda st: (st.farm,), worker_starts),
        Section("worker_stats", lambda st: (st.farm, st.workers), worker_stats),
        Section("worker_memory", lambda st: (st.farm, st.fleet, st.worker_pids), worker_memory),
        Section("quarantines", lambda st: (st.farm, st.fleet), quarantines),
    )


class FarmCollector(Collector):
    """Formats the current `MetricsState`; registered on a dedicated registry."""

    def __init__(self, state_getter: Callable[[], MetricsState], version: str) -> None:
        self._get = state_getter
        self.sections = sections(version)
        # (openmetrics, section index) -> the parts it was formatted from, and its text.
        self._texts: dict[tuple[bool, int], tuple[tuple[object, ...], str]] = {}
        self._lock = threading.Lock()

    def describe(self) -> Iterator[Metric]:
        # Nothing to pre-declare; returning empty keeps any registry from calling
        # collect() at registration time.
        return iter(())

    def collect(self) -> Iterator[Metric]:
        st = self._get()  # the one read of the shared reference
        for section in self.sections:
            yield from section.families(st)

    def exposition(self, *, openmetrics: bool) -> bytes:
        """The body of the current state; sections whose parts did not change since the
        last call are not formatted again. `exposition.Unsupported` if a family is not
        one the farm's writer takes (the caller then asks the library)."""
        st = self._get()
        out: list[str] = []
        for i, section in enumerate(self.sections):
            parts = section.parts(st)
            with self._lock:
                hit = self._texts.get((openmetrics, i))
            if hit is not None and all(a is b for a, b in zip(hit[0], parts, strict=True)):
                out.append(hit[1])
                continue
            text = exposition.render_text(section.families(st), openmetrics=openmetrics)
            with self._lock:
                # Keeps the parts themselves: their ids cannot be reused while cached.
                self._texts[(openmetrics, i)] = (parts, text)
            out.append(text)
        if openmetrics:
            out.append("# EOF\n")
        return "".join(out).encode("utf-8")


def _farm_extras(st: MetricsState) -> Iterator[Metric]:
    if st.farm is not None and st.farm.gateway is not None:
        yield from gateway(st.farm.gateway)
    if st.farm is not None and st.farm.staging is not None:
        yield from staging(st.farm.staging)
    if st.farm is not None and st.farm.canary is not None:
        yield from canary(st.farm, st.farm.canary)
    if st.farm is not None:
        yield canary_rollbacks(st.farm)


def _gpus_of(st: MetricsState) -> Iterator[Metric]:
    if st.fleet is not None:
        yield from gpus(st.fleet)


class FarmRegistry(CollectorRegistry):
    """A registry of one `FarmCollector`, which writes its own exposition section by
    section (`exposition.encode` asks it first)."""

    def __init__(self, collector: FarmCollector) -> None:
        super().__init__(auto_describe=False)
        self.register(collector)
        self.farm = collector

    def register(self, collector: Collector) -> None:
        # The farm's own writer formats the farm's sections only: another collector
        # would be in the library's bodies and missing from the farm's.
        if hasattr(self, "farm"):
            raise ValueError("a FarmRegistry holds the farm's collector alone")
        super().register(collector)

    def exposition(self, *, openmetrics: bool) -> bytes:
        return self.farm.exposition(openmetrics=openmetrics)


def build_registry(
    state_getter: Callable[[], MetricsState], *, version: str = __version__
) -> FarmRegistry:
    """A dedicated registry whose one collector formats `state_getter()` at each scrape.

    Dedicated, not the global REGISTRY: no process/platform collectors mixed in,
    and tests can build as many as they like.
    """
    return FarmRegistry(FarmCollector(state_getter, version))
