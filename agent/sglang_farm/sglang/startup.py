"""Pure: a worker's start, phase by phase, from the milestones SGLang prints.

A real worker takes minutes to start: the weights (from /dev/shm or disk), the KV pool
sized from what memory is left, CUDA graphs captured batch size by batch size, the HTTP
server bound, then SGLang's own warm-up request. Each step begins with a line of its own
(docs/reference/sglang.md §10: the same lines in 0.5.12 and 0.5.23, and the simulator's):

| phase | begins with the line |
| --- | --- |
| `launching` | (the process started: imports, argument resolution, the schedulers' spawn) |
| `loading_weights` | `Load weight begin.` |
| `allocating_kv_cache` | `Load weight end.` (the pool is sized from the memory the weights left) |
| `capturing_cuda_graphs` | `Capture … CUDA graph begin.` |
| `starting_server` | `max_total_num_tokens=…` (the scheduler is ready and says its capacity) |
| `warming_up` | `Uvicorn running on …` (the port is bound; SGLang's warm-up request runs) |
| (served) | `The server is fired up and ready to roll!` |

The scheduler's `max_total_num_tokens=…, max_running_requests=…, context_len=…` line is
also the capacity SGLang settled on (its KV tokens and running-request limit): a worker
started with less than its siblings, or a flag change such as `no_buffer` raising the
limit, shows there at once. `StartTimeline` folds lines into that; `slow_phase` says which
phase made one start slower than its siblings'.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, replace
from enum import StrEnum


class StartPhase(StrEnum):
    LAUNCHING = "launching"
    LOADING_WEIGHTS = "loading_weights"
    ALLOCATING_KV_CACHE = "allocating_kv_cache"
    CAPTURING_CUDA_GRAPHS = "capturing_cuda_graphs"
    STARTING_SERVER = "starting_server"
    WARMING_UP = "warming_up"
    SERVED = "served"  # the start is over: the server said it is ready

    @property
    def words(self) -> str:
        """For people: `loading weights`."""
        return str(self).replace("_", " ")


# SGLang's log prefix: `[2026-12-02 06:35:55] ` or `[2026-12-02 06:35:55 DP0 TP3] `.
_PREFIX = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:[^\]]*)\]\s*")
_CAPACITY = re.compile(
    r"max_total_num_tokens=(\d+).*?max_running_requests=(\d+).*?context_len=(\d+)"
)


def message(line: str) -> str:
    """The line without SGLang's timestamp and rank tags."""
    return _PREFIX.sub("", line, count=1)


def phase_begun(line: str) -> StartPhase | None:
    """The phase a log line begins, if it is one of the milestones."""
    text = message(line)
    if text.startswith("Load weight begin."):
        return StartPhase.LOADING_WEIGHTS
    if text.startswith("Load weight end."):
        return StartPhase.ALLOCATING_KV_CACHE
    if text.startswith("Capture ") and "CUDA graph begin." in text:
        return StartPhase.CAPTURING_CUDA_GRAPHS
    if text.startswith("max_total_num_tokens="):
        return StartPhase.STARTING_SERVER
    if "Uvicorn running on " in text:
        return StartPhase.WARMING_UP
    if text.startswith("The server is fired up and ready to roll!"):
        return StartPhase.SERVED
    return None


@dataclass(frozen=True, slots=True)
class Capacity:
    """What SGLang chose for the worker at start (its scheduler's line)."""

    kv_tokens: int  # max_total_num_tokens: the KV pool's size in tokens
    max_running_requests: int
    context_len: int


def capacity_of(line: str) -> Capacity | None:
    m = _CAPACITY.search(message(line))
    if m is None or not message(line).startswith("max_total_num_tokens="):
        return None
    return Capacity(int(m.group(1)), int(m.group(2)), int(m.group(3)))


@dataclass(frozen=True, slots=True)
class StartTimeline:
    """One process's start: when (agent clock) each phase began, in order, and the capacity.
    Phases only move forward: a milestone printed again (a second CUDA graph, every TP rank
    saying the same) changes nothing."""

    began: tuple[tuple[StartPhase, float], ...]
    capacity: Capacity | None = None

    @staticmethod
    def launched(at: float) -> StartTimeline:
        return StartTimeline(((StartPhase.LAUNCHING, at),))

    @property
    def phase(self) -> StartPhase:
        return self.began[-1][0]

    @property
    def phase_since(self) -> float:
        return self.began[-1][1]

    @property
    def done(self) -> bool:
        return self.phase is StartPhase.SERVED

    def advance(self, line: str, at: float) -> StartTimeline:
        out = self
        cap = capacity_of(line)
        if cap is not None and out.capacity is None:
            out = replace(out, capacity=cap)
        phase = phase_begun(line)
        order = list(StartPhase)
        if phase is not None and order.index(phase) > order.index(out.phase):
            out = replace(out, began=(*out.began, (phase, at)))
        return out

    def durations(self) -> dict[StartPhase, float]:
        """Seconds spent in each phase that has ended."""
        return {
            p: round(nxt - t, 3)
            for (p, t), (_, nxt) in zip(self.began, self.began[1:], strict=False)
        }


SLOW_RATIO = 2.0  # a phase this many times its siblings' median...
SLOW_MIN_S = 10.0  # ...and this many seconds longer is slow (a simulator's 0.1 s vs 0.3 s is not)


@dataclass(frozen=True, slots=True)
class SlowPhase:
    phase: StartPhase
    seconds: float
    siblings_median: float
    siblings: int

    def text(self) -> str:
        return (
            f"{self.phase.words} took {self.seconds:.0f} s, against {self.siblings_median:.0f} s "
            f"for its {self.siblings} sibling{'s' if self.siblings != 1 else ''} (median)"
        )


def slow_phase(phase: StartPhase, seconds: float, siblings: Iterable[float]) -> SlowPhase | None:
    """`phase` took `seconds` in one worker's start; `siblings`: the same phase's seconds in
    the other workers' latest starts. Slow when well above their median."""
    others = list(siblings)
    if not others:
        return None
    median = statistics.median(others)
    if seconds > SLOW_RATIO * median and seconds - median > SLOW_MIN_S:
        return SlowPhase(phase, seconds, median, len(others))
    return None
