"""I/O: probes of a worker's HTTP API.

Liveness uses SGLang's `/health` (200 only once warm-up is done and the scheduler answers
a 1-token generation; 503 while starting, shutting down, or when the scheduler stopped
answering); readiness asks `/ready` first where SGLang has it (`sglang/ready_route`).
`/model_info` is never used: it answers as soon as HTTP listens, before warm-up
(docs/reference/sglang.md §7).

`LocalHttp` is the agent's own client for these GETs: plain HTTP/1.1 over asyncio streams,
one connection per GET. httpx cost 3-4 ms of CPU per GET on a 2-core machine, which with
64 workers (a `/metrics` poll every 5 s and a `/health` probe every 10 s each) was most of
the agent's idle CPU (docs/benchmarks.md, "Where the time goes"); this costs a tenth of it.
"""

from __future__ import annotations

import asyncio
import errno
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

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
    status: int | None = None  # the HTTP status, when the worker answered one


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


class HttpFailure(Exception):
    """`LocalHttp.get` could not get an answer: `refused` when nothing listens."""

    def __init__(self, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    body: bytes
    truncated: bool  # the body went past the caller's `limit`; `body` holds what was read


class LocalHttp:
    """GETs to a worker's plain-HTTP API: HTTP/1.1, `Connection: close`, no TLS, no proxy.

    Reads a body of Content-Length, chunked, or until the server closes, at most `limit`
    bytes of it. `get` raises `HttpFailure` for an answer that cannot be had, the agent's
    own `OSError` (out of descriptors, ...) as is, and never bounds time itself: callers
    wrap it in `asyncio.timeout`.
    """

    async def get(
        self, url: str, *, headers: Mapping[str, str] | None = None, limit: int
    ) -> Answer:
        parts = urlsplit(url)
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        try:
            reader, writer = await asyncio.open_connection(host, port, limit=1 << 16)
        except ConnectionRefusedError as exc:
            raise HttpFailure("connection refused", refused=True) from exc
        except OSError as exc:
            if exc.errno in LOCAL_ERRNOS:
                raise
            raise HttpFailure(f"cannot connect: {exc.strerror or exc}", refused=True) from exc
        try:
            writer.write(
                f"GET {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nConnection: close\r\n"
                f"Accept-Encoding: identity\r\n{extra}\r\n".encode("latin-1")
            )
            head = await reader.readuntil(b"\r\n\r\n")
            status, fields = _head(head)
            if "chunked" in fields.get("transfer-encoding", ""):
                body, truncated = await _chunked(reader, limit)
            elif "content-length" in fields:
                n = int(fields["content-length"])
                truncated = n > limit
                body = b"" if truncated else await reader.readexactly(n)
            else:
                body = await reader.read(limit + 1)
                while body and len(body) <= limit and (more := await reader.read(limit + 1)):
                    body += more
                truncated = len(body) > limit
            return Answer(status, body[:limit], truncated)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            raise HttpFailure(f"malformed or cut answer ({type(exc).__name__})") from exc
        except OSError as exc:
            if exc.errno in LOCAL_ERRNOS:
                raise
            raise HttpFailure(f"transport error: {type(exc).__name__}: {exc.strerror}") from exc
        finally:
            writer.transport.abort()  # no lingering close handshake to wait for


def _head(head: bytes) -> tuple[int, dict[str, str]]:
    """Status code and lower-cased header fields of a response head. ValueError if malformed."""
    lines = head.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    if not version.startswith("HTTP/1."):
        raise ValueError(f"not an HTTP/1 status line: {lines[0][:64]!r}")
    fields: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            fields[name.strip().lower()] = value.strip().lower()
    return int(rest[:3]), fields


async def _chunked(reader: asyncio.StreamReader, limit: int) -> tuple[bytes, bool]:
    body = bytearray()
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
        if size == 0:
            return bytes(body), False
        if len(body) + size > limit:
            return bytes(body), True
        body += await reader.readexactly(size)
        await reader.readexactly(2)  # the chunk's CRLF


async def _local_probe(client: LocalHttp, url: str, timeout: float) -> ProbeResult:
    try:
        async with asyncio.timeout(timeout):
            answer = await client.get(url, limit=HEALTH_BODY_LIMIT)
    except TimeoutError:
        return ProbeResult(False, f"timeout after {timeout:g} s")
    except HttpFailure as exc:
        if exc.refused:
            return ProbeResult(False, "connection refused", refused=True)
        return ProbeResult(False, str(exc))
    except OSError as exc:  # the agent's own (LOCAL_ERRNOS): `get` lets only these through
        return _local(exc)
    detail = str(answer.status)
    if answer.truncated:
        detail += f" (body over {HEALTH_BODY_LIMIT // 1024} KiB, not read)"
    return ProbeResult(answer.status == 200, detail, status=answer.status)


async def probe(client: httpx.AsyncClient | LocalHttp, url: str, timeout: float) -> ProbeResult:
    """GET `url` once, within `timeout` seconds in all; never raises for network errors.

    Reads at most `HEALTH_BODY_LIMIT` bytes of the body: a worker answering an endless
    body costs the agent that much and no more. An error of the agent's own (out of file
    descriptors, ...) gives `local_error=True`, never a verdict on the worker.
    """
    if isinstance(client, LocalHttp):
        return await _local_probe(client, url, timeout)
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
    return ProbeResult(resp.status_code == 200, detail, status=resp.status_code)


class Prober(Protocol):
    """One health probe of one URL; never raises for network errors."""

    async def probe(self, url: str, timeout: float) -> ProbeResult: ...

    async def aclose(self) -> None: ...


class HttpProber:
    """Probes over `LocalHttp` (plain HTTP to a local worker: no pool, CA bundle or proxy)."""

    def __init__(self) -> None:
        self._client = LocalHttp()

    async def probe(self, url: str, timeout: float) -> ProbeResult:
        return await probe(self._client, url, timeout)

    async def aclose(self) -> None:
        return None  # one connection per GET: nothing held between probes
