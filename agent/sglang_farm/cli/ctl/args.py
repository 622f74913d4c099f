"""The arguments and options several verbs take alike: a worker id or `all` (start,
restart, stop), a worker id (reset-oom, release-gpu --worker, logs, why), `--timeout` for
the verbs that wait until workers are ready, and `--no-drain`.

Apart from the verbs so that each of them parses and words these the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


def worker_or_all(ctx: click.Context, param: click.Parameter, value: str) -> int | str:
    """A worker id or `all` (a callback: works with click's 8.1 and later ParamType alike)."""
    if value == "all":
        return value
    try:
        n = int(value)
    except ValueError:
        raise click.BadParameter(f"expected a worker id or 'all', got {value!r}") from None
    if n < 0:
        raise click.BadParameter(f"expected a worker id (>= 0), got {n}")
    return n


WORKER = click.IntRange(min=0)


def timeout_option(text: str) -> Callable[[F], F]:
    """--timeout for the commands that wait until workers are ready."""
    return click.option(
        "--timeout",
        type=click.FloatRange(min=0, min_open=True, max=3600),
        default=1200.0,
        show_default=True,
        help=text,
    )


no_drain_option = click.option(
    "--no-drain",
    is_flag=True,
    help="Skip the gateway drain: the worker is stopped while requests may still be running.",
)
