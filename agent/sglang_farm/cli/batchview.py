"""Pure: what `farmctl batch` prints about a batch: its progress (a bar on a terminal,
plain lines otherwise), its status, the list, and the last line of a wait.

Everything here is a function of the batch objects the batch service returned (OpenAI's
Batch object: `status`, `request_counts`, the `*_at` times, `errors`, and `usage` where
the service counts tokens) and of the times they were read at, so the tests hold every
figure without a service or a clock: the rates are measured over the samples `farmctl`
took, the ETA is the service's own (`sglang_farm_batch_eta_seconds`) when it has one,
else the remaining requests at the measured rate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# OpenAI's batch statuses that end a batch; `farmctl batch wait` stops at one.
TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})
# The rates are measured over the samples of the last RATE_WINDOW_S seconds.
RATE_WINDOW_S = 30.0
BAR_MIN = 10  # the bar's narrowest, in cells
BAR_MAX = 40


@dataclass(frozen=True, slots=True)
class Sample:
    """One read of a batch: when (seconds, any monotonic clock), and its counts."""

    t: float
    total: int
    completed: int
    failed: int
    tokens: int | None = None  # every token of the batch so far (None: not counted)

    @property
    def done(self) -> int:
        """Requests that are finished either way: a result line or an error line."""
        return self.completed + self.failed


@dataclass(frozen=True, slots=True)
class Rates:
    """Requests and tokens per second over the recent samples (None: not yet measurable)."""

    requests_per_s: float | None
    tokens_per_s: float | None


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def counts(batch: Mapping[str, Any]) -> tuple[int, int, int]:
    """(total, completed, failed) of a batch object's `request_counts` (0s where absent)."""
    rc = batch.get("request_counts")
    rc = rc if isinstance(rc, Mapping) else {}
    return _int(rc.get("total")), _int(rc.get("completed")), _int(rc.get("failed"))


def tokens(batch: Mapping[str, Any]) -> int | None:
    """The batch's tokens so far from its `usage` (total_tokens, else input + output)."""
    usage = batch.get("usage")
    if not isinstance(usage, Mapping):
        return None
    if isinstance(usage.get("total_tokens"), int):
        return int(usage["total_tokens"])
    parts = [usage.get(k) for k in ("input_tokens", "output_tokens")]
    if any(isinstance(p, int) for p in parts):
        return sum(_int(p) for p in parts)
    return None


def sample(batch: Mapping[str, Any], t: float, tokens_now: int | None = None) -> Sample:
    """A `Sample` of `batch` read at `t`; `tokens_now` when the tokens come from elsewhere
    (the service's /metrics) rather than the batch's `usage`."""
    total, completed, failed = counts(batch)
    own = tokens(batch)
    return Sample(t, total, completed, failed, own if own is not None else tokens_now)


def rates(samples: Sequence[Sample], window: float = RATE_WINDOW_S) -> Rates:
    """Requests/s and tokens/s between the oldest sample within `window` of the newest and
    the newest; None where there is no second sample or no time between them."""
    if len(samples) < 2:
        return Rates(None, None)
    last = samples[-1]
    first = next(s for s in samples if last.t - s.t <= window)
    span = last.t - first.t
    if span <= 0:
        return Rates(None, None)
    req = max(0, last.done - first.done) / span
    tok: float | None = None
    if last.tokens is not None and first.tokens is not None:
        tok = max(0, last.tokens - first.tokens) / span
    return Rates(req, tok)


def add_sample(
    samples: Sequence[Sample], new: Sample, keep: float = 2 * RATE_WINDOW_S
) -> list[Sample]:
    """`samples` with `new` last, less those older than `keep` seconds; a count that went
    back (the service restarted: its token counter starts from 0 again) starts over."""
    kept = [s for s in samples if new.t - s.t <= keep]
    if kept and (
        new.done < kept[-1].done
        or (new.tokens is not None and kept[-1].tokens is not None and new.tokens < kept[-1].tokens)
    ):
        kept = []
    return [*kept, new]


def eta_seconds(last: Sample, r: Rates, service_eta: float | None = None) -> float | None:
    """Seconds to the end: the service's own estimate when it gives one, else what is
    left at the measured rate; 0 when nothing is left; None when it cannot be told."""
    left = max(0, last.total - last.done)
    if left == 0 and last.total > 0:
        return 0.0
    if service_eta is not None and math.isfinite(service_eta) and service_eta >= 0:
        return service_eta
    if r.requests_per_s:
        return left / r.requests_per_s
    return None


def duration(seconds: float | None) -> str:
    """`45s`, `2m05s`, `3h10m`, `2d04h`; `?` when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    s = max(round(seconds), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _rate(value: float | None, unit: str) -> str:
    if value is None:
        return f"? {unit}/s"
    return f"{value:,.0f} {unit}/s" if value >= 10 else f"{value:.1f} {unit}/s"


def bar(done: int, total: int, width: int) -> str:
    """`[#####-----]`: `width` cells inside the brackets, filled by the share done."""
    width = max(1, width)
    filled = width if total <= 0 and done > 0 else (width * done // total if total > 0 else 0)
    filled = min(width, max(0, filled))
    return "[" + "#" * filled + "-" * (width - filled) + "]"


def _figures(last: Sample, r: Rates, eta: float | None) -> list[str]:
    figures = [f"{last.done:,}/{last.total:,} done", f"{last.failed:,} failed"]
    if last.tokens is not None:
        figures.append(_rate(r.tokens_per_s, "tokens"))
    else:
        figures.append(_rate(r.requests_per_s, "requests"))
    figures.append(f"ETA {duration(eta)}")
    return figures


def progress_line(status: str, last: Sample, r: Rates, eta: float | None, *, columns: int) -> str:
    """The terminal's one line, redrawn in place under `farmctl batch wait`'s heading (which
    names the batch): `in_progress [####----] 4,210/10,000 · 3 failed · 812 tok/s · ETA
    2m10s`, the bar as wide as `columns` leaves room for (BAR_MIN to BAR_MAX cells); without
    room for it, the figures alone, cut to `columns`."""
    rate = (
        _rate(r.tokens_per_s, "tok") if last.tokens is not None else _rate(r.requests_per_s, "req")
    )
    text = " · ".join(
        [f"{last.done:,}/{last.total:,}", f"{last.failed:,} failed", rate, f"ETA {duration(eta)}"]
    )
    head = f"{status} "
    room = columns - len(head) - len(text) - 3  # the brackets and a space
    width = min(BAR_MAX, room)
    if width < BAR_MIN:
        line = f"{head}{text}"
        return line if len(line) <= columns or columns <= 0 else line[: max(columns, 1)]
    return f"{head}{bar(last.done, last.total, width)} {text}"


def plain_line(batch_id: str, status: str, last: Sample, r: Rates, eta: float | None) -> str:
    """A log's line (no terminal): `batch ID: in_progress, 4,210/10,000 done (42.1 %), 3
    failed, 812 tokens/s, ETA 2m10s`."""
    share = f" ({100 * last.done / last.total:.1f} %)" if last.total else ""
    figures = _figures(last, r, eta)
    figures[0] += share
    return f"batch {batch_id}: {status}, " + ", ".join(figures)


def validation_errors(batch: Mapping[str, Any]) -> list[str]:
    """The batch's `errors.data`, one line each: `line 12, body.messages: what (code)`."""
    errors = batch.get("errors")
    data = errors.get("data") if isinstance(errors, Mapping) else None
    out: list[str] = []
    for e in data if isinstance(data, list) else []:
        if not isinstance(e, Mapping):
            continue
        where = []
        if e.get("line") is not None:
            where.append(f"line {e['line']}")
        if e.get("param"):
            where.append(str(e["param"]))
        code = f" ({e['code']})" if e.get("code") else ""
        prefix = ", ".join(where) + ": " if where else ""
        out.append(f"{prefix}{e.get('message') or 'invalid'}{code}")
    return out


def end_line(batch_id: str, batch: Mapping[str, Any]) -> str:
    """How a batch ended, and what to do next (the results command, the error file)."""
    status = str(batch.get("status"))
    total, completed, failed = counts(batch)
    results = f"farmctl batch results {batch_id} -o FILE"
    if status == "completed":
        text = f"batch {batch_id} completed: {completed:,} of {total:,} requests succeeded"
        if failed:
            return (
                f"{text}, {failed:,} failed (each is a line of the error file); "
                f"fetch both with: {results}"
            )
        return f"{text}; fetch the results with: {results}"
    if status == "failed":
        errors = validation_errors(batch)
        head = f"batch {batch_id} failed"
        if errors:
            shown = "; ".join(errors[:20])
            more = f" (and {len(errors) - 20} more: farmctl batch status {batch_id})"
            return (
                f"{head} validation, nothing was sent: {shown}"
                f"{more if len(errors) > 20 else ''}; fix the file and submit it again"
            )
        return f"{head}: {completed:,} of {total:,} requests succeeded; see: {results}"
    kept = f"{completed:,} of {total:,} requests succeeded, {failed:,} failed"
    if status == "expired":
        return (
            f"batch {batch_id} expired (its completion_window passed): {kept}; "
            f"the results it has: {results}"
        )
    if status == "cancelled":
        return f"batch {batch_id} cancelled: {kept}; the results it has: {results}"
    return f"batch {batch_id}: {status}"


def _when(value: object, now: float) -> str:
    if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
        return "-"
    return f"{duration(now - float(value))} ago"


def list_table(batches: Sequence[Mapping[str, Any]], now: float) -> str:
    """`farmctl batch list`: one row per batch, newest first as the service lists them."""
    rows = [["ID", "STATUS", "DONE", "FAILED", "ENDPOINT", "CREATED"]]
    for b in batches:
        total, completed, failed = counts(b)
        rows.append(
            [
                str(b.get("id")),
                str(b.get("status")),
                f"{completed + failed:,}/{total:,}",
                f"{failed:,}",
                str(b.get("endpoint") or "-"),
                _when(b.get("created_at"), now),
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


_TIMES = (
    ("created_at", "created"),
    ("in_progress_at", "in progress"),
    ("finalizing_at", "finalizing"),
    ("completed_at", "completed"),
    ("failed_at", "failed"),
    ("expired_at", "expired"),
    ("cancelling_at", "cancelling"),
    ("cancelled_at", "cancelled"),
    ("expires_at", "expires"),
)


def status_text(batch: Mapping[str, Any], now: float, eta: float | None = None) -> str:
    """`farmctl batch status ID`: the batch, its counts, its files, its times, its errors."""
    total, completed, failed = counts(batch)
    done = completed + failed
    bid = batch.get("id")
    lines = [f"batch {bid} · {batch.get('status')} · {batch.get('endpoint') or '-'}"]
    share = f" ({100 * done / total:.1f} %)" if total else ""
    lines.append(
        f"requests: {done:,}/{total:,} done{share} · {completed:,} succeeded · {failed:,} failed"
    )
    if batch.get("status") not in TERMINAL and eta is not None:
        lines.append(f"ETA: {duration(eta)}")
    usage = tokens(batch)
    if usage is not None:
        lines.append(f"tokens: {usage:,}")
    lines.append(f"input file: {batch.get('input_file_id') or '-'}")
    for key, what in (("output_file_id", "output file"), ("error_file_id", "error file")):
        if batch.get(key):
            lines.append(f"{what}: {batch[key]}")
    for key, what in _TIMES:
        value = batch.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
            rel = now - float(value)
            ago = f"{duration(rel)} ago" if rel >= 0 else f"in {duration(-rel)}"
            lines.append(f"{what}: {ago}")
    meta = batch.get("metadata")
    if isinstance(meta, Mapping) and meta:
        lines.append("metadata: " + ", ".join(f"{k}={v}" for k, v in sorted(meta.items())))
    for err in validation_errors(batch):
        lines.append(f"error: {err}")
    if batch.get("status") in TERMINAL:
        lines.append(end_line(str(bid), batch))
    return "\n".join(lines)


def metric_sum(text: str, name: str, labels: Mapping[str, str] | None = None) -> float | None:
    """The sum of the samples of `name` (with every label of `labels`) in a Prometheus text
    exposition; None when there is none. Enough for the batch service's own /metrics:
    no escaped quotes or commas in its label values (batch ids and fixed words)."""
    found: float | None = None
    want = labels or {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line.startswith(name) or line.startswith("#"):
            continue
        rest = line[len(name) :]
        got: dict[str, str] = {}
        if rest.startswith("{"):
            end = rest.find("}")
            if end < 0:
                continue
            for pair in filter(None, rest[1:end].split(",")):
                k, _, v = pair.partition("=")
                got[k.strip()] = v.strip().strip('"')
            rest = rest[end + 1 :]
        elif not rest.startswith(" "):
            continue  # another metric whose name starts with this one
        if any(got.get(k) != v for k, v in want.items()):
            continue
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        found = value if found is None else found + value
    return found
