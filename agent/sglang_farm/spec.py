"""Pure: the validated, frozen shape of a farm (what `config.load_spec` returns).

Every other module reads a `FarmSpec`; none reads TOML. Defaults live here, on the
dataclasses, and `etc/sglang-farm/farm.toml` spells them out with comments.
Durations are seconds (floats); the config accepts "30s", "5m", "1h30m" or numbers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from sglang_farm.host.paths import DEFAULT_SOCKET, DEFAULT_STATE_DIR

# The module a worker runs (`python -m sglang.launch_server`): `[farm] module`'s default,
# and what `sglang.flags` knows the command line of.
SGLANG_MODULE = "sglang.launch_server"

# A flag value as written in `[sglang]`: `true` is a bare flag, `false` omits it,
# a list becomes several argv items (argparse nargs="+").
FlagValue = bool | int | float | str | tuple[str | int | float, ...]


@dataclass(frozen=True, slots=True)
class FarmSection:
    """`[farm]`: who the farm is and where its workers' SGLang lives."""

    name: str = "sglang-farm"
    # The SGLang environment's interpreter: workers run `<python> -m sglang.launch_server`.
    python: str = "/opt/sglang/bin/python3"
    # The module the interpreter runs; the demo points it at the simulator.
    module: str = SGLANG_MODULE
    user: str = "sglang"
    group: str = "sglang"
    state_dir: str = DEFAULT_STATE_DIR
    # Extra environment for every worker (per-worker `env` overrides these).
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True, slots=True)
class StartupPolicy:
    """`[startup]`: rollout order and the load deadline."""

    canary: int | None = 0  # worker id started alone first; None = no canary
    parallel: int = 4  # at most this many workers loading at once after the canary
    # SGLang binds its HTTP port only after weights, KV pool and CUDA graphs: minutes.
    load_timeout: float = 1200.0
    # Between health polls while a worker loads (connection refused until bound).
    poll_interval: float = 0.25


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    """`[health]`: liveness of ready workers.

    SGLang's `/health` runs a 1-token generation, sleeps 1 s first and times out
    server-side after 20 s (SGLANG_HEALTH_CHECK_TIMEOUT), so the client timeout
    must exceed 20 s and probes of one worker never overlap.
    """

    period: float = 10.0
    timeout: float = 25.0
    failure_threshold: int = 3
    path: str = "/health"
    # The route a starting worker's readiness is asked on: "auto" = SGLang's /ready (0.5.20+),
    # then `path` where the worker answers /ready with 404 (older SGLang); or a route.
    ready_path: str = "auto"
    # A failed probe of a worker whose token or request counters advanced after the probe
    # was sent, and within this long, is a busy worker (its /health waits behind a long
    # batch), not a hang.
    busy_window: float = 30.0
    # Running requests with no counter progress for this long (and an idle GPU where
    # NVML says) is a wedged engine: restarted even while /health still answers.
    stall_window: float = 120.0


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """`[restart]`: exponential back-off, its reset, and the crash-loop limit."""

    backoff_initial: float = 5.0
    backoff_max: float = 300.0
    reset_after: float = 600.0  # ready this long => back-off starts over
    # Restarts in a row (no stable period between) a failing worker gets; the next failure
    # marks it failed.
    max_failures: int = 5
    stop_timeout: float = 60.0  # SIGTERM drain has no bound in SGLang: SIGKILL after this


@dataclass(frozen=True, slots=True)
class OomAdjust:
    """One flag change of a ladder step.

    `set` replaces the value; `add`/`multiply` adjust the current numeric value,
    clamped to [min, max] where given. Exactly one of set/add/multiply is not None.
    """

    flag: str  # snake_case SGLang flag name
    set: FlagValue | None = None
    add: float | None = None
    multiply: float | None = None
    min: float | None = None
    max: float | None = None


@dataclass(frozen=True, slots=True)
class OomStep:
    name: str
    adjust: tuple[OomAdjust, ...]


@dataclass(frozen=True, slots=True)
class OomPolicy:
    """`[oom]`: the ladder walked down on out-of-memory failures (issue 6)."""

    enabled: bool = True
    scope: str = "worker"  # "worker" or "all"
    steps: tuple[OomStep, ...] = ()


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A listen address (`[metrics] listen`, `[gateway] listen` and `metrics_listen`),
    parsed once, by the config (`config.parse_endpoint`): `host` without an IPv6 address's
    brackets, `port` in 0..65535 (0: the kernel picks a free port). `str()` gives the
    "host:port" text back, with the brackets for an IPv6 address.
    """

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class MetricsSpec:
    """`[metrics]`: the Prometheus exporter."""

    listen: Endpoint = Endpoint("127.0.0.1", 9840)
    gpu_poll_interval: float = 5.0
    worker_poll_interval: float = 5.0
    worker_poll_timeout: float = 2.0
    # "nvml" (real GPUs), "fake" (simulated GPUs for the demo), "none"
    gpu_source: str = "nvml"


# ---- [gateway]'s routing opinions (issue 34 §3) --------------------------------------
# What smg 1.13 decides by itself about routing, set by the farm on purpose on the managed
# gateway's command line; `gateway.routing` says why each default is what it is and
# renders them. smg's own defaults, kept unless a measurement said otherwise
# (docs/gateway.md, "smg's routing opinions").


@dataclass(frozen=True, slots=True)
class GatewayRouting:
    """`[gateway]` overload_*, stall/wedge/stale_secs, warmup_*, priority_*."""

    # A worker with this many queued requests, or this share of its KV cache in use, is
    # left out of routing while another worker is under both (smg's overload protection).
    overload_protection: bool = True
    overload_waiting_requests: int = 8
    overload_token_usage: float = 0.8
    # Every candidate overloaded: answer 503 (True) or route to the least loaded (False).
    overload_shed: bool = False
    # Exclusion timers (whole seconds, as smg takes them): no contact after a transport
    # failure; no progress while loaded; no contact from a worker that pushes load records.
    stall_secs: int = 2
    wedge_secs: int = 3
    stale_secs: int = 15
    # cache_aware's warm-up slice for a worker that just became routable.
    warmup_secs: int = 60
    warmup_blocks: int = 1024
    warmup_share: float = 0.25
    # smg's priority-aware admission (classes system | interactive | default | bulk).
    priority_scheduler: bool = False
    # With it: the share of smg's capacity the `bulk` class may not take, held for users'
    # requests (`default`, no header) (gateway.scheduler).
    priority_user_share: float = 0.25


@dataclass(frozen=True, slots=True)
class GatewaySpec:
    """`[gateway]`: SGLang's gateway (smg) in front of the workers (docs/gateway.md).

    mode "off": no gateway. "managed": the farm runs smg itself at `listen`.
    "external": the farm registers its workers with the smg at `url`.
    """

    mode: str = "off"
    listen: Endpoint = Endpoint("127.0.0.1", 8000)  # managed: where clients connect
    url: str | None = None  # external: the gateway's base URL
    # External, several gateways (issue 26): every ready worker is a member of each one.
    urls: tuple[str, ...] = ()
    policy: str = "cache_aware"  # managed: smg's --policy
    metrics_listen: Endpoint = Endpoint("127.0.0.1", 29000)  # managed: smg's /metrics
    extra_args: tuple[str, ...] = ()  # managed: more `smg launch` flags
    # Files holding keys (root-only; never the config itself or argv): the key for the
    # worker API (/workers), and the key clients must send to the serving routes.
    admin_key_file: str | None = None
    api_key_file: str | None = None
    # The address the gateway reaches the workers at (external: this host's address as
    # the gateway sees it); None: [workers] host.
    worker_host: str | None = None
    # A planned stop waits at most this long for a worker's requests to finish.
    drain_timeout: float = 60.0
    # managed: smg's routing opinions, set on purpose (issue 34 §3).
    routing: GatewayRouting = GatewayRouting()

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def external_urls(self) -> tuple[str, ...]:
        """The external gateways the farm registers with: `urls`, else `url` alone."""
        if self.mode != "external":
            return ()
        return self.urls or ((self.url,) if self.url is not None else ())


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """`[model]`: where the workers' model comes from; staged into `[sglang] model_path`
    before any worker starts (docs/staging.md). Absent: the farm never touches the model."""

    # An absolute directory (a persistent disk, NFS) or a Hugging Face repo id ("org/name").
    source: str
    revision: str | None = None  # Hub: a branch, tag or commit; None = "main"
    # Read every staged file once so the workers' loads hit the page cache (not on tmpfs).
    warm_page_cache: bool = False
    # Free space beyond the model's size the target must keep (bytes).
    headroom: int = 1 << 30
    # Hub: a root-only file holding the token (never the config itself or argv).
    token_file: str | None = None
    # Hub: the persistent download cache; None = <state_dir>/hub-cache.
    cache_dir: str | None = None

    @property
    def is_local(self) -> bool:
        return self.source.startswith("/")


@dataclass(frozen=True, slots=True)
class RolloutSpec:
    """`[rollout]`: canary analysis of a reload's change on live traffic (docs/canary.md).

    The thresholds' defaults are `canary.verdict.CanaryPolicy`'s, justified there.
    """

    # How long the canary serves real traffic before its verdict; 0 = no analysis (the
    # next wave follows as soon as the canary is ready, as before issue 23).
    analysis_window: float = 300.0
    on_inconclusive: str = "hold"  # "hold" | "rollback" | "promote"
    # A window that ends short of traffic (nothing failed) is judged for another window,
    # this many times at most, before on_inconclusive applies; 0: at once.
    max_extensions: int = 2
    # Paired probes during the window (canary/probe.py): this many pairs in flight at
    # once, each the same prompt to the canary and to a baseline worker; 0: none.
    probe_concurrency: int = 0
    eval: str | None = None  # an eval set (JSON Lines) asked of the canary before traffic
    eval_tolerance: float = 0.05
    min_requests: int = 50
    itl_max_ratio: float = 1.4
    ttft_max_ratio: float = 3.0
    error_floor: float = 0.01
    error_max_ratio: float = 2.0
    min_errors: int = 2
    confidence: float = 0.98


# smg's request priority header (read by its priority scheduler): `[batch] priority`.
PRIORITY_HEADER = "x-smg-priority"


@dataclass(frozen=True, slots=True)
class BatchSpec:
    """`[batch]`: the batch service, `sglang-farm-batch` (docs/batch.md): OpenAI's Files and
    Batches API over the farm's front door, each request's state in a store."""

    enabled: bool = False
    listen: Endpoint = Endpoint("127.0.0.1", 8300)
    # The key clients must send (Authorization: Bearer); required when enabled.
    api_key_file: str | None = None
    # "sqlite" (<state_dir>/batch.db) or a postgresql:// URL (a queue several hosts share).
    store: str = "sqlite"
    state_dir: str = "/var/lib/sglang-farm-batch"
    # None ("auto"): follow what the farm can serve now; an int: at most that many in flight.
    concurrency: int | None = None
    max_attempts: int = 5
    retry_backoff_s: float = 1.0
    request_timeout_s: float = 600.0
    # The key the runner sends to the front door (a tenant key mapped to smg's bulk
    # class, docs/batch.md); None: the gateway's api_key_file's key, if readable.
    gateway_key_file: str | None = None
    # smg's priority class for the batch's requests (its `x-smg-priority` header, honoured
    # with `--priority-scheduler-enabled`): "bulk" lets users' requests go first. "none":
    # no header.
    priority: str = "bulk"
    # More headers on every request the runner sends.
    headers: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True, slots=True)
class ControlSpec:
    """`[control]`: the local control socket."""

    socket: str = DEFAULT_SOCKET
    group: str = "sglang-farm"


def gpu_label(gpus: Sequence[int]) -> str:
    """A worker's GPUs as one word, "3" or "0,1" (a worker spanning GPUs 0 and 1): the
    metrics' `gpu` label, and how the farm's texts name a worker's GPUs."""
    return ",".join(str(g) for g in gpus)


def gpu_field(gpus: Sequence[int]) -> int | str:
    """The `gpu` field of a worker's log lines: the GPU's index when it has one, a number
    as in the lines about one GPU (`gpu_failing`), else `gpu_label`; the same text."""
    return gpus[0] if len(gpus) == 1 else gpu_label(gpus)


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """One resolved worker: everything needed to build its command line."""

    id: int
    gpus: tuple[int, ...]
    host: str
    port: int
    nccl_port: int
    # Merged `[sglang]` + per-worker flags (snake_case keys), after farm-owned ones
    # (host, port, nccl_port, tp_size) are removed: those come from the fields above.
    flags: Mapping[str, FlagValue]
    env: Mapping[str, str]

    @property
    def base_url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"


@dataclass(frozen=True, slots=True)
class FarmSpec:
    """The whole validated config. `workers` is ordered by id."""

    source: str
    farm: FarmSection
    workers: tuple[WorkerSpec, ...]
    startup: StartupPolicy = StartupPolicy()
    health: HealthPolicy = HealthPolicy()
    restart: RestartPolicy = RestartPolicy()
    oom: OomPolicy = OomPolicy()
    metrics: MetricsSpec = MetricsSpec()
    control: ControlSpec = ControlSpec()
    gateway: GatewaySpec = GatewaySpec()
    model: ModelSpec | None = None  # [model]: staged before the rollout (None: not managed)
    rollout: RolloutSpec = RolloutSpec()
    batch: BatchSpec = BatchSpec()  # [batch]: the batch service (its own process)
    # sha256 of the text it was read from (config.load.text_digest); "" when not from
    # text. `status` compares it with the file on disk (`config_pending`).
    config_sha256: str = ""

    def worker(self, worker_id: int) -> WorkerSpec:
        """The worker with this id; KeyError if there is none."""
        for w in self.workers:
            if w.id == worker_id:
                return w
        raise KeyError(worker_id)

    def gateway_url_of(self, worker_id: int) -> str:
        """The worker's URL as the gateway reaches it (its member URL there)."""
        w = self.worker(worker_id)
        host = self.gateway.worker_host or w.host
        if host in ("0.0.0.0", "::"):
            host = "127.0.0.1"
        elif ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{w.port}"

    @property
    def worker_ids(self) -> tuple[int, ...]:
        return tuple(w.id for w in self.workers)
