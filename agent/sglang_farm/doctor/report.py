"""Pure: the doctor's report for people: a table of checks, each fix under its row."""

from __future__ import annotations

from sglang_farm.doctor.checks import DoctorReport, Status


def _workers_text(workers: tuple[int, ...]) -> str:
    if not workers:
        return "all"
    parts: list[str] = []
    start = prev = workers[0]
    for w in (*workers[1:], None):
        if w is not None and w == prev + 1:
            prev = w
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if w is not None:
            start = prev = w
    return ",".join(parts)


def format_report(report: DoctorReport) -> str:
    """A table for people: status, check, workers, message, and the fix under it."""
    rows = [(c.status.upper(), str(c.id), _workers_text(c.workers), c) for c in report.checks]
    w_check = max([len("CHECK"), *(len(r[1]) for r in rows)])
    w_workers = max([len("WORKERS"), *(len(r[2]) for r in rows)])
    indent = " " * (6 + 2 + w_check + 2 + w_workers + 2)
    lines = [f"{'STATUS':<6}  {'CHECK':<{w_check}}  {'WORKERS':<{w_workers}}  MESSAGE"]
    for status, cid, workers, c in rows:
        lines.append(f"{status:<6}  {cid:<{w_check}}  {workers:<{w_workers}}  {c.message}")
        if c.fix and c.status in (Status.FAIL, Status.WARN):
            lines.append(f"{indent}fix: {c.fix}")
    counts = report.counts()
    picked = sorted(set(report.attention.values()))
    lines.append("")
    warnings = f"{counts['warn']} warning{'' if counts['warn'] == 1 else 's'}"
    lines.append(
        f"{counts['fail']} failed, {warnings}, {counts['pass']} passed"
        + (f"; attention backend: {', '.join(picked)}" if picked else "")
    )
    lines.append(
        "OK: nothing blocks a start."
        if report.ok
        else "NOT OK: the failed checks above would stop the workers they name."
    )
    return "\n".join(lines) + "\n"
