"""Pure: the systemd units of a farm, rendered from its `FarmSpec` and what each worker
runs (`worker_commands`): `render(spec, commands=...)` -> `{relative path: text}`.

The static units shipped in the package, one drop-in per worker, the agent's drop-in
when the install or the config needs one, and the managed gateway's unit: docs/units.md
says what each holds and why. The syntax is `unit_syntax`'s, the secret files are
`unit_secrets`', and `runtime.unit_files` writes them all.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from importlib import resources
from pathlib import PurePosixPath
from urllib.parse import urlsplit

from sglang_farm.gateway.managed import (
    GATEWAY_STOP_MARGIN_S,
    SMG_PROPAGATION_S,
    ManagedGateway,
    admin_key_path,
    for_farm,
    launch_argv,
    smg_stop_timeout,
)
from sglang_farm.host.paths import DEFAULT_AGENT_BIN, DEFAULT_CONFIG_PATH
from sglang_farm.runtime.unit_secrets import env_file_path, key_file_path
from sglang_farm.runtime.unit_syntax import (
    GATEWAY_UNIT,
    HEADER_PREFIX,
    comment_text,
    credential_line,
    environment_line,
    exec_line,
    setting_text,
    time_span,
    worker_unit,
)
from sglang_farm.sglang.argv import API_KEY_CREDENTIAL as WORKER_KEY_CREDENTIAL
from sglang_farm.sglang.argv import Command, build_command
from sglang_farm.sglang.ready_route import readiness_routes
from sglang_farm.spec import FarmSpec, WorkerSpec, gpu_label

DROPIN_NAME = "50-farm.conf"
# The batch service's unit (issue 33) is static too: it reads [batch] itself.
STATIC_UNITS = (
    "sglang@.service",
    "sglang-farm.service",
    "sglang-farm.target",
    "sglang-farm-batch.service",
)
# Whole units the renderer writes (not drop-ins): `write_units` removes a stale one
# that carries our header, e.g. the gateway's after [gateway] was switched off.
GENERATED_UNITS = (GATEWAY_UNIT,)
# The interpreter of the package's private venv: the packaged /usr/bin/sglang-farm is a
# wrapper around it (packaging/bin/sglang-farm), and it carries smg (the gateway extra).
PACKAGED_PYTHON = "/usr/lib/sglang-farm/venv/bin/python3"
# The names the gateway's keys get under $CREDENTIALS_DIRECTORY (`%d` in the unit).
ADMIN_KEY_CREDENTIAL = "admin-key"
API_KEY_CREDENTIAL = "api-key"
# SupplementaryGroups= of the shipped sglang-farm.service (the package creates both):
# the control socket's default group and the workers' default group.
SHIPPED_AGENT_GROUPS = ("sglang-farm", "sglang")
# The agent's ExecStart= in the shipped sglang-farm.service, minus the binary.
_AGENT_ARGS = ("run", "--runtime", "systemd")


def dropin_path(worker_id: int) -> PurePosixPath:
    """Where a worker's rendered drop-in lives, relative to the unit directory."""
    return PurePosixPath(f"{worker_unit(worker_id)}.d") / DROPIN_NAME


def _listen_text(worker: WorkerSpec) -> str:
    """Where the worker listens (its `--host`), and the URL the farm probes when that
    differs (a wildcard host is probed on loopback): what the drop-in's comment says."""
    host = f"[{worker.host}]" if ":" in worker.host else worker.host
    listen = f"listening on {host}:{worker.port}"
    probed = worker.base_url
    if probed.split("://", 1)[-1] == f"{host}:{worker.port}":
        return listen
    return f"{listen}, probed at {probed}"


def _header(config_path: str) -> list[str]:
    return [
        f"{HEADER_PREFIX} from {comment_text(config_path)}, do not edit.",
        "# Change the config instead; the agent renders this again on start and reload",
        "# (or run `sglang-farm render`).",
    ]


def _number(value: float, setting: str) -> str:
    """A number of seconds as a command-line word that reads back exactly."""
    time_span(value, setting)  # NaN or negative: refused with the setting named
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def gate_argv(spec: FarmSpec, worker: WorkerSpec, python: str) -> list[str]:
    """The readiness gate's argv, up to `--main-pid` (which systemd fills in).

    `python -I -m sglang_farm.cli.main wait-ready --url URL [--url URL] --timeout S
    --probe-timeout S --interval S`: the readiness routes (`sglang/ready_route`, in order)
    and timeouts as the agent's loaded config has them.
    """
    urls: list[str] = []
    for route in readiness_routes(spec.health.ready_path, spec.health.path):
        urls += ["--url", worker.base_url + route]
    return [
        python,
        "-I",
        "-m",
        "sglang_farm.cli.main",
        "wait-ready",
        *urls,
        "--timeout",
        _number(spec.startup.load_timeout, "[startup] load_timeout"),
        "--probe-timeout",
        _number(spec.health.timeout, "[health] timeout"),
        "--interval",
        _number(spec.startup.poll_interval, "[startup] poll_interval"),
    ]


def render_worker_dropin(
    spec: FarmSpec,
    worker: WorkerSpec,
    *,
    agent_bin: str = DEFAULT_AGENT_BIN,
    config_path: str = DEFAULT_CONFIG_PATH,
    command: Command | None = None,
    python: str | None = None,
    unprivileged_port_start: int | None = None,
) -> str:
    """The text of one worker's `50-farm.conf`, running `command` (`worker_commands`;
    default: the worker's configured flags as they are).

    `python` runs the readiness gate (default: `gateway_python(agent_bin)`).
    `unprivileged_port_start`: the host's `net.ipv4.ip_unprivileged_port_start`; a
    worker user other than root is given CAP_NET_BIND_SERVICE (and no other capability)
    when one of its ports is below it (issue 30: ports no other user can bind).
    """
    cmd = command if command is not None else build_command(spec.farm, worker)
    python = python or gateway_python(agent_bin)
    gpus = gpu_label(worker.gpus)
    gpu_word = "GPU" if len(worker.gpus) == 1 else "GPUs"
    lines = [
        *_header(config_path),
        comment_text(f"# Worker {worker.id}: {gpu_word} {gpus}, {_listen_text(worker)}")
        + f" (NCCL port {worker.nccl_port}).",
        "",
        "[Unit]",
        f"Description=SGLang worker {worker.id} ({gpu_word} {gpus}, port {worker.port})",
        "",
        "[Service]",
        f"User={setting_text(spec.farm.user, '[farm] user')}",
        f"Group={setting_text(spec.farm.group, '[farm] group')}",
    ]
    # The config's own variables ([farm] env, a worker's env) may be tokens: they go to a
    # root-only file (`render_secrets`), never into this world-readable drop-in. Only the
    # variables the farm itself sets are written here.
    # The names come from the command (`Command.public_env`), not from `spec`: during a
    # canary analysis a baseline worker runs the accepted config's command (issue 23, B7).
    private = [k for k, _ in cmd.private_env]
    lines += [f"Environment={environment_line(k, v)}" for k, v in cmd.env if k in cmd.public_env]
    if private:
        lines += [
            "# The config's environment (" + comment_text(", ".join(private)) + "): its values",
            "# are in a file only root can read, which systemd reads at each start.",
            "EnvironmentFile="
            + setting_text(str(env_file_path(spec, worker.id)), "[farm] state_dir"),
        ]
    low = sorted(
        p
        for p in (worker.port, worker.nccl_port)
        if unprivileged_port_start is not None and p < unprivileged_port_start
    )
    if low and spec.farm.user != "root":
        lines += [
            f"# Port {', '.join(map(str, low))} is below this host's"
            f" net.ipv4.ip_unprivileged_port_start ({unprivileged_port_start}):",
            "# no other user can bind it, and the worker needs this one capability to.",
            "CapabilityBoundingSet=CAP_NET_BIND_SERVICE",
            "AmbientCapabilities=CAP_NET_BIND_SERVICE",
        ]
    if cmd.api_key is not None:
        lines += [
            "# The API key: systemd (as root) copies the root-only key file into the worker's",
            "# credentials directory, readable by its user alone; the launcher in ExecStart=",
            "# reads it there and hands it to SGLang, so no command line shows it.",
            "LoadCredential="
            + credential_line(WORKER_KEY_CREDENTIAL, str(key_file_path(spec, worker.id))),
        ]
    lines += [
        "# SGLang binds its port only after weights, KV pool and CUDA graphs: the",
        "# start deadline is [startup] load_timeout.",
        f"TimeoutStartSec={time_span(spec.startup.load_timeout, '[startup] load_timeout')}",
        "# SGLang's SIGTERM drain has no bound: SIGKILL after [restart] stop_timeout.",
        f"TimeoutStopSec={time_span(spec.restart.stop_timeout, '[restart] stop_timeout')}",
        "ExecStart=",
        f"ExecStart={exec_line(cmd.argv, wrap=True)}",
        "# Readiness gate: the unit stays `activating` until the worker's /health",
        "# answers, then turns `active`; it fails when the start deadline passes, or at",
        "# once when the main process dies (systemd 252 would wait for the gate).",
        "# Everything it needs is on its command line (it never reads the config, which",
        "# may be mid-edit), and Python runs isolated (-I): no PYTHON* variable or",
        "# working folder changes what it imports.",
        "ExecStartPost=" + exec_line(gate_argv(spec, worker, python)) + " --main-pid $MAINPID %i",
        "",
    ]
    return "\n".join(lines)


def _ip_allowed(host: str, *, wildcard: str | None) -> str | None:
    """The IPAddressAllow= entry the agent needs to reach (or be reached at) `host`:
    None for loopback, the address for an IP literal, `any` for a host name (resolved at
    run time, through a DNS server that may be anywhere) and `wildcard` for 0.0.0.0/::."""
    host = host.strip("[]")
    if host in ("", "0.0.0.0", "::"):
        return wildcard
    if host == "localhost":
        return None
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return "any"
    return None if addr.is_loopback else str(addr)


def agent_ip_allow(spec: FarmSpec) -> tuple[str, ...]:
    """What the agent's IPAddressAllow= needs beyond the shipped `localhost`, sorted.

    The agent probes and polls each worker at its base URL (a wildcard host on loopback),
    serves /metrics at `[metrics] listen` (scrapers on a real address may be anywhere:
    `any`), and calls the gateway: a managed one at its listen address (a wildcard on
    loopback), an external one at its URL's host. IPAddressAllow= matches the peer's
    address of each packet, so every entry is an address the agent talks to; `any`
    alone when one of them cannot be listed.
    """
    wanted: set[str | None] = {_ip_allowed(w.host, wildcard=None) for w in spec.workers}
    wanted.add(None if _ip_allowed(spec.metrics.listen.host, wildcard="any") is None else "any")
    g = spec.gateway
    if g.mode == "managed":
        wanted.add(_ip_allowed(g.listen.host, wildcard=None))
    for url in g.external_urls:  # issue 26: every gateway of [gateway] urls
        wanted.add(_ip_allowed(urlsplit(url).hostname or "", wildcard="any"))
    found = {entry for entry in wanted if entry is not None}
    if "any" in found:
        return ("any",)
    return tuple(sorted(found, key=lambda a: (ipaddress.ip_address(a).version, a)))


def agent_groups(spec: FarmSpec) -> tuple[str, ...]:
    """The agent's supplementary groups for this config: the control socket's group (it
    hands the socket over without CAP_CHOWN) and the workers' group (it reads their
    files without CAP_DAC_READ_SEARCH); root, the agent's own group, needs no entry."""
    groups = [spec.control.group, spec.farm.group]
    return tuple(dict.fromkeys(g for g in groups if g != "root"))


def _needs_agent_dropin(spec: FarmSpec, agent_bin: str, config_path: str) -> bool:
    return (
        agent_bin != DEFAULT_AGENT_BIN
        or config_path != DEFAULT_CONFIG_PATH
        or agent_groups(spec) != SHIPPED_AGENT_GROUPS
        or bool(agent_ip_allow(spec))
    )


def render_agent_dropin(*, agent_bin: str, config_path: str, spec: FarmSpec | None = None) -> str:
    """`sglang-farm.service.d/50-farm.conf`: what the shipped agent unit cannot know.

    The agent's own binary and config path when they are not the packaged ones; with
    `spec`, its supplementary groups (`agent_groups`) and the IP addresses it talks to
    beyond loopback (`agent_ip_allow`). Without `spec` (a development install set up
    before any config is read) the package's groups are reset: they may not exist
    there, and the agent's own group (root) then owns the control socket.
    Raises ValueError for a group name with a control character.
    """
    lines = [*_header(config_path), "", "[Service]"]
    if agent_bin != DEFAULT_AGENT_BIN or config_path != DEFAULT_CONFIG_PATH:
        argv = [agent_bin, *_AGENT_ARGS]
        if config_path != DEFAULT_CONFIG_PATH:
            argv += ["--config", config_path]
        lines += ["ExecStart=", f"ExecStart={exec_line(argv)}"]
    groups = agent_groups(spec) if spec is not None else ()
    if spec is None or groups != SHIPPED_AGENT_GROUPS:
        lines += [
            "# The config's groups in place of the package's: the control socket's and the",
            "# workers' (the agent has no CAP_CHOWN or CAP_DAC_READ_SEARCH).",
            "SupplementaryGroups=",
        ]
        if groups:
            names = [setting_text(g, "[control] group / [farm] group") for g in groups]
            lines.append("SupplementaryGroups=" + " ".join(names))
    allow = agent_ip_allow(spec) if spec is not None else ()
    if allow:
        lines += [
            "# Beyond loopback (the shipped IPAddressAllow=localhost): the addresses this",
            "# config's workers, exporter and gateway are reached or scraped at.",
            "IPAddressAllow=" + " ".join(allow),
        ]
    return "\n".join([*lines, ""])


def gateway_python(agent_bin: str) -> str:
    """The agent's interpreter: it runs the readiness gate and the managed gateway (which
    needs smg installed beside the farm).

    The packaged agent's is the private venv's (`PACKAGED_PYTHON`); any other agent
    binary is a virtualenv's console script, whose interpreter sits beside it.
    """
    if agent_bin == DEFAULT_AGENT_BIN:
        return PACKAGED_PYTHON
    return str(PurePosixPath(agent_bin).parent / "python3")


def gateway_argv(
    spec: FarmSpec, python: str, gateway: ManagedGateway | None = None
) -> tuple[list[str], list[int]]:
    """The managed gateway's argv, and the indexes of its `%d/...` key-file words.

    `python -I -m sglang_farm.gateway.launch [--api-key-file %d/api-key]
    --admin-key-file %d/admin-key launch FLAGS...`: `-I` (isolated) so that no
    environment variable or working directory changes what the gateway imports. The
    admin key is always there (`managed.admin_key_path`: the configured file, else the
    one the agent generates in the state directory). `gateway`: the agent's, built at
    its start (default: built here from `spec.gateway`).
    Raises ValueError when `gateway.managed` refuses the config.
    """
    g = spec.gateway
    admin = f"%d/{ADMIN_KEY_CREDENTIAL}"
    api = f"%d/{API_KEY_CREDENTIAL}" if g.api_key_file else None
    managed = gateway or for_farm(spec)
    argv = launch_argv(managed, python, admin_key_file=admin, api_key_file=api)
    argv.insert(1, "-I")
    # Only the launcher's own options (before smg's `launch`) are key files.
    head = argv.index("launch")
    marks = [i for i, arg in enumerate(argv[:head]) if arg in (admin, api)]
    return argv, marks


def _gateway_low_ports(ports: tuple[int, int], start: int | None) -> list[int]:
    return sorted(p for p in ports if start is not None and p < start)


def _gateway_identity(listen: int, metrics: int, start: int | None) -> list[str]:
    low = _gateway_low_ports((listen, metrics), start)
    if not low:
        return [
            "# A user of its own, allocated at start and gone at stop; no capabilities at all.",
            "DynamicUser=yes",
            "CapabilityBoundingSet=",
        ]
    return [
        "# A user of its own, allocated at start and gone at stop. Port"
        f" {', '.join(map(str, low))} is below this",
        f"# host's net.ipv4.ip_unprivileged_port_start ({start}): no other user can bind it,",
        "# and smg needs this one capability to (issue 30).",
        "DynamicUser=yes",
        "CapabilityBoundingSet=CAP_NET_BIND_SERVICE",
        "AmbientCapabilities=CAP_NET_BIND_SERVICE",
    ]


def _gateway_userns(listen: int, metrics: int, start: int | None) -> list[str]:
    if _gateway_low_ports((listen, metrics), start):
        return [
            "# No user namespace of its own: a capability held there does not count for the",
            "# host's network namespace, so smg could not bind its privileged port.",
            "PrivateUsers=no",
        ]
    return [
        "# A user namespace where only root and its own user exist; it may create no",
        "# namespaces or mounts itself.",
        "PrivateUsers=yes",
    ]


def render_gateway_unit(
    spec: FarmSpec,
    *,
    python: str,
    config_path: str = DEFAULT_CONFIG_PATH,
    gateway: ManagedGateway | None = None,
    unprivileged_port_start: int | None = None,
) -> str:
    """The text of `sglang-farm-gateway.service`, the managed gateway (smg).

    A port below `unprivileged_port_start` (the host's sysctl) gives smg
    CAP_NET_BIND_SERVICE and no user namespace of its own (issue 30).

    Raises ValueError when the gateway's command line cannot be built or written
    (`gateway.managed` refuses the config, or a path systemd cannot run).
    """
    g = spec.gateway
    # First: a control character in the listen address is the clearest message.
    listen = setting_text(str(g.listen), "[gateway] listen")
    argv, marks = gateway_argv(spec, python, gateway)
    stop = smg_stop_timeout(g.extra_args)
    lines = [
        *_header(config_path),
        f'# The managed gateway ([gateway] mode = "managed"): SGLang\'s gateway, smg, at'
        f" {comment_text(str(g.listen))},",
        "# policy " + comment_text(g.policy) + ". The agent starts this unit and adds each"
        " READY worker",
        "# through smg's worker API, and takes it out before any planned stop",
        "# (docs/gateway.md).",
        "# Its keys come from LoadCredential=, never from this file.",
        "",
        "[Unit]",
        f"Description=sglang-farm gateway (smg at {listen})",
        "Documentation=man:sglang-farm(8) man:farm.toml(5)",
        "# Stopping or restarting sglang-farm.target stops or restarts the gateway with the",
        "# farm. Nothing Wants= it: the agent (which the target wants) starts it each time",
        "# the agent starts, after rendering this file from the current config (after a",
        "# boot it does not exist until then). Restarting the agent leaves it running.",
        "PartOf=sglang-farm.target",
        "# Ordering only: a gateway listening on a real address binds it once the network is up.",
        "After=network-online.target",
        "",
        "[Service]",
        "# Started once exec() succeeded: smg answers about 0.2 s later, and the agent",
        "# waits for its worker API (GET /workers) before adding workers.",
        "Type=exec",
        f"ExecStart={exec_line(argv, wrap=True, specifiers=marks)}",
    ]
    lines += [
        "# The keys: systemd (as root) copies each root-only file into this service's",
        "# credentials directory (%d), readable by its user alone; the launcher reads",
        "# them there, so no command line, `systemctl show` or `systemctl cat` shows one.",
    ]
    if g.admin_key_file is None:
        lines += [
            "# The admin key (smg's --control-plane-api-keys: without one, smg's worker API",
            "# /workers is open to every local user) was generated by the agent at its",
            "# first start, as [gateway] admin_key_file is not set.",
        ]
    admin_file = admin_key_path(g.admin_key_file, spec.farm.state_dir)
    lines.append(f"LoadCredential={credential_line(ADMIN_KEY_CREDENTIAL, admin_file)}")
    if g.api_key_file:
        lines.append(f"LoadCredential={credential_line(API_KEY_CREDENTIAL, g.api_key_file)}")
    lines += [
        "# The journal names it, whatever smg renames its process to (smg::router).",
        "SyslogIdentifier=sglang-farm-gateway",
        "# A crash comes back 5 s later; a stop on purpose does not. 5 s apart, the restarts",
        "# stay under systemd's start limit (5 in 10 s), so a failing gateway is retried",
        "# for as long as it fails (its journal says why) instead of given up on.",
        "Restart=on-failure",
        "RestartSec=5",
        f"# smg keeps listening {SMG_PROPAGATION_S:g} s after SIGTERM, then waits up to its"
        f" shutdown grace ({stop - SMG_PROPAGATION_S - GATEWAY_STOP_MARGIN_S:g} s)",
        f"# for requests in flight; SIGKILL only after both, plus {GATEWAY_STOP_MARGIN_S:g} s.",
        f"TimeoutStopSec={time_span(stop, '[gateway] extra_args --shutdown-grace-period-secs')}",
        "",
        "# --- Hardening: smg needs no privilege. It listens on TCP (clients, /metrics),",
        "# connects to the workers over TCP, reads its keys from the credentials directory,",
        "# and writes only to stdout (the journal).",
        *_gateway_identity(g.listen.port, g.metrics_listen.port, unprivileged_port_start),
        "NoNewPrivileges=yes",
        "# Nothing writable: the file system is read-only to it, /tmp its own.",
        "ProtectSystem=strict",
        "PrivateTmp=yes",
        "# Read-only rather than hidden: a development install's interpreter may live under",
        "# /root or /home (pyenv); the dynamic user reads only what is world-readable there.",
        "ProtectHome=read-only",
        "# No devices (it needs no GPU), no kernel or cgroup settings, no clock, no hostname.",
        "PrivateDevices=yes",
        "ProtectKernelTunables=yes",
        "ProtectKernelModules=yes",
        "ProtectKernelLogs=yes",
        "ProtectControlGroups=yes",
        "ProtectClock=yes",
        "ProtectHostname=yes",
        "# Other processes are invisible in /proc, and only process entries are there.",
        "ProtectProc=invisible",
        "ProcSubset=pid",
        *_gateway_userns(g.listen.port, g.metrics_listen.port, unprivileged_port_start),
        "RestrictNamespaces=yes",
        "PrivateMounts=yes",
        "RestrictRealtime=yes",
        "RestrictSUIDSGID=yes",
        "LockPersonality=yes",
        "# inet/inet6: clients, /metrics and the workers; unix: the journal, and user",
        "# lookups through nss-systemd (where the dynamic user exists). No PrivateNetwork=",
        "# or IPAddressDeny=: clients and workers may be on other hosts.",
        "RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX",
        "SystemCallArchitectures=native",
        "# A Python launcher and smg's Rust router (tokio): an ordinary service's syscalls;",
        "# no privileged ones, no CPU affinity, priorities or resource limits.",
        "SystemCallFilter=@system-service",
        "SystemCallFilter=~@privileged @resources",
        "SystemCallErrorNumber=EPERM",
        "# Neither CPython without a JIT nor the Rust binary needs writable+executable memory.",
        "MemoryDenyWriteExecute=yes",
        "UMask=0077",
        "",
    ]
    return "\n".join(lines)


def static_unit(name: str) -> str:
    """The text of a shipped unit (package data, read through importlib.resources)."""
    if name not in STATIC_UNITS:
        raise KeyError(name)
    return resources.files("sglang_farm").joinpath("units", name).read_text(encoding="utf-8")


def render(
    spec: FarmSpec,
    *,
    agent_bin: str = DEFAULT_AGENT_BIN,
    config_path: str = DEFAULT_CONFIG_PATH,
    commands: Mapping[int, Command] | None = None,
    static: bool = True,
    python: str | None = None,
    gateway: ManagedGateway | None = None,
    unprivileged_port_start: int | None = None,
) -> dict[PurePosixPath, str]:
    """Every unit file of the farm, by path relative to a unit directory.

    `commands` is what the workers it names run (`worker_commands`: the OOM ladder's
    step applied); any other worker runs its configured flags as they are.
    `static=False` leaves out the shipped units (the agent installs only drop-ins
    and the gateway unit; the package ships the units themselves). `python` is the
    agent's interpreter, which runs the managed gateway and the workers' readiness gate
    (default: `gateway_python(agent_bin)`). `gateway` is the managed gateway the agent
    built at its start (default: built from `spec.gateway`). `unprivileged_port_start`:
    the host's `net.ipv4.ip_unprivileged_port_start` (None: not known), below which a
    worker or smg is given CAP_NET_BIND_SERVICE for its port.
    Reading the shipped units is the only file access, and they are package data.
    Raises ValueError for a gateway or a worker command line systemd cannot run, or a
    value that would break a unit file (a control character, a NaN or negative time).
    """
    files: dict[PurePosixPath, str] = {}
    if static:
        for name in STATIC_UNITS:
            files[PurePosixPath(name)] = static_unit(name)
    if spec.gateway.mode == "managed":
        files[PurePosixPath(GATEWAY_UNIT)] = render_gateway_unit(
            spec,
            python=python or gateway_python(agent_bin),
            config_path=config_path,
            gateway=gateway,
            unprivileged_port_start=unprivileged_port_start,
        )
    if _needs_agent_dropin(spec, agent_bin, config_path):
        path = PurePosixPath("sglang-farm.service.d") / DROPIN_NAME
        files[path] = render_agent_dropin(agent_bin=agent_bin, config_path=config_path, spec=spec)
    runs = commands or {}
    for worker in spec.workers:
        files[dropin_path(worker.id)] = render_worker_dropin(
            spec,
            worker,
            agent_bin=agent_bin,
            config_path=config_path,
            command=runs.get(worker.id),
            python=python,
            unprivileged_port_start=unprivileged_port_start,
        )
    return dict(sorted(files.items()))
