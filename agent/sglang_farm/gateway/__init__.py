"""Pure: the gateway seam (`Gateway`, `Member`, `GatewayError`); see `gateway.port`.

Implementations live in submodules: `gateway.smg` (I/O, smg's worker API) and
`gateway.managed` (pure, the command line of a gateway the farm runs itself).
"""

from sglang_farm.errors import GatewayError, GatewayErrorCode
from sglang_farm.gateway.port import (
    DRAINING_STATUS,
    ROUTED_STATUS,
    Gateway,
    Member,
    normalize_url,
)

__all__ = [
    "DRAINING_STATUS",
    "ROUTED_STATUS",
    "Gateway",
    "GatewayError",
    "GatewayErrorCode",
    "Member",
    "normalize_url",
]
