"""I/O: the eval gate's shell (issue 23 #3; docs/canary.md, "The eval gate"): send an eval
set to one worker and collect its replies; run it on the canary and on a baseline worker
and judge the two scores (`evalset.eval_verdict`).

The route is `POST /v1/chat/completions`, which SGLang and the farm's simulator both
serve: a chat model is asked the way its users ask it (its chat template applied), and
the reply's text is `choices[0].message.content`. Sampling is deterministic as far as
SGLang allows: temperature 0 (greedy) and a fixed seed; max_tokens bounds each reply.
Greedy text can still differ across versions and batch sizes, hence a tolerance on the
score, not a comparison of texts.

Every request is bounded (`timeout_s`, all of it: connect, queue, generation) and at most
`concurrency` are in flight, so the eval never floods the worker it is judging. A request
that fails (HTTP error, timeout, a body without a reply) is a wrong answer, counted
separately (`Score.failed`), with one line saying why in `EvalRun.errors`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import structlog

from sglang_farm.canary.evalset import EvalItem, EvalVerdict, Score, eval_verdict, score

log = structlog.get_logger("sglang_farm.canary.evalrun")

CHAT_PATH = "/v1/chat/completions"


@dataclass(frozen=True, slots=True)
class EvalOptions:
    """How the eval set is sent. `model`: the `model` field (the worker's served model
    name); None leaves it out and SGLang answers with the one model it serves."""

    concurrency: int = 4
    timeout_s: float = 60.0
    max_tokens: int = 256
    seed: int = 0
    model: str | None = None

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be more than 0, got {self.timeout_s}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")


@dataclass(frozen=True, slots=True)
class EvalRun:
    """One worker's run: its replies in the set's order (None: the request failed), why
    each failed request failed, and the score."""

    url: str
    replies: tuple[str | None, ...]
    errors: tuple[str, ...]
    score: Score


@dataclass(frozen=True, slots=True)
class EvalGate:
    """The gate's outcome: the verdict and both runs (for `why` and the logs)."""

    verdict: EvalVerdict
    canary: EvalRun
    baseline: EvalRun


class _NoReply(Exception):
    """A request that gave no reply to grade; the message says why."""


def request_body(item: EvalItem, options: EvalOptions) -> dict[str, Any]:
    """The chat request for one question: the prompt as the user's message, greedy."""
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": item.prompt}],
        "temperature": 0,
        "seed": options.seed,
        "max_tokens": options.max_tokens,
        "stream": False,
    }
    if options.model is not None:
        body["model"] = options.model
    return body


def reply_text(response: httpx.Response) -> str:
    """The reply's text, or _NoReply naming what was wrong with the response."""
    if response.status_code != 200:
        detail = response.text.strip().replace("\n", " ")[:200]
        raise _NoReply(f"HTTP {response.status_code}: {detail}")
    try:
        body = response.json()
    except ValueError:
        raise _NoReply("HTTP 200 with a body that is not JSON") from None
    try:
        content = body["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise _NoReply("HTTP 200 without choices[0].message.content") from None
    if content is None:
        return ""  # a reasoning model cut off by max_tokens: an answer without a number
    if not isinstance(content, str):
        raise _NoReply(f"choices[0].message.content is {type(content).__name__}, not text")
    return content


async def _ask(
    client: httpx.AsyncClient,
    item: EvalItem,
    options: EvalOptions,
    limit: asyncio.Semaphore,
) -> tuple[str | None, str | None]:
    """(reply, None) or (None, why it failed)."""
    async with limit:
        try:
            response = await asyncio.wait_for(
                client.post(CHAT_PATH, json=request_body(item, options)), options.timeout_s
            )
            return reply_text(response), None
        except (TimeoutError, httpx.TimeoutException):
            why = f"no reply within {options.timeout_s:g} s"
        except httpx.HTTPError as exc:
            why = f"{type(exc).__name__}: {exc}"
        except _NoReply as exc:
            why = str(exc)
    return None, f"{item.name}: {why}"


async def run_eval(
    url: str,
    items: Sequence[EvalItem],
    *,
    api_key: str | None = None,
    options: EvalOptions = EvalOptions(),
    worker: int | None = None,
    gpu: int | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> EvalRun:
    """Send every question to the worker at `url` (its base URL, e.g.
    http://127.0.0.1:30000) and score the replies. `api_key`: the worker's SGLang
    `--api-key`, sent as a bearer token. `worker`/`gpu` name it in the logs. Never raises
    for a failed request: it is a wrong answer, counted in `score.failed`."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = asyncio.Semaphore(options.concurrency)
    async with httpx.AsyncClient(
        base_url=url,
        headers=headers,
        timeout=httpx.Timeout(options.timeout_s),
        limits=httpx.Limits(max_connections=options.concurrency),
        transport=transport,
    ) as client:
        answers = await asyncio.gather(*(_ask(client, i, options, limit) for i in items))
    replies = tuple(reply for reply, _ in answers)
    errors = tuple(why for _, why in answers if why is not None)
    result = EvalRun(url, replies, errors, score(items, replies))
    event = log.warning if errors else log.info
    event(
        "eval_run",
        worker=worker,
        gpu=gpu,
        url=url,
        correct=result.score.correct,
        total=result.score.total,
        failed=result.score.failed,
        first_error=errors[0] if errors else None,
    )
    return result


async def run_gate(
    items: Sequence[EvalItem],
    *,
    canary_url: str,
    baseline_url: str,
    tolerance: float,
    canary_key: str | None = None,
    baseline_key: str | None = None,
    options: EvalOptions = EvalOptions(),
    canary_worker: int | None = None,
    baseline_worker: int | None = None,
) -> EvalGate:
    """Run the set on the canary and on one baseline worker (at the same time: they are
    different GPUs), and judge: the canary fails when its score is below the baseline's by
    more than `tolerance`."""
    canary, baseline = await asyncio.gather(
        run_eval(canary_url, items, api_key=canary_key, options=options, worker=canary_worker),
        run_eval(
            baseline_url, items, api_key=baseline_key, options=options, worker=baseline_worker
        ),
    )
    verdict = eval_verdict(
        canary.score.correct,
        baseline.score.correct,
        len(items),
        tolerance,
        canary_failed=canary.score.failed,
        baseline_failed=baseline.score.failed,
    )
    (log.info if verdict.passed else log.warning)(
        "eval_verdict",
        worker=canary_worker,
        baseline_worker=baseline_worker,
        passed=verdict.passed,
        evidence=verdict.evidence_line,
    )
    return EvalGate(verdict, canary, baseline)
