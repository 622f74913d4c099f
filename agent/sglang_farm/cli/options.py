"""Pure: click options shared by the `sglang-farm` commands (one definition each)."""

from __future__ import annotations

import click

from sglang_farm.paths import DEFAULT_CONFIG_PATH

config_option = click.option(
    "--config",
    "config_path",
    default=DEFAULT_CONFIG_PATH,
    show_default=True,
    envvar="SGLANG_FARM_CONFIG",
    help="The farm's TOML config.",
)
"""`--config PATH` (env SGLANG_FARM_CONFIG), passed to the command as `config_path`."""
