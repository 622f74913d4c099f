"""Pure: what the farm knows of its gateways (`GatewayStatus`), for status, metrics and logs.

`workers.gateway_sync` keeps one gateway's status as it reconciles, `workers.gateway_fleet`
sums several up; `farm_view.FarmView.gateway` carries it to the readers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GatewayStatus:
    """What the farm knows of its gateway, for status, metrics and logs."""

    url: str
    up: bool
    members: int  # the farm's own workers the gateway routes to (as last confirmed)
    errors: int  # failed calls and reconciles since the agent started
    last_error: str | None = None
    # Members the farm did not register, as of the last reconcile (an external gateway's
    # other hosts; on a managed gateway, removed by that reconcile).
    foreign: tuple[str, ...] = ()
    # Issue 26, several gateways ([gateway] urls): each one's own status; this one then
    # sums them up (up: any answers; members: the workers counted as in, each one's
    # `in_gateway`; url: the first one's). Empty with one gateway: this status is that
    # gateway's.
    gateways: tuple[GatewayStatus, ...] = ()
    # The farm's workers this gateway confirmed it routes to; None: not told (a summary
    # of several, or a hand-made status), each worker's `in_gateway` says.
    routed: tuple[int, ...] | None = None
    # Issue 34 §3: the farm's workers this gateway lists ready but leaves out of routing
    # for overload (smg's overload protection), each with why (its figure and threshold),
    # as of the last reconcile.
    overloaded: tuple[tuple[int, str], ...] = ()

    @property
    def each(self) -> tuple[GatewayStatus, ...]:
        """Every gateway's own status (one gateway: this one)."""
        return self.gateways or (self,)
