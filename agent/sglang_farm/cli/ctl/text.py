"""Pure: the words several verbs print alike: a duration (`3m07s`), a table of aligned
columns, a list of workers (`workers 1, 2`).

Apart from the verbs because status, why, the canary lines and the verbs that change
workers all say these the same way.
"""

from __future__ import annotations

from collections.abc import Sequence


def duration(seconds: float) -> str:
    s = max(int(seconds), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(wd) for c, wd in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def who(ids: Sequence[int]) -> str:
    return f"worker{'s' if len(ids) != 1 else ''} {', '.join(str(i) for i in ids) or '(none)'}"
