"""Pure: click options shared by the `sglang-farm` commands (one definition each)."""

from __future__ import annotations

import click

from sglang_farm.errors import ConfigError
from sglang_farm.host.paths import DEFAULT_CONFIG_PATH

config_option = click.option(
    "--config",
    "config_path",
    default=DEFAULT_CONFIG_PATH,
    show_default=True,
    envvar="SGLANG_FARM_CONFIG",
    help="The farm's TOML config.",
)
"""`--config PATH` (env SGLANG_FARM_CONFIG), passed to the command as `config_path`."""

gpus_option = click.option(
    "--gpus",
    "gpus",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help='The GPU count that workers.gpus = "all" stands for, instead of asking NVML: '
    "check a config for another machine (review, CI) on one without GPUs.",
)
"""`--gpus N` (N >= 1), passed to the command as `gpus` (None: count with NVML)."""


def config_error_text(exc: ConfigError, *, gpus_given: bool) -> str:
    """A config error as the commands print it, with how to state the GPU count when
    `gpus = "all"` could not be resolved (no NVML here) and `--gpus` was not given."""
    text = str(exc)
    if not gpus_given and any('gpus = "all"' in p for p in exc.problems):
        text += (
            "\nNVML cannot count the GPUs here: to check this config for a machine with N "
            "GPUs, pass --gpus N."
        )
    return text
