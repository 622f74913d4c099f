"""An in-memory `Gateway` for tests of what the farm does with its gateway.

It keeps the same contract as `SmgGateway` (tests/test_gateway_smg.py runs one
scenario against both): `add` lists the worker as routed, `remove` takes it out of
rotation at once, both are idempotent, URLs are normalized, and every method but `up`
raises `GatewayError` while the gateway is `down`. Calls are recorded in order;
`fail_add`/`fail_remove` make a call for that URL raise REFUSED; `others` seeds
workers registered by someone else (another host's farm); `delay` makes every call take
that long first (a slow gateway; `float("inf")`: one that never answers); `hang_add` makes
an add of that URL register it and then never answer (smg routed it, but its answer to the
farm's add had not come back when the gateway froze); `refuse_after_add` makes an add of that
URL register it and then answer REFUSED (smg's add timeout for a slow worker, which it
registers all the same); `list_lag` makes a list take that long after it has read the
members (its answer is the gateway as it was when asked). `timeline` gets
a line per call too ("gateway remove URL"): a harness shares one list among its fakes, to
order their calls.
"""

from __future__ import annotations

import asyncio
import builtins
import itertools
from collections.abc import Iterable

from sglang_farm.gateway import GatewayError, GatewayErrorCode, Member, normalize_url


class FakeGateway:
    def __init__(self, url: str = "http://127.0.0.1:8000", others: Iterable[str] = ()) -> None:
        self._url = url
        self._ids = itertools.count(1)
        self.members: dict[str, Member] = {}
        self.calls: list[tuple[str, str]] = []  # ("add" | "remove", normalized URL)
        self.timeline: list[str] = []
        self.keys: dict[str, str | None] = {}  # the worker key each URL was last added with
        self.down = False
        self.delay = 0.0
        self.fail_add: set[str] = set()
        self.fail_remove: set[str] = set()
        self.hang_add: set[str] = set()
        self.refuse_after_add: set[str] = set()
        self.list_lag = 0.0
        for u in others:
            self._put(normalize_url(u))

    @property
    def url(self) -> str:
        return self._url

    def routed(self) -> set[str]:
        """The URLs the gateway sends new requests to now."""
        return {u for u, m in self.members.items() if m.routed}

    async def up(self) -> bool:
        return not self.down

    async def _slow(self) -> None:
        if self.delay == float("inf"):
            await asyncio.Event().wait()
        elif self.delay:
            await asyncio.sleep(self.delay)

    async def add(self, url: str, *, api_key: str | None = None) -> None:
        await self._slow()
        u = normalize_url(url)
        self.calls.append(("add", u))
        self.timeline.append(f"gateway add {u}")
        self.keys[u] = api_key
        self._check(u, self.fail_add, "add")
        if u not in self.members:
            self._put(u)
        if u in self.hang_add:
            await asyncio.Event().wait()
        if u in self.refuse_after_add:
            raise GatewayError(self._url, GatewayErrorCode.REFUSED, f"add of {u} timed out (fake)")

    async def remove(self, url: str) -> None:
        await self._slow()
        u = normalize_url(url)
        self.calls.append(("remove", u))
        self.timeline.append(f"gateway remove {u}")
        self._check(u, self.fail_remove, "remove")
        self.members.pop(u, None)

    async def list(self) -> builtins.list[Member]:
        await self._slow()
        self._check("", set(), "list")
        members = list(self.members.values())
        if self.list_lag:
            await asyncio.sleep(self.list_lag)
        return members

    def _put(self, u: str) -> None:
        self.members[u] = Member(url=u, id=f"fake-{next(self._ids)}", status="ready")

    def _check(self, u: str, failing: set[str], what: str) -> None:
        if self.down:
            raise GatewayError(
                self._url, GatewayErrorCode.UNREACHABLE, f"cannot reach it for {what} (fake: down)"
            )
        if u in failing:
            raise GatewayError(
                self._url, GatewayErrorCode.REFUSED, f"refused to {what} worker {u} (fake)"
            )
