"""I/O: `sglang-farm run` — builds the agent and everything around it, then runs until told to stop.

Picks the runtime (systemd when it is PID 1, else plain processes), starts the control
socket and the exporter with its pollers, talks sd_notify (READY=1 once the rollout has
begun or the units are adopted, STATUS= "6/8 ready", WATCHDOG=1), and handles signals:
SIGTERM/SIGINT stop, SIGHUP reloads the config.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import structlog

from sglang_farm import __version__
from sglang_farm.agent import Agent
from sglang_farm.collaborators import Collaborators, StatsReaders
from sglang_farm.config import check_spec_file
from sglang_farm.control.farm_api import GpuMemory
from sglang_farm.doctor.cache import DoctorReportCache
from sglang_farm.errors import ConfigError
from sglang_farm.farm_view import FarmView, Rollout
from sglang_farm.gateway.managed import ManagedGateway
from sglang_farm.gateway.rotation import KeyRotation
from sglang_farm.gateway.smg import SmgGateway
from sglang_farm.gpus.snapshot import GpuPoller
from sglang_farm.host.paths import DEFAULT_AGENT_BIN
from sglang_farm.operations import FarmControl
from sglang_farm.runtime import Emit, GatewayRunner, Runtime
from sglang_farm.runtime.batch_child import ChildBatch
from sglang_farm.runtime.notify import keep_start_alive, notify, watchdog_interval
from sglang_farm.sglang.argv import Command
from sglang_farm.sglang.load import RecentAnswers
from sglang_farm.spec import FarmSpec

log = structlog.get_logger("sglang_farm.service")

# systemd: how long a worker's exit waits for its last journal lines (runtime.journal).
SYSTEMD_EXIT_GRACE_S = 2.0


def raise_nofile() -> None:
    """Raise the soft descriptor limit to the hard one (process runtime, issue 22 item 13).

    A login shell hands the agent a soft limit of 1,024; its workers' pipes, probes, the
    exporter and the control socket share it, and the servers' caps are fractions of it
    (`fdbudget`). Under systemd the unit's LimitNOFILE= sets both already.
    """
    import resource

    from sglang_farm.host.fdbudget import nofile_target

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = nofile_target(soft, hard, resource.RLIM_INFINITY)
    if want is None:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (OSError, ValueError) as exc:  # e.g. above fs.nr_open: keep what we have
        log.warning("nofile_not_raised", soft=soft, hard=hard, wanted=want, error=str(exc))
        return
    log.info("nofile_raised", soft=want, was=soft)


def ensure_state_folder(path: str) -> None:
    """Create the state folder if missing; refuse one another user could write (or owns).

    Raises `UntrustedFolder` naming the folder, its owner and mode, and the fix: a state
    folder pre-created by another user let it plant links that root's writes followed
    (issue 22, item 11).
    """
    from sglang_farm.errors import UntrustedFolder
    from sglang_farm.host.securepath import folder_problem, make_folders

    what, key = "the state folder", "[farm] state_dir"
    problem = folder_problem(path, what, key)
    if problem is None:
        make_folders(path)
        problem = folder_problem(path, what, key)  # what is there now, whoever made it
    if problem is not None:
        raise UntrustedFolder(problem)


def systemd_is_pid1() -> bool:
    """sd_booted(): systemd creates /run/systemd/system/ early at boot, and only then."""
    return os.path.isdir("/run/systemd/system")


def choose_runtime(requested: str) -> tuple[str, str]:
    """(runtime, why) for `--runtime auto|process|systemd`."""
    if requested != "auto":
        return requested, "asked for with --runtime"
    if systemd_is_pid1():
        return "systemd", "systemd is PID 1 (/run/systemd/system exists)"
    return "process", "systemd is not running here (/run/systemd/system is missing)"


def runtime_factory(
    kind: str, spec: FarmSpec, config_path: str, gateway: ManagedGateway | None = None
) -> Callable[[Emit], Runtime]:
    """The runtime, with what it differs in given at construction (`gateway`: the managed
    gateway `build_gateway` built, whose unit the systemd runtime renders)."""
    if kind == "systemd":
        from sglang_farm.runtime.systemd import SystemdRuntime

        agent_bin = agent_executable()

        def units(spec: FarmSpec, commands: Mapping[int, Command]) -> Mapping[PurePosixPath, str]:
            from sglang_farm.host.ports import unprivileged_port_start
            from sglang_farm.runtime.units import render

            return render(
                spec,
                config_path=config_path,
                agent_bin=agent_bin,
                python=sys.executable,  # the gateway unit runs the agent's own interpreter
                static=False,
                commands=commands,
                gateway=gateway,
                # Issue 30: a port below it gets its worker or smg CAP_NET_BIND_SERVICE.
                unprivileged_port_start=unprivileged_port_start(),
            )

        return lambda emit: SystemdRuntime(
            emit,
            units=units,
            # The journal may deliver a worker's last lines after D-Bus reported its exit.
            exit_grace=SYSTEMD_EXIT_GRACE_S,
            ready_gate_wait=spec.health.timeout + 2 * spec.startup.poll_interval + 5.0,
        )
    from sglang_farm.runtime.children import RECORDS_SUBDIR, ChildRecords
    from sglang_farm.runtime.process import ProcessRuntime

    records = ChildRecords(Path(spec.farm.state_dir) / RECORDS_SUBDIR)
    return lambda emit: ProcessRuntime(emit, records=records)


def status_line(view: FarmView) -> str:
    ready = view.ready_count
    failed = sum(1 for w in view.workers if w.phase == "failed")
    text = f"{ready}/{len(view.workers)} ready"
    if failed:
        text += f", {failed} failed"
    unrouted = [w.id for w in view.workers if w.ready and not w.in_gateway]
    if view.gateway is not None and unrouted and view.held_out_since is None:
        # Issue 31: ready is not yet what users get.
        text += f", {len(unrouted)} not yet routed by the gateway"
    if view.rollout is Rollout.HALTED and view.rollout_reason:
        text += f"; rollout halted: {view.rollout_reason}"
    return text


def load_config(path: str, gpu_count: int | None, runtime_kind: str) -> FarmSpec:
    """Load and validate the config; its warnings (an older SGLang's spelling of a renamed
    flag, ...) are logged at start and at every reload, never dropped. Under systemd a
    user or group the host lacks is a problem (`accounts`): the units would name it. A
    config another user wrote or can change is refused (`securepath.config_problem`)."""
    from sglang_farm.errors import UntrustedFolder
    from sglang_farm.host.securepath import config_problem

    problem = config_problem(path)
    if problem is not None:
        raise UntrustedFolder(problem)
    result = check_spec_file(path, gpu_count=gpu_count)
    for warning in result.warnings:
        log.warning("config_warning", config=path, warning=warning)
    if runtime_kind == "systemd":
        from sglang_farm.doctor.accounts import host_account_problems

        problems = host_account_problems(result.spec)
        if problems:  # each names its file, as the config's own problems do
            raise ConfigError(path, [f"{path}: {p}" for p in problems])
    return result.spec


async def serve(config_path: str, runtime_kind: str, *, gpu_count: int | None = None) -> int:
    """Run the farm until SIGTERM/SIGINT. Returns the process exit status."""
    kind, why = choose_runtime(runtime_kind)
    spec = load_config(config_path, gpu_count, kind)
    log.info("runtime_chosen", runtime=kind, why=why, config=config_path)
    if kind == "process":
        raise_nofile()  # before anything sizes itself from the limit (control, exporter)
    ensure_state_folder(spec.farm.state_dir)
    from sglang_farm.metrics.pollers import MetricPollers, make_gpu_poller

    poller = make_gpu_poller(spec)
    agent: Agent | None = None
    # The doctor judges what each worker runs: its command at its OOM-ladder step.
    doctor = DoctorReportCache(
        poller, oom_steps=lambda: agent.oom_steps() if agent is not None else {}
    )
    # The preflight may take minutes (a cold `import torch`): systemd's start deadline is
    # extended while it runs, so a slow doctor does not kill the start.
    async with keep_start_alive():
        await doctor.refresh(spec)
    last_status: list[str] = [""]

    def on_status(view: FarmView) -> None:
        text = status_line(view)
        if text != last_status[0]:
            last_status[0] = text
            notify(f"STATUS={text}")

    pollers: MetricPollers | None = None

    def to_pollers(view: FarmView) -> None:
        if pollers is not None:
            pollers.on_view(view)

    def gpu_memory() -> Sequence[GpuMemory]:
        return pollers.gpu_memory() if pollers is not None else ()

    def queue_depths() -> Mapping[int, float]:
        return pollers.queue_depths() if pollers is not None else {}

    def recent_answers() -> Mapping[int, RecentAnswers]:
        return pollers.recent_answers() if pollers is not None else {}

    front = build_gateway(spec, kind)
    batch = build_batch(spec, kind, config_path)  # [batch], process runtime: the agent's child
    collaborators = Collaborators(
        gateway=front.client if front is not None else None,
        more_gateways=front.more if front is not None else (),
        preflight=doctor.blocking,
        refresh_preflight=doctor.refresh,
        compute_caps=doctor.compute_caps,
        observers=(on_status, to_pollers),
        stats=StatsReaders(gpu_memory, queue_depths, recent_answers, doctor.gpu_numa_nodes),
        check_gpu=(lambda gpu: check_gpu(poller, gpu)) if poller is not None else None,
    )
    agent = Agent(
        spec,
        runtime_factory(kind, spec, config_path, front.managed if front is not None else None),
        config_loader=lambda: load_config(config_path, gpu_count, kind),
        collaborators=collaborators,
    )
    ops = FarmControl(agent, collaborators)  # what farmctl and SIGHUP ask of the agent
    pollers = MetricPollers(
        lambda: agent.spec,  # the config in force, a reload's once it applies
        poller,
        agent.view(),
        on_fleet=agent.observe_fleet,
        on_stats=agent.observe_stats,
        guard=agent.key_guard,  # a worker's key goes to its own listener only
    )

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)

    loop.add_signal_handler(signal.SIGHUP, ops.reload_on_signal)

    from sglang_farm.control.server import ControlServer

    control = ControlServer(ops, spec.control.socket, spec.control.group, version=__version__)
    await control.start()  # it says where it listens, and who may connect

    await pollers.start()
    extra: list[asyncio.Task[None]] = []
    interval = watchdog_interval()
    if interval:
        extra.append(asyncio.create_task(_watchdog(interval)))
    try:

        def on_ready() -> None:
            # The agent has rendered its units (the managed gateway's among them under
            # systemd): only now can the gateway be started.
            notify("READY=1", f"STATUS={status_line(agent.view())}")
            if front is not None and front.runner is not None:
                agent.spawn(front.runner.start())
                log.info("gateway_managed", url=front.client.url)
            if batch is not None:
                agent.spawn(batch.start())

        await agent.run(stop, ready=on_ready)
    finally:
        notify("STOPPING=1")
        for t in extra:
            t.cancel()
        if batch is not None:
            await batch.close()  # what it has in flight is sent again at its next start
        await pollers.close()
        await control.close()
        if front is not None:
            if front.rotation is not None:
                await front.rotation.close()
            if front.runner is not None:
                await front.runner.close()  # after the workers: it routed to them until now
            for client in (front.client, *front.more):
                await client.aclose()
    return 0


RELEASE_SLACK_BYTES = 1 << 30  # used memory beyond the driver's reserve that still counts as free


async def check_gpu(poller: GpuPoller, gpu: int) -> list[str]:
    """A fresh NVML read of `gpu`: what keeps it from being released (empty: clear)."""
    from sglang_farm.workers.gpu_health import release_problems

    fleet = await asyncio.to_thread(poller.snapshot)
    return release_problems(fleet, gpu, slack_bytes=RELEASE_SLACK_BYTES)


@dataclass(frozen=True, slots=True)
class FrontDoor:
    """The gateway the farm registers with, and (managed) what runs it."""

    client: SmgGateway
    runner: GatewayRunner | None
    # The managed gateway, built once from [gateway] (None: external); the systemd
    # runtime renders its unit from this one.
    managed: ManagedGateway | None = None
    # Issue 26: the other external gateways of `[gateway] urls` (the first is `client`).
    more: tuple[SmgGateway, ...] = ()
    # Issue 30: managed, what replaces an admin key that may have reached another process.
    rotation: KeyRotation | None = None


def build_gateway(spec: FarmSpec, kind: str) -> FrontDoor | None:
    """The gateway client (and, managed, its runner) for `[gateway]`; None when off."""
    g = spec.gateway
    if not g.enabled:
        return None
    from sglang_farm.gateway.managed import for_farm, launch_argv
    from sglang_farm.gateway.smg import SmgGateway

    runner: GatewayRunner | None = None
    managed: ManagedGateway | None = None
    if g.mode == "managed":
        from sglang_farm.gateway.keys import managed_admin_key

        admin_file, key = managed_admin_key(g, spec.farm.state_dir)
        managed = for_farm(spec)
        url = managed.url
        if kind == "systemd":
            from sglang_farm.runtime.gateway_unit import UnitGateway

            runner = UnitGateway()
        else:
            from sglang_farm.runtime.children import RECORDS_SUBDIR, ChildRecords
            from sglang_farm.runtime.gateway_child import ChildGateway

            argv = launch_argv(
                managed,
                sys.executable,
                admin_key_file=admin_file,
                api_key_file=g.api_key_file,
            )
            state = Path(spec.farm.state_dir)
            runner = ChildGateway(
                argv, state / "gateway.log", records=ChildRecords(state / RECORDS_SUBDIR)
            )
    else:
        assert g.external_urls  # config: external needs url or urls
        url = g.external_urls[0]
        from sglang_farm.gateway.keys import external_key

        key = external_key(g)
    # SGLang's /health can take up to 20 s on a busy worker (docs/reference/sglang.md):
    # smg's own 5 s probe timeout would drop busy workers. The key smg presents to each
    # worker is given with each add, from the config in force (workers.gateway_sync.worker_key).
    health: dict[str, int | bool] = {"timeout_secs": 20}
    guard = None
    rotation = None
    if runner is not None and managed is not None:
        # Issue 30: the admin key goes only to a listener held by the farm's own smg.
        from sglang_farm.gateway.listener import ListenerGuard

        guard = ListenerGuard(url, managed.host, managed.port, runner.pids)
    client = SmgGateway(url, api_key=key, health=health, guard=guard)
    if guard is not None and runner is not None:
        generated = Path(admin_file) if g.admin_key_file is None else None
        rotation = KeyRotation(url, generated, runner, client.set_key)
        guard.on_exposed = rotation.exposed
    # Issue 26: every gateway of [gateway] urls takes the same admin key.
    more = tuple(SmgGateway(u, api_key=key, health=health) for u in g.external_urls[1:])
    return FrontDoor(client, runner, managed, more, rotation)


def build_batch(spec: FarmSpec, kind: str, config_path: str) -> ChildBatch | None:
    """The batch service ([batch] enabled) as the agent's child in the process runtime, its
    key file made at the first start (runtime/batch_child); None otherwise: under systemd it
    is a unit of its own (sglang-farm-batch.service), which the farm's target starts. A key
    file that cannot be made is logged with the fix, and the farm runs without the service."""
    if kind != "process" or not spec.batch.enabled or spec.batch.api_key_file is None:
        return None
    from sglang_farm.runtime.batch_child import LOG_NAME, batch_argv, ensure_key
    from sglang_farm.runtime.children import RECORDS_SUBDIR, ChildRecords

    key = spec.batch.api_key_file
    try:
        if ensure_key(Path(key)):
            log.info("batch_key_created", file=key, hint="farmctl batch reads it; clients send it")
    except OSError as exc:
        log.error(
            "batch_not_started",
            file=key,
            error=exc.strerror or str(exc),
            fix="make [batch] api_key_file a path the agent can create (its folder must exist "
            "or be creatable), or write the key there yourself",
        )
        return None
    state = Path(spec.farm.state_dir)
    return ChildBatch(
        batch_argv(config_path),
        state / LOG_NAME,
        records=ChildRecords(state / RECORDS_SUBDIR),
    )


async def _watchdog(interval: float) -> None:
    """Ping systemd's watchdog from the event loop: a stuck loop stops the pings."""
    while True:
        notify("WATCHDOG=1")
        await asyncio.sleep(interval)


def agent_executable() -> str:
    """The `sglang-farm` of this installation (the units' readiness gate runs it).

    The one beside our interpreter first (a virtualenv, the package's private venv),
    then PATH, then the packaged path.
    """
    sibling = Path(sys.executable).parent / "sglang-farm"
    if sibling.is_file() and os.access(sibling, os.X_OK):
        return str(sibling)
    return shutil.which("sglang-farm") or DEFAULT_AGENT_BIN
