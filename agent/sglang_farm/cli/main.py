"""I/O: the `sglang-farm` command: run the agent, check and render config, the simulator, explain.

Thin: each command parses its options, calls one module, and turns the farm's errors
into one-line messages and exit statuses. Imports happen inside the commands so that
`sglang-farm wait-ready` and `explain` start fast.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import stat
import sys
from pathlib import Path

import click

from sglang_farm import __version__
from sglang_farm.cli.options import config_error_text, config_option, gpus_option
from sglang_farm.gpus.nvml import gpu_count_for_config
from sglang_farm.host.paths import DEFAULT_AGENT_BIN

# The agent's GIL switch interval (CPython's default: 5 ms); see `run`.
SWITCH_INTERVAL_S = 0.0005


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="sglang-farm")
def cli() -> None:
    """Run one SGLang server per GPU, supervised (see `farmctl` to operate a running farm)."""


@cli.command()
@config_option
@click.option(
    "--runtime",
    type=click.Choice(["auto", "process", "systemd"]),
    default="auto",
    show_default=True,
    help="systemd units when systemd is PID 1 (auto), else child processes.",
)
@click.option("--log-level", default="info", show_default=True)
@click.option(
    "--log-format",
    type=click.Choice(["auto", "json", "console"]),
    default="auto",
    show_default=True,
    help="console: a short plain line per event, for a person (./scripts/demo asks for it); "
    "json: every field, for the journal and scripts; auto: console on a terminal, else JSON.",
)
def run(config_path: str, runtime: str, log_level: str, log_format: str) -> None:
    """Start the farm and supervise it until SIGTERM or Ctrl-C (SIGHUP reloads the config)."""
    from sglang_farm import logsetup
    from sglang_farm.errors import ConfigError, FarmError
    from sglang_farm.service import serve

    logsetup.configure(log_level, json=None if log_format == "auto" else log_format == "json")
    # The event loop shares the GIL with the exporter's threads and the /proc walks of the
    # default executor: at CPython's 5 ms switch interval a scrape or a control reply waited
    # up to 5 ms at each hand-over, the tail of both at 64 workers (docs/benchmarks.md).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        config_path = os.path.abspath(config_path)  # units name it; they run elsewhere
        code = asyncio.run(serve(config_path, runtime, gpu_count=gpu_count_for_config(config_path)))
    except ConfigError as exc:
        raise click.ClickException(
            f"{exc}\nFix the config, then check it with: "
            f"sglang-farm check-config --config {config_path}"
        ) from exc
    except FarmError as exc:
        raise click.ClickException(str(exc)) from exc
    sys.exit(code)


def _gpu_count(config_path: str, gpus: int | None) -> int | None:
    """`--gpus N` when given, else NVML's count when the config says gpus = "all"."""
    return gpus if gpus is not None else gpu_count_for_config(config_path)


def _readable_by_everyone(path: str) -> int | None:
    """The file's mode when every local user can read it (read for others, and every
    folder above it open to others), else None. A file in a private folder (Ansible's
    `validate:` copy, pytest's tmp_path) is no one else's to read, whatever its mode."""
    try:
        real = os.path.realpath(path)
        mode = stat.S_IMODE(os.stat(real).st_mode)
        if not mode & stat.S_IROTH:
            return None
        folder = os.path.dirname(real)
        while True:
            if not os.stat(folder).st_mode & stat.S_IXOTH:
                return None
            if folder == os.path.dirname(folder):
                return mode
            folder = os.path.dirname(folder)
    except OSError:
        return None


def _credentials_everyone_reads(path: str, group: str) -> str | None:
    """Issue 30, item 7: a config holding credentials in a file every local user can read
    fails the check (it only warned, so Ansible's `validate:` let a 0644 farm.toml with an
    api_key through): the file, the key paths and the fix. None: nothing to say."""
    import tomllib

    from sglang_farm.doctor.host_rules import credential_paths

    mode = _readable_by_everyone(path)
    if mode is None:
        return None
    try:
        with open(path, "rb") as f:
            paths = credential_paths(tomllib.load(f))
    except (OSError, tomllib.TOMLDecodeError):
        return None  # validated a moment ago; changed since: the next check says
    if not paths:
        return None
    q = shlex.quote(path)
    return (
        f"{path} holds credentials ({', '.join(paths)}) and every local user can read it "
        f"(mode {mode:04o}); fix: chgrp {shlex.quote(group)} {q} && chmod 0640 {q} "
        f"(root and [control] group {group!r} read it), or chmod 0600 {q}"
    )


@cli.command("check-config")
@config_option
@gpus_option
def check_config(config_path: str, gpus: int | None) -> None:
    """Validate the config and print every problem with its line; exit 1 if there are any.

    Warnings (e.g. a flag spelt as an older SGLang spells it: this check has no SGLang at
    hand, `sglang-farm doctor` asks the installed one; workers reachable from other hosts
    without an API key; a user or group this host lacks, which the agent under systemd
    refuses) go to stderr and do not fail. A [gateway] key file the agent refuses at
    start (another user could read or replace it, or it cannot be read) fails the check,
    and so do credentials (an api_key, a token in an env table) in a config file every
    local user can read.
    """
    from sglang_farm.config import check_spec_file
    from sglang_farm.errors import ConfigError

    try:
        result = check_spec_file(config_path, gpu_count=_gpu_count(config_path, gpus))
    except ConfigError as exc:
        click.echo(config_error_text(exc, gpus_given=gpus is not None), err=True)
        sys.exit(1)
    for warning in result.warnings:
        click.echo(f"warning: {warning}", err=True)
    spec = result.spec
    exposed = _credentials_everyone_reads(config_path, spec.control.group)
    if exposed is not None:
        click.echo(f"error: {exposed}", err=True)
    from sglang_farm.doctor.gather import farm_folder_problems, key_file_facts
    from sglang_farm.doctor.host_rules import key_file_checks
    from sglang_farm.gateway.keyfile import gateway_key_problem

    # Issue 26 review: the gateway's key files the agent refuses at start fail the check
    # (the Hub token file, read at stage time, is warned of below).
    refused = {
        f"[gateway] {what} ": p
        for what, path in (
            ("admin_key_file", spec.gateway.admin_key_file),
            ("api_key_file", spec.gateway.api_key_file),
        )
        if path and (p := gateway_key_problem(path, what)) is not None
    }
    for problem in refused.values():
        click.echo(f"error: {problem}", err=True)
    for check in key_file_checks(spec, key_file_facts(spec), os.geteuid()):
        if check.message.startswith(tuple(refused)):
            continue  # said above, as the error it is
        click.echo(f"warning: {check.message}; fix: {check.fix}", err=True)
    for problem in farm_folder_problems(spec):  # the agent refuses these at start
        click.echo(f"warning: the agent would stop: {problem}", err=True)
    from sglang_farm.doctor.accounts import host_account_problems

    for problem in host_account_problems(spec):  # the agent under systemd refuses these
        click.echo(f"warning: under systemd: {problem}", err=True)
    if refused or exposed is not None:
        sys.exit(1)
    click.echo(
        f"{config_path}: OK, {len(spec.workers)} workers "
        f"(ports {spec.workers[0].port}-{spec.workers[-1].port})"
        if spec.workers
        else f"{config_path}: OK, no workers"
    )


@cli.command()
@config_option
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="Directory to write the units into (e.g. /run/systemd/system).",
)
@click.option(
    "--agent-bin",
    default=DEFAULT_AGENT_BIN,
    show_default=True,
    help="Path of sglang-farm inside the units (the readiness gate runs it).",
)
@gpus_option
def render(config_path: str, out: Path, agent_bin: str, gpus: int | None) -> None:
    """Write the systemd units for this config: template, one drop-in per worker, agent, target."""
    from sglang_farm.config import load_spec_file
    from sglang_farm.errors import ConfigError
    from sglang_farm.runtime.unit_files import write_units
    from sglang_farm.runtime.units import render as render_units

    try:
        spec = load_spec_file(config_path, gpu_count=_gpu_count(config_path, gpus))
    except ConfigError as exc:
        click.echo(config_error_text(exc, gpus_given=gpus is not None), err=True)
        sys.exit(1)
    files = render_units(spec, agent_bin=agent_bin, config_path=str(Path(config_path).resolve()))
    changes = write_units(out, files)
    for p in changes.written:
        click.echo(f"wrote    {out / p}")
    for p in changes.removed:
        click.echo(f"removed  {out / p}")
    click.echo(f"{len(changes.unchanged)} unchanged")


@cli.command(
    context_settings={
        "ignore_unknown_options": True,
        "allow_extra_args": True,
        "help_option_names": [],
    }
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def sim(args: tuple[str, ...]) -> None:
    """The SGLang simulator: takes SGLang's flags (SGLANG_SIM_* variables select failures)."""
    from sglang_farm.sim import main as sim_main

    sys.exit(sim_main(list(args)))


def _add_optional_commands() -> None:
    from sglang_farm.cli.doctor import doctor
    from sglang_farm.cli.explain import explain
    from sglang_farm.cli.waitready import wait_ready_command

    cli.add_command(explain)
    cli.add_command(doctor)
    cli.add_command(wait_ready_command)


_add_optional_commands()


def main() -> None:
    cli(prog_name="sglang-farm")


if __name__ == "__main__":
    main()
