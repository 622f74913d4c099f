"""Pure: smg's own routing opinions, set by the farm on purpose (issue 34 §3).

smg 1.13 decides by itself, with defaults of its own, when a worker is left out of
routing (overload protection, exclusion timers), how much traffic a fresh worker gets
(cache_aware's warm-up slice) and in which order requests are admitted (the priority
scheduler). Each of these touches the farm: its "in the gateway" word, a drain's wait,
the canary's traffic share, a batch that fills every slot. So the managed gateway's
command line names every one of them (`smg_flags`), from `[gateway]` keys an operator
may change (`GatewayRouting` in the spec), and a later smg that changes a default does
not change the farm behind its back. Why each default is what it is: `REASONS`, and
docs/gateway.md ("smg's routing opinions") with the measurements.

`overloaded(waiting, token_usage, routing)` judges smg's own worker list as smg does,
so that `farmctl status` can say which worker smg left out of rotation for overload
while smg still lists it `ready`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import fields

from sglang_farm.spec import GatewayRouting

DEFAULT = GatewayRouting()

# The `[gateway]` key of each field, and smg's flag for it (smg 1.13, smg/router_args.py);
# overload_protection = false is --disable-worker-overload-protection.
KEYS: Mapping[str, str] = {
    "overload_protection": "--worker-overload-protection",
    "overload_waiting_requests": "--worker-overload-waiting-requests",
    "overload_token_usage": "--worker-overload-token-usage",
    "overload_shed": "--worker-overload-shed",
    "stall_secs": "--worker-stall-secs",
    "wedge_secs": "--worker-wedge-secs",
    "stale_secs": "--worker-stale-secs",
    "warmup_secs": "--worker-warmup-secs",
    "warmup_blocks": "--worker-warmup-blocks",
    "warmup_share": "--worker-warmup-share",
    "priority_scheduler": "--priority-scheduler-enabled",
    # written by the launcher from it (gateway.scheduler)
    "priority_user_share": "--priority-scheduler-config",
}

# smg flags the farm sets from these keys: `[gateway] extra_args` may not repeat them.
FLAGS: Mapping[str, str] = {
    **{flag: key for key, flag in KEYS.items()},
    "--disable-worker-overload-protection": "overload_protection",
}

# Why each default (docs/gateway.md has the measurements behind them).
REASONS: Mapping[str, str] = {
    "overload_protection": (
        "smg's default, kept: a worker with a long queue or a full KV cache is passed over "
        "while a sibling has room, which shortens users' waits; the farm still counts it "
        "in the gateway (smg lists it ready) and status says it is overloaded"
    ),
    "overload_waiting_requests": (
        "smg's 8, kept: SGLang queues only once its running batch is full, so 8 waiting "
        "requests means a saturated worker"
    ),
    "overload_token_usage": (
        "smg's 0.8, kept: a worker whose KV cache is that full has little room for a new "
        "request, and near a full cache SGLang retracts running requests to make room"
    ),
    "overload_shed": (
        "off, smg's default: a batch that fills every worker would otherwise have the "
        "gateway answer users' requests 503; routed to the least loaded, they wait instead"
    ),
    "stall_secs": "smg's 2, kept: a transport failure already fails over by retry",
    "wedge_secs": (
        "smg's 3, kept: it only holds back new requests (measured: it slowed, did not stop, "
        "those to a wedged simulator); the farm's own stall check ([health] stall_window) "
        "is what takes a wedged worker out and restarts it"
    ),
    "stale_secs": (
        "smg's 15, kept: it applies only to workers that push KV-event load records, "
        "which the farm's SGLang workers do not"
    ),
    "warmup_secs": (
        "smg's 60, kept: a restarted worker (a canary) is offered cache misses to build its "
        "cache; measured, it changed no restarted worker's share (docs/benchmarks.md)"
    ),
    "warmup_blocks": "smg's 1024, kept, with warmup_secs",
    "warmup_share": "smg's 0.25, kept, with warmup_secs",
    "priority_scheduler": (
        "off, smg's default: on, the batch service's bulk requests are admitted after "
        "users' (docs/batch.md, 'Priority')"
    ),
    "priority_user_share": (
        "1 slot in 4 held for users' requests (default class), the rest free for a bulk "
        "batch; smg's built-in class defaults hold nearly all of a small farm's capacity "
        "for classes the farm's users do not use, which left a bulk batch about 2 slots; "
        "of 1/8, 1/4 and 1/2, a quarter gave users the shortest waits under a batch at the "
        "batch's best pace (docs/benchmarks.md, 'Batch jobs: users first')"
    ),
}

assert set(KEYS) == set(REASONS) == {f.name for f in fields(GatewayRouting)}


def problems(r: GatewayRouting) -> list[tuple[str, str]]:
    """Each value smg would refuse or the farm cannot use: (key, message saying what to
    write instead). Empty when `r` can be rendered."""
    out: list[tuple[str, str]] = []

    def whole(key: str, value: int, lo: int, hint: str) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            out.append((key, f"expected whole seconds >= {lo} ({hint}), got {value!r}"))

    n = r.overload_waiting_requests
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        out.append(
            (
                "overload_waiting_requests",
                f"expected an integer >= 1 (smg compares 'at or above': 0 would leave every "
                f"worker out of routing), got {n!r}; to switch overload protection off, set "
                "overload_protection = false",
            )
        )
    u = r.overload_token_usage
    if not _fraction(u) or u <= 0:
        out.append(
            (
                "overload_token_usage",
                f"expected a fraction of the KV cache in (0, 1], e.g. 0.8, got {u!r}; "
                "1 leaves a worker in until its cache is full",
            )
        )
    if r.overload_shed and not r.overload_protection:
        out.append(
            (
                "overload_shed",
                "needs overload_protection = true (without it no worker is ever "
                "overloaded, so nothing is shed); remove overload_shed or set "
                "overload_protection = true",
            )
        )
    whole("stall_secs", r.stall_secs, 1, "0 would exclude a worker at its first transport error")
    whole("wedge_secs", r.wedge_secs, 1, "0 would exclude every loaded worker between tokens")
    whole("stale_secs", r.stale_secs, 0, "0 switches the check off")
    whole("warmup_secs", r.warmup_secs, 0, "0 switches the warm-up slice off")
    b = r.warmup_blocks
    if isinstance(b, bool) or not isinstance(b, int) or b < 1:
        out.append(
            (
                "warmup_blocks",
                f"expected an integer >= 1 (cache blocks a fresh worker must add to count "
                f"as warm), got {b!r}; to switch the warm-up slice off, set warmup_secs = 0",
            )
        )
    p = r.priority_user_share
    if not _fraction(p) or p >= 1:
        out.append(
            (
                "priority_user_share",
                f"expected a fraction in [0, 1) of smg's capacity held for users' requests "
                f"(0.25: one slot in 4; 0: a bulk batch may take every slot; 1 would leave "
                f"it none), got {p!r}",
            )
        )
    s = r.warmup_share
    if not _fraction(s):
        out.append(
            (
                "warmup_share",
                f"expected a fraction in 0..1 of cache misses offered to a warming worker "
                f"(0.25: one in four), got {s!r}",
            )
        )
    return out


def _fraction(v: object) -> bool:
    return (
        isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and 0 <= v <= 1
    )


def smg_flags(r: GatewayRouting) -> list[str]:
    """The `smg launch` flags that set every opinion, defaults included (so a later smg's
    other default cannot change the farm's gateway). Raises ValueError on `problems`."""
    found = problems(r)
    if found:
        raise ValueError("; ".join(f"{key}: {msg}" for key, msg in found))
    out: list[str] = []
    if r.overload_protection:
        out += [
            "--worker-overload-protection",
            "--worker-overload-waiting-requests",
            str(r.overload_waiting_requests),
            "--worker-overload-token-usage",
            _num(r.overload_token_usage),
        ]
        if r.overload_shed:
            out.append("--worker-overload-shed")
    else:
        out.append("--disable-worker-overload-protection")
    out += [
        "--worker-stall-secs",
        str(r.stall_secs),
        "--worker-wedge-secs",
        str(r.wedge_secs),
        "--worker-stale-secs",
        str(r.stale_secs),
        "--worker-warmup-secs",
        str(r.warmup_secs),
        "--worker-warmup-blocks",
        str(r.warmup_blocks),
        "--worker-warmup-share",
        _num(r.warmup_share),
    ]
    if r.priority_scheduler:
        out.append("--priority-scheduler-enabled")
    return out


def _num(v: float) -> str:
    return repr(float(v))


def owned_flag(arg: str) -> str | None:
    """The `[gateway]` key that sets the smg flag `arg` (`--flag` or `--flag=value`), if any."""
    return FLAGS.get(arg.split("=", 1)[0])


def engine_figures(engine_load: object) -> tuple[int | None, float | None]:
    """A worker's queued requests and KV usage from the `engine_load` of its entry in
    smg's `GET /workers` (`{"loads": [{"num_waiting_reqs", "token_usage", ...} per DP
    rank]}`), as smg's overload protection reads them: the waiting requests summed over
    the ranks, their mean KV usage. None where smg has no figure (yet)."""
    if not isinstance(engine_load, Mapping):
        return None, None
    loads = engine_load.get("loads")
    if not isinstance(loads, list):
        return None, None
    waiting: int | None = None
    usage: list[float] = []
    for rank in loads:
        if not isinstance(rank, Mapping):
            continue
        w = rank.get("num_waiting_reqs")
        if isinstance(w, int) and not isinstance(w, bool):
            waiting = (waiting or 0) + w
        t = rank.get("token_usage")
        if isinstance(t, int | float) and not isinstance(t, bool) and math.isfinite(t):
            usage.append(float(t))
    return waiting, (sum(usage) / len(usage) if usage else None)


def overloaded(waiting: int | None, token_usage: float | None, r: GatewayRouting) -> bool:
    """Whether smg leaves a worker with these figures (`engine_figures`) out of routing
    for overload: at or above either threshold. False when protection is off or smg has
    no figure."""
    if not r.overload_protection:
        return False
    if waiting is not None and waiting >= r.overload_waiting_requests:
        return True
    return token_usage is not None and token_usage >= r.overload_token_usage


def overload_reason(waiting: int | None, token_usage: float | None, r: GatewayRouting) -> str:
    """Why `overloaded` said so, for a status line: the figure and its threshold."""
    parts = []
    if waiting is not None and waiting >= r.overload_waiting_requests:
        parts.append(
            f"{waiting} requests waiting (overload_waiting_requests {r.overload_waiting_requests})"
        )
    if token_usage is not None and token_usage >= r.overload_token_usage:
        parts.append(
            f"KV cache {token_usage:.0%} used (overload_token_usage {r.overload_token_usage:g})"
        )
    return ", ".join(parts)
