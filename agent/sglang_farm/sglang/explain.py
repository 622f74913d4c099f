"""Pure: the log classifier for people: failures in a whole log, as text or JSON.

The command (`sglang-farm explain`, in `cli/explain.py`) reads a file or stdin and
prints these. Typical use: `journalctl -u sglang@3 -o cat | sglang-farm explain`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

from sglang_farm.sglang.classify import classify_lines
from sglang_farm.sglang.failures import Failure


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
