"""I/O: keeps one gateway's membership equal to what the supervisor decides.

The decision is the pure core's (`supervisor.wants_in_gateway`: a worker is routed to
only while READY; and not while the farm keeps it out: `kept_out`, a canary waiting for
its eval gate, canary.rollout.kept_out_of_gateway). This module carries it out against
one gateway and reports what that gateway confirmed (`confirmed`, and `on_member` on
each change); `workers.gateway_fleet` runs one of these per gateway and turns their
confirmations into the supervisor's `GatewayMembership` events
(`gateway.membership.combined`: in every gateway that answers, out of all of them), so
the supervisor knows when a draining worker is really out and when a restarted one is
back in.

It is level-triggered, not edge-triggered: every change of the farm's state, and a
periodic reconcile, compare what should be with what the gateway lists, so a failed
call, a gateway restart (which forgets its workers) or a registration smg finished
late all converge. The gateway being down never stops supervision: calls are retried
with back-off, the state says so (`up`), and the next reconcile repairs the rest.
Down means it does not answer (no connection, no answer within the call's bound) or
cannot be listed; a refusal of one worker's change (an error status, smg's add timeout
for one slow worker) is that worker's error (`refused`), and the gateway's word on the
others stands (issue 26 review: a gateway wrongly counted down is left out of every
drain while it still routes).

Members that are not the farm's ("foreign": registered by someone else): a MANAGED
gateway is the farm's alone, so each reconcile removes them (logged with their URL:
someone with the admin key routed users elsewhere behind the farm's back). An
EXTERNAL gateway is shared with other hosts' farms: their workers are left alone, and
shown (`GatewayStatus.foreign`: status, metrics) so that an operator sees who else
takes the users' requests.

A worker is added with the key the gateway must present to it (SGLang's `--api-key`)
read from the config in force at that moment, so a reload that adds or changes a key
brings the worker back with it (issue 22, item 8).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Collection, Mapping

import structlog

from sglang_farm.errors import GatewayError, GatewayErrorCode
from sglang_farm.gateway.port import Gateway, Member, normalize_url
from sglang_farm.gateway.routing import overload_reason, overloaded
from sglang_farm.gateway.status import GatewayStatus
from sglang_farm.spec import FarmSpec, gpu_label
from sglang_farm.workers.supervisor import WorkerState, wants_in_gateway

log = structlog.get_logger("sglang_farm.gateway.sync")

RECONCILE_EVERY_S = 10.0  # a restarted gateway is noticed (and refilled) within this
# Issue 26: the most one call may take here, whatever the `Gateway` does (smg's adapter
# bounds its own: 30 s to add, 10 s to remove, 5 s a request): past it the gateway counts
# as down, so a gateway that hangs holds no drain and no wave on the others.
ADD_BOUND_S = 45.0
REMOVE_BOUND_S = 15.0
LIST_BOUND_S = 15.0
RETRY_INITIAL_S = 0.5
RETRY_MAX_S = 15.0


class MembershipSync:
    def __init__(
        self,
        gateway: Gateway,
        *,
        spec: Callable[[], FarmSpec],
        states: Callable[[], Mapping[int, WorkerState]],
        on_member: Callable[[int, bool], None],
        on_status: Callable[[], None] = lambda: None,
        kept_out: Callable[[], Collection[int]] = frozenset,
    ) -> None:
        self._gateway = gateway
        # What this gateway last confirmed per worker: True routed, False not; a worker
        # absent is not known yet (before the first call or reconcile that says).
        self.confirmed: dict[int, bool] = {}
        # Whether this gateway last held the worker at all (a member, routed or not): one
        # it holds but does not route (smg's health check failed it for a moment) is
        # routed again once its check passes, so it is not out of the gateway for a drain.
        self.held: dict[int, bool] = {}
        # Per worker, how many changes this sync sent or confirmed: a list asked before one
        # and answered after it is stale for that worker (its word is not taken).
        self._changes: dict[int, int] = {}
        self._evicting: set[str] = set()  # foreign URLs whose removal runs
        self.foreign: tuple[str, ...] = ()  # as of the last reconcile
        # The farm's workers the gateway leaves out of routing for overload, with why
        # (as of the last reconcile; issue 34 §3).
        self.overloaded: dict[int, str] = {}
        self._spec = spec
        self._states = states
        self._kept_out = kept_out  # workers the farm keeps out whatever their state
        self._on_member = on_member
        self._on_status = on_status
        self._busy: set[int] = set()
        self._retry_at: dict[int, float] = {}
        self._delay: dict[int, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._reconciler: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self.up = False  # until the gateway has answered once
        # Per worker, why the gateway last refused its change (cleared when one succeeds).
        self.refused: dict[int, str] = {}
        self._reached = False
        self.errors = 0
        self.last_error: str | None = None

    @property
    def gateway_url(self) -> str:
        return self._gateway.url

    def status(self) -> GatewayStatus:
        states = self._states()
        routed = tuple(sorted(w for w in states if self.confirmed.get(w)))
        error = self.last_error
        refused = sorted(w for w in self.refused if w in states)
        if self.up and refused:
            wid = refused[-1]
            error = f"worker {wid}: {self.refused[wid]}"
        return GatewayStatus(
            self._gateway.url,
            self.up,
            len(routed),
            self.errors,
            error,
            self.foreign,
            routed=routed,
            overloaded=tuple(sorted((w, r) for w, r in self.overloaded.items() if w in states)),
        )

    def start(self) -> None:
        self._reconciler = asyncio.create_task(
            self._reconcile_loop(), name=f"sf-gateway-sync {self._gateway.url}"
        )

    async def close(self) -> None:
        tasks = [*self._tasks, *([self._reconciler] if self._reconciler else [])]
        for t in tasks:
            t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)

    # ---- level-triggered sync ------------------------------------------------------

    def update(self) -> None:
        """Compare each worker's wanted membership with the confirmed one; fix the gaps."""
        loop = asyncio.get_running_loop()
        kept_out = self._kept_out()
        for wid, s in self._states().items():
            want = wants_in_gateway(s) and wid not in kept_out
            # Not known yet counts as out here: a worker that should not be routed is not
            # removed blindly (the reconcile, at start, lists what the gateway holds).
            if want == self.confirmed.get(wid, False):
                self.refused.pop(wid, None)  # what was refused is no longer wanted
                continue
            if wid in self._busy:
                continue
            if self._retry_at.get(wid, 0.0) > loop.time():
                continue  # backing off after a failed call; the reconciler comes back
            self._busy.add(wid)
            task = asyncio.create_task(self._change(wid, want))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _change(self, wid: int, want: bool) -> None:
        url = self._spec().gateway_url_of(wid)
        blog = log.bind(worker=wid, gpu=self._gpu(wid), gateway=self._gateway.url)
        # Sent, the add may take effect whatever its answer (smg routes a worker before
        # its answer comes back; one that times out may register it still): until a
        # confirmed remove, or a list asked after this call, the gateway may hold it.
        self._changes[wid] = self._changes.get(wid, 0) + 1
        if want:
            self.held.pop(wid, None)
        try:
            async with _bounded(self._gateway.url, ADD_BOUND_S if want else REMOVE_BOUND_S):
                if want:
                    await self._gateway.add(url, api_key=worker_key(self._spec(), wid))
                else:
                    await self._gateway.remove(url)
        except GatewayError as exc:
            self._busy.discard(wid)
            self._failed(wid, str(exc), down=not_answering(exc))
            # Until the gateway first answers, `gateway_not_reached_yet` said it once
            # (smg not installed retried every 15 s would flood the log: issue 22 item 10).
            (blog.warning if self._reached else blog.debug)(
                "gateway_change_failed",
                change="add" if want else "remove",
                error=str(exc),
                retry_in_s=self._delay[wid],
            )
            return
        except BaseException:
            self._busy.discard(wid)
            raise
        self._delay.pop(wid, None)
        self._retry_at.pop(wid, None)
        self.refused.pop(wid, None)
        blog.info("gateway_member" if want else "gateway_removed", url=url)
        # Recorded before the report: the state change it causes calls update() again,
        # which must see the new membership, not start the same call a second time.
        self.confirmed[wid] = want
        self.held[wid] = want
        self._changes[wid] = self._changes.get(wid, 0) + 1
        self._busy.discard(wid)
        self._mark_up()
        if wid in self._states():
            self._on_member(wid, want)
        self.update()  # the phase may have moved on while the call ran

    def _failed(self, wid: int, error: str, *, down: bool) -> None:
        loop = asyncio.get_running_loop()
        delay = min(RETRY_MAX_S, self._delay.get(wid, RETRY_INITIAL_S / 2) * 2)
        self._delay[wid] = delay
        self._retry_at[wid] = loop.time() + delay
        if down:
            self._record_error(error)
        else:
            # The gateway answered: it refused this worker (an HTTP error, smg's add
            # timeout for one slow worker). Its word on every other worker stands, so it
            # stays up and keeps guarding their drains; this worker stays unconfirmed.
            self.refused[wid] = error
            if self._reached:
                self.errors += 1
            self._on_status()
        loop.call_later(delay, self._wake.set)

    def _record_error(self, error: str) -> None:
        """The gateway does not answer (or cannot be listed): it counts as down."""
        first = self.last_error is None
        self.last_error = error
        if not self._reached:
            # Not up yet: not an error, said once. A managed gateway starts with the agent,
            # and its runner warns when it exits or cannot start (`gateway_exited`): its
            # first unanswered call is the normal start, said only at debug (issue 31).
            if first:
                managed = self._spec().gateway.mode == "managed"
                (log.debug if managed else log.info)(
                    "gateway_not_reached_yet", gateway=self._gateway.url, error=error
                )
            self._on_status()
            return
        self.errors += 1
        if self.up:
            self.up = False
            log.warning("gateway_down", gateway=self._gateway.url, error=error)
        self._on_status()

    def _mark_up(self) -> None:
        if not self.up:
            self.up = True
            self._reached = True
            self.last_error = None
            log.info("gateway_up", gateway=self._gateway.url)
            self._wake.set()  # reconcile now: it may have restarted empty
            self._on_status()

    # ---- periodic reconcile --------------------------------------------------------

    async def _reconcile_loop(self) -> None:
        while True:
            await self.reconcile()
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(RECONCILE_EVERY_S):
                    await self._wake.wait()

    async def reconcile(self) -> None:
        """Make the gateway's list agree with the farm, for the farm's own addresses.

        Listed but not wanted (a stale entry after an agent restart, a late registration):
        removed. Confirmed but no longer listed (the gateway restarted): marked out, so
        `update` adds it again. Other hosts' workers: untouched. A worker whose add or
        remove was confirmed while the list was under way keeps that confirmation: the
        list may show the gateway as it was before it.
        """
        spec = self._spec()
        ours = {normalize_url(spec.gateway_url_of(w)): w for w in spec.worker_ids}
        asked = dict(self._changes)
        try:
            async with _bounded(self._gateway.url, LIST_BOUND_S):
                members = await self._gateway.list()
        except GatewayError as exc:
            was_up = self.up
            self._record_error(str(exc))
            # Said when it goes down (`gateway_down`), not on every reconcile while it is.
            (log.warning if was_up else log.debug)(
                "gateway_reconcile_failed", gateway=self._gateway.url, error=str(exc)
            )
            return
        self._mark_up()
        # Managed: the farm runs it, so no member but the farm's belongs there.
        self._foreign(members, set(ours), managed=spec.gateway.mode == "managed")
        self._overloaded(members, ours, spec)
        listed = {_url(m) for m in members if m.routed}
        known = {_url(m) for m in members}
        states, kept_out = self._states(), self._kept_out()
        for url, wid in ours.items():
            s = states.get(wid)
            if s is None or wid in self._busy:
                continue  # a change under way reports what it confirms itself
            if self._changes.get(wid, 0) != asked.get(wid, 0):
                continue  # confirmed while the list was under way: the list is older
            was, now_in = self.confirmed.get(wid), url in listed
            if was and not now_in:
                log.warning(
                    "gateway_lost_member",
                    worker=wid,
                    gpu=self._gpu(wid),
                    gateway=self._gateway.url,
                    url=url,
                )
            self.confirmed[wid] = now_in
            self.held[wid] = url in known
            if url in known and not (wants_in_gateway(s) and wid not in kept_out):
                self._busy.add(wid)
                task = asyncio.create_task(self._change(wid, False))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            if was != now_in:
                self._on_member(wid, now_in)
        self._retry_at.clear()  # a reconcile is a fresh attempt for every worker
        self.update()

    def _overloaded(self, members: list[Member], ours: Mapping[str, int], spec: FarmSpec) -> None:
        """Note which of the farm's routed workers the gateway passes over for overload:
        smg lists them ready (so they are in the gateway for the farm) but sends new
        requests to their siblings while they are over a threshold. Judged from smg's
        own polled figures with `[gateway]`'s thresholds (what a managed gateway was
        started with; for an external one, what the operator says it runs with)."""
        r = spec.gateway.routing
        now: dict[int, str] = {}
        for m in members:
            wid = ours.get(_url(m))
            if wid is not None and m.routed and overloaded(m.waiting, m.token_usage, r):
                now[wid] = overload_reason(m.waiting, m.token_usage, r)
        for wid in sorted(now.keys() - self.overloaded.keys()):
            log.info(
                "gateway_worker_overloaded",
                worker=wid,
                gpu=self._gpu(wid),
                gateway=self._gateway.url,
                reason=now[wid],
            )
        for wid in sorted(self.overloaded.keys() - now.keys()):
            log.info(
                "gateway_worker_not_overloaded",
                worker=wid,
                gpu=self._gpu(wid),
                gateway=self._gateway.url,
            )
        if now != self.overloaded:
            self.overloaded = now
            self._on_status()

    def _foreign(self, members: list[Member], ours: set[str], *, managed: bool) -> None:
        """Note the members that are not the farm's; on a managed gateway, remove them."""
        foreign = sorted({_url(m) for m in members} - ours)
        if tuple(foreign) != self.foreign:
            self.foreign = tuple(foreign)
            if foreign and not managed:
                log.warning("gateway_foreign_members", gateway=self._gateway.url, urls=foreign)
            self._on_status()
        if not managed:
            return
        for url in foreign:
            if url in self._evicting:
                continue
            self._evicting.add(url)
            task = asyncio.create_task(self._evict(url, [m for m in members if _url(m) == url]))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _evict(self, url: str, seen: list[Member]) -> None:
        """Take a member the farm did not register out of its managed gateway."""
        what = ", ".join(f"{m.id} {m.status}" for m in seen)
        try:
            log.warning(
                "gateway_foreign_member",
                gateway=self._gateway.url,
                url=url,
                members=what,
                action="removing: a managed gateway routes only to the farm's workers",
            )
            await self._gateway.remove(url)
        except GatewayError as exc:
            if not_answering(exc):  # a refusal of this one member is not the gateway down
                self._record_error(str(exc))
            log.warning(
                "gateway_foreign_remove_failed", gateway=self._gateway.url, url=url, error=str(exc)
            )
            return
        finally:
            self._evicting.discard(url)
        log.warning("gateway_foreign_removed", gateway=self._gateway.url, url=url)
        self.foreign = tuple(u for u in self.foreign if u != url)
        self._on_status()

    def _gpu(self, wid: int) -> str:
        spec = self._spec()
        if wid not in spec.worker_ids:
            return "?"
        return gpu_label(spec.worker(wid).gpus)


@contextlib.asynccontextmanager
async def _bounded(gateway: str, seconds: float) -> AsyncIterator[None]:
    """At most `seconds` for one call; past them a `GatewayError` (TIMEOUT)."""
    try:
        async with asyncio.timeout(seconds):
            yield
    except TimeoutError:
        raise GatewayError(
            gateway,
            GatewayErrorCode.UNREACHABLE,
            f"no answer within {seconds:g} s; the farm counts it as down and goes on with "
            "its other gateways; check that it runs and is not overloaded",
        ) from None


def not_answering(exc: GatewayError) -> bool:
    """Pure: whether a failed add or remove says the gateway itself does not answer (no
    connection, no answer in time: `UNREACHABLE`, `_bounded`), rather than that it
    answered and refused that one worker (`REFUSED`, `UNAUTHORIZED`, `PROTOCOL`, or
    `TIMEOUT`: accepted, not confirmed within the adapter's bound); a managed gateway's
    port held by another process (`NOT_OURS`) is down too."""
    # NOT_OURS: another process holds a managed gateway's port (issue 30): no key is sent
    # there, and the farm's gateway is not running on it.
    return exc.code in (GatewayErrorCode.UNREACHABLE, GatewayErrorCode.NOT_OURS)


def worker_key(spec: FarmSpec, wid: int) -> str | None:
    """The key the gateway must present to worker `wid` (its SGLang `--api-key`, per worker
    or farm-wide), as the config in force says; None without one."""
    if wid not in spec.worker_ids:
        return None
    key = spec.worker(wid).flags.get("api_key")
    return key if isinstance(key, str) and key else None


def _url(m: Member) -> str:
    """A member's URL in the form the farm compares (a scheme the farm does not know of,
    such as smg's grpc://, as listed)."""
    try:
        return normalize_url(m.url)
    except ValueError:
        return m.url
