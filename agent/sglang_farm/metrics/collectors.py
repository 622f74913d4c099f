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
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from types import MappingProxyType
from urllib.parse import urlsplit, urlunsplit

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from sglang_farm import __version__
from sglang_farm.canary.view import CanaryState, RolloutVerdictView
from sglang_farm.farm_view import FarmView, GatewayStatus, Phase
from sglang_farm.gpus.snapshot import FleetSnapshot, GpuSnapshot, attribute_memory
from sglang_farm.metrics import exposition
from sglang_farm.staging.failure import StageFailureKind
from sglang_farm.staging.state import StageState, StagingView
from sglang_farm.state_alerts import AlertKind
from sglang_farm.workers.failures import OomKind, RestartReason
from sglang_farm.workers.load import WorkerStats

ROLLOUT_STATES = ("idle", "canary", "rolling", "done", "halted")
# A stop while staging is no failure of the stage: not counted.
STAGE_FAILURE_KINDS = tuple(str(k) for k in StageFailureKind if k is not StageFailureKind.CANCELLED)
# Phases in which a worker serves HTTP, so its polled figures mean something. A draining
# worker is out of the gateway but still finishing its requests: its running and queued
# figures falling to 0 are the drain itself.
_SERVING = (Phase.READY, Phase.UNHEALTHY, Phase.DRAINING)


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


def gpu_label(gpus: tuple[int, ...]) -> str:
    """The `gpu` label of a worker: "3", or "0,1" for a worker spanning GPUs 0 and 1."""
    return ",".join(str(g) for g in gpus)


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


def _g(name: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels or [])


def _c(name: str, doc: str, labels: list[str]) -> CounterMetricFamily:
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


def sections(version: str) -> tuple[Section, ...]:
    """Every family the farm exports, in exposition order, grouped by what they read."""
    return (
        Section("agent", lambda st: (st,), partial(_agent, version)),
        Section("farm", lambda st: (st.farm,), _farm_extras),
        Section("gpus", lambda st: (st.fleet,), _gpus_of),
        Section("worker_phases", lambda st: (st.farm,), _worker_phases),
        Section("worker_starts", lambda st: (st.farm,), _worker_starts),
        Section("worker_stats", lambda st: (st.farm, st.workers), _worker_stats),
        Section("worker_memory", lambda st: (st.farm, st.fleet, st.worker_pids), _worker_memory),
        Section("quarantines", lambda st: (st.farm, st.fleet), _quarantines),
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


def _agent(version: str, st: MetricsState) -> Iterator[Metric]:
    m = _g("sglang_farm_build_info", "The agent's version; always 1.", ["version"])
    m.add_metric([version], 1)
    yield m
    m = _g(
        "sglang_farm_snapshot_timestamp_seconds",
        "When the agent last rebuilt the state scrapes read (Unix time); old = stuck loop.",
    )
    m.add_metric([], st.snapshot_at)
    yield m
    ok = _g("sglang_farm_probe_success", "1 if the latest poll of a source succeeded.", ["source"])
    dur = _g(
        "sglang_farm_probe_duration_seconds",
        "How long the latest poll of a source took.",
        ["source"],
    )
    last = _g(
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
        m = _g("sglang_farm_info", "The farm's name and runtime; always 1.", ["farm", "runtime"])
        m.add_metric([farm.name, farm.runtime], 1)
        yield m
        m = _g("sglang_farm_start_time_seconds", "When the agent started (Unix time).")
        m.add_metric([], farm.started_at)
        yield m
        m = _g("sglang_farm_rollout_state", "The rollout's state (a state set).", ["state"])
        for s in ROLLOUT_STATES:
            m.add_metric([s], 1 if farm.rollout == s else 0)
        yield m
        m = _g(
            "sglang_farm_host_drained",
            "1 while farmctl drain-host holds this host's workers out of the gateway.",
        )
        m.add_metric([], 1 if farm.held_out_since is not None else 0)
        yield m
        yield from _state_files(farm)


def _state_files(farm: FarmView) -> Iterator[Metric]:
    """Issue 30: the farm's own state files (state.json, canary.json)."""
    c = _c(
        "sglang_farm_state_save_failures",
        "Failed writes of state.json (a full or read-only state_dir) since the agent started.",
        [],
    )
    c.add_metric([], farm.state_save_failures)
    yield c
    m = _g(
        "sglang_farm_state_alerts",
        "Problems with the farm's state files now: not saved, or found damaged or refused at "
        "the agent's start (farmctl status names each); 0 when there is none.",
    )
    m.add_metric([], len(farm.state_alerts))
    yield m
    m = _g(
        "sglang_farm_state_unsaved_since_timestamp_seconds",
        "Since when (Unix time) a state file's writes fail; only while they do.",
        ["file"],
    )
    for a in farm.state_alerts:
        if a.kind is AlertKind.NOT_SAVED:
            m.add_metric([a.file], a.since)
    yield m


def _farm_extras(st: MetricsState) -> Iterator[Metric]:
    if st.farm is not None and st.farm.gateway is not None:
        yield from _gateway(st.farm.gateway)
    if st.farm is not None and st.farm.staging is not None:
        yield from _staging(st.farm.staging)
    if st.farm is not None and st.farm.canary is not None:
        yield from _canary(st.farm, st.farm.canary)
    if st.farm is not None:
        yield _canary_rollbacks(st.farm)


def _gpus_of(st: MetricsState) -> Iterator[Metric]:
    if st.fleet is not None:
        yield from _gpus(st.fleet)


def _gateway(gw: GatewayStatus) -> Iterator[Metric]:
    # Only with a [gateway]: a farm without one has no gateway series at all.
    up = _g(
        "sglang_farm_gateway_up",
        "1 if the gateway answered the farm's latest membership call or reconcile.",
        ["url"],
    )
    for each in gw.each:  # issue 26: one series per gateway of [gateway] urls
        up.add_metric([public_url(each.url)], 1 if each.up else 0)
    yield up
    members = _g(
        "sglang_farm_gateway_members",
        "The farm's own workers the gateway routes to, as it last confirmed (several "
        "gateways: those the farm counts as in, sglang_farm_worker_in_gateway).",
    )
    members.add_metric([], gw.members)
    yield members
    routed = _g(
        "sglang_farm_gateway_routed_workers",
        "The farm's own workers this gateway routes to, as it last confirmed.",
        ["url"],
    )
    for each in gw.each:
        routed.add_metric([public_url(each.url)], each.members)
    yield routed
    errors = _c(
        "sglang_farm_gateway_errors",
        "Failed gateway membership calls and reconciles since the agent started.",
        [],
    )
    errors.add_metric([], gw.errors)
    yield errors
    foreign = _g(
        "sglang_farm_gateway_foreign_members",
        "Workers in the gateway that the farm did not register (farmctl status names them); "
        "a managed gateway's are removed at the next reconcile.",
    )
    foreign.add_metric([], len(gw.foreign))
    yield foreign
    overloaded = _g(
        "sglang_farm_gateway_overloaded_workers",
        "The farm's workers the gateway lists ready but leaves out of routing for overload "
        "(smg's overload protection; farmctl status names them), as of the last reconcile.",
    )
    overloaded.add_metric([], len({w for w, _ in gw.overloaded}))
    yield overloaded


def _staging(sg: StagingView) -> Iterator[Metric]:
    # Only with a [model]: a farm that does not stage its model has no staging series.
    state = _g(
        "sglang_farm_model_stage_state",
        "The model stage's state (a state set); failed holds the rollout.",
        ["state"],
    )
    for s in StageState:
        state.add_metric([s.value], 1 if sg.state is s else 0)
    yield state
    staged = _c(
        "sglang_farm_model_staged_bytes",
        "Bytes copied into the workers' model path by completed stages since the agent started.",
        [],
    )
    staged.add_metric([], sg.staged_bytes_total)
    yield staged
    stages = _c(
        "sglang_farm_model_stages",
        "Completed model stages since the agent started (a current copy counts, copying nothing).",
        [],
    )
    stages.add_metric([], sg.stages_total)
    yield stages
    failures = _c(
        "sglang_farm_model_stage_failures",
        "Failed model stages since the agent started, by what failed.",
        ["kind"],
    )
    for kind in STAGE_FAILURE_KINDS:
        failures.add_metric([kind], sg.failures_by_kind.get(kind, 0))
    yield failures
    if sg.last_duration_s is not None:
        took = _g(
            "sglang_farm_model_stage_duration_seconds",
            "How long the last model stage took (completed or failed).",
        )
        took.add_metric([], sg.last_duration_s)
        yield took
    if sg.state is StageState.STAGING and sg.bytes_total:
        done = _g(
            "sglang_farm_model_stage_progress_bytes",
            "Bytes done of the stage step under way (download, copy or warm-up).",
            ["step"],
        )
        total = _g(
            "sglang_farm_model_stage_size_bytes",
            "Bytes the stage step under way handles in all.",
            ["step"],
        )
        done.add_metric([sg.step or ""], sg.bytes_done)
        total.add_metric([sg.step or ""], sg.bytes_total)
        yield done
        yield total


def _canary(farm: FarmView, cv: RolloutVerdictView) -> Iterator[Metric]:
    # Only once a change has been judged on a canary (docs/canary.md): the latest one's
    # state, its window, and the figures compared, as `farmctl why` shows them.
    state = _g(
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
    info = _g(
        "sglang_farm_canary_info",
        "The change judged (its short hash) and its canary worker; always 1.",
        ["change", "worker", "gpu"],
    )
    info.add_metric([cv.change, str(cv.canary), gpus], 1)
    yield info
    window = _g(
        "sglang_farm_canary_window_seconds",
        "The canary's analysis window, with its extensions so far.",
    )
    window.add_metric([], cv.window_s)
    yield window
    extended = _g(
        "sglang_farm_canary_window_extensions",
        "How many times the window ended short of traffic and was extended (of at most "
        "[rollout] max_extensions).",
    )
    extended.add_metric([], cv.extensions)
    yield extended
    if cv.ends_at is not None:
        ends = _g(
            "sglang_farm_canary_window_end_timestamp_seconds",
            "While the canary is analysed: when its window ends (Unix time).",
        )
        ends.add_metric([], cv.ends_at)
        yield ends
    figure = _g(
        "sglang_farm_canary_figure",
        "A figure the verdict compared, for the canary and for the baseline (seconds for "
        "itl_* and ttft_*, a ratio for errors, requests for traffic, a score for eval).",
        ["check", "side"],
    )
    ratio = _g("sglang_farm_canary_check_ratio", "A compared figure, canary / baseline.", ["check"])
    limit = _g("sglang_farm_canary_check_limit", "The limit a check is judged against.", ["check"])
    passed = _g(
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


def _canary_rollbacks(farm: FarmView) -> Metric:
    # From the agent's start, at 0 before any change is judged (unlike the other canary
    # series): a canary that fails within one scrape interval must still show as a step
    # from 0, or the rollback alert's increase() never sees it (etc/prometheus/alerts.yml).
    rollbacks = _c(
        "sglang_farm_canary_rollbacks",
        "Changes rolled back from their canary since the agent started.",
        [],
    )
    rollbacks.add_metric([], farm.canary.rollbacks_total if farm.canary is not None else 0)
    return rollbacks


def _gpus(fleet: FleetSnapshot) -> Iterator[Metric]:
    up = _g("sglang_farm_nvml_up", "1 if NVML answered the latest GPU snapshot.")
    up.add_metric([], 1 if fleet.nvml_up else 0)
    yield up
    sim = _g(
        "sglang_farm_gpu_simulated", "1 if the GPUs are simulated (demo), 0 if read through NVML."
    )
    sim.add_metric([], 1 if fleet.simulated else 0)
    yield sim

    gl = ["gpu", "uuid"]
    info = _g(
        "sglang_farm_gpu_info",
        "Identity of a GPU; always 1.",
        [*gl, "name", "pci_bus_id", "compute_capability", "driver_version"],
    )
    healthy = _g(
        "sglang_farm_gpu_healthy", "0 if NVML failed on this GPU (lost, unknown error).", gl
    )
    g: list[tuple[GaugeMetricFamily, Callable[[GpuSnapshot], float | int | bool | None]]] = [
        (
            _g("sglang_farm_gpu_memory_total_bytes", "GPU memory size.", gl),
            lambda s: s.memory_total_bytes,
        ),
        (
            _g("sglang_farm_gpu_memory_used_bytes", "GPU memory in use.", gl),
            lambda s: s.memory_used_bytes,
        ),
        (
            _g("sglang_farm_gpu_memory_free_bytes", "GPU memory free.", gl),
            lambda s: s.memory_free_bytes,
        ),
        (
            _g("sglang_farm_gpu_memory_reserved_bytes", "GPU memory reserved by the driver.", gl),
            lambda s: s.memory_reserved_bytes,
        ),
        (
            _g("sglang_farm_gpu_utilization_ratio", "Fraction of time a kernel ran (0-1).", gl),
            lambda s: s.utilization_gpu_ratio,
        ),
        (
            _g(
                "sglang_farm_gpu_memory_utilization_ratio",
                "Fraction of time device memory was read or written (0-1).",
                gl,
            ),
            lambda s: s.utilization_memory_ratio,
        ),
        (
            _g("sglang_farm_gpu_temperature_celsius", "GPU core temperature.", gl),
            lambda s: s.temperature_c,
        ),
        (_g("sglang_farm_gpu_power_watts", "Power draw.", gl), lambda s: s.power_w),
        (_g("sglang_farm_gpu_sm_clock_hertz", "SM clock.", gl), lambda s: s.sm_clock_hz),
        (
            _g(
                "sglang_farm_gpu_clock_event_reasons",
                "NVML clocks-event (throttle) reasons bitmask; 0 = not throttled.",
                gl,
            ),
            lambda s: s.throttle_reasons,
        ),
        (
            _g(
                "sglang_farm_gpu_remapped_rows_pending",
                "1 if row remapping is pending (needs a GPU reset).",
                gl,
            ),
            lambda s: s.remapped_rows_pending,
        ),
        (
            _g(
                "sglang_farm_gpu_remapped_rows_failure",
                "1 if a row remapping failed (replace the GPU).",
                gl,
            ),
            lambda s: s.remapped_rows_failure,
        ),
        (
            _g("sglang_farm_gpu_compute_processes", "Compute processes on the GPU.", gl),
            lambda s: len(s.processes) if s.healthy else None,
        ),
    ]
    energy = _c("sglang_farm_gpu_energy_joules", "Energy used since the driver loaded.", gl)
    ecc = _c(
        "sglang_farm_gpu_ecc_errors",
        "Volatile ECC errors since the driver loaded, by type (corrected, uncorrected).",
        [*gl, "type"],
    )
    rows = _g("sglang_farm_gpu_remapped_rows", "Rows remapped, by kind.", [*gl, "kind"])
    uuids: dict[int, str] = {}
    for s in fleet.gpus:
        lv = [str(s.index), s.uuid or ""]
        uuids[s.index] = s.uuid or ""
        cc = f"{s.compute_capability[0]}.{s.compute_capability[1]}" if s.compute_capability else ""
        info.add_metric([*lv, s.name or "", s.pci_bus_id or "", cc, fleet.driver_version or ""], 1)
        healthy.add_metric(lv, 1 if s.healthy else 0)
        for fam, get in g:
            v = get(s)
            if v is not None:
                fam.add_metric(lv, float(v))
        if s.energy_j is not None:
            energy.add_metric(lv, s.energy_j)
        if s.ecc_corrected_volatile_total is not None:
            ecc.add_metric([*lv, "corrected"], s.ecc_corrected_volatile_total)
        if s.ecc_uncorrected_volatile_total is not None:
            ecc.add_metric([*lv, "uncorrected"], s.ecc_uncorrected_volatile_total)
        if s.remapped_rows_correctable is not None:
            rows.add_metric([*lv, "correctable"], s.remapped_rows_correctable)
        if s.remapped_rows_uncorrectable is not None:
            rows.add_metric([*lv, "uncorrectable"], s.remapped_rows_uncorrectable)
    yield info
    yield healthy
    for fam, _ in g:
        yield fam
    yield energy
    yield ecc
    yield rows
    xid = _c(
        "sglang_farm_gpu_xid_errors",
        "XID critical errors seen through NVML events since the agent started, by code.",
        [*gl, "xid"],
    )
    for (index, code), n in sorted(fleet.xid_events_total.items()):
        gpu = str(index) if index >= 0 else "unknown"
        xid.add_metric([gpu, uuids.get(index, ""), str(code)], n)
    yield xid


_WORKER_LABELS = ["worker", "gpu"]


def _worker_phases(st: MetricsState) -> Iterator[Metric]:
    """What the farm view alone says of each worker: phase, restarts, OOM ladder, loads."""
    if st.farm is None:
        return
    wl = _WORKER_LABELS
    state = _g("sglang_farm_worker_state", "The worker's phase (a state set).", [*wl, "state"])
    since = _g(
        "sglang_farm_worker_state_since_timestamp_seconds",
        "When the worker entered its phase (Unix time).",
        wl,
    )
    restarts = _c("sglang_farm_worker_restarts", "Restarts by reason.", [*wl, "reason"])
    ooms = _c("sglang_farm_worker_oom_events", "Out-of-memory failures by kind.", [*wl, "kind"])
    step = _g(
        "sglang_farm_worker_oom_ladder_step", "OOM-ladder step in force (0 = as configured).", wl
    )
    load = _g(
        "sglang_farm_worker_last_load_duration_seconds",
        "How long the last start took from launch to ready.",
        wl,
    )
    drain = _g(
        "sglang_farm_worker_last_drain_duration_seconds",
        "How long the last planned stop waited for the worker to leave the gateway and go idle.",
        wl,
    )
    in_gateway = _g(
        "sglang_farm_worker_in_gateway", "1 if the gateway confirmed it routes to the worker.", wl
    )
    busy = _g(
        "sglang_farm_worker_busy",
        "1 while a slow /health is excused: the worker's own counters were advancing.",
        wl,
    )
    gateway = st.farm.gateway is not None
    reasons = [str(r) for r in RestartReason]
    kinds = [str(k) for k in OomKind]
    for w in st.farm.workers:
        lv = [str(w.id), gpu_label(w.gpus)]
        for p in Phase:
            state.add_metric([*lv, str(p)], 1 if w.phase is p else 0)
        since.add_metric(lv, w.since)
        _add_counts(restarts, lv, w.restarts_by_reason, reasons)
        _add_counts(ooms, lv, w.oom_events_by_kind, kinds)
        step.add_metric(lv, w.oom_step)
        busy.add_metric(lv, 1 if w.busy else 0)
        if w.last_load_seconds is not None:
            load.add_metric(lv, w.last_load_seconds)
        if w.last_drain_seconds is not None:
            drain.add_metric(lv, w.last_drain_seconds)
        if gateway:
            in_gateway.add_metric(lv, 1 if w.in_gateway else 0)
    yield from (state, since, restarts, ooms, step, busy, load, drain)
    if gateway:
        yield in_gateway


def _worker_starts(st: MetricsState) -> Iterator[Metric]:
    """Each worker's latest start, phase by phase, and the capacity SGLang chose (issue 34
    §4): from its log's milestones (`sglang.startup`)."""
    if st.farm is None:
        return
    wl = _WORKER_LABELS
    phases = _g(
        "sglang_farm_worker_startup_seconds",
        "Seconds each phase of the worker's latest start took (the phases that ended), from "
        "SGLang's log milestones.",
        [*wl, "phase"],
    )
    starting = _g(
        "sglang_farm_worker_startup_phase",
        "The phase the worker's start is in now (a state set; absent once served).",
        [*wl, "phase"],
    )
    since = _g(
        "sglang_farm_worker_startup_phase_since_timestamp_seconds",
        "When the phase the worker's start is in now began (Unix time; absent once served).",
        wl,
    )
    kv = _g(
        "sglang_farm_worker_kv_cache_tokens",
        "The KV cache's size in tokens SGLang chose at the worker's start (max_total_num_tokens).",
        wl,
    )
    running = _g(
        "sglang_farm_worker_max_running_requests",
        "The running-request limit SGLang settled on at the worker's start.",
        wl,
    )
    context = _g(
        "sglang_farm_worker_context_length",
        "The context length SGLang serves the worker's model with.",
        wl,
    )
    for w in st.farm.workers:
        s = w.start
        if s is None:
            continue
        lv = [str(w.id), gpu_label(w.gpus)]
        for phase, seconds in s.durations.items():
            phases.add_metric([*lv, phase], seconds)
        if s.in_progress:
            starting.add_metric([*lv, str(s.phase)], 1)
            since.add_metric(lv, s.phase_since)
        if s.capacity is not None:
            kv.add_metric(lv, s.capacity.kv_tokens)
            running.add_metric(lv, s.capacity.max_running_requests)
            context.add_metric(lv, s.capacity.context_len)
    yield from (phases, starting, since, kv, running, context)


def _worker_stats(st: MetricsState) -> Iterator[Metric]:
    """What the latest stats poll said of each serving worker (and its model and version)."""
    if st.farm is None:
        return
    wl = _WORKER_LABELS
    info = _g(
        "sglang_farm_worker_info",
        "A worker's port, model and SGLang version; always 1.",
        [*wl, "port", "model_name", "sglang_version"],
    )
    up = _g(
        "sglang_farm_worker_up",
        "1 if the worker is serving and answered the latest stats poll.",
        wl,
    )
    queued = _g("sglang_farm_worker_queued_requests", "Requests waiting in the worker's queue.", wl)
    running = _g("sglang_farm_worker_running_requests", "Requests the worker is running.", wl)
    kv = _g("sglang_farm_worker_kv_cache_usage_ratio", "KV-cache pool usage (0-1).", wl)
    tput = _g(
        "sglang_farm_worker_generation_throughput_tokens_per_second",
        "Decode throughput as SGLang last reported it.",
        wl,
    )
    hit = _g(
        "sglang_farm_worker_prefix_cache_hit_ratio", "Prefix (radix) cache hit ratio (0-1).", wl
    )
    stale = _g(
        "sglang_farm_worker_stats_stale",
        "1 if the worker's figures are stale: no answer, or frozen while requests run.",
        wl,
    )
    polled = _g(
        "sglang_farm_worker_stats_timestamp_seconds", "When the worker's figures were read.", wl
    )
    poll_dur = _g(
        "sglang_farm_worker_stats_poll_duration_seconds", "How long the latest stats poll took.", wl
    )
    # Issue 34 §2: from SGLang's own sglang:http_responses_total (>= 0.5.20), absent without.
    answered = _c(
        "sglang_farm_worker_http_responses",
        "The worker's 2xx and 5xx answers on its serving routes since it started, as its "
        "SGLang counts them (sglang:http_responses_total).",
        wl,
    )
    errors = _c(
        "sglang_farm_worker_http_server_errors",
        "The worker's 5xx answers on its serving routes since it started, as its SGLang "
        "counts them.",
        wl,
    )
    ratio = _g(
        "sglang_farm_worker_http_5xx_ratio",
        "The 5xx share of the worker's answers over its polls of the last 5 minutes "
        "(absent with no answer then).",
        wl,
    )
    for w in st.farm.workers:
        lv = [str(w.id), gpu_label(w.gpus)]
        stats = st.workers.get(w.id)
        model = (stats.model_name if stats else None) or model_from_argv(w.argv) or ""
        version = (stats.sglang_version if stats else None) or ""
        info.add_metric([*lv, str(w.port), model, version], 1)
        serving = w.phase in _SERVING
        up.add_metric(lv, 1 if serving and stats is not None and stats.up else 0)
        if not serving or stats is None:
            continue
        stale.add_metric(lv, 1 if stats.stale else 0)
        polled.add_metric(lv, stats.taken_at)
        poll_dur.add_metric(lv, stats.poll_duration_s)
        if not stats.up:
            continue
        for fam, v in (
            (queued, stats.queued),
            (running, stats.running),
            (kv, stats.token_usage),
            (tput, stats.gen_throughput),
            (hit, stats.cache_hit_rate),
        ):
            if v is not None:
                fam.add_metric(lv, v)
        if stats.answered is not None and stats.server_errors is not None:
            answered.add_metric(lv, stats.answered)
            errors.add_metric(lv, stats.server_errors)
        recent = stats.recent
        if recent is not None and recent.ratio is not None:
            ratio.add_metric(lv, recent.ratio)
    yield from (info, up, queued, running, kv, tput, hit, stale, polled, poll_dur)
    yield from (answered, errors, ratio)


def _worker_memory(st: MetricsState) -> Iterator[Metric]:
    """The GPU memory each worker's process tree holds, from the fleet snapshot."""
    if st.farm is None:
        return
    mem = _g(
        "sglang_farm_worker_gpu_memory_bytes",
        "GPU memory held by the worker's process tree (NVML per-process memory).",
        _WORKER_LABELS,
    )
    fleet = st.fleet
    memory: dict[int, int] = {}
    if fleet is not None and fleet.nvml_up:
        memory = attribute_memory(fleet, st.worker_pids)
    for w in st.farm.workers:
        if w.id in memory and w.id in st.worker_pids:
            mem.add_metric([str(w.id), gpu_label(w.gpus)], memory[w.id])
    yield mem


def _quarantines(st: MetricsState) -> Iterator[Metric]:
    # A quarantine is the worker's (the supervisor sets it), but it names one GPU: the
    # gauge is per GPU, so an alert says which card to reset; the counter is per worker,
    # like restarts. XID reasons are free-form ("xid 79"), so only counted reasons appear.
    if st.farm is None:
        return
    uuids = {g.index: g.uuid or "" for g in st.fleet.gpus} if st.fleet is not None else {}
    gauge = _g(
        "sglang_farm_gpu_quarantined",
        "1 while the GPU is quarantined (its worker stopped, not restarted until released); "
        '0 with reason="" for the farm\'s other GPUs.',
        ["gpu", "uuid", "reason"],
    )
    total = _c(
        "sglang_farm_worker_quarantines",
        'Times the worker\'s GPU was quarantined, by reason ("xid 79", "gpu lost", ...).',
        ["worker", "gpu", "reason"],
    )
    shown: dict[int, str] = {}
    for w in st.farm.workers:
        q = w.quarantine
        if q is not None:
            shown[q.gpu] = q.reason
        for g in w.gpus:
            shown.setdefault(g, "")
        lv = [str(w.id), gpu_label(w.gpus)]
        for reason in sorted(w.quarantines_by_reason):
            total.add_metric([*lv, reason], w.quarantines_by_reason[reason])
    for gpu in sorted(shown):
        reason = shown[gpu]
        gauge.add_metric([str(gpu), uuids.get(gpu, ""), reason], 1 if reason else 0)
    yield gauge
    yield total


def _add_counts(
    fam: CounterMetricFamily, lv: list[str], counts: Mapping[str, int], known: list[str]
) -> None:
    # Every known key is exported, 0 included, so rate()/increase() see the first event.
    for key in [*known, *sorted(k for k in counts if k not in known)]:
        fam.add_metric([*lv, key], counts.get(key, 0))


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
