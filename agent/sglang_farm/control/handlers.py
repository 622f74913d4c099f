"""I/O: what each control command does, against the agent's `FarmOps`.

One handler per `Command`, in an explicit table. A handler takes a decoded
`Request` and a `Channel` (the connection, bound to that request) and returns
the final reply's `result`; it sends stream messages through the channel
(`logs` with `follow`, `wait-ready`). It raises `RequestError` for a reply with
an error code (`unknown_worker`, `busy`), lets the agent's `FarmError`s through
(the server answers `failed`), and `ClientGone` when the client left.

State changes are serialized per worker: a second change of a worker that is
already changing is answered `busy` at once, never queued (a queued restart runs
after the operator has moved on). Reloads are serialized the same way. Until the
agent has restored its state and adopted its running workers
(`FarmOps.startup_pending`), every state change is answered `busy` with the
agent's reason; read-only commands are served throughout. `release-gpu` is a
state change of every worker on that GPU (by worker: of that worker).

A quarantined worker is started only by a release: `start N`/`restart N` of one is
refused (`failed`) with the release command in the message, never answered as if
it had started; `start all`/`restart all` act on the others and list it apart.

Handlers read the agent only through `FarmOps`: `view()`, `gpu_memory()` and
`queue_depths()` never block, so no handler calls a worker, NVML or systemd.
Who may call them is `auth`; the bytes on the wire are `codec`; the content
of results is `results`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Final, Protocol

import structlog

from sglang_farm.config.load import text_digest
from sglang_farm.control import prose, results, settled
from sglang_farm.control.codec import (
    Command,
    DrainHostArgs,
    ErrorCode,
    GpuArgs,
    LogsArgs,
    ReleaseWorkerArgs,
    Request,
    RequestError,
    RequestId,
    StopArgs,
    TargetArgs,
    WaitArgs,
    WorkerArgs,
)
from sglang_farm.control.farm_api import FarmOps
from sglang_farm.control.results import Result
from sglang_farm.farm_view import FarmView, Phase, WorkerView

log = structlog.get_logger("sglang_farm.control")

# How often `wait-ready` looks at the view for a new phase: view() is a pointer read.
WAIT_POLL: Final = 0.1


class ClientGone(Exception):
    """The client went away or stopped reading; end its connection quietly."""


class Channel(Protocol):
    """The connection a request came on, as its handler sees it."""

    async def stream(self, kind: str, payload: Mapping[str, object]) -> None:
        """Send one stream message for this request. Raises `ClientGone`."""
        ...

    async def hangup(self) -> None:
        """Return once the client closes its side or sends anything more."""
        ...


Handler = Callable[[Request, Channel], Awaitable[Result]]


class Handlers:
    """The command table. `wall_clock` (epoch seconds) stamps `status` and `issued_at`."""

    def __init__(
        self,
        ops: FarmOps,
        *,
        version: str,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._ops = ops
        self._version = version
        self._wall_clock = wall_clock
        self._worker_locks: dict[int, asyncio.Lock] = {}
        self._reload_lock = asyncio.Lock()
        self._host_lock = asyncio.Lock()  # drain-host / undrain-host: one at a time
        self._config_file = _FileDigest()  # `status`: the config file on disk, hashed on change
        self.table: Mapping[Command, Handler] = {
            Command.STATUS: self._status,
            Command.VERSION: self._version_cmd,
            Command.ENDPOINTS: self._endpoints,
            Command.WHY: self._why,
            Command.LOGS: self._logs,
            Command.WAIT_READY: self._wait_ready,
            Command.START: self._start,
            Command.STOP: self._stop,
            Command.RESTART: self._restart,
            Command.RESET_OOM: self._reset_oom,
            Command.RELOAD: self._reload,
            Command.RELEASE_GPU: self._release_gpu,
            Command.SETTLED: self._settled,
            Command.DRAIN_HOST: self._drain_host,
            Command.UNDRAIN_HOST: self._undrain_host,
        }

    async def handle(self, req: Request, channel: Channel) -> Result:
        """Run `req`; return the final reply's result. Raises as the module docstring says."""
        if req.changes_state:
            self._refuse_during_startup(req)
        return await self.table[req.cmd](req, channel)

    def _refuse_during_startup(self, req: Request) -> None:
        # Asked before anything else, the worker lookup included. The reason only ever
        # goes from a string to None, so a check at the request's start is enough.
        reason = self._ops.startup_pending()
        if reason is not None:
            raise RequestError(
                ErrorCode.BUSY,
                f"{reason}; state changes wait until it is done: retry {req.cmd} in a few "
                "seconds (farmctl status works meanwhile)",
                req.id,
            )

    # --- helpers -----------------------------------------------------------------

    def _known(self, view: FarmView, worker: int, rid: RequestId) -> WorkerView:
        try:
            return view.worker(worker)
        except KeyError:
            ids = [w.id for w in view.workers]
            raise RequestError(
                ErrorCode.UNKNOWN_WORKER,
                f"no worker {worker}; workers are {prose.describe_ids(ids)}",
                rid,
            ) from None

    def _targets(self, req: Request) -> list[int]:
        # the codec pairs each command with its args
        assert isinstance(req.args, TargetArgs | StopArgs)
        view = self._ops.view()
        if req.args.worker == "all":
            return [w.id for w in view.workers]
        return [self._known(view, req.args.worker, req.id).id]

    @contextlib.asynccontextmanager
    async def _locked(self, ids: Sequence[int], req: Request) -> AsyncIterator[None]:
        """Hold every named worker's lock, or answer `busy` without waiting."""
        locks = [self._worker_locks.setdefault(i, asyncio.Lock()) for i in sorted(set(ids))]
        busy = [i for i, lk in zip(sorted(set(ids)), locks, strict=True) if lk.locked()]
        if busy:
            raise RequestError(
                ErrorCode.BUSY,
                f"worker {prose.describe_ids(busy)} is busy with another state change; "
                "wait for it to finish (farmctl status) and try again",
                req.id,
            )
        # No await between the check and the acquisitions: nothing can slip in.
        for lk in locks:
            await lk.acquire()
        try:
            yield
        finally:
            for lk in locks:
                lk.release()

    # --- read-only commands ------------------------------------------------------

    async def _status(self, req: Request, channel: Channel) -> Result:
        view = self._ops.view()
        on_disk = None
        if view.config_sha256 is not None:  # from a file: is that file still the one in force?
            on_disk = await self._config_file.digest(view.config_source)
        return results.status_result(
            view,
            self._ops.gpu_memory(),
            version=self._version,
            now=self._wall_clock(),
            queues=self._ops.queue_depths(),
            config_file_sha256=on_disk,
            answers=self._ops.recent_answers(),
            gpu_nodes=self._ops.gpu_numa_nodes(),
        )

    async def _settled(self, req: Request, channel: Channel) -> Result:
        """Whether the farm is settled (`settled.settled_result`); farmctl wait polls it."""
        return settled.settled_result(self._ops.view())

    async def _version_cmd(self, req: Request, channel: Channel) -> Result:
        return results.version_result(self._version)

    async def _endpoints(self, req: Request, channel: Channel) -> Result:
        return results.endpoints_result(self._ops.view())

    async def _why(self, req: Request, channel: Channel) -> Result:
        assert isinstance(req.args, WorkerArgs)  # the codec pairs each command with its args
        view = self._ops.view()
        return results.why_result(
            self._known(view, req.args.worker, req.id),
            view.gateway,
            view.staging,
            view.canary,
            held_out=view.held_out_since is not None,
            answers=self._ops.recent_answers().get(req.args.worker),
            gpu_nodes=self._ops.gpu_numa_nodes(),
        )

    async def _logs(self, req: Request, channel: Channel) -> Result:
        a = req.args
        assert isinstance(a, LogsArgs)  # the codec pairs each command with its args
        self._known(self._ops.view(), a.worker, req.id)
        tail = list(await self._ops.logs(a.worker, a.lines)) if a.lines else []
        if not a.follow:
            return results.logs_result(a.worker, tail)
        for ln in tail:
            await channel.stream("line", results.line_payload(ln))
        # Follow until the client hangs up (seen as EOF on its side of the socket)
        # or the log source ends; a quiet worker must not hold a dead connection.
        gone = asyncio.ensure_future(channel.hangup())
        source = self._ops.follow_logs(a.worker)
        try:
            while True:
                nxt = asyncio.ensure_future(anext(source))
                done, _ = await asyncio.wait({nxt, gone}, return_when=asyncio.FIRST_COMPLETED)
                if nxt not in done:
                    nxt.cancel()
                    with contextlib.suppress(BaseException):
                        await nxt
                    raise ClientGone
                try:
                    ln = nxt.result()
                except StopAsyncIteration:
                    break
                await channel.stream("line", results.line_payload(ln))
        finally:
            gone.cancel()
            with contextlib.suppress(BaseException):
                await gone
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
        return results.logs_ended_result(a.worker)

    async def _wait_ready(self, req: Request, channel: Channel) -> Result:
        """Stream phase changes until the wait is over (`settled.worker_settled`: ready,
        with a gateway routed to unless the host is held out of it, or failed, entered at
        or after `after`; quarantined, whenever entered) or timeout.

        Polls `view()` (a reference read): the progress lines need every phase, and
        `after` must skip a ready phase that predates the restart the client just issued.
        """
        a = req.args
        assert isinstance(a, WaitArgs)  # the codec pairs each command with its args
        self._known(self._ops.view(), a.worker, req.id)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        last: tuple[Phase, float] | None = None
        while True:
            view = self._ops.view()  # one snapshot: the worker and the gateway together
            w = self._known(view, a.worker, req.id)
            elapsed = loop.time() - t0
            if (w.phase, w.since) != last:
                last = (w.phase, w.since)
                await channel.stream("phase", results.phase_payload(w, elapsed))
            done = settled.worker_settled(w, view, after=a.after, now=self._wall_clock())
            if done or elapsed >= a.timeout:
                return results.wait_result(w, view.gateway, settled=done, elapsed=elapsed)
            await asyncio.sleep(min(WAIT_POLL, max(a.timeout - elapsed, 0.0)))

    # --- state-changing commands -------------------------------------------------

    async def _start(self, req: Request, channel: Channel) -> Result:
        from sglang_farm.staging.failure import StageError

        try:
            return await self._change(req, self._ops.start, skip_quarantined=True)
        except StageError as exc:
            # A failed model stage holds the farm; start staged again and failed again.
            raise RequestError(
                ErrorCode.FAILED,
                f"not started: the model could not be staged: {exc.message}; {exc.fix}",
                req.id,
            ) from exc

    async def _stop(self, req: Request, channel: Channel) -> Result:
        drain = self._drain(req)
        return await self._change(req, lambda ids: self._ops.stop(ids, drain=drain))

    async def _restart(self, req: Request, channel: Channel) -> Result:
        drain = self._drain(req)
        return await self._change(
            req, lambda ids: self._ops.restart(ids, drain=drain), skip_quarantined=True
        )

    @staticmethod
    def _drain(req: Request) -> bool:
        assert isinstance(req.args, StopArgs)  # the codec pairs each command with its args
        return req.args.drain

    async def _change(
        self,
        req: Request,
        op: Callable[[Sequence[int]], Awaitable[None]],
        *,
        skip_quarantined: bool = False,
    ) -> Result:
        ids = self._targets(req)
        async with self._locked(ids, req):
            held: list[int] = []
            if skip_quarantined:
                ids, held = self._not_quarantined(req, ids)
            # Taken before the call: every phase the agent enters for this request
            # has `since >= issued_at`, which `wait-ready after=` relies on.
            issued_at = self._wall_clock()
            if ids:
                await op(ids)
        return results.change_result(ids, issued_at, held)

    def _not_quarantined(self, req: Request, ids: list[int]) -> tuple[list[int], list[int]]:
        """`ids` split into those a start or restart acts on and the quarantined ones
        (stopped, or stopping for their GPU: the agent leaves them so). One named worker
        that is quarantined is refused with the way out: a release."""
        view = self._ops.view()
        held = [w.id for w in view.workers if w.id in ids and w.set_aside]
        assert isinstance(req.args, TargetArgs | StopArgs)  # the codec pairs them
        if held and req.args.worker != "all":
            raise RequestError(
                ErrorCode.FAILED,
                prose.quarantined_refusal(view.worker(held[0]), str(req.cmd)),
                req.id,
            )
        return [i for i in ids if i not in held], held

    async def _reset_oom(self, req: Request, channel: Channel) -> Result:
        assert isinstance(req.args, WorkerArgs)  # the codec pairs each command with its args
        w = self._known(self._ops.view(), req.args.worker, req.id)
        async with self._locked([w.id], req):
            await self._ops.reset_oom(w.id)
        return results.reset_oom_result(w.id)

    async def _release_gpu(self, req: Request, channel: Channel) -> Result:
        """Re-check a quarantined GPU and start its workers again (`FarmOps.release_gpu`).

        Holds the lock of every worker on the GPU while the agent checks it, so that a
        restart or stop of one of them is `busy` meanwhile, and the other way round.
        """
        if isinstance(req.args, ReleaseWorkerArgs):
            return await self._release_worker(req, req.args.worker)
        assert isinstance(req.args, GpuArgs)  # the codec pairs each command with its args
        gpu = req.args.gpu
        view = self._ops.view()
        users = [w.id for w in view.workers if gpu in w.gpus]
        if not users:
            used = sorted({g for w in view.workers for g in w.gpus})
            # A quarantine on a GPU that a reload took from its worker: released by worker.
            moved = [w for w in view.workers if w.quarantine and w.quarantine.gpu == gpu]
            hint = "".join(
                f"; worker {w.id}'s quarantine names it: {prose.release_command(w)}" for w in moved
            )
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"no worker of this farm uses GPU {gpu}; its workers use GPU "
                f"{prose.describe_ids(used)} (farmctl status lists them){hint}",
                req.id,
            )
        held = [w.id for w in view.workers if w.quarantine is not None and w.quarantine.gpu == gpu]
        async with self._locked(users, req):
            problems = list(await self._ops.release_gpu(gpu))
        log.info("control_release_gpu_done", request_id=req.id, gpu=gpu, problems=problems)
        return results.release_gpu_result(gpu, held, problems)

    async def _release_worker(self, req: Request, worker: int) -> Result:
        """`release-gpu` by worker (`FarmOps.release_worker`): its quarantine, whichever
        GPU that names; the agent re-checks the GPUs the worker uses now."""
        w = self._known(self._ops.view(), worker, req.id)
        async with self._locked([w.id], req):
            problems = list(await self._ops.release_worker(w.id))
        log.info("control_release_gpu_done", request_id=req.id, worker=w.id, problems=problems)
        q = w.quarantine
        return results.release_gpu_result(
            q.gpu if q is not None else None,
            [w.id] if w.phase is Phase.QUARANTINED else [],
            problems,
            worker=w.id,
            checked=w.gpus,
        )

    async def _drain_host(self, req: Request, channel: Channel) -> Result:
        """The host out of the gateway, its requests waited for (`FarmOps.drain_host`).

        Refused without a gateway (nothing routes to the workers but what the operator
        set up). Not a per-worker change: stops and restarts go on meanwhile.
        """
        a = req.args
        assert isinstance(a, DrainHostArgs)  # the codec pairs each command with its args
        view = self._ops.view()
        if view.gateway is None:
            raise RequestError(
                ErrorCode.FAILED,
                "this farm has no gateway ([gateway] is off in its config), so there is "
                "nothing to take its workers out of; stop them instead (farmctl stop all) "
                "or switch the gateway on as docs/gateway.md says",
                req.id,
            )
        async with self._host_change(req):
            r = await self._ops.drain_host(a.timeout)
        return results.drain_host_result(r)

    async def _undrain_host(self, req: Request, channel: Channel) -> Result:
        async with self._host_change(req):
            ids = await self._ops.undrain_host()
        return results.undrain_host_result(ids)

    @contextlib.asynccontextmanager
    async def _host_change(self, req: Request) -> AsyncIterator[None]:
        if self._host_lock.locked():
            raise RequestError(
                ErrorCode.BUSY,
                "a drain-host or undrain-host is already in progress; wait for it and retry",
                req.id,
            )
        async with self._host_lock:
            yield

    async def _reload(self, req: Request, channel: Channel) -> Result:
        if self._reload_lock.locked():
            raise RequestError(
                ErrorCode.BUSY, "a reload is already in progress; wait for it and retry", req.id
            )
        async with self._reload_lock:
            # Taken before the reload: the canary analysis it starts has a later
            # `started_at`, which `farmctl reload` relies on to follow the right one.
            issued_at = self._wall_clock()
            r = await self._ops.reload()
        log.info(
            "control_reload_done",
            request_id=req.id,
            applied=r.applied,
            problems=len(r.problems),
            restarted=list(r.restarted),
        )
        return results.reload_result(r, issued_at)


# What tells a changed file apart without reading it: a rename over it (an editor, Ansible)
# gives another inode, a write in place another size or change time.
_FileKey = tuple[int, int, int, int, int]


class _FileDigest:
    """The config file's digest, read and hashed again only when its stat changed
    (issue 32, 4.3: `farmctl reload` polls `status` every second, and each one read and
    hashed the whole file); a stat per `status` tells."""

    def __init__(self) -> None:
        self._path: str | None = None
        self._key: _FileKey | None = None
        self._digest: str | None = None

    async def digest(self, path: str) -> str | None:
        try:
            st = os.stat(path)
        except OSError:
            self._path = self._key = self._digest = None
            return None  # unreadable: `status` says pending, a reload names the problem
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        if path != self._path or key != self._key:
            self._digest = await asyncio.to_thread(_file_digest, path)
            self._path, self._key = path, key
        return self._digest


def _file_digest(path: str) -> str | None:
    """The digest of the config file on disk as the agent would read it (`text_digest`);
    None when it cannot be read (`status` then says the config is pending: a reload
    names the problem)."""
    try:
        with open(path, encoding="utf-8") as f:
            return text_digest(f.read())
    except (OSError, UnicodeDecodeError):
        return None
