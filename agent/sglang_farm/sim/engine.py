"""I/O: the simulated scheduler: a running batch capped by --max-running-requests and a queue.

Each request waits in the queue until a running slot is free, then produces one
token every `token_seconds`: `stream()` hands it out token by token (for streamed
answers), `generate()` runs it to the end. What the scheduler publishes (`/v1/loads`, the
scheduler gauges of `/metrics`) is a snapshot refreshed by `publish()`; once the
engine hangs or wedges, nothing moves and the snapshot stays frozen, as SGLang's
file-backed metrics do.

`health_generate()` is SGLang's `/health` with generation (`entrypoints/http_server.py`,
`health_generate`): a one-token request queued like any other, and a look every `period`
for *any* output having reached the tokenizer since the probe began. Outputs are what
SGLang's scheduler sends the tokenizer: each token of a streamed request, a finished
request, the probe's own token. Non-streamed requests send nothing until they finish, so
under a full batch of long non-streamed requests the probe waits for a request to finish
or for a running slot, however fast the tokens flow.

The prefix cache (prefix.py): at admission a request's prompt blocks are looked up; its
prefill then takes `prefill_token_seconds` per uncached prompt token before its first
token (so a hit makes the time to first token shorter, as in SGLang), and the published
`cache_hit_rate` is the share of prompt tokens found cached over the prefills since the
previous publish (SGLang's is its last prefill batches'; it keeps its value while none ran).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from sglang_farm.sim.prefix import Hit, HitRate, PrefixCache
from sglang_farm.sim.snapshots import HistogramSnapshot, SchedulerStats, TokenizerStats

# SGLang's default buckets (observability/metrics_collector.py), docs/reference/sglang.md §9.
E2E_BUCKETS = (
    0.1,
    0.2,
    0.4,
    0.6,
    0.8,
    1.0,
    2.0,
    4.0,
    6.0,
    8.0,
    10.0,
    20.0,
    40.0,
    60.0,
    80.0,
    100.0,
    200.0,
    400.0,
    600.0,
    1200.0,
    1800.0,
    2400.0,
)
# SGLang's time-to-first-token buckets are the end-to-end ones up to 400 s.
TTFT_BUCKETS = tuple(b for b in E2E_BUCKETS if b <= 400.0)
# SGLang's inter-token latency buckets (TokenizerMetricsCollector's default).
ITL_BUCKETS = (
    0.002,
    0.004,
    0.006,
    0.008,
    0.010,
    0.015,
    0.020,
    0.025,
    0.030,
    0.035,
    0.040,
    0.060,
    0.080,
    0.100,
    0.200,
    0.400,
    0.600,
    0.800,
    1.0,
    2.0,
    4.0,
    6.0,
    8.0,
)
QUEUE_BUCKETS = (
    0.0,
    0.1,
    0.2,
    0.5,
    1.0,
    2.0,
    3.0,
    4.0,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    70.0,
    80.0,
    90.0,
    100.0,
    200.0,
    300.0,
    400.0,
    500.0,
    600.0,
    700.0,
    800.0,
    900.0,
    1000.0,
    1200.0,
    1400.0,
    1600.0,
    1800.0,
    2000.0,
    2500.0,
    3000.0,
)
THROUGHPUT_WINDOW_S = 2.0


@dataclass(frozen=True, slots=True)
class Completion:
    prompt_tokens: int
    completion_tokens: int
    e2e_s: float
    ttft_s: float
    queue_s: float
    cached_tokens: int = 0  # of prompt_tokens, found in the prefix cache


class QueueFull(Exception):
    """--max-queued-requests reached; SGLang answers 503 "The request queue is full."."""


class Engine:
    """Thread-safe request accounting; `generate` blocks its caller for the simulated time."""

    def __init__(
        self,
        *,
        max_running: int,
        max_queued: int | None,
        max_total_tokens: int,
        token_seconds: float,
        prefill_token_seconds: float = 0.0,
        prefix_cache_tokens: int = 0,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._max_running = max_running
        self._max_queued = max_queued
        self._max_total = max_total_tokens
        self._token_s = token_seconds
        self._prefill_s = prefill_token_seconds
        self._cache = PrefixCache(prefix_cache_tokens)
        self._hits = HitRate()  # since the last publish
        self._hit_rate = 0.0
        self._clock = clock
        self._wall = wall
        self._sleep = sleep
        self._cond = threading.Condition()
        self._hung = False
        self._wedged = False
        self._running = 0
        self._queued = 0
        self._waiting_tokens = 0
        self._used = 0
        self._generated = 0
        self._last_output = -float("inf")  # clock time of the last output to the tokenizer
        self._history: deque[tuple[float, int]] = deque()
        self._queue_hist = HistogramSnapshot.empty(QUEUE_BUCKETS)
        self._tok = TokenizerStats(
            0,
            0,
            0,
            0,
            HistogramSnapshot.empty(E2E_BUCKETS),
            HistogramSnapshot.empty(TTFT_BUCKETS),
            HistogramSnapshot.empty(ITL_BUCKETS),
        )
        self._published = self._compute()

    # -- requests -------------------------------------------------------------------------

    def generate(
        self, prompt_tokens: int, max_new_tokens: int, *, blocks: Sequence[bytes] = ()
    ) -> Completion:
        """Queue, run and finish one request; raises QueueFull when the queue limit is reached.
        `blocks`: the prompt's block names (prefix.blocks) for the prefix cache."""
        steps = self.stream(prompt_tokens, max_new_tokens, streamed=False, blocks=blocks)
        for _ in steps:
            pass
        return steps.completion

    def stream(
        self,
        prompt_tokens: int,
        max_new_tokens: int,
        *,
        streamed: bool = True,
        blocks: Sequence[bytes] = (),
    ) -> Generation:
        """One request, token by token: iterate it (each step sleeps one token's time).

        The first `next()` queues the request and raises QueueFull when the queue limit
        is reached. Closing it before the last token aborts the request, as a client
        that hangs up does in SGLang (`sglang:num_aborted_requests_total`). `streamed`:
        each token reaches the tokenizer as it is made (else only the finished request).
        `blocks`: the prompt's block names for the prefix cache (none: nothing cached).
        """
        return Generation(self, prompt_tokens, max_new_tokens, streamed=streamed, blocks=blocks)

    def _admit(self, prompt_tokens: int, blocks: Sequence[bytes] = ()) -> tuple[float, Hit]:
        """Wait for a running slot; returns the time spent queued and the prefix cache's hit."""
        t0 = self._clock()
        with self._cond:
            busy = self._running >= self._max_running or self._stuck
            if busy and self._max_queued is not None and self._queued >= self._max_queued:
                self._tok = _replace_tok(self._tok, num_aborted=self._tok.num_aborted + 1)
                raise QueueFull("The request queue is full.")
            self._queued += 1
            self._waiting_tokens += prompt_tokens
            while self._running >= self._max_running or self._stuck:
                self._cond.wait()
            self._queued -= 1
            self._waiting_tokens -= prompt_tokens
            self._running += 1
            self._used += prompt_tokens
            queue_s = self._clock() - t0
            self._queue_hist = self._queue_hist.observe(queue_s)
            hit = self._cache.admit(blocks, prompt_tokens)
            self._hits = self._hits.plus(hit)
        return queue_s, hit

    def _prefill(self, hit: Hit) -> None:
        """The prefill of the uncached part of a prompt."""
        if self._prefill_s > 0 and hit.uncached_tokens > 0:
            self._sleep(self._prefill_s * hit.uncached_tokens)

    def flush_cache(self) -> bool:
        """SGLang's /flush_cache: the prefix cache emptied, unless requests run or wait."""
        with self._cond:
            if self._running or self._queued:
                return False
            self._cache.clear()
            return True

    @property
    def _stuck(self) -> bool:
        return self._hung or self._wedged

    def _token(self, *, output: bool) -> None:
        """One decode step of one request: a token's time, then account for the token.

        `output`: the token is sent to the tokenizer at once (a streamed request).
        """
        self._sleep(self._token_s)
        with self._cond:
            while self._stuck:
                self._cond.wait()
            self._used += 1
            self._generated += 1
            if output:
                self._last_output = self._clock()

    def _release(self, prompt_tokens: int, produced: int) -> None:
        with self._cond:
            self._running -= 1
            self._used -= prompt_tokens + produced
            self._cond.notify_all()

    def _finish(
        self,
        prompt_tokens: int,
        produced: int,
        e2e: float,
        ttft: float,
        gaps: Sequence[float] = (),
    ) -> None:
        with self._cond:
            self._last_output = self._clock()
            t = self._tok
            itl = t.itl
            for gap in gaps:
                itl = itl.observe(gap)
            self._tok = TokenizerStats(
                prompt_tokens=t.prompt_tokens + prompt_tokens,
                generation_tokens=t.generation_tokens + produced,
                num_requests=t.num_requests + 1,
                num_aborted=t.num_aborted,
                e2e=t.e2e.observe(e2e),
                ttft=t.ttft.observe(ttft),
                itl=itl,
            )

    def _abort(self) -> None:
        with self._cond:
            self._tok = _replace_tok(self._tok, num_aborted=self._tok.num_aborted + 1)

    def hang(self) -> None:
        """Freeze the scheduler for good: no token, no dequeue, no publish."""
        with self._cond:
            self._hung = True

    @property
    def hung(self) -> bool:
        return self._hung

    def wedge(self) -> None:
        """Break the engine for good, as a CUDA error can: running requests stop making
        tokens, queued ones are never admitted, the snapshot freezes; unlike `hang`, the
        server around it (`/health`, `/server_info`) goes on answering."""
        with self._cond:
            self._wedged = True

    @property
    def wedged(self) -> bool:
        return self._wedged

    def health_generate(
        self, timeout: float, period: float, *, stop: Callable[[], bool] = lambda: False
    ) -> bool:
        """SGLang's generating `/health` (module docstring): True when some output reached
        the tokenizer since the call began, found at a look every `period` seconds; False
        after `timeout` (or once `stop()` is true at a look). The probe's own request
        waits for a running slot, then takes one token's time; it leaves the queue when
        the call ends, as SGLang cancels it. It is not counted in the tokenizer metrics
        (SGLang sends it with `log_metrics=False`). Waits in real time: a test's clock
        must follow it.
        """
        period = max(period, 0.01)
        tic = self._clock()
        deadline = tic + timeout
        next_look = tic + period
        admitted_at: float | None = None
        produced = False
        with self._cond:
            self._queued += 1
            self._waiting_tokens += 1
            try:
                while True:
                    now = self._clock()
                    free = self._running < self._max_running and not self._stuck
                    if admitted_at is None and free:
                        # queued -> running: a slot is free
                        self._queued -= 1
                        self._waiting_tokens -= 1
                        self._running += 1
                        self._used += 1
                        admitted_at = now
                    token_at = None if admitted_at is None else admitted_at + self._token_s
                    due = token_at is not None and now >= token_at
                    if due and not produced and not self._stuck:
                        # its one token, sent to the tokenizer; the request ends
                        produced = True
                        self._generated += 1
                        self._last_output = now
                        self._running -= 1
                        self._used -= 1
                        self._cond.notify_all()
                    if now >= next_look:
                        if self._last_output > tic:
                            return True
                        if now >= deadline or stop():
                            return False
                        next_look = min(next_look + period, deadline)
                    wake = next_look
                    if token_at is not None and not produced:
                        wake = min(wake, token_at)
                    self._cond.wait(max(0.0, wake - now))
            finally:
                if admitted_at is None:
                    self._queued -= 1
                    self._waiting_tokens -= 1
                elif not produced:
                    self._running -= 1
                    self._used -= 1
                    self._cond.notify_all()

    def inflight(self) -> int:
        """Running plus queued requests."""
        with self._cond:
            return self._running + self._queued

    # -- what the scheduler publishes ------------------------------------------------------

    def publish(self) -> None:
        """Refresh the published snapshot (the scheduler's periodic write); a no-op once
        hung or wedged."""
        with self._cond:
            if self._stuck:
                return
            self._published = self._compute()

    def _compute(self) -> SchedulerStats:
        now = self._clock()
        self._history.append((now, self._generated))
        while len(self._history) > 1 and now - self._history[0][0] > THROUGHPUT_WINDOW_S:
            self._history.popleft()
        t_old, g_old = self._history[0]
        throughput = (self._generated - g_old) / (now - t_old) if now > t_old else 0.0
        if self._hits.rate is not None:
            self._hit_rate, self._hits = self._hits.rate, HitRate()
        return SchedulerStats(
            timestamp=self._wall(),
            num_running_reqs=self._running,
            num_waiting_reqs=self._queued,
            num_waiting_uncached_tokens=self._waiting_tokens,
            num_used_tokens=self._used,
            max_total_num_tokens=self._max_total,
            max_running_requests=self._max_running,
            token_usage=round(self._used / self._max_total, 4) if self._max_total else 0.0,
            gen_throughput=round(throughput, 2),
            cache_hit_rate=round(self._hit_rate, 4),
            utilization=round(self._running / self._max_running, 4) if self._max_running else 0.0,
            queue_time=self._queue_hist,
        )

    def scheduler_stats(self) -> SchedulerStats:
        return self._published

    def tokenizer_stats(self) -> TokenizerStats:
        return self._tok


class Generation(Iterator[int]):
    """One request being generated; yields the number of tokens produced so far.

    A class rather than a generator function so that the caller can read `completion`
    once it is exhausted, and so that `close()` before the end counts as an abort.
    """

    def __init__(
        self,
        engine: Engine,
        prompt_tokens: int,
        max_new_tokens: int,
        *,
        streamed: bool = True,
        blocks: Sequence[bytes] = (),
    ) -> None:
        self._engine = engine
        self._streamed = streamed
        self._blocks = blocks
        self.cached_tokens = 0  # known once admitted (the first next())
        self.prompt_tokens = prompt_tokens
        self.max_new_tokens = max_new_tokens
        self._t0 = 0.0
        self._queue_s = 0.0
        self._ttft = 0.0
        self._last_token = 0.0
        self._gaps: list[float] = []  # the inter-token latencies, observed when it finishes
        self._produced = -1  # -1: not admitted yet
        self._done = False
        self._completion: Completion | None = None

    def __iter__(self) -> Generation:
        return self

    def __next__(self) -> int:
        eng = self._engine
        if self._done:
            raise StopIteration
        if self._produced < 0:
            self._t0 = eng._clock()
            self._queue_s, hit = eng._admit(self.prompt_tokens, self._blocks)  # may raise QueueFull
            self.cached_tokens = hit.cached_tokens
            self._produced = 0
            try:
                eng._prefill(hit)
            except BaseException:
                self.close()
                raise
        if self._produced >= self.max_new_tokens:
            self._end()
            raise StopIteration
        try:
            eng._token(output=self._streamed)
        except BaseException:
            self.close()
            raise
        self._produced += 1
        now = eng._clock()
        if self._produced == 1:
            self._ttft = now - self._t0
        else:
            self._gaps.append(now - self._last_token)
        self._last_token = now
        return self._produced

    def _end(self) -> None:
        eng = self._engine
        self._done = True
        eng._release(self.prompt_tokens, self.max_new_tokens)
        e2e = eng._clock() - self._t0
        ttft = self._ttft if self.max_new_tokens else e2e
        eng._finish(self.prompt_tokens, self.max_new_tokens, e2e, ttft, self._gaps)
        self._completion = Completion(
            self.prompt_tokens, self.max_new_tokens, e2e, ttft, self._queue_s, self.cached_tokens
        )

    def close(self) -> None:
        """Stop early: free the running slot and count the request as aborted."""
        if self._done:
            return
        self._done = True
        if self._produced >= 0:
            self._engine._release(self.prompt_tokens, self._produced)
            self._engine._abort()

    @property
    def completion(self) -> Completion:
        """The finished request's figures; raises RuntimeError before the last token."""
        if self._completion is None:
            raise RuntimeError("the generation has not finished")
        return self._completion


def _replace_tok(t: TokenizerStats, *, num_aborted: int) -> TokenizerStats:
    return TokenizerStats(
        t.prompt_tokens, t.generation_tokens, t.num_requests, num_aborted, t.e2e, t.ttft, t.itl
    )
