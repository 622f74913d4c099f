"""Pure: the `/metrics` body of the farm's families, in the format a scraper asked for.

prometheus_client's encoders are general (any name, any escaping, histograms,
exemplars) and pay for it on every sample; OpenMetrics escapes each sample name a
character at a time. A farm of 64 workers exposes about 3,500 samples, so the first
scrape after each state swap cost 34-43 ms (text) and 54-81 ms (OpenMetrics, what
Prometheus asks for first) of a 2-core machine's CPU, holding the GIL the agent's event
loop needs (docs/benchmarks.md).

The farm's own families are plain gauges and counters with plain names (letters,
digits, `_`), no unit, timestamp or exemplar. For those both formats are a few
string joins, and this module writes them byte for byte as the library does
(`tests/test_exposition.py` compares the two on every family the farm has). Anything
else (a family of another shape, an escaping that rewrites plain names such as
`dots`, an OpenMetrics version other than 1.0.0) goes to the library's encoder, so the
body is always the library's. The Content-Type is too, unless the library would echo a
version that is not digits and dots: then the answer is the text format.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import lru_cache, partial
from typing import Protocol, cast, runtime_checkable

from prometheus_client import exposition as text_format
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics import exposition as om_format
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

Encoder = Callable[[Collector], bytes]

# Names that `underscores` and `allow-utf-8` write unchanged (OpenMetrics' `underscores`
# rewrites a `:` in a sample name, so the fast path takes no colon; `dots` and `values`
# rewrite every name, so they go to the library).
_PLAIN_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")
# A content type the library built from the Accept header with a version of digits and dots.
_SAFE_CONTENT_TYPE = re.compile(
    r"[a-z/.-]+(; version=\d+(\.\d+)*)?(; charset=utf-8)?(; escaping=[a-z0-9-]+)?\Z"
)
# Escapings under which a plain name is written unchanged.
_NAMES_UNCHANGED = (om_format.UNDERSCORES, om_format.ALLOWUTF8)
# The library's float writer (Go's formatting: "+Inf", "1.5e+07"), typed.
_float_text = cast(Callable[[float], str], floatToGoString)
# Most samples are 0 or 1 (state sets, flags, counts): their text, looked up.
_SMALL_INTS = {i: _float_text(i) for i in range(1024)}


class Unsupported(Exception):
    """A family this module does not write as the library would: the library writes it."""


@dataclass(frozen=True)
class Format:
    """One exposition format: its Content-Type and how to encode a registry in it.

    Equal formats have equal content types, so a body cached per content type is
    cached per format (`choose_encoder` builds a new encoder object for every request).
    """

    content_type: str
    encode: Encoder = field(compare=False)


# The Accept header of Prometheus 2.42 (Debian 12's), captured from a real scrape:
# OpenMetrics 1.0.0 first. The tests and the benchmark scrape with it.
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)


def choose(accept: str) -> Format:
    """The format for an Accept header, as prometheus_client chooses it; the text format
    for a header the library cannot parse (it raises on `version=1.0.0a`)."""
    try:
        library, content_type = text_format.choose_encoder(accept)
    except (TypeError, ValueError):
        library, content_type = text_format.choose_encoder("")
    if not _SAFE_CONTENT_TYPE.match(content_type):
        # The library echoes the asked-for version into the header, whatever it holds
        # (a folded header's CR LF included): only digits and dots are sent back.
        library, content_type = text_format.choose_encoder("")
    fast = _fast_twin(library)
    return Format(content_type, fast if fast is not None else library)


def _fast_twin(library: Encoder) -> Encoder | None:
    func = library.func if isinstance(library, partial) else library
    kwargs = library.keywords if isinstance(library, partial) else {}
    escaping = kwargs.get("escaping", om_format.UNDERSCORES)
    if escaping not in _NAMES_UNCHANGED:
        return None
    if func is text_format.generate_latest:
        return partial(encode, openmetrics=False, fallback=library)
    if func is om_format.generate_latest and kwargs.get("version", "1.0.0") == "1.0.0":
        return partial(encode, openmetrics=True, fallback=library)
    return None


class _Collected:
    """Families already collected, as the library's encoders take them (a `collect()`)."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


@runtime_checkable
class WritesItsOwn(Protocol):
    """A registry that writes its exposition itself (`metrics.FarmRegistry`, which
    reuses the text of the parts of the state that did not change)."""

    def exposition(self, *, openmetrics: bool) -> bytes: ...


def encode(registry: Collector, *, openmetrics: bool, fallback: Encoder) -> bytes:
    """The registry's families in the text format (0.0.4) or OpenMetrics 1.0.0.

    If any family is of a shape this module does not write, `fallback` (the library's
    encoder for that format) writes the whole body.
    """
    if isinstance(registry, WritesItsOwn):
        try:
            return registry.exposition(openmetrics=openmetrics)
        except Unsupported:
            return fallback(registry)
    families = list(registry.collect())
    try:
        return render(families, openmetrics=openmetrics)
    except Unsupported:
        return fallback(_Collected(families))


def render(families: Iterable[Metric], *, openmetrics: bool) -> bytes:
    """Gauges and counters with plain names as the library writes them; `Unsupported`
    for anything else."""
    text = render_text(families, openmetrics=openmetrics)
    return (text + "# EOF\n" if openmetrics else text).encode("utf-8")


def render_text(families: Iterable[Metric], *, openmetrics: bool) -> str:
    """`render` without OpenMetrics' closing `# EOF`, not encoded: a run of families
    that can be joined to others."""
    out: list[str] = []
    add = out.append
    for m in families:
        if m.type == "counter":
            sample_name = m.name + "_total"
            typed = m.name if openmetrics else sample_name
        elif m.type == "gauge":
            sample_name = typed = m.name
        else:
            raise Unsupported(m.name)
        if m.unit or not _PLAIN_NAME.match(m.name):
            raise Unsupported(m.name)
        doc = m.documentation.replace("\\", r"\\").replace("\n", r"\n")
        if openmetrics:
            doc = doc.replace('"', r"\"")
        add(f"# HELP {typed} {doc}\n# TYPE {typed} {m.type}\n")
        for s in m.samples:
            add(_sample_line(s, sample_name))
    return "".join(out)


def _sample_line(s: Sample, name: str) -> str:
    if s.name != name or s.timestamp is not None or s.exemplar is not None:
        raise Unsupported(s.name)
    if s.native_histogram is not None:
        raise Unsupported(s.name)
    v = s.value
    if v is None:  # OpenMetrics writes no value, the text format fails: the library's call
        raise Unsupported(s.name)
    value = _SMALL_INTS.get(v) if type(v) is int else None
    if value is None:
        value = _float_text(v)
    if not s.labels:
        return f"{name} {value}\n"
    return f"{name}{{{_labels(s.labels)}}} {value}\n"


def _labels(labels: dict[str, str]) -> str:
    parts = []
    for k, v in sorted(labels.items()):
        if not _plain_label(k):
            raise Unsupported(k)
        if "\\" in v or "\n" in v or '"' in v:
            v = v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
        parts.append(f'{k}="{v}"')
    return ",".join(parts)


@lru_cache(maxsize=256)  # the farm uses a dozen label names: each is checked once
def _plain_label(name: str) -> bool:
    # A leading `__` is reserved: the library quotes such a name under `allow-utf-8`.
    return _PLAIN_NAME.match(name) is not None and not name.startswith("__")
