"""Pure: the seam between the farm and the gateway in front of its workers.

A `Gateway` holds the membership of one model gateway (smg, docs/gateway.md): which
worker base URLs it routes requests to. The farm adds a worker when it is READY and
removes it before anything the farm does to it; `remove` returns only once the gateway
routes no new request to the worker, so a stop that follows it never meets a new
request. Implementations: `gateway.smg.SmgGateway` (smg's worker API over HTTP) and
`tests/fake_gateway.py` (in memory).

Errors are `GatewayError`s (a `FarmError`) with a closed `GatewayErrorCode`; each
message names the gateway's URL and says what to do.
"""

from __future__ import annotations

import builtins
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

# smg's worker statuses (GET /workers): only "ready" receives traffic; "draining" is a
# removed worker kept for its settle window, with no new requests (docs/gateway.md).
ROUTED_STATUS = "ready"
DRAINING_STATUS = "draining"


@dataclass(frozen=True, slots=True)
class Member:
    """One worker the gateway knows, whoever registered it."""

    url: str  # normalized base URL (`normalize_url`)
    id: str  # the gateway's own worker id
    status: str  # smg: pending, ready, not_ready, failed, draining
    model_id: str | None = None
    load: int = 0  # requests the gateway has in flight to it
    # The engine's figures smg last polled (its `engine_load`): queued requests (summed
    # over DP ranks) and mean KV usage; None: not reported (yet), or not smg.
    waiting: int | None = None
    token_usage: float | None = None

    @property
    def routed(self) -> bool:
        """True when the gateway sends new requests to this worker."""
        return self.status == ROUTED_STATUS


def normalize_url(url: str) -> str:
    """The form in which worker URLs are compared: no surrounding blanks, no trailing '/'.

    Raises ValueError for a URL without an http:// or https:// scheme, which smg refuses
    (`400 BAD_REQUEST`), so that the mistake is reported where it is made.
    """
    u = url.strip().rstrip("/")
    parts = urlsplit(u)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"worker URL {url!r}: expected http://HOST:PORT")
    return u


class Gateway(Protocol):
    """Membership of one gateway. Every method may raise `GatewayError` except `up`."""

    @property
    def url(self) -> str:
        """The gateway's base URL, for messages, status and metrics."""
        ...

    async def add(self, url: str, *, api_key: str | None = None) -> None:
        """Route to the worker at `url`; returns once the gateway lists it as routed.

        `api_key`: the key the gateway must present to the worker (SGLang's `--api-key`),
        from the config in force when the worker is added. Idempotent: a worker already
        routed is left as it is.
        """
        ...

    async def remove(self, url: str) -> None:
        """Stop routing to `url`; returns once the gateway sends it no new request.

        Requests already in flight to it are not cut. Idempotent: an unknown URL is a
        no-op. Raises `GatewayError` (code TIMEOUT) when the gateway has not confirmed
        within the implementation's bound.
        """
        ...

    async def up(self) -> bool:
        """True when the gateway answers its worker API with the farm's credentials."""
        ...

    async def list(self) -> builtins.list[Member]:
        """Every worker the gateway knows, the farm's own and others' alike."""
        ...
