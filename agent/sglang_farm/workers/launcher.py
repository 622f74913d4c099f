"""I/O: carrying out the supervisor's `Launch`: the gate a worker passes before it starts.

In order: the doctor's blocking checks for this worker, a free port (SGLang binds its
port only after a full model load, so a clash found then costs minutes), the runtime's
preparation (systemd: the drop-in with the current flags), then the start. The
supervisor may change its mind while this awaits (an operator's stop or restart): the
launch is then abandoned, or what it started is stopped again. A launch that cannot
happen is reported as the worker's exit with the failure that explains it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from sglang_farm.host.listeners import OwnerKind, connect_host
from sglang_farm.host.portowner import PortOwner
from sglang_farm.host.ports import PortState
from sglang_farm.runtime import Runtime
from sglang_farm.sglang.argv import Command
from sglang_farm.sglang.failures import Failure, FailureKind, port_taken
from sglang_farm.spec import FarmSpec
from sglang_farm.workers.events import Event, FailureSeen, ProcessExited
from sglang_farm.workers.phase import Phase
from sglang_farm.workers.records import WorkerState

PORT_FREE_WAIT_S = 30.0  # SGLang's SIGKILL "only queues the teardown": ports free within seconds
PORT_POLL_S = 0.2  # the kernel offers no event for "a port became free"
# A port still held this long into the wait is named (`port_taken`, in `why`) while the
# launch goes on waiting: a squatter is shown at once, a slow teardown is not blamed.
PORT_NAMED_AFTER_S = 5.0

Preflight = Callable[[FarmSpec, int], list[Failure]]


class Launcher:
    """Carries out launches. What it needs of the agent, each a call-back: `state` (the
    supervisor's view of the worker: is this launch still wanted?), `feed` (report what
    became of it), `plan` (the config in force and the worker's command line, read when
    the launch begins) and `prepare` (the runtime's preparation for that config, with every
    worker's flags as they are now; systemd: the drop-ins)."""

    def __init__(
        self,
        runtime: Runtime,
        *,
        state: Callable[[int], WorkerState | None],
        feed: Callable[[int, Event], None],
        plan: Callable[[int], tuple[FarmSpec, Command]],
        prepare: Callable[[FarmSpec], Awaitable[object]],
        clock: Callable[[], float],
        preflight: Preflight | None = None,
        port_state: Callable[[str, int], PortState],
        log_for: Callable[[int], structlog.typing.FilteringBoundLogger],
        port_owner: PortOwner | None = None,
    ) -> None:
        self._runtime = runtime
        self._state = state
        self._feed = feed
        self._plan = plan
        self._prepare = prepare
        self._clock = clock
        self._preflight = preflight
        self._port_state = port_state
        self._log_for = log_for
        self._port_owner = port_owner

    async def _busy(self, worker: int, host: str, port: int) -> Failure:
        """Why the port cannot be bound: `port_taken` naming the process that holds it when
        it can be found (`portowner`), else `port_in_use`."""
        if self._port_owner is not None:

            async def none_of_ours() -> frozenset[int]:
                return frozenset()  # not launched: no process of the worker exists

            own = await self._port_owner.check(connect_host(host), port, none_of_ours, fresh=True)
            if own.kind in (OwnerKind.FOREIGN, OwnerKind.UNSEEN):
                return port_taken(port, own.holder(), worker, launched=False)
        return Failure(
            FailureKind.PORT_IN_USE,
            f"port {port} on {host} is in use by another process; not started",
            f"find the owner with `ss -ltnp 'sport = :{port}'` and stop it, "
            f"or give worker {worker} another port in the config",
        )

    async def _name_holder(self, worker: int, host: str, port: int, begun: float) -> bool:
        """Issue 30, item 12: while the launch waits for a held port, `why` said "no failure
        recorded". Past PORT_NAMED_AFTER_S the holder is recorded as the worker's failure
        (`port_taken`, the worker still unstarted); True once named."""
        if self._clock() - begun < PORT_NAMED_AFTER_S:
            return False
        failure = await self._busy(worker, host, port)
        if failure.kind is not FailureKind.PORT_TAKEN:
            return False  # no holder found (yet): nothing to name
        self._log_for(worker).warning(
            "worker_port_held",
            port=port,
            summary=failure.summary,
            waiting_s=round(PORT_FREE_WAIT_S - (self._clock() - begun), 1),
        )
        s = self._state(worker)
        if s is not None and s.phase is Phase.STARTING:
            self._feed(worker, FailureSeen(failure))
        return True

    async def launch(self, worker: int) -> None:
        first = self._state(worker)
        launched = first.launched_at if first is not None else None
        blog = self._log_for(worker)

        def still_wanted() -> bool:
            s = self._state(worker)
            return s is not None and s.phase is Phase.STARTING and s.launched_at == launched

        def abandon(failure: Failure | None) -> None:
            # The stop (or this failure) finds no process: report the "exit" ourselves.
            self._feed(worker, ProcessExited(None, failure))

        try:
            spec, cmd = self._plan(worker)
            w = spec.worker(worker)
            blocking = self._preflight(spec, worker) if self._preflight is not None else []
            if blocking:
                blog.error("worker_preflight_failed", problems=[f.summary for f in blocking])
                abandon(blocking[0])
                return
            begun = self._clock()
            deadline = begun + PORT_FREE_WAIT_S
            named = False
            state = self._port_state(w.host, w.port)
            while state is not PortState.FREE and self._clock() < deadline:
                await asyncio.sleep(PORT_POLL_S)
                if not still_wanted():
                    abandon(None)
                    return
                state = self._port_state(w.host, w.port)
                if state is PortState.IN_USE and not named:
                    named = await self._name_holder(worker, w.host, w.port, begun)
            if state is PortState.UNKNOWN:
                # The agent could not test the port (its own trouble, e.g. out of fds): not
                # the worker's failure. Launch; SGLang itself reports a port in use.
                blog.warning("worker_port_unchecked", port=w.port)
            elif state is PortState.IN_USE:
                failure = await self._busy(worker, w.host, w.port)
                blog.error("worker_port_busy", port=w.port, summary=failure.summary)
                abandon(failure)
                return
            blog.info("worker_launching", port=w.port, argv=list(cmd.argv))
            await self._prepare(spec)
            if not still_wanted():
                abandon(None)
                return
            await self._runtime.start(worker, cmd)
            s = self._state(worker)
            if s is not None and s.phase is Phase.STOPPING:
                # Stopped while starting: the Terminate found nothing yet; stop it now.
                await self._runtime.stop(worker, spec.restart.stop_timeout)
        except Exception as exc:  # task root: any launch error becomes this worker's failure
            blog.error("worker_launch_failed", error=str(exc))
            abandon(
                Failure(
                    FailureKind.CRASH,
                    f"could not be started: {exc}",
                    "check farm.python in the config and the runtime's log",
                )
            )
