"""I/O: the runner. It claims requests from the store, sends each through the farm's
front door (the managed gateway, every gateway of `[gateway] urls`, or without a gateway
the workers themselves, in turn), and records every attempt's outcome in the store. It
keeps `capacity.target` requests in flight, moves live batches along their lifecycle, and
pauses, losing nothing, while the store's disk is full.

One step at a time, as soon as an answer comes: the outcomes gathered since the last step
are recorded and the slots they freed claimed again in one store transaction (a group
commit: one fsync for every answer that came while the last one ran). A result counts once
that commit returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import httpx
import structlog

from sglang_farm.batch import capacity, lifecycle
from sglang_farm.batch.lifecycle import BatchStatus
from sglang_farm.batch.metrics import BatchMetrics
from sglang_farm.batch.requeststate import Next, RequestState, after_attempt
from sglang_farm.batch.retry import (
    Outcome,
    Reason,
    classify_status,
    overloaded,
    uncounted,
    unroutable,
)
from sglang_farm.batch.store import Attempt, BatchRow, Claimed, Result, Store, StoreError, StoreFull

log = structlog.get_logger("sglang_farm.batch.runner")

DOOR_DOWN_S = 2.0


class _Clients:
    """An HTTP client for each request in flight, lent and given back (the last given
    back first: its connection is the warmest). httpcore's pool walks every connection it
    holds on each request's start and end, so one client of 256 connections costs CPU in
    proportion to them; a client that holds one connection (one per front door) costs the
    same whatever the concurrency (docs/benchmarks.md, "Batch jobs")."""

    def __init__(self, make: Callable[[], httpx.AsyncClient]) -> None:
        self._make = make
        self._free: list[httpx.AsyncClient] = []
        self._all: list[httpx.AsyncClient] = []

    def take(self) -> httpx.AsyncClient:
        if self._free:
            return self._free.pop()
        c = self._make()
        self._all.append(c)
        return c

    def give(self, c: httpx.AsyncClient) -> None:
        self._free.append(c)

    async def aclose(self) -> None:
        for c in self._all:
            await c.aclose()


UNAUTHORIZED_WAIT_S = 1.0


class StatusSource(Protocol):
    """The agent's status (`farmstatus.FarmStatus`), None while it cannot be read."""

    async def read(self) -> Mapping[str, object] | None: ...


@dataclass(frozen=True, slots=True)
class RunnerSettings:
    frontdoors: tuple[str, ...]
    owner: str
    max_attempts: int = 5
    retry_backoff_s: float = 1.0
    request_timeout_s: float = 600.0
    concurrency: int | None = None
    # Each worker's max_running_requests where the config says it (worker id -> slots).
    max_running: Mapping[int, int] = field(default_factory=dict)
    # The farm's slots when the agent's status is not at hand yet.
    config_slots: int = capacity.DEFAULT_MAX_RUNNING
    headers: Mapping[str, str] = field(default_factory=dict)
    poll_s: float = 0.2
    # A step waits this long after the answer that woke it, for the answers of the next
    # moment to share its commit (0: each step takes what came while the last one ran).
    gather_s: float = 0.0
    status_every_s: float = 2.0
    gateway: bool = True

    @property
    def lease_s(self) -> float:
        return self.request_timeout_s + 30.0


class Runner:
    def __init__(
        self,
        store: Store,
        settings: RunnerSettings,
        metrics: BatchMetrics,
        *,
        farm: StatusSource | None,
        validate: Callable[[BatchRow], Awaitable[None]],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._s = settings
        self._m = metrics
        self._farm = farm
        self._validate = validate
        self._clock = clock
        self._doors = itertools.cycle(settings.frontdoors)
        # A front door that refused a connection is passed over for a while (a worker that
        # died, without a gateway; a gateway restarting) while another one answers.
        self._door_down_until: dict[str, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # sends and validations, cancelled at stop
        self._sending = 0  # requests claimed whose outcome is not yet in `_outcomes`
        self._outcomes: list[Attempt] = []
        self._throttle = capacity.Throttle()
        self._slots = settings.config_slots
        self._validating: set[str] = set()
        self.paused: str | None = None
        self._paused_reason: str | None = None  # kept while claims are tried again
        self._paused_at = 0.0
        self._pause_kind: str | None = None
        self._wake = asyncio.Event()
        self._rates: dict[str, tuple[float, int]] = {}

    @property
    def target(self) -> int:
        return capacity.target(self._slots, self._throttle, self._s.concurrency)

    def wake(self) -> None:
        self._wake.set()

    async def _call(self, fn: Callable[..., object], *args: object, **kw: object) -> object:
        return await asyncio.to_thread(fn, *args, **kw)

    async def run(self) -> None:
        """Until cancelled: on start, what a dead process had in flight goes back to
        pending (`Store.release_at_start`: every claim in the embedded store, this owner's
        in a shared one)."""
        released = await asyncio.to_thread(self._store.release_at_start, self._s.owner)
        if released:
            log.info("batch_resumed", requests_sent_again=released, owner=self._s.owner)
        tls = ssl.create_default_context()  # one CA bundle read, not one per client
        timeout = httpx.Timeout(self._s.request_timeout_s, connect=10.0)
        limits = httpx.Limits(
            max_connections=None, max_keepalive_connections=len(self._s.frontdoors)
        )
        headers = {"Content-Type": "application/json", **self._s.headers}
        clients = _Clients(
            lambda: httpx.AsyncClient(verify=tls, timeout=timeout, limits=limits, headers=headers)
        )
        next_status = 0.0
        next_advance = 0.0  # batches' lifecycle: once a poll, not on every answer
        try:
            while True:
                now = self._clock()
                if self._farm is not None and now >= next_status:
                    next_status = now + self._s.status_every_s
                    await self._refresh_capacity()
                if self.paused is None and now >= next_advance:
                    next_advance = now + self._s.poll_s
                    await self._advance()
                self._wake.clear()  # an answer from here on wakes the next step
                await self._step(clients)
                self._m.in_flight.set(self._sending)
                self._m.target.set(self.target)
                self._m.paused.set(1 if self.paused else 0)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self._s.poll_s)
                if self._s.gather_s > 0:
                    await asyncio.sleep(self._s.gather_s)
        finally:
            for t in list(self._tasks):
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await clients.aclose()

    async def _refresh_capacity(self) -> None:
        assert self._farm is not None
        status = await self._farm.read()
        if status is None:
            return  # the agent is away: its workers keep serving; the last figure stands
        workers, gateway, held = capacity.workers_from_status(status, self._s.max_running)
        self._slots = capacity.slots(workers, gateway=gateway and self._s.gateway, held_out=held)

    def _pause(self, reason: str, *, kind: str = "store") -> None:
        """Send nothing new: the store cannot write ("store": until a write succeeds) or
        the front door refuses the key ("door": until an answer comes). Claims are tried
        again after a second; one that meets the same trouble pauses again (one log)."""
        if self._paused_reason != reason:
            log.error("batch_paused", reason=reason)
        self.paused = self._paused_reason = reason
        self._pause_kind = kind
        self._paused_at = self._clock()

    def _unpause(self, kind: str) -> None:
        if self._paused_reason is not None and self._pause_kind == kind:
            log.info("batch_unpaused", after=self._paused_reason)
            self.paused = self._paused_reason = self._pause_kind = None

    async def _step(self, clients: _Clients) -> None:
        """Record the outcomes gathered since the last step and claim what the slots
        want, in one transaction; send what was claimed."""
        if self.paused is not None and self._clock() - self._paused_at >= 1.0:
            self.paused = None  # claims are tried again; the reason is kept until it is gone
        want = max(0, self.target - self._sending) if self.paused is None else 0
        if not self._outcomes and want == 0:
            return
        batch, self._outcomes = self._outcomes, []
        now = self._clock()
        try:
            recorded, claimed = await asyncio.to_thread(
                self._store.exchange, batch, self._s.owner, want, now=now, lease_s=self._s.lease_s
            )
        except StoreFull as exc:
            self._outcomes = batch + self._outcomes  # kept: written when space is back
            self._pause(str(exc))
            return
        except StoreError as exc:
            self._outcomes = batch + self._outcomes
            log.warning("batch_store_error", what="record" if batch else "claim", error=str(exc))
            return
        if batch:
            self._unpause("store")
            # Only what was recorded: an answer whose request was taken over meanwhile
            # (its lease passed, another runner claimed it) is no result of the batch.
            self._count([a for a, ok in zip(batch, recorded, strict=True) if ok])
        for c in claimed:
            self._sending += 1
            t = asyncio.create_task(self._send(clients, c))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    def _count(self, batch: Sequence[Attempt]) -> None:
        """The metrics of the outcomes just recorded: added up, then one update each."""
        prompt = completion = 0
        progressed: set[str] = set()
        for a in batch:
            if a.state == RequestState.COMPLETED and a.result is not None:
                prompt += a.result.prompt_tokens
                completion += a.result.completion_tokens
            if a.state != RequestState.PENDING:
                progressed.add(a.claim.batch_id)
        if prompt:
            self._m.tokens.labels(kind="prompt").inc(prompt)
        if completion:
            self._m.tokens.labels(kind="completion").inc(completion)
        now = self._clock()
        for batch_id in progressed:
            self._m.last_progress.labels(batch=batch_id).set(now)

    async def _advance(self) -> None:
        try:
            live = await asyncio.to_thread(self._store.live_batches)
        except StoreError as exc:
            log.warning("batch_store_error", what="live batches", error=str(exc))
            return
        now = self._clock()
        for b in live:
            self._observe(b, now)
            if b.status is BatchStatus.VALIDATING:
                if b.id not in self._validating:
                    self._validating.add(b.id)
                    t = asyncio.create_task(self._validate_one(b))
                    self._tasks.add(t)  # cancelled with the rest at stop
                    t.add_done_callback(self._tasks.discard)
                continue
            if b.id in self._validating:
                continue  # cancelled while its validation runs here: that ends first
            new = lifecycle.step(b.status, b.progress, now=now, expires_at=b.expires_at)
            if new is None:
                continue
            try:
                moved = await asyncio.to_thread(
                    self._store.set_status, b.id, b.status, new, now=now
                )
            except StoreFull as exc:
                self._pause(str(exc))
                return
            if moved:
                log.info("batch_status", batch=b.id, status=str(new), was=str(b.status))
                if new in lifecycle.TERMINAL:
                    self._m.forget(b.id)
                    self._rates.pop(b.id, None)

    async def _validate_one(self, b: BatchRow) -> None:
        try:
            await self._validate(b)
        finally:
            self._validating.discard(b.id)

    def _observe(self, b: BatchRow, now: float) -> None:
        p = b.progress
        g = self._m.requests
        g.labels(batch=b.id, state="pending").set(max(0, p.unfinished - p.in_flight))
        g.labels(batch=b.id, state="in_flight").set(p.in_flight)
        g.labels(batch=b.id, state="completed").set(p.completed)
        g.labels(batch=b.id, state="failed").set(p.failed)
        done = p.completed + p.failed
        first = self._rates.setdefault(b.id, (now, done))
        elapsed = now - first[0]
        if elapsed > 0 and done > first[1]:
            rate = (done - first[1]) / elapsed
            self._m.eta.labels(batch=b.id).set(p.unfinished / rate)

    def _door(self) -> str:
        now = self._clock()
        for _ in range(len(self._s.frontdoors)):
            door = next(self._doors)
            if self._door_down_until.get(door, 0.0) <= now:
                return door
        return next(self._doors)  # every one is down: try them in turn all the same

    async def _send(self, clients: _Clients, c: Claimed) -> None:
        client = clients.take()
        try:
            attempt = await self._attempt(client, c)
        finally:
            clients.give(client)
            self._sending -= 1
        self._outcomes.append(attempt)  # with the count above: no await between them
        self._wake.set()

    async def _attempt(self, client: httpx.AsyncClient, c: Claimed) -> Attempt:
        """One attempt at a claimed request, and what it comes to."""
        door = self._door()
        reason: Reason | None = None
        result: Result | None = None
        status = 0
        try:
            r = await client.post(door + c.url, content=c.body.encode())
            status = r.status_code
            outcome, reason, result = read_answer(status, r.content, r.headers.get("x-request-id"))
            if overloaded(status):
                self._throttle = self._throttle.overload(self._clock())
            else:
                self._throttle = self._throttle.ok(self._clock())
        except httpx.TimeoutException:
            outcome, reason = Outcome.RETRY, Reason.TIMEOUT
        except httpx.TransportError:
            outcome, reason = Outcome.RETRY, Reason.CONNECTION
            self._door_down_until[door] = self._clock() + DOOR_DOWN_S
        if uncounted(reason):
            nxt = Next(RequestState.PENDING, c.attempts, UNAUTHORIZED_WAIT_S)
            self._pause(
                f"the front door {door} refuses the batch service's key ({status}); check "
                "[batch] gateway_key_file (or [gateway] api_key_file); the batch resumes by "
                "itself once it is accepted",
                kind="door",
            )
        else:
            nxt = after_attempt(
                outcome,
                c.attempts,
                max_attempts=self._s.max_attempts,
                backoff_s=self._s.retry_backoff_s,
            )
        if outcome is not Outcome.RETRY:
            self._unpause("door")  # answered: the key is accepted
        if reason is not None and nxt.state is RequestState.PENDING:
            self._m.retries.labels(reason=str(reason)).inc()
        if nxt.gave_up:
            result = Result(
                None,
                None,
                None,
                error_code="attempts_exhausted",
                error_message=f"no answer after {nxt.attempts} attempts (last: {reason}); "
                + (
                    "the gateway had no worker for the body's model: check that it names a "
                    "model the farm serves, or raise [batch] max_attempts"
                    if reason is Reason.UNROUTABLE
                    else "raise [batch] max_attempts or check the farm"
                ),
            )
        return Attempt(
            c,
            str(nxt.state),
            nxt.attempts,
            result,
            str(reason) if reason is not None else None,
            self._clock() + nxt.delay_s,
        )


def read_answer(
    status: int, content: bytes, request_id: str | None
) -> tuple[Outcome, Reason | None, Result | None]:
    """Pure: an HTTP answer -> its outcome, why it is retried, and the result to record
    (the body kept as it came, as text; only its usage and id are read from it)."""
    outcome, reason = classify_status(status)
    if outcome is Outcome.RETRY:
        return outcome, reason, None
    if outcome is Outcome.FAIL:
        text = content.decode("utf-8", "replace")
        code, message = _error(text)
        if unroutable(status, code, message):
            return Outcome.RETRY, Reason.UNROUTABLE, None
        message = message or f"the engine answered {status}"
        return outcome, None, Result(status, request_id, text, f"http_{status}", message)
    try:
        text = content.decode("utf-8")
        doc = json.loads(text)
    except ValueError:  # not UTF-8 or not JSON: cut short
        return Outcome.RETRY, Reason.BAD_ANSWER, None
    if not isinstance(doc, dict):
        return outcome, None, Result(status, request_id, text)
    usage = doc.get("usage")
    usage = usage if isinstance(usage, dict) else {}
    rid = request_id or doc.get("id")
    return (
        outcome,
        None,
        Result(
            status,
            rid if isinstance(rid, str) else None,
            text,
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
        ),
    )


def _error(text: str) -> tuple[object, str | None]:
    """The engine's own error code and message (OpenAI's {"error": {"code", "message"}} or
    {"message"})."""
    try:
        doc = json.loads(text)
    except ValueError:
        return None, text[:500] or None
    if isinstance(doc, dict):
        err = doc.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err.get("code"), str(err["message"])
        if isinstance(doc.get("message"), str):
            return doc.get("code"), str(doc["message"])
    return None, None


def frontdoors(
    gateway_mode: str, listen: str, urls: Sequence[str], workers: Sequence[str]
) -> tuple[str, ...]:
    """Where requests go: the managed gateway, every external gateway, else the workers."""
    if gateway_mode == "managed":
        return (f"http://{listen}",)
    if gateway_mode == "external" and urls:
        return tuple(urls)
    return tuple(workers)
