"""Pure: the command line of a gateway the farm runs itself (`smg launch ...`).

`smg_argv(spec)` is what a rendered unit's ExecStart (systemd runtime) or the process
runtime runs. The farm owns the flags below; `extra_args` carries any other smg flag
(`smg launch --help`) and may not repeat one of them. Why each owned flag:

- `--host`/`--port`: smg's own default port is 30000, the farm's first worker port.
- `--prometheus-host`/`--prometheus-port`: smg serves `/metrics` on a second listener,
  by default 0.0.0.0:29000, open to anyone (its startup SECURITY POSTURE warning);
  the farm binds it to the gateway's own host unless told otherwise.
- `--control-plane-api-keys farm:sglang-farm:admin:<key>` when `admin_key` is set: the
  worker API (`/workers`) then needs that key, and the serving routes stay as
  `api_key` says. Without any key smg leaves `/workers` open to any caller that can
  reach it: anyone could add or remove backends. So the farm always gives its managed
  gateway one (`admin_key_path`: the configured file, else one it generates).
- `--api-key` when `api_key` is set: the shared key of the serving routes (clients
  send `Authorization: Bearer <key>`); smg also presents it to the workers given by
  `--worker-urls`, and accepts it on `/workers` when no `admin_key` is set.
- smg's routing opinions (overload protection, exclusion timers, warm-up slice, priority
  scheduler) when `routing` is set, as the agent always sets it: every one named, from
  `[gateway]` (`gateway.routing`), so that a later smg's other defaults change nothing.

Keys on a command line can be read by other local users while the launcher starts
(smg's launcher then renames its process `smg::router`, which hides them), and in a
unit file's ExecStart: docs/gateway.md says how the farm keeps them out of both.
"""

from __future__ import annotations

import contextlib
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from sglang_farm.gateway import routing as routing_flags
from sglang_farm.gateway import scheduler
from sglang_farm.spec import FarmSpec, GatewayRouting, GatewaySpec

# smg 1.13.0 on SIGTERM (docs/gateway.md, "The gateway process"): it keeps its listener
# open for a 5 s load-balancer propagation window, then waits for requests in flight
# up to --shutdown-grace-period-secs (default 180, smg/router_args.py). The unit's stop
# timeout is both plus this margin, so SIGKILL never cuts a request smg would finish.
SMG_PROPAGATION_S = 5.0
SMG_SHUTDOWN_GRACE_S = 180.0
GATEWAY_STOP_MARGIN_S = 10.0

# `smg launch --policy` choices in smg 1.13.0 (smg/router_args.py, COMMON_POLICY_CHOICES).
POLICIES = (
    "random",
    "round_robin",
    "passthrough",
    "cache_aware",
    "power_of_two",
    "least_load",
    "manual",
    "consistent_hashing",
    "prefix_hash",
)
# Those smg 1.13 will not start with fewer than 2 workers ("Power-of-two policy requires
# at least 2 workers", at `smg launch` without --worker-urls); the managed gateway starts
# with none, so the config refuses them (docs/gateway.md).
POLICIES_NEEDING_WORKERS = frozenset({"power_of_two"})

# Flags `smg_argv` sets itself; `extra_args` must not repeat them (argparse would keep
# the last one silently).
OWNED_FLAGS = (
    "--host",
    "--port",
    "--policy",
    "--prometheus-host",
    "--prometheus-port",
    "--worker-urls",
    "--api-key",
    "--control-plane-api-keys",
)

# The control-plane key's id and name in smg's 'id:name:role:key' format; they show in
# smg's audit log (`--control-plane-audit-enabled`).
ADMIN_KEY_ID = "sglang-farm"

# The admin key the agent generates (gateway.adminkey) when [gateway] admin_key_file is
# not set, in the state directory.
GENERATED_ADMIN_KEY_NAME = "gateway-admin.key"


def admin_key_path(admin_key_file: str | None, state_dir: str) -> str:
    """The file holding a managed gateway's admin key: the configured one, else the one
    the agent generates in `state_dir`. A managed gateway always has one."""
    if admin_key_file is not None:
        return admin_key_file
    return str(PurePosixPath(state_dir) / GENERATED_ADMIN_KEY_NAME)


@dataclass(frozen=True, slots=True)
class ManagedGateway:
    """What the farm decides about a gateway it runs: where, how it routes, its keys."""

    host: str
    port: int
    policy: str
    metrics_port: int
    metrics_host: str | None = None  # None: the gateway's own host
    worker_urls: tuple[str, ...] = ()
    api_key: str | None = None
    admin_key: str | None = None
    extra_args: tuple[str, ...] = field(default=())
    # smg's routing opinions (gateway.routing), all named on the command line; None: the
    # farm names none of them and smg's own defaults apply (a test's or bench's gateway).
    routing: GatewayRouting | None = None
    # With routing.priority_scheduler: the slots smg's scheduler holds for users at least
    # (gateway.scheduler.user_slots of the farm's configured slots); None: one.
    user_slots: int | None = None

    @property
    def url(self) -> str:
        """The base URL the farm and its users reach the gateway at."""
        host = self.host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"  # listening everywhere: reach it on loopback
        elif ":" in host:
            host = f"[{host}]"  # an IPv6 literal
        return f"http://{host}:{self.port}"

    @property
    def control_key(self) -> str | None:
        """The key the farm must send to the gateway's worker API."""
        return self.admin_key or self.api_key


def problems(spec: ManagedGateway, *, keyed: bool = False) -> list[str]:
    """Everything wrong with `spec`, each a complete line; empty when it can be launched.

    `keyed`: a key is given another way (a key file the launcher reads), not in `spec`.
    """
    out = []
    if spec.policy not in POLICIES:
        out.append(f"policy: expected one of {', '.join(POLICIES)}, got {spec.policy!r}")
    for name, port in (("port", spec.port), ("metrics_port", spec.metrics_port)):
        if not 1 <= port <= 65535:
            out.append(f"{name}: expected a port in 1..65535, got {port!r}")
    if spec.port == spec.metrics_port:
        out.append(f"metrics_port: must differ from port ({spec.port})")
    for name, key in (("api_key", spec.api_key), ("admin_key", spec.admin_key)):
        if key is not None and (not key or any(c.isspace() for c in key)):
            out.append(f"{name}: expected a non-empty key without blanks")
    keyless = spec.admin_key is None and spec.api_key is None and not keyed
    if keyless and not is_loopback(spec.host):
        out.append(
            f"admin_key: required when the gateway listens on {spec.host!r} (not loopback): "
            "without a key anyone who reaches it can add and remove its backends"
        )
    for arg in spec.extra_args:
        flag = arg.split("=", 1)[0]
        if flag in OWNED_FLAGS:
            out.append(
                f"extra_args: {flag} is set by the farm from the gateway config; "
                "remove it from extra_args"
            )
        elif spec.routing is not None and (key := routing_flags.owned_flag(arg)):
            out.append(
                f"extra_args: {flag} is set by the farm from [gateway] {key}; "
                f"remove it from extra_args and set {key} instead"
            )
    if spec.routing is not None:
        out += [f"{key}: {msg}" for key, msg in routing_flags.problems(spec.routing)]
    return out


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


def smg_argv(
    spec: ManagedGateway, smg: Sequence[str] = ("smg",), *, keyed: bool = False
) -> list[str]:
    """The full argv: `smg` (the launcher: a path, or an interpreter and `-m smg...`),
    then `launch` and the flags. Raises ValueError listing `problems(spec)` if any."""
    found = problems(spec, keyed=keyed)
    if found:
        raise ValueError("managed gateway: " + "; ".join(found))
    argv = [
        *smg,
        "launch",
        "--host",
        spec.host,
        "--port",
        str(spec.port),
        "--policy",
        spec.policy,
        "--prometheus-host",
        spec.metrics_host or spec.host,
        "--prometheus-port",
        str(spec.metrics_port),
    ]
    if spec.worker_urls:
        argv += ["--worker-urls", *spec.worker_urls]
    if spec.api_key:
        argv += ["--api-key", spec.api_key]
    if spec.admin_key:
        argv += [
            "--control-plane-api-keys",
            f"{ADMIN_KEY_ID}:{ADMIN_KEY_ID}:admin:{spec.admin_key}",
        ]
    if spec.routing is not None:
        argv += routing_flags.smg_flags(spec.routing)
    return argv + list(spec.extra_args)


def from_spec(gateway: GatewaySpec, *, slots: int | None = None) -> ManagedGateway:
    """The managed gateway of a `[gateway]` section; keys are passed as files (`launch_argv`).
    `slots`: the farm's configured running-request slots (`for_farm`), which size what
    smg's priority scheduler holds for users.

    Built once by the agent at start (`service.build_gateway`; a reload refuses [gateway]
    changes): the process runtime runs it and the units render it from that one.
    """
    share = gateway.routing.priority_user_share
    return ManagedGateway(
        user_slots=None if slots is None else scheduler.user_slots(share, slots),
        host=gateway.listen.host,
        port=gateway.listen.port,
        policy=gateway.policy,
        metrics_port=gateway.metrics_listen.port,
        metrics_host=gateway.metrics_listen.host,
        extra_args=tuple(gateway.extra_args),
        routing=gateway.routing,
    )


def for_farm(spec: FarmSpec) -> ManagedGateway:
    """`from_spec` of the farm's `[gateway]`, sized by its workers' `max_running_requests`."""
    runs = [w.flags.get("max_running_requests") for w in spec.workers]
    slots = scheduler.config_slots(n if isinstance(n, int) else None for n in runs)
    return from_spec(spec.gateway, slots=slots)


def launch_argv(
    gateway: ManagedGateway,
    python: str,
    *,
    admin_key_file: str | None = None,
    api_key_file: str | None = None,
) -> list[str]:
    """What runs the managed gateway: this package's key-file launcher under `python`
    (the agent's own, which has smg installed), then smg's `launch` flags. With smg's
    priority scheduler on, the launcher writes its admission config (`gateway.scheduler`)."""
    smg = [python, "-m", "sglang_farm.gateway.launch"]
    r = gateway.routing
    if r is not None and r.priority_scheduler:
        floor = gateway.user_slots
        if floor is None:
            floor = scheduler.user_slots(r.priority_user_share, 0)
        smg += [
            "--scheduler-user-share",
            repr(float(r.priority_user_share)),
            "--scheduler-user-slots",
            str(floor),
        ]
    if api_key_file:
        smg += ["--api-key-file", api_key_file]
    if admin_key_file:
        smg += ["--admin-key-file", admin_key_file]
    return smg_argv(gateway, smg, keyed=bool(admin_key_file or api_key_file))


def smg_stop_timeout(extra_args: Sequence[str]) -> float:
    """How long smg may take to exit after SIGTERM: its propagation window, its shutdown
    grace (`--shutdown-grace-period-secs` in `extra_args`, else smg's default) and a margin."""
    grace = SMG_SHUTDOWN_GRACE_S
    flag = "--shutdown-grace-period-secs"
    for i, arg in enumerate(extra_args):
        value = None
        if arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
        elif arg == flag and i + 1 < len(extra_args):
            value = extra_args[i + 1]
        if value is not None:
            # A bad value: smg itself refuses it at start, with its own message.
            with contextlib.suppress(ValueError):
                grace = max(0.0, float(value))
    return SMG_PROPAGATION_S + grace + GATEWAY_STOP_MARGIN_S
