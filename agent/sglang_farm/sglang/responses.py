"""Pure: what SGLang's own HTTP counters say of a worker's answers (SGLang >= 0.5.20 with
`--enable-metrics`: `sglang:http_responses_total{endpoint,status_code,method}`), read
alike by the canary (`canary.figures`) and the farm's per-worker figures (`sglang.stats`).

Only the serving routes count (`SERVING_ENDPOINTS`): the agent's own probes and scrapes
(`/health`, `/metrics`, `/server_info`...) are no user's traffic. A 2xx or 5xx answer
is an answer, a 5xx a server error; a 4xx is the client's (a bad or unauthorised
request; a non-streamed request whose client hung up) and counts for neither; an
aborted stream had its 200 sent and is an answer.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

HTTP_RESPONSES = "sglang:http_responses_total"
HTTP_REQUESTS = "sglang:http_requests_total"
# The routes that serve users' requests (SGLang's `endpoint` label).
SERVING_ENDPOINTS = frozenset(
    {
        "/generate",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/rerank",
        "/v1/score",
        "/v1/classify",
        "/classify",
        "/encode",
    }
)


class Samples(Protocol):
    """A scrape's samples by name, each with its labels (`canary.promtext.Scrape`)."""

    def series(self, name: str) -> Iterator[tuple[tuple[tuple[str, str], ...], float]]: ...


def http_responses(sglang: Samples) -> tuple[float | None, float | None]:
    """(answered, server errors) on the serving routes, cumulative since the worker
    started: answered counts the 2xx and 5xx answers, server errors the 5xx. (None, None)
    when the worker has no such counter: neither family shows in its scrape (SGLang
    before 0.5.20, or without `--enable-metrics`). `sglang:http_requests_total` counts a
    request as it arrives, so a worker with the counters shows it at its first scrape,
    before any response."""
    series = list(sglang.series(HTTP_RESPONSES))
    if not series and next(sglang.series(HTTP_REQUESTS), None) is None:
        return None, None
    answered = server_errors = 0.0
    for labels, value in series:
        have = dict(labels)
        if have.get("endpoint") not in SERVING_ENDPOINTS:
            continue
        code = have.get("status_code", "")
        if code.startswith("5"):
            server_errors += value
            answered += value
        elif code.startswith("2"):
            answered += value
    return answered, server_errors
