"""Pure: the config's problems and warnings, collected and rendered as lines.

Every problem is one line, `file:line: key.path: what is wrong (the bad value) and
what is accepted`, sorted by line so that the report reads top to bottom.
"""

from __future__ import annotations

import re

from sglang_farm.config.lines import _LineIndex, _Path


def _fmt_path(path: _Path) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            text = part if re.fullmatch(r"[A-Za-z0-9_-]+", part) else repr(part)
            out += ("." if out else "") + text
    return out


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class _ConversionError(Exception):
    """Raised by a converter (`values`, `flags`) for a value it cannot accept; the
    message says what is wrong and what is accepted, the reader adds where."""


_Located = tuple[int | None, int, str]


def _by_line(items: list[_Located]) -> list[str]:
    # By line, so the report reads top to bottom; lines without a position last.
    return [t for _, _, t in sorted(items, key=lambda x: (x[0] is None, x[0] or 0, x[1]))]


class _Problems:
    def __init__(self, source: str, index: _LineIndex) -> None:
        self.source = source
        self.index = index
        self.items: list[_Located] = []
        self.warnings: list[_Located] = []
        # Keys whose value was already refused as a whole (control characters): later
        # problems at or below them would only repeat it.
        self.refused: set[_Path] = set()

    def _locate(self, path: _Path, message: str, line_of: _Path | None) -> tuple[int | None, str]:
        line = self.index.line(path if line_of is None else line_of)
        where = f"{self.source}:{line}" if line is not None else self.source
        return line, (f"{where}: {_fmt_path(path)}: {message}" if path else f"{where}: {message}")

    def add(self, path: _Path, message: str, *, line_of: _Path | None = None) -> None:
        if any(path[: len(refused)] == refused for refused in self.refused):
            return
        line, text = self._locate(path, message, line_of)
        self.items.append((line, len(self.items), text))

    def warn(self, path: _Path, message: str) -> None:
        """Something that works but deserves a look (never fails the load)."""
        line, text = self._locate(path, message, None)
        self.warnings.append((line, len(self.warnings), text))

    def sorted(self) -> list[str]:
        return _by_line(self.items)

    def sorted_warnings(self) -> list[str]:
        return _by_line(self.warnings)

    def __bool__(self) -> bool:
        return bool(self.items)
