"""I/O: paired probes: during a canary's analysis window the farm sends its own requests,
each prompt at the same moment to the canary and to one baseline worker (issue 34 §1;
docs/canary.md, "Like with like").

Why: with cache-aware routing the gateway sends a freshly restarted canary another mix
of requests than its warm siblings (mostly cache misses), or none at all when every
request shares one prefix, so its traffic can neither be compared with theirs nor be
enough to judge. The probes give the canary traffic of its own, and give both sides the
*same* requests: the same prompts (a system prompt that names the change, so neither
side holds it cached when the window starts, then the same few questions after it), at
the same moments, under the same host load. The verdict judges TTFT on them alone
(`verdict.judge(..., probes=figures.probe_figures(pairs))`); their requests also count
in each worker's own counters and histograms (errors, ITL), like any request.

Bounded: at most `concurrency` pairs in flight (each pair one request to each side), each
request bounded by `timeout_s` and `max_tokens`; sent straight to the workers' ports with
their API keys (`[sglang] api_key`), not through the gateway, which would route them by
its own policy. The baseline side takes the baseline workers in turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import structlog

from sglang_farm.canary.figures import ProbePair, ProbeResult
from sglang_farm.host.keyguard import KeyGuard

log = structlog.get_logger("sglang_farm.canary")

CHAT = "/v1/chat/completions"
MAX_TOKENS = 8
TIMEOUT_S = 30.0
QUESTIONS = 8  # distinct questions after the shared system prompt, in turn
FAIL_PAUSE_S = 0.5  # after a pair with a failed side: a refused port must not spin

# (url, bearer key or None, chat body) -> the result; never raises for the worker's doing.
Send = Callable[[str, str | None, dict[str, Any]], Awaitable[ProbeResult]]


@dataclass(frozen=True, slots=True)
class Target:
    worker: int
    url: str  # http://host:port
    key: str | None


def system_prompt(change: str) -> str:
    """A long system prompt (about 300 tokens) naming the change: new to every worker when
    the window starts, then shared by every probe, as a deployment's system prompt is."""
    rule = (
        "You are the farm's canary probe. Answer in as few words as you can, with no "
        "preamble, and never ask a question back. "
    )
    return f"Canary probe for change {change}. " + rule * 8


def body(change: str, n: int, model: str | None) -> dict[str, Any]:
    """The n-th probe's chat request: the shared system prompt, then question n % QUESTIONS."""
    out: dict[str, Any] = {
        "messages": [
            {"role": "system", "content": system_prompt(change)},
            {"role": "user", "content": f"Probe question {n % QUESTIONS}: count to three."},
        ],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model is not None:
        out["model"] = model
    return out


async def http_send(
    client: httpx.AsyncClient, url: str, key: str | None, payload: dict[str, Any]
) -> ProbeResult:
    """One streamed chat request: its time to the first content chunk, whether it ended
    with `data: [DONE]` and no error event, and the cached tokens its usage reported."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    t0 = time.perf_counter()
    ttft: float | None = None
    cached: int | None = None
    try:
        async with client.stream("POST", url + CHAT, json=payload, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                return ProbeResult(None, False, None, f"HTTP {r.status_code}")
            last = ""
            # Read to the body's end (not only to [DONE]): a connection closed with its
            # last chunk unread is reset, and a worker's server logs the reset.
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    last = line or last
                    continue
                last = line
                try:
                    chunk = json.loads(line[6:])
                except ValueError:
                    return ProbeResult(ttft, False, cached, "a chunk that is not JSON")
                if "error" in chunk:
                    return ProbeResult(ttft, False, cached, "an error event in the stream")
                choices = chunk.get("choices") or []
                if ttft is None and choices and (choices[0].get("delta") or {}).get("content"):
                    ttft = time.perf_counter() - t0
                details = (chunk.get("usage") or {}).get("prompt_tokens_details") or {}
                if isinstance(details.get("cached_tokens"), int):
                    cached = details["cached_tokens"]
            if last != "data: [DONE]":
                return ProbeResult(ttft, False, cached, "the stream ended without [DONE]")
            return ProbeResult(ttft, True, cached)
    except httpx.HTTPError as exc:
        return ProbeResult(ttft, False, cached, f"{type(exc).__name__}: {exc}")


class Prober:
    """Sends paired probes until cancelled; `pairs` holds every pair sent so far."""

    def __init__(
        self,
        change: str,
        canary: Target,
        baseline: Sequence[Target],
        *,
        concurrency: int,
        model: str | None,
        send: Send | None = None,
        timeout_s: float = TIMEOUT_S,
        guard: KeyGuard | None = None,
    ) -> None:
        """`guard`: each probe goes to a worker only while its port is the worker's own
        (`host.keyguard`); a refused one is a failed side, nothing sent."""
        if not baseline:
            raise ValueError("paired probes need at least one baseline worker")
        self.change = change
        self.canary = canary
        self.baseline = tuple(baseline)
        self.concurrency = max(1, concurrency)
        self.model = model
        self.timeout_s = timeout_s
        self._send = send
        self._guard = guard
        self.pairs: list[ProbePair] = []
        self._n = 0

    async def run(self) -> None:
        """`concurrency` loops of pairs, until cancelled."""
        limits = httpx.Limits(max_connections=2 * self.concurrency)
        async with httpx.AsyncClient(
            trust_env=False, timeout=self.timeout_s, limits=limits
        ) as client:
            send = self._send or (lambda url, key, p: http_send(client, url, key, p))
            loops = [asyncio.create_task(self._loop(send)) for _ in range(self.concurrency)]
            try:
                await asyncio.gather(*loops)
            finally:
                for t in loops:
                    t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.gather(*loops, return_exceptions=True)

    async def _loop(self, send: Send) -> None:
        while True:
            n = self._n
            self._n += 1
            base = self.baseline[n % len(self.baseline)]
            payload = body(self.change, n, self.model)
            c, b = await asyncio.gather(
                self._bounded(send, self.canary, payload), self._bounded(send, base, payload)
            )
            self.pairs.append(ProbePair(c, b, base.worker))
            if not (c.ok and b.ok):
                await asyncio.sleep(FAIL_PAUSE_S)

    async def _bounded(self, send: Send, t: Target, payload: dict[str, Any]) -> ProbeResult:
        if self._guard is not None:
            why = await self._guard.refusal(t.worker, t.url)
            if why is not None:
                return ProbeResult(None, False, None, why)
        try:
            return await asyncio.wait_for(send(t.url, t.key, payload), self.timeout_s)
        except TimeoutError:
            return ProbeResult(None, False, None, f"no answer within {self.timeout_s:g} s")
