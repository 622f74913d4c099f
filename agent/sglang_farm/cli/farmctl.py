"""I/O: `farmctl`, the command line for a running sglang-farm agent: the click group (the
socket, from `--socket` or `--config`, and `--json`) and the verbs registered on it.

It talks to the agent's control socket (docs/control-protocol.md). Each verb lives in
`cli/ctl/`, one module per verb or close family of verbs (as circus has its commands);
this module only builds the group. Imports are kept to click, the standard library and
the control client so that it starts in a few tens of milliseconds: no httpx,
prometheus_client or structlog here.
"""

from __future__ import annotations

import sys
from typing import NoReturn

import click

from sglang_farm.cli.batchctl import batch
from sglang_farm.cli.ctl.about import completion, version
from sglang_farm.cli.ctl.changes import reset_oom, restart, start, stop
from sglang_farm.cli.ctl.connection import Ctl
from sglang_farm.cli.ctl.drain import drain_host, undrain_host
from sglang_farm.cli.ctl.endpoints import endpoints
from sglang_farm.cli.ctl.exits import BadUsage
from sglang_farm.cli.ctl.logs import logs
from sglang_farm.cli.ctl.release_gpu import release_gpu
from sglang_farm.cli.ctl.reload import reload
from sglang_farm.cli.ctl.status import status
from sglang_farm.cli.ctl.wait import wait
from sglang_farm.cli.ctl.why import why
from sglang_farm.host.paths import DEFAULT_SOCKET


def _socket_from_config(path: str) -> str:
    import shlex  # only when --config is given
    import tomllib

    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise BadUsage(f"cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise BadUsage(
            f"{path} is not valid TOML ({exc}); "
            f"check it with: sglang-farm check-config --config {shlex.quote(path)}"
        ) from None
    control = data.get("control", {})
    sock = control.get("socket") if isinstance(control, dict) else None
    return sock if isinstance(sock, str) and sock else DEFAULT_SOCKET


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--socket",
    "socket_path",
    envvar="FARMCTL_SOCKET",
    metavar="PATH",
    help=f"Control socket (default: [control].socket of --config, else {DEFAULT_SOCKET}).",
)
@click.option(
    "--config",
    "config_path",
    metavar="FILE",
    help="Read the socket path from this farm.toml's [control].socket.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the agent's raw results as JSON.")
@click.pass_context
def cli(
    ctx: click.Context, socket_path: str | None, config_path: str | None, as_json: bool
) -> None:
    """Operate a running sglang-farm: status, restarts, logs, failures.

    Exit codes: 0 ok, 1 refused or failed, 2 usage, 3 worker not running or
    failed, 4 agent unreachable, 5 reload rolled back, 6 reload held, 7 timed
    out (wait, drain-host), 8 rollout halted (wait), 9 host drained (wait), 10
    reload needs an agent restart, 11 a gateway did not confirm the host out
    (drain-host).
    """
    if socket_path is None:
        socket_path = _socket_from_config(config_path) if config_path else DEFAULT_SOCKET
    ctx.obj = Ctl(socket_path, as_json, config_path)


# The verbs, from their modules in cli/ctl/ (`farmctl --help` lists them sorted).
for _verb in (
    status,
    restart,
    start,
    stop,
    reset_oom,
    reload,
    release_gpu,
    wait,
    drain_host,
    undrain_host,
    logs,
    why,
    endpoints,
    version,
    completion,
):
    cli.add_command(_verb)
cli.add_command(batch)  # farmctl batch ...: the batch service (cli/batchctl.py, issue 33)


def main() -> NoReturn:
    """The `farmctl` entry point."""
    sys.exit(cli.main(prog_name="farmctl"))


if __name__ == "__main__":
    main()
