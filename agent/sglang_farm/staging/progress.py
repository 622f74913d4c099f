"""Pure: a stage's progress as people read it: bytes done of total, rate, time left."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StageProgress:
    step: str  # "checking", "downloading", "copying", "verifying", "warming"
    bytes_done: int
    bytes_total: int
    elapsed_s: float  # since this step began

    @property
    def rate(self) -> float | None:
        """Bytes per second so far (None before a measurable interval)."""
        if self.elapsed_s <= 0.0 or self.bytes_done <= 0:
            return None
        return self.bytes_done / self.elapsed_s

    @property
    def eta_s(self) -> float | None:
        r = self.rate
        if r is None:
            return None
        return max(0.0, (self.bytes_total - self.bytes_done) / r)


def describe(p: StageProgress) -> str:
    """'copying 1.2 GiB of 51.0 GiB (2%) at 1.1 GiB/s, about 45s left'."""
    from sglang_farm.staging.plan import gib

    pct = f" ({100 * p.bytes_done // p.bytes_total}%)" if p.bytes_total else ""
    text = f"{p.step} {gib(p.bytes_done)} of {gib(p.bytes_total)}{pct}"
    if p.rate is not None:
        text += f" at {gib(int(p.rate))}/s"
    if p.eta_s is not None:
        text += f", about {seconds_text(p.eta_s)} left"
    return text


def seconds_text(s: float) -> str:
    s = int(s + 0.5)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
