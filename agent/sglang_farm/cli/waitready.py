"""I/O: `sglang-farm wait-ready N`: the readiness gate as a command (see `waitready`).

Exit 0 when the worker is ready, 1 when the deadline passed, 2 for a bad config or an
unknown worker (`waitready.WaitExit`).
"""

from __future__ import annotations

import sys

import click

from sglang_farm.cli.options import config_option
from sglang_farm.gpu import gpu_count_for_config
from sglang_farm.waitready import WaitExit, wait_ready


@click.command("wait-ready")
@config_option
@click.option(
    "--timeout",
    type=float,
    default=None,
    help="Seconds to wait [default: startup.load_timeout].",
)
@click.option(
    "--main-pid",
    type=int,
    default=None,
    help="Give up as soon as this process exits (units pass $MAINPID).",
)
@click.argument("worker", type=int)
def wait_ready_command(
    config_path: str, timeout: float | None, main_pid: int | None, worker: int
) -> None:
    """Wait until worker WORKER answers its health check (a unit's ExecStartPost= gate).

    Exit 0 when ready, 1 when the deadline passed, 2 for a bad config or unknown worker.
    """
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
