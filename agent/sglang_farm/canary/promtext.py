"""Pure: a Prometheus text exposition (format 0.0.4, as SGLang's and smg's `/metrics`
write it) turned into the samples a canary analysis reads.

Why our own parser: the analysis needs only `name{labels} value` lines, must never
raise on families it does not know, and must say which line of a body is wrong when
one is. Comments (`# HELP`, `# TYPE`) and blank lines are skipped; a sample's optional
timestamp is ignored; label values are unescaped (`\\\\`, `\\"`, `\\n`).

Raises `ValueError` naming the line for a line that is not a sample.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

Labels = tuple[tuple[str, str], ...]  # sorted by name

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SAMPLE = re.compile(rf"^({_NAME})(?:\{{(.*)\}})?\s+(\S+)(?:\s+-?\d+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)')
_UNESCAPE = re.compile(r"\\(.)")


@dataclass(frozen=True, slots=True)
class Scrape:
    """Every sample of one body: (name, labels) -> value."""

    samples: Mapping[tuple[str, Labels], float]

    def series(self, name: str) -> Iterator[tuple[Labels, float]]:
        """The samples named `name`, each with its labels."""
        for (n, labels), value in self.samples.items():
            if n == name:
                yield labels, value

    def total(self, name: str, **match: str) -> float | None:
        """The sum of the samples named `name` whose labels include `match`; None if none."""
        found = [v for labels, v in self.series(name) if _matches(labels, match)]
        return math.fsum(found) if found else None


def _matches(labels: Labels, match: Mapping[str, str]) -> bool:
    have = dict(labels)
    return all(have.get(k) == v for k, v in match.items())


def _value(text: str) -> float:
    special = {"+Inf": math.inf, "-Inf": -math.inf, "NaN": math.nan}
    if text in special:
        return special[text]
    return float(text)


def _labels(body: str, where: str) -> Labels:
    out: list[tuple[str, str]] = []
    pos = 0
    body = body.rstrip()
    while pos < len(body):
        m = _LABEL.match(body, pos)
        if m is None:
            raise ValueError(f"{where}: labels do not parse at {body[pos:]!r}")
        out.append((m.group(1), _UNESCAPE.sub(lambda e: "\n" if e[1] == "n" else e[1], m[2])))
        pos = m.end()
    return tuple(sorted(out))


def parse(text: str, *, source: str = "metrics") -> Scrape:
    """Every sample of a Prometheus text body. Raises ValueError naming `source:line`."""
    samples: dict[tuple[str, Labels], float] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{source}:{number}"
        m = _SAMPLE.match(line)
        if m is None:
            raise ValueError(f"{where}: not a Prometheus sample line: {line[:120]!r}")
        try:
            value = _value(m.group(3))
        except ValueError:
            raise ValueError(f"{where}: value {m.group(3)!r} is not a number") from None
        labels = _labels(m.group(2) or "", where)
        key = (m.group(1), labels)
        # A repeated series (several SGLang processes, one body) adds up, as a sum() would.
        samples[key] = samples.get(key, 0.0) + value
    return Scrape(samples)
