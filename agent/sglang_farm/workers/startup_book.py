"""Pure: every worker's latest start, phase by phase (`sglang.startup.StartTimeline`),
fed the worker's log lines with the agent's clock; which phase made a start slower than its
siblings'. No I/O, no clock of its own: the agent passes `at`.

Kept per worker until its next launch, so a ready worker still shows how its start went
(each phase's seconds, the capacity SGLang chose). An adopted worker (an agent restarted
while it ran) has no start here: its milestones were printed to an agent that is gone.
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_farm.sglang.startup import SlowPhase, StartTimeline, slow_phase


@dataclass(frozen=True, slots=True)
class SlowStart:
    worker: int
    slow: SlowPhase


class StartupBook:
    """Each worker's latest start, and the phases of it found slow (kept with the start, so
    that `farmctl status` and `why` say them too, not the agent's log alone)."""

    def __init__(self) -> None:
        self._starts: dict[int, StartTimeline] = {}
        self._slow: list[SlowStart] = []
        self._slow_of: dict[int, tuple[SlowPhase, ...]] = {}  # the latest start's
        self.version = 0  # moves whenever a start moves: the view is rebuilt then

    def launched(self, worker: int, at: float) -> None:
        self._starts[worker] = StartTimeline.launched(at)
        self._slow_of.pop(worker, None)
        self.version += 1

    def forget(self, worker: int) -> None:
        self._slow_of.pop(worker, None)
        if self._starts.pop(worker, None) is not None:
            self.version += 1

    def line(self, worker: int, text: str, at: float) -> None:
        t = self._starts.get(worker)
        if t is None or t.done:
            return
        new = t.advance(text, at)
        if new == t:
            return
        self._starts[worker] = new
        self.version += 1
        if len(new.began) > len(t.began):  # the phase `t` was in has ended
            ended = t.phase
            seconds = new.durations()[ended]
            siblings = [
                d[ended]
                for w, other in self._starts.items()
                if w != worker and ended in (d := other.durations())
            ]
            slow = slow_phase(ended, seconds, siblings)
            if slow is not None:
                self._slow.append(SlowStart(worker, slow))
                self._slow_of[worker] = (*self._slow_of.get(worker, ()), slow)

    def take_slow(self) -> list[SlowStart]:
        """The slow phases found since the last call (the agent logs each once)."""
        out, self._slow = self._slow, []
        return out

    def starts(self) -> dict[int, StartTimeline]:
        return dict(self._starts)

    def slow_phases(self) -> dict[int, tuple[SlowPhase, ...]]:
        """The slow phases of each worker's latest start (workers with none left out)."""
        return dict(self._slow_of)
