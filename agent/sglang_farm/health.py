"""I/O: probes of a worker's HTTP API.

Readiness and liveness both use SGLang's `/health` (200 only once warm-up is done and
the scheduler answers a 1-token generation; 503 while starting, shutting down, or when
the scheduler stopped answering). `/model_info` is never used: it answers as soon as
HTTP listens, before warm-up (interface sheet §2.2).
"""

from __future__ import annotations

from dataclasses import dataclass

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
