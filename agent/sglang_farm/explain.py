"""I/O: `sglang-farm explain`, the log classifier as a command for people.

`explain_lines` and `format_text` are pure; only the click command reads a file
(or stdin) and prints. Typical use: `journalctl -u sglang@3 -o cat | sglang-farm explain`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import TextIO

import click

from sglang_farm.classify import classify_lines
from sglang_farm.failures import Failure

EXIT_NO_FAILURE = 0
EXIT_FAILURES_FOUND = 1


def explain_lines(lines: Iterable[str]) -> list[Failure]:
    """Every distinct failure in a whole SGLang log, in order (see `classify_lines`)."""
    return classify_lines(lines)


def format_text(failures: Sequence[Failure], *, source: str = "the log") -> str:
    """A report for people: per failure its kind, what happened, the lines that show it,
    and what to do. Ends with a newline."""
    if not failures:
        return f"No known failure found in {source}.\n"
    n = len(failures)
    out = [f"{n} failure{'s' if n != 1 else ''} found in {source}."]
    for i, f in enumerate(failures, start=1):
        out.append("")
        out.append(f"[{i}] {f.kind}: {f.summary}")
        if f.lines:
            out.append("    the lines that show it:")
            out.extend(f"      | {line}" for line in f.lines)
        out.append(f"    what to do: {f.advice}")
    return "\n".join(out) + "\n"


def format_json(failures: Sequence[Failure], *, source: str) -> str:
    """`{"source": ..., "failures": [Failure.to_dict(), ...]}` as one JSON document."""
    return json.dumps({"source": source, "failures": [f.to_dict() for f in failures]}, indent=2)


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
