"""I/O: probes of a worker's HTTP API.

Readiness and liveness both use SGLang's `/health` (200 only once warm-up is done and
the scheduler answers a 1-token generation; 503 while starting, shutting down, or when
the scheduler stopped answering). `/model_info` is never used: it answers as soon as
HTTP listens, before warm-up (docs/reference/sglang.md §7).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import httpx


@dataclass(frozen=True, slots=True)
class ProbeResult:
    ok: bool
    detail: str  # "200", "503", "connection refused", "timeout after 25 s", ...
    refused: bool = False  # nothing listens yet: normal while the model loads


async def probe(client: httpx.AsyncClient, url: str, timeout: float) -> ProbeResult:
    """GET `url` once; never raises for network errors."""
    try:
        resp = await client.get(url, timeout=timeout)
    except httpx.ConnectError:
        return ProbeResult(False, "connection refused", refused=True)
    except httpx.TimeoutException:
        return ProbeResult(False, f"timeout after {timeout:g} s")
    except httpx.TransportError as exc:
        return ProbeResult(False, f"transport error: {exc.__class__.__name__}")
    return ProbeResult(resp.status_code == 200, str(resp.status_code))


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
