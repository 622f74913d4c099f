"""Pure: the gateway's families (only with a [gateway]), one series per gateway."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric

from sglang_farm.farm_view import GatewayStatus
from sglang_farm.metrics.families import (
    new_counter,
    new_gauge,
    public_url,
)


def gateway(gw: GatewayStatus) -> Iterator[Metric]:
    # Only with a [gateway]: a farm without one has no gateway series at all.
    up = new_gauge(
        "sglang_farm_gateway_up",
        "1 if the gateway answered the farm's latest membership call or reconcile.",
        ["url"],
    )
    for each in gw.each:  # issue 26: one series per gateway of [gateway] urls
        up.add_metric([public_url(each.url)], 1 if each.up else 0)
    yield up
    members = new_gauge(
        "sglang_farm_gateway_members",
        "The farm's own workers the gateway routes to, as it last confirmed (several "
        "gateways: those the farm counts as in, sglang_farm_worker_in_gateway).",
    )
    members.add_metric([], gw.members)
    yield members
    routed = new_gauge(
        "sglang_farm_gateway_routed_workers",
        "The farm's own workers this gateway routes to, as it last confirmed.",
        ["url"],
    )
    for each in gw.each:
        routed.add_metric([public_url(each.url)], each.members)
    yield routed
    errors = new_counter(
        "sglang_farm_gateway_errors",
        "Failed gateway membership calls and reconciles since the agent started.",
        [],
    )
    errors.add_metric([], gw.errors)
    yield errors
    foreign = new_gauge(
        "sglang_farm_gateway_foreign_members",
        "Workers in the gateway that the farm did not register (farmctl status names them); "
        "a managed gateway's are removed at the next reconcile.",
    )
    foreign.add_metric([], len(gw.foreign))
    yield foreign
    overloaded = new_gauge(
        "sglang_farm_gateway_overloaded_workers",
        "The farm's workers the gateway lists ready but leaves out of routing for overload "
        "(smg's overload protection; farmctl status names them), as of the last reconcile.",
    )
    overloaded.add_metric([], len({w for w, _ in gw.overloaded}))
    yield overloaded
