"""I/O: the `Gateway` port over smg's worker API (`GET/POST /workers`, `DELETE /workers/{id}`).

What this adapter relies on, measured against smg 1.13.0 in front of the farm's
simulator (docs/gateway.md has the commands and figures):

- `POST /workers {"url": ...}` answers 202 at once; registration (probing the worker,
  reading its model) runs in the background, and the worker is listed, status
  "ready", about 0.3 s later. A worker whose registration still runs is not listed.
- `DELETE /workers/{id}` answers 202; a "ready" worker turns "draining" within a few
  milliseconds and gets no new request from then on. Requests already in flight to it
  complete. It leaves the list after its drain settle time: smg's default is 5 s, and
  this adapter registers workers with `drain_settle_s` (0 by default), because the
  farm drains a worker itself (its own running + queued requests) before stopping it.
- 409 `WORKER_ALREADY_EXISTS` for a URL that is listed (a draining one too: a new
  POST must wait until it is gone); 409 `WORKER_CREATE_IN_PROGRESS` while a
  registration for the URL runs. Only "ready" workers receive traffic.
- `POST /workers` takes the key smg must present to that worker (`"api_key"`). A
  registration whose worker refuses it (401 on `/v1/models`) is not listed and is
  retried by smg in the background for minutes, answering 409 `WORKER_CREATE_IN_PROGRESS`
  to any new POST of the URL; `DELETE /workers/{id}` with the id of the 202 ends that.
- Control-plane auth is `Authorization: Bearer <key>` (an admin key given to smg by
  `--control-plane-api-keys`, or its shared `--api-key`); 401 without a valid one.
"""

from __future__ import annotations

import asyncio
import builtins
import json
from collections.abc import Mapping
from types import TracebackType
from typing import Any, Protocol

import httpx

from sglang_farm.errors import GatewayError, GatewayErrorCode
from sglang_farm.gateway.port import (
    DRAINING_STATUS,
    Member,
    normalize_url,
)
from sglang_farm.gateway.routing import engine_figures


class KeyGuard(Protocol):
    """Who may be sent the key (`gateway.listener.ListenerGuard`: the managed gateway's
    own smg only). `verify` raises `GatewayError` where the key must not go."""

    async def verify(self) -> frozenset[int]: ...

    async def confirm(self, before: frozenset[int], what: str) -> None: ...


# Statuses of a registered worker that will not become "ready" again on its own before
# smg's next health check (60 s by default): re-registered when the farm adds it.
_STALE_STATUSES = frozenset({"not_ready", "failed"})


class SmgGateway:
    """Membership of one smg gateway, through its worker API.

    `api_key` is the control-plane key the farm sends (never logged, never in an
    error). The key smg must present to a worker (SGLang's `--api-key`) is given with
    each `add`, from the config in force: smg does not give its own `--api-key` to
    workers added through the API, and takes a key per worker (`"api_key"` in
    `POST /workers`), so a reload that adds or changes a worker's key re-registers it
    with the new one when it comes back (item 8 of issue 22). Bounds: `add` waits at
    most `add_timeout` seconds for the worker to be listed as ready; `remove` at most
    `remove_timeout` for it to leave the routed set (measured: a few milliseconds);
    both raise `GatewayError` with code TIMEOUT past them. Every single HTTP request is
    bounded by `request_timeout`. With a `guard` (a managed gateway: `gateway.listener`),
    no request leaves before the listener is shown to be the gateway's own (issue 30).

    Workers are registered with `labels` and smg's per-worker `health` overrides
    (`timeout_secs`, `check_interval_secs`, `failure_threshold`, `success_threshold`,
    `disable_health_check`), plus `drain_settle_secs` = `drain_settle_s`. smg probes
    `/health` while registering (5 s timeout by default; a probe that fails is retried
    only every 30 s), and SGLang's `/health` can take up to 20 s on a busy worker
    (docs/reference/sglang.md §6): `{"timeout_secs": 20}` keeps a busy worker from being
    refused or dropped by smg's checks.
    """

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        labels: Mapping[str, str] | None = None,
        health: Mapping[str, int | bool] | None = None,
        client: httpx.AsyncClient | None = None,
        request_timeout: float = 5.0,
        add_timeout: float = 30.0,
        remove_timeout: float = 10.0,
        poll_interval: float = 0.05,
        drain_settle_s: int = 0,
        guard: KeyGuard | None = None,
    ) -> None:
        self._url = url.strip().rstrip("/")
        self._guard = guard
        self.set_key(api_key)
        self._labels = dict(labels or {})
        self._health = dict(health or {})
        self._own_client = client is None
        self._client = client if client is not None else httpx.AsyncClient()
        self._request_timeout = request_timeout
        self._add_timeout = add_timeout
        self._remove_timeout = remove_timeout
        self._poll = poll_interval
        self._drain_settle_s = drain_settle_s
        # smg's id of each registration this adapter started that has not been listed
        # ready yet, and of those its `add` gave up on (see `_register`).
        self._started: dict[str, str] = {}
        self._stale: dict[str, str] = {}

    @property
    def url(self) -> str:
        return self._url

    def set_key(self, api_key: str | None) -> None:
        """The key sent from now on (a rotated admin key: `gateway.rotation`)."""
        self._has_key = bool(api_key)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def aclose(self) -> None:
        """Close the HTTP client if this object created it."""
        if self._own_client:
            await self._client.aclose()

    async def __aenter__(self) -> SmgGateway:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # -- the port ----------------------------------------------------------------------

    async def up(self) -> bool:
        """True when `GET /workers` answers 200 with the farm's credentials. Never raises."""
        try:
            r = await self._request("GET", "/workers")
        except GatewayError:
            return False
        return r.status_code == 200

    async def list(self) -> builtins.list[Member]:
        r = await self._request("GET", "/workers")
        if r.status_code != 200:
            raise self._refused("list its workers", r)
        try:
            return parse_members(r.json())
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            raise GatewayError(
                self._url,
                GatewayErrorCode.PROTOCOL,
                f"GET /workers answered what this farm cannot read ({exc}); is this an smg "
                "gateway (the farm is tested against smg 1.13)?",
            ) from exc

    async def add(self, url: str, *, api_key: str | None = None) -> None:
        u = normalize_url(url)
        try:
            async with asyncio.timeout(self._add_timeout):
                await self._register(u, api_key)
                # Polling: the gateway has no way to tell when a registration finished.
                while True:
                    if any(m.url == u and m.routed for m in await self.list()):
                        self._started.pop(u, None)
                        return
                    await asyncio.sleep(self._poll)
        except TimeoutError:
            if u in self._started:
                self._stale[u] = self._started.pop(u)
            raise GatewayError(
                self._url,
                GatewayErrorCode.TIMEOUT,
                f"did not list worker {u} as ready within {self._add_timeout:g} s of the "
                "farm adding it; the gateway keeps probing it in the background (its log "
                "says why: 'Failed job: type=AddWorker'). Check that the gateway's host can "
                f"reach {u}/health",
            ) from None

    async def remove(self, url: str) -> None:
        u = normalize_url(url)
        last: builtins.list[Member] = []
        try:
            async with asyncio.timeout(self._remove_timeout):
                for m in await self.list():
                    # A draining worker is already out of rotation; every other status
                    # is deleted, so that a worker failing smg's checks now does not
                    # come back into rotation when it answers them again.
                    if m.url == u and m.status != DRAINING_STATUS:
                        await self._delete(m)
                # A registration of ours still running (not listed): cancelled, so that
                # it cannot bring the worker in later, with what may be an old key.
                for pending in (self._started.pop(u, None), self._stale.pop(u, None)):
                    if pending is not None:
                        await self._delete(Member(url=u, id=pending, status="pending"))
                while True:
                    last = [m for m in await self.list() if m.url == u]
                    if not any(m.routed for m in last):
                        return
                    await asyncio.sleep(self._poll)
        except TimeoutError:
            seen = ", ".join(f"{m.id} {m.status}" for m in last) or "not seen"
            raise GatewayError(
                self._url,
                GatewayErrorCode.TIMEOUT,
                f"still routes to worker {u} ({seen}) {self._remove_timeout:g} s after the "
                "farm removed it; requests may still reach it. Check the gateway's log for "
                "'type=RemoveWorker'",
            ) from None

    # -- membership steps --------------------------------------------------------------

    async def _register(self, u: str, api_key: str | None) -> None:
        """POST the worker (with the key smg must present to it) until smg accepts it or
        it is already routed."""
        body: dict[str, Any] = {
            "url": u,
            "health": {"drain_settle_secs": self._drain_settle_s, **self._health},
        }
        if api_key:
            body["api_key"] = api_key
        if self._labels:
            body["labels"] = self._labels
        while True:
            r = await self._request("POST", "/workers", body)
            if r.status_code in (200, 201, 202):
                wid = _worker_id(r)
                if wid is not None:
                    self._started[u] = wid
                return
            if r.status_code != 409:
                raise self._refused(f"add worker {u}", r)
            if _error_code(r) == "WORKER_CREATE_IN_PROGRESS":
                stale = self._stale.pop(u, None)
                if stale is None:
                    return  # a registration of the same URL runs: wait for its result
                # Ours, and not done within a whole `add_timeout`: smg keeps retrying it
                # (with the key it was given then: a reload may have changed the
                # worker's since, and smg's 401s never end). Cancel it, register anew.
                await self._delete(Member(url=u, id=stale, status="pending"))
                await asyncio.sleep(self._poll)
                continue
            mine = [m for m in await self.list() if m.url == u]
            if any(m.routed for m in mine):
                return
            for m in mine:
                if m.status in _STALE_STATUSES:
                    await self._delete(m)
            # Draining (gone after its settle time), just deleted, or not listed yet:
            # try again shortly, within the caller's bound.
            await asyncio.sleep(self._poll)

    async def _delete(self, m: Member) -> None:
        r = await self._request("DELETE", f"/workers/{m.id}")
        # 404: it left between the listing and this call, which is what was wanted.
        if r.status_code not in (200, 202, 204, 404):
            raise self._refused(f"remove worker {m.url} (id {m.id})", r)

    # -- HTTP --------------------------------------------------------------------------

    async def _request(
        self, method: str, path: str, body: Mapping[str, Any] | None = None
    ) -> httpx.Response:
        """One request; transport failures and 401/403 become `GatewayError`s.

        With a `guard` (a managed gateway), a request is sent only once the listener is
        shown to be the gateway's own, and checked again after it: every request carries
        the admin key, and a registration the key of its worker."""
        before = None
        if self._guard is not None:
            before = await self._guard.verify()
        try:
            try:
                r = await self._client.request(
                    method,
                    self._url + path,
                    json=body,
                    headers=self._headers,
                    timeout=self._request_timeout,
                )
            except (httpx.ConnectError, httpx.ConnectTimeout):
                before = None  # no connection was made: nothing was sent
                raise
        except httpx.TimeoutException as exc:
            raise GatewayError(
                self._url,
                GatewayErrorCode.UNREACHABLE,
                f"no answer to {method} {path} within {self._request_timeout:g} s; check "
                "that the gateway runs and is not overloaded",
            ) from exc
        except httpx.TransportError as exc:
            raise GatewayError(
                self._url,
                GatewayErrorCode.UNREACHABLE,
                f"cannot reach it for {method} {path} ({type(exc).__name__}: {exc}); check "
                "that the gateway runs and listens at this address",
            ) from exc
        finally:
            if self._guard is not None and before is not None:
                await self._guard.confirm(before, f"{method} {path}")
        if r.status_code in (401, 403):
            if self._has_key:
                what = "refused the farm's key"
            else:
                what = "requires a key and the farm has none"
            raise GatewayError(
                self._url,
                GatewayErrorCode.UNAUTHORIZED,
                f"{what} ({r.status_code} to {method} {path}: {_error_text(r)}); give the "
                "farm the gateway's admin key (the key in smg's --control-plane-api-keys, "
                "or its --api-key)",
            )
        return r

    def _refused(self, what: str, r: httpx.Response) -> GatewayError:
        return GatewayError(
            self._url,
            GatewayErrorCode.REFUSED,
            f"refused to {what}: {r.status_code} {_error_text(r)}",
        )


def parse_members(body: object) -> list[Member]:
    """`GET /workers`'s answer as `Member`s. Raises ValueError for another shape."""
    if not isinstance(body, dict) or not isinstance(body.get("workers"), list):
        raise ValueError('expected an object with a "workers" list')
    members = []
    for i, w in enumerate(body["workers"]):
        if not isinstance(w, dict):
            raise ValueError(f"workers[{i}] is not an object")
        url, wid = w.get("url"), w.get("id")
        if not isinstance(url, str) or not isinstance(wid, str):
            raise ValueError(f'workers[{i}] has no "url" and "id" strings')
        status = w.get("status")
        if not isinstance(status, str):
            status = "ready" if w.get("is_healthy") is True else "not_ready"
        model = w.get("model_id")
        load = w.get("load")
        waiting, usage = engine_figures(w.get("engine_load"))
        members.append(
            Member(
                url=url.rstrip("/"),
                id=wid,
                status=status,
                model_id=model if isinstance(model, str) else None,
                load=load if isinstance(load, int) else 0,
                waiting=waiting,
                token_usage=usage,
            )
        )
    return members


def _worker_id(r: httpx.Response) -> str | None:
    """The id smg gives a registration it accepted (`{"worker_id": ...}`), if any."""
    try:
        body = r.json()
    except ValueError:
        return None
    wid = body.get("worker_id") if isinstance(body, dict) else None
    # It goes into a path (DELETE /workers/{id}): smg's ids are UUIDs.
    if isinstance(wid, str) and wid and all(c.isalnum() or c in "-_" for c in wid):
        return wid
    return None


def _error_code(r: httpx.Response) -> str | None:
    """smg's worker-endpoint error code (`{"error": "...", "code": "..."}`), if any."""
    try:
        body = r.json()
    except ValueError:
        return None
    code = body.get("code") if isinstance(body, dict) else None
    return code if isinstance(code, str) else None


def _error_text(r: httpx.Response) -> str:
    """The gist of an error answer, in one line of at most 300 characters."""
    try:
        body = r.json()
    except ValueError:
        text = r.text
    else:
        err = body.get("error") if isinstance(body, dict) else None
        if isinstance(err, dict):
            err = err.get("message")
        text = err if isinstance(err, str) else json.dumps(body)
    text = " ".join(text.split())
    return text[:300] if text else "(empty answer)"
