"""I/O: the runner. It claims requests from the store, sends each through the farm's
front door (the managed gateway, every gateway of `[gateway] urls`, or without a gateway
the workers themselves, in turn), and records every attempt's outcome in the store in
group commits. It keeps `capacity.target` requests in flight, moves live batches along
their lifecycle, and pauses, losing nothing, while the store's disk is full.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import httpx
import structlog

from sglang_farm.batch import capacity, lifecycle
from sglang_farm.batch.lifecycle import BatchStatus
from sglang_farm.batch.metrics import BatchMetrics
from sglang_farm.batch.requeststate import RequestState, after_attempt
from sglang_farm.batch.retry import Outcome, Reason, classify_status, overloaded
from sglang_farm.batch.store import Attempt, BatchRow, Claimed, Result, Store, StoreError, StoreFull

log = structlog.get_logger("sglang_farm.batch.runner")


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
        self._in_flight: set[asyncio.Task[None]] = set()
        self._outcomes: list[Attempt] = []
        self._throttle = capacity.Throttle()
        self._slots = settings.config_slots
        self._validating: set[str] = set()
        self.paused: str | None = None
        self._paused_reason: str | None = None  # kept while claims are tried again
        self._paused_at = 0.0
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
        """Until cancelled: on start, what this owner had in flight goes back to pending."""
        released = await asyncio.to_thread(self._store.release_owner, self._s.owner)
        if released:
            log.info("batch_resumed", requests_sent_again=released, owner=self._s.owner)
        client = httpx.AsyncClient(
            timeout=httpx.Timeout(self._s.request_timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=1000),
        )
        next_status = 0.0
        try:
            while True:
                now = self._clock()
                if self._farm is not None and now >= next_status:
                    next_status = now + self._s.status_every_s
                    await self._refresh_capacity()
                await self._flush()
                if self.paused is None:
                    await self._advance()
                    await self._fill(client)
                self._m.in_flight.set(len(self._in_flight))
                self._m.target.set(self.target)
                self._m.paused.set(1 if self.paused else 0)
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self._s.poll_s)
        finally:
            for t in list(self._in_flight):
                t.cancel()
            await asyncio.gather(*self._in_flight, return_exceptions=True)
            await client.aclose()

    async def _refresh_capacity(self) -> None:
        assert self._farm is not None
        status = await self._farm.read()
        if status is None:
            return  # the agent is away: its workers keep serving; the last figure stands
        workers, gateway, held = capacity.workers_from_status(status, self._s.max_running)
        self._slots = capacity.slots(workers, gateway=gateway and self._s.gateway, held_out=held)

    async def _fill(self, client: httpx.AsyncClient) -> None:
        want = self.target - len(self._in_flight)
        if want <= 0:
            return
        try:
            claimed = await asyncio.to_thread(
                self._store.claim, self._s.owner, want, now=self._clock(), lease_s=self._s.lease_s
            )
        except StoreFull as exc:
            self._pause(str(exc))
            return
        except StoreError as exc:
            log.warning("batch_store_error", what="claim", error=str(exc))
            return
        for c in claimed:
            t = asyncio.create_task(self._send(client, c))
            self._in_flight.add(t)
            t.add_done_callback(self._in_flight.discard)

    def _pause(self, reason: str) -> None:
        if self.paused is None and self._paused_reason != reason:
            log.error("batch_paused", reason=reason)
        self.paused = self._paused_reason = reason
        self._paused_at = self._clock()

    async def _flush(self) -> None:
        """Record the outcomes gathered since the last pass, in one transaction."""
        if not self._outcomes:
            if self.paused is not None:
                await self._probe_space()
            return
        batch, self._outcomes = self._outcomes, []
        try:
            await asyncio.to_thread(self._store.record, batch, now=self._clock())
        except StoreFull as exc:
            self._outcomes = batch + self._outcomes  # kept: written when space is back
            self._pause(str(exc))
            return
        except StoreError as exc:
            self._outcomes = batch + self._outcomes
            log.warning("batch_store_error", what="record", error=str(exc))
            return
        if self._paused_reason is not None:
            log.info("batch_unpaused", after=self._paused_reason)
            self.paused = self._paused_reason = None
        now = self._clock()
        for a in batch:
            if a.state == RequestState.COMPLETED and a.result is not None:
                self._m.tokens.labels(kind="prompt").inc(a.result.prompt_tokens)
                self._m.tokens.labels(kind="completion").inc(a.result.completion_tokens)
            if a.state != RequestState.PENDING:
                self._m.last_progress.labels(batch=a.claim.batch_id).set(now)

    async def _probe_space(self) -> None:
        """Paused with nothing to write (a claim could not be recorded): after a second,
        claims are tried again; the next one that fails pauses again."""
        now = self._clock()
        if now - self._paused_at >= 1.0:
            self.paused = None

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
                    self._in_flight.add(t)  # cancelled with the rest at stop
                    t.add_done_callback(self._in_flight.discard)
                continue
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

    async def _send(self, client: httpx.AsyncClient, c: Claimed) -> None:
        door = next(self._doors)
        headers = {"Content-Type": "application/json", **self._s.headers}
        reason: Reason | None = None
        result: Result | None = None
        try:
            r = await client.post(door + c.url, content=c.body.encode(), headers=headers)
            status = r.status_code
            outcome, reason = classify_status(status)
            text = r.text
            if outcome is Outcome.SUCCESS:
                try:
                    doc = json.loads(text)
                except ValueError:
                    outcome, reason = Outcome.RETRY, Reason.BAD_ANSWER
                else:
                    usage = doc.get("usage") if isinstance(doc, dict) else None
                    usage = usage if isinstance(usage, dict) else {}
                    result = Result(
                        status,
                        r.headers.get("x-request-id")
                        or (doc.get("id") if isinstance(doc, dict) else None),
                        text,
                        prompt_tokens=int(usage.get("prompt_tokens") or 0),
                        completion_tokens=int(usage.get("completion_tokens") or 0),
                    )
            elif outcome is Outcome.FAIL:
                result = Result(
                    status,
                    r.headers.get("x-request-id"),
                    text,
                    error_code=f"http_{status}",
                    error_message=_message(text) or f"the engine answered {status}",
                )
            if overloaded(status):
                self._throttle = self._throttle.overload(self._clock())
            else:
                self._throttle = self._throttle.ok(self._clock())
        except httpx.TimeoutException:
            outcome, reason = Outcome.RETRY, Reason.TIMEOUT
        except httpx.TransportError:
            outcome, reason = Outcome.RETRY, Reason.CONNECTION
        nxt = after_attempt(
            outcome,
            c.attempts,
            max_attempts=self._s.max_attempts,
            backoff_s=self._s.retry_backoff_s,
        )
        if reason is not None and nxt.state is RequestState.PENDING:
            self._m.retries.labels(reason=str(reason)).inc()
        if nxt.gave_up:
            result = Result(
                None,
                None,
                None,
                error_code="attempts_exhausted",
                error_message=f"no answer after {nxt.attempts} attempts (last: {reason}); "
                "raise [batch] max_attempts or check the farm",
            )
        self._outcomes.append(
            Attempt(
                c,
                str(nxt.state),
                nxt.attempts,
                result,
                str(reason) if reason is not None else None,
                self._clock() + nxt.delay_s,
            )
        )
        self._wake.set()


def _message(text: str) -> str | None:
    """The engine's own error message (OpenAI's {"error": {"message"}} or {"message"})."""
    try:
        doc = json.loads(text)
    except ValueError:
        return text[:500] or None
    if isinstance(doc, dict):
        err = doc.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])
        if isinstance(doc.get("message"), str):
            return str(doc["message"])
    return None


def frontdoors(
    gateway_mode: str, listen: str, urls: Sequence[str], workers: Sequence[str]
) -> tuple[str, ...]:
    """Where requests go: the managed gateway, every external gateway, else the workers."""
    if gateway_mode == "managed":
        return (f"http://{listen}",)
    if gateway_mode == "external" and urls:
        return tuple(urls)
    return tuple(workers)
