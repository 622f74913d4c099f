"""`farmctl version` and `farmctl completion`: farmctl about itself, its version (and the
agent's) and its shell completion script.

One family: neither changes nor reads the farm beyond the agent's version.
"""

from __future__ import annotations

import click

from sglang_farm.cli.ctl.connection import Ctl, farmctl_version, pass_ctl
from sglang_farm.cli.ctl.exits import FarmctlError


@click.command()
@pass_ctl
def version(ctl: Ctl) -> None:
    """Print farmctl's version, and the agent's with its protocol version."""
    try:
        r = ctl.call("version")
    except FarmctlError:
        click.echo(f"farmctl {farmctl_version()}")
        raise
    if ctl.as_json:
        ctl.emit_json({"farmctl_version": farmctl_version(), **r})
        return
    click.echo(f"farmctl {farmctl_version()}")
    click.echo(f"agent {r.get('agent_version')} (protocol {r.get('protocol_version')})")


@click.command()
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]), default="bash")
@click.pass_context
def completion(ctx: click.Context, shell: str) -> None:
    """Print the shell completion script for SHELL (bash by default).

    Load it with: eval "$(farmctl completion bash)", or install it as
    /usr/share/bash-completion/completions/farmctl.
    """
    from click.shell_completion import get_completion_class

    cls = get_completion_class(shell)
    assert cls is not None  # the Choice above only names shells click knows
    root = ctx.find_root().command
    click.echo(cls(root, {}, "farmctl", "_FARMCTL_COMPLETE").source())
