"""I/O: `sglang-farm explain [FILE|-] [--json]`: explain the failures in an SGLang log."""

from __future__ import annotations

from typing import TextIO

import click

from sglang_farm.sglang.explain import explain_lines, format_json, format_text

EXIT_NO_FAILURE = 0
EXIT_FAILURES_FOUND = 1


@click.command("explain")
@click.argument(
    "log_file",
    metavar="[FILE|-]",
    default="-",
    type=click.File("r", encoding="utf-8", errors="replace"),
)
@click.option("--json", "as_json", is_flag=True, help="Print the failures as JSON.")
@click.pass_context
def explain(ctx: click.Context, log_file: TextIO, as_json: bool) -> None:
    """Explain the failures in an SGLang log.

    Reads FILE (default: standard input, also "-"), e.g.
    `journalctl -u sglang@3 -o cat | sglang-farm explain`, and prints each failure
    found: its kind, the lines that show it, and what to do.

    Exit status: 0 when no known failure was found, 1 when at least one was
    (so `explain || alert` works in scripts), 2 for usage errors such as an
    unreadable FILE.
    """
    name = getattr(log_file, "name", None)  # stdin wrappers may have none, or "<stdin>"
    source = name if isinstance(name, str) and not name.startswith("<") else "standard input"
    failures = explain_lines(log_file)
    if as_json:
        click.echo(format_json(failures, source=source))
    else:
        click.echo(format_text(failures, source=source), nl=False)
    ctx.exit(EXIT_FAILURES_FOUND if failures else EXIT_NO_FAILURE)
