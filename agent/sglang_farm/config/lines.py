"""Pure: where a key is in the TOML text, so that a problem can name its line.

tomllib gives no positions, so `_LineIndex` finds them by scanning the text for table
headers and key lines (best effort; no line when it cannot tell).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

_Path = tuple[str | int, ...]


_KEYPART = r"""(?:[A-Za-z0-9_-]+|"(?:[^"\\]|\\.)*"|'[^']*')"""

_DOTTED = rf"{_KEYPART}(?:\s*\.\s*{_KEYPART})*"

_HEADER_RE = re.compile(rf"^\s*(\[\[?)\s*({_DOTTED})\s*\]")

_KEYLINE_RE = re.compile(rf"^\s*({_DOTTED})\s*=")

_KEYPART_RE = re.compile(_KEYPART)


def _split_key(dotted: str) -> list[str]:
    parts = []
    for raw in _KEYPART_RE.findall(dotted):
        if raw.startswith('"'):
            parts.append(raw[1:-1].encode("latin-1", "backslashreplace").decode("unicode_escape"))
        elif raw.startswith("'"):
            parts.append(raw[1:-1])
        else:
            parts.append(raw)
    return parts


class _ValueScanner:
    """Tracks whether a value continues on the next line (open brackets, multi-line strings)."""

    def __init__(self) -> None:
        self.depth = 0
        self.mode: str | None = None  # '"""' or "'''" inside a multi-line string

    @property
    def open(self) -> bool:
        return self.depth > 0 or self.mode is not None

    def feed(self, s: str) -> None:
        i = 0
        while i < len(s):
            if self.mode is not None:
                if s.startswith(self.mode, i):
                    i += 3
                    self.mode = None
                elif self.mode == '"""' and s[i] == "\\":
                    i += 2
                else:
                    i += 1
                continue
            c = s[i]
            if c == "#":
                return
            if s.startswith('"""', i) or s.startswith("'''", i):
                self.mode = s[i : i + 3]
                i += 3
                continue
            if c in "\"'":
                i += 1
                while i < len(s) and s[i] != c:
                    i += 2 if (c == '"' and s[i] == "\\") else 1
            elif c in "[{":
                self.depth += 1
            elif c in "]}":
                self.depth = max(0, self.depth - 1)
            i += 1


class _LineIndex:
    """Key path -> 1-based line of its table header or key line."""

    def __init__(self, text: str) -> None:
        self.lines: dict[_Path, int] = {}
        aot_index: dict[_Path, int] = {}  # array-of-tables path -> index of its last element
        table: _Path = ()
        scanner = _ValueScanner()
        for lineno, line in enumerate(text.splitlines(), start=1):
            if scanner.open:
                scanner.feed(line)
                continue
            header = _HEADER_RE.match(line)
            if header:
                parts = _split_key(header.group(2))
                path = (*self._resolve(parts[:-1], aot_index), parts[-1])
                if header.group(1) == "[[":
                    aot_index[path] = aot_index.get(path, -1) + 1
                    path = (*path, aot_index[path])
                elif path in aot_index:
                    path = (*path, aot_index[path])
                table = path
                self.lines.setdefault(table, lineno)
                continue
            keyline = _KEYLINE_RE.match(line)
            if keyline:
                path = table + tuple(_split_key(keyline.group(1)))
                self.lines.setdefault(path, lineno)
                scanner.feed(line[keyline.end() :])

    @staticmethod
    def _resolve(parts: list[str], aot_index: Mapping[_Path, int]) -> _Path:
        path: _Path = ()
        for part in parts:
            path = (*path, part)
            if path in aot_index:
                path = (*path, aot_index[path])
        return path

    def line(self, path: _Path) -> int | None:
        """The line of `path`, else of its nearest enclosing key or table; None if unknown."""
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path[:-1]
        return None
