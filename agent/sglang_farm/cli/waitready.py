"""I/O: `sglang-farm wait-ready N`: the readiness gate as a command (see `waitready`).

Exit 0 when the worker is ready, 1 when the deadline passed, 2 for a bad config, an
unknown worker or bad usage (`waitready.WaitExit`). The units pass `--url` and the
timeouts, so the gate never reads farm.toml (`waitready`).
"""

from __future__ import annotations

import sys

import click

from sglang_farm.cli.options import config_option
from sglang_farm.gpus.nvml import gpu_count_for_config
from sglang_farm.runtime.waitready import WaitExit, wait_ready, wait_url
from sglang_farm.spec import HealthPolicy, StartupPolicy


@click.command("wait-ready")
@config_option
@click.option(
    "--url",
    "urls",
    multiple=True,
    help="The worker's readiness URL; repeated, the next is asked once one answers 404 "
    "(/ready, then /health); with it no config is read (what the units pass).",
)
@click.option(
    "--timeout",
    type=float,
    default=None,
    help="Seconds to wait [default: startup.load_timeout; required with --url].",
)
@click.option(
    "--probe-timeout",
    type=float,
    default=None,
    help="Seconds per health request, with --url [default: health.timeout's default].",
)
@click.option(
    "--interval",
    type=float,
    default=None,
    help="Seconds between health requests, with --url [default: startup.poll_interval's].",
)
@click.option(
    "--main-pid",
    type=int,
    default=None,
    help="Give up as soon as this process exits (units pass $MAINPID).",
)
@click.argument("worker", type=int)
def wait_ready_command(
    config_path: str,
    urls: tuple[str, ...],
    timeout: float | None,
    probe_timeout: float | None,
    interval: float | None,
    main_pid: int | None,
    worker: int,
) -> None:
    """Wait until worker WORKER answers its health check (a unit's ExecStartPost= gate).

    The units pass --url and the timeouts, and no config is read; without --url they
    come from the config. Exit 0 when ready, 1 when the deadline passed, 2 for a bad
    config, unknown worker or bad usage.
    """
    if urls:
        if timeout is None:
            raise click.UsageError("--url needs --timeout (the start deadline in seconds)")
        defaults_h, defaults_s = HealthPolicy(), StartupPolicy()
        sys.exit(
            wait_url(
                worker,
                urls,
                deadline=timeout,
                probe_timeout=defaults_h.timeout if probe_timeout is None else probe_timeout,
                interval=defaults_s.poll_interval if interval is None else interval,
                main_pid=main_pid,
            )
        )

    from sglang_farm.config import load_spec_file
    from sglang_farm.errors import ConfigError

    try:
        spec = load_spec_file(config_path, gpu_count=gpu_count_for_config(config_path))
    except ConfigError as exc:
        click.echo(f"wait-ready: {exc}", err=True)
        sys.exit(WaitExit.USAGE)
    if worker not in spec.worker_ids:
        ids = ", ".join(str(i) for i in spec.worker_ids) or "none"
        click.echo(
            f"wait-ready: no worker {worker} in {config_path}; its workers are {ids}", err=True
        )
        sys.exit(WaitExit.USAGE)
    budget = spec.startup.load_timeout if timeout is None else timeout
    sys.exit(wait_ready(spec, worker, budget, main_pid))
