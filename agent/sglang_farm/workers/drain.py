"""I/O: watching a worker drain before a planned stop, and a whole host drain
(`farmctl drain-host`, issue 26) without a stop.

The supervisor decides that a stop is drained first (`Drain` action, phase DRAINING)
and how long it may take (`[gateway] drain_timeout`). This module watches: first until
the gateway no longer routes to the worker (`GatewayMembership(False)` confirmed, or
the gateway is down and routes nothing anywhere), then until the worker's own figures
show no request running or queued (its `/metrics`, or `/v1/loads`). Then `Drained`.

SGLang keeps admitting new requests while it drains after SIGTERM
(docs/reference/sglang.md §12): taking the worker out of the gateway first is what
makes the stop lose nothing.

A host drain (`wait_host_idle`) watches the same two steps for every serving worker at
once, but nothing stops: the supervisor holds the host out of the gateway
(`Supervisor.hold_out`) and the workers keep running, idle, for a reboot or an upgrade.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Mapping
from typing import Protocol

import httpx

from sglang_farm.sglang.stats import poll_worker
from sglang_farm.workers.events import Drained, Event
from sglang_farm.workers.phase import Phase
from sglang_farm.workers.phase_sets import SERVING
from sglang_farm.workers.records import WorkerState

POLL_S = 0.25  # how often the worker's load is read while draining
UNKNOWN_LIMIT = 3  # polls in a row with no answer: nothing to wait for (it answers nothing)


class InFlight(Protocol):
    """Running + queued requests of the worker at `base_url`; None when it does not say."""

    async def in_flight(self, worker: int, base_url: str) -> int | None: ...


class HttpInFlight:
    """Reads a worker's own figures, as the metric pollers do (`sglang.stats`)."""

    def __init__(self, timeout: float = 2.0) -> None:
        self._client = httpx.AsyncClient(trust_env=False)
        self._timeout = timeout

    async def in_flight(self, worker: int, base_url: str) -> int | None:
        sample = await poll_worker(
            self._client, base_url, self._timeout, worker=worker, known_version="?"
        )
        if not sample.ok or sample.running is None:
            return None
        return int((sample.running or 0) + (sample.queued or 0))

    async def aclose(self) -> None:
        await self._client.aclose()


async def watch_drain(
    worker: int,
    *,
    state: Callable[[int], WorkerState | None],
    gateway_routes_nothing: Callable[[], bool],
    in_flight: InFlight,
    base_url: Callable[[], str],
    feed: Callable[[int, Event], None],
    poll_s: float = POLL_S,
) -> None:
    """Report `Drained` once the worker is out of the gateway and idle; return early when
    the drain is over for another reason (budget spent, operator's --no-drain, exit)."""
    first = state(worker)
    if first is None:
        return
    began = first.since
    unknown = 0
    while True:
        s = state(worker)
        if s is None or s.phase is not Phase.DRAINING or s.since != began:
            return
        if not s.in_gateway or gateway_routes_nothing():
            n = await in_flight.in_flight(worker, base_url())
            unknown = unknown + 1 if n is None else 0
            if n == 0 or unknown >= UNKNOWN_LIMIT:
                s = state(worker)
                if s is not None and s.phase is Phase.DRAINING and s.since == began:
                    feed(worker, Drained())
                return
        await asyncio.sleep(poll_s)


async def wait_host_idle(
    workers: Collection[int],
    *,
    state: Callable[[int], WorkerState | None],
    gateway_routes_nothing: Callable[[], bool],
    in_flight: InFlight,
    base_url: Callable[[int], str],
    clock: Callable[[], float],
    timeout: float,
    poll_s: float = POLL_S,
) -> dict[int, int | None]:
    """Wait until each of `workers` still serving is out of the gateway (confirmed, or the
    gateway routes nothing) and has no request running or queued (or gives no figures
    `UNKNOWN_LIMIT` polls in a row), at most `timeout` seconds. A worker that stops
    serving meanwhile (stopped, crashed) is no longer waited for. Returns those left when
    time ran out: worker -> running + queued (None: still in the gateway, or no figures);
    {} once every one is idle."""
    end = clock() + timeout
    pending = set(workers)
    unknown = dict.fromkeys(pending, 0)
    last: dict[int, int | None] = dict.fromkeys(pending)

    async def look(w: int) -> None:
        s = state(w)
        if s is None or s.phase not in SERVING:
            pending.discard(w)  # not serving any more: nothing to wait for
            return
        if s.in_gateway and not gateway_routes_nothing():
            last[w] = None
            return
        n = await in_flight.in_flight(w, base_url(w))
        unknown[w] = unknown[w] + 1 if n is None else 0
        last[w] = n
        if n == 0 or unknown[w] >= UNKNOWN_LIMIT:
            pending.discard(w)

    while True:
        await asyncio.gather(*(look(w) for w in sorted(pending)))
        if not pending or clock() >= end:
            return {w: last[w] for w in sorted(pending)}
        await asyncio.sleep(min(poll_s, max(end - clock(), 0.0)))


class Drains:
    """The agent's drains, wired once: a worker's before its planned stop (`watch`), and
    the whole host's (`host_idle`, `farmctl drain-host`)."""

    def __init__(
        self,
        *,
        state: Callable[[int], WorkerState | None],
        gateway_routes_nothing: Callable[[], bool],
        in_flight: InFlight,
        base_url: Callable[[int], str],
        feed: Callable[[int, Event], None],
        clock: Callable[[], float],
        unconfirmed: Callable[[Collection[int]], Mapping[str, tuple[int, ...]]] = (lambda _w: {}),
    ) -> None:
        self._unconfirmed = unconfirmed
        self._state, self._routes_nothing = state, gateway_routes_nothing
        self._in_flight, self._base_url = in_flight, base_url
        self._feed, self._clock = feed, clock

    async def watch(self, worker: int) -> None:
        """Report `Drained` for `worker` once it is out of the gateway and idle."""
        await watch_drain(
            worker,
            state=self._state,
            gateway_routes_nothing=self._routes_nothing,
            in_flight=self._in_flight,
            base_url=lambda: self._base_url(worker),
            feed=self._feed,
        )

    def unconfirmed(self, workers: Collection[int]) -> Mapping[str, tuple[int, ...]]:
        """The gateways that do not answer and never confirmed some of `workers` out
        (`GatewayFleet.unconfirmed_out`): a host drain cannot say they route nothing."""
        return self._unconfirmed(workers)

    async def host_idle(self, workers: Collection[int], timeout: float) -> dict[int, int | None]:
        """Each of `workers` out of the gateway and idle; those left when `timeout` ran out."""
        return await wait_host_idle(
            workers,
            state=self._state,
            gateway_routes_nothing=self._routes_nothing,
            in_flight=self._in_flight,
            base_url=self._base_url,
            clock=self._clock,
            timeout=timeout,
        )
