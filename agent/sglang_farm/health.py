"""I/O: probes of a worker's HTTP API.

Readiness and liveness both use SGLang's `/health` (200 only once warm-up is done and
the scheduler answers a 1-token generation; 503 while starting, shutting down, or when
the scheduler stopped answering). `/model_info` is never used: it answers as soon as
HTTP listens, before warm-up (docs/reference/sglang.md §7).
"""

from __future__ import annotations

import asyncio
import errno
import os
from dataclasses import dataclass
from typing import Protocol

import httpx

HEALTH_BODY_LIMIT = 64 * 1024  # bytes of a /health body read; the verdict is the status code

# errnos that say the agent itself is short of something (descriptors, buffers, memory,
# ephemeral ports), never that the worker refused, reset or did not answer.
LOCAL_ERRNOS = frozenset(
    {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.EADDRNOTAVAIL}
)


@dataclass(frozen=True, slots=True)
class ProbeResult:
    ok: bool
    detail: str  # "200", "503", "connection refused", "timeout after 25 s", ...
    refused: bool = False  # nothing listens yet: normal while the model loads
    # The agent's own trouble (out of fds, ...): says nothing about the worker. Callers
    # treat the beat as unknown, never as the worker's failure.
    local_error: bool = False


def _local_oserror(exc: BaseException) -> OSError | None:
    """The agent-side OSError behind `exc` (httpx wraps it in its own errors), if any."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno in LOCAL_ERRNOS:
            return cur
        cur = cur.__cause__ or cur.__context__
    return None


def _local(exc: OSError) -> ProbeResult:
    code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return ProbeResult(
        False,
        f"agent-side error, worker not judged: {code} ({os.strerror(exc.errno or 0)})",
        local_error=True,
    )


async def probe(client: httpx.AsyncClient, url: str, timeout: float) -> ProbeResult:
    """GET `url` once, within `timeout` seconds in all; never raises for network errors.

    Reads at most `HEALTH_BODY_LIMIT` bytes of the body: a worker answering an endless
    body costs the agent that much and no more. An error of the agent's own (out of file
    descriptors, ...) gives `local_error=True`, never a verdict on the worker.
    """
    try:
        # httpx's timeout bounds each read, not the whole answer: a body dripping one byte
        # at a time would never trip it. This bounds the probe.
        async with asyncio.timeout(timeout):
            async with client.stream("GET", url, timeout=timeout) as resp:
                read = 0
                async for chunk in resp.aiter_raw():
                    read += len(chunk)
                    if read > HEALTH_BODY_LIMIT:
                        break  # leaving the block closes the connection
    except httpx.ConnectError as exc:
        if (local := _local_oserror(exc)) is not None:
            return _local(local)
        return ProbeResult(False, "connection refused", refused=True)
    except (httpx.TimeoutException, TimeoutError):
        return ProbeResult(False, f"timeout after {timeout:g} s")
    except httpx.TransportError as exc:
        if (local := _local_oserror(exc)) is not None:
            return _local(local)
        return ProbeResult(False, f"transport error: {exc.__class__.__name__}")
    except OSError as exc:  # raised by a transport without httpx's wrapping
        if (local := _local_oserror(exc)) is not None:
            return _local(local)
        return ProbeResult(False, f"transport error: {exc.__class__.__name__}: {exc.strerror}")
    detail = str(resp.status_code)
    if read > HEALTH_BODY_LIMIT:
        detail += f" (body over {HEALTH_BODY_LIMIT // 1024} KiB, not read)"
    return ProbeResult(resp.status_code == 200, detail)


class Prober(Protocol):
    """One health probe of one URL; never raises for network errors."""

    async def probe(self, url: str, timeout: float) -> ProbeResult: ...

    async def aclose(self) -> None: ...


class HttpProber:
    """Probes over one shared HTTP client.

    One client for all probes: each client loads a CA bundle (~0.7 MiB and up to 0.1 s of
    the loop each), and every probe is plain HTTP to a local worker anyway.
    """

    def __init__(self) -> None:
        self._client = httpx.AsyncClient(
            trust_env=False,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )

    async def probe(self, url: str, timeout: float) -> ProbeResult:
        return await probe(self._client, url, timeout)

    async def aclose(self) -> None:
        await self._client.aclose()
