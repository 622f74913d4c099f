"""I/O: one SGLang worker's load figures (`poll_worker`); pure: their parsing.

`poll_worker` reads the worker's `/metrics` (Prometheus text, `sglang:` names; only
with `--enable-metrics`) and falls back to `/v1/loads` (JSON) when `/metrics` is 404.
It never raises: a worker that does not answer gives a sample with `ok=False`.
What a poll gives (`WorkerSample`), what the farm keeps (`WorkerStats`) and the
staleness verdict between them (`WorkerStatsTracker`) are in `worker_load` (pure).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace

import httpx

from sglang_farm.sglang.health import HttpFailure, LocalHttp
from sglang_farm.sglang.load import WorkerSample
from sglang_farm.sglang.responses import HTTP_REQUESTS, HTTP_RESPONSES, http_responses

# Most bytes read of one answer (/metrics, /v1/loads). SGLang's /metrics is tens of KiB
# per DP rank; a worker answering more (or an endless body) gets a failed sample, not
# the agent's memory and event loop.
BODY_LIMIT = 4 << 20

# Samples whose values move whenever the scheduler does work. Tokenizer-side HTTP
# counters (`sglang:http_requests_total`, ...) are left out on purpose: they keep
# counting incoming requests (and our own scrapes) while the scheduler is hung.
PROGRESS_SAMPLES = (
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    "sglang:token_usage",
    "sglang:num_used_tokens",
    "sglang:gen_throughput",
    "sglang:realtime_tokens_total",
    "sglang:forward_execution_seconds_total",
    "sglang:generation_tokens_total",
    "sglang:prompt_tokens_total",
)


# --- parsing (pure) -------------------------------------------------------------


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


# The sample names the farm reads; everything else in SGLang's /metrics (histograms,
# ~150 lines) is skipped unparsed. prometheus_client's parser on the dozen lines left
# still cost 0.8 ms a poll; these lines are plain `name{labels} value`, read here directly.
_WANTED = frozenset({*PROGRESS_SAMPLES, "sglang:cache_hit_rate"})
# SGLang's HTTP counters (>= 0.5.20): read as the canary reads them (`sglang.responses`),
# their labels taken here as the model label is (the canary's general parser costs more).
_HTTP = frozenset({HTTP_RESPONSES, HTTP_REQUESTS})
# The wanted lines, found by one regex whose literal start ("\nsglang:") the regex engine
# searches for quickly: a Python loop over all ~180 lines of a body (histogram buckets
# mostly) cost 0.33 ms a poll, the largest share of an idle 64-worker agent's polls after
# the GET itself; this costs a tenth of that. A name is whole: followed by its labels, a
# space or the end of the line.
_PREFIX = "sglang:"
assert all(n.startswith(_PREFIX) for n in (*_WANTED, *_HTTP))
_WANTED_LINE = re.compile(
    "\n"
    + re.escape(_PREFIX)
    + "(?:"
    + "|".join(re.escape(n[len(_PREFIX) :]) for n in sorted({*_WANTED, *_HTTP}, key=len)[::-1])
    + ")(?=[{ \r\n])[^\n]*"
)


def _wanted_lines(text: str) -> Iterator[str]:
    """The lines of `text` that are samples of a wanted name, without their line ending."""
    for match in _WANTED_LINE.finditer(f"\n{text}\n"):
        yield match.group()[1:].rstrip("\r")


_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_MODEL_LABEL = re.compile(r'model_name="((?:[^"\\]|\\.)*)"')


class _HttpSeries:
    """The HTTP counters' samples of one body, as `sglang.responses.Samples`."""

    def __init__(self) -> None:
        self._by_name: dict[str, list[tuple[tuple[tuple[str, str], ...], float]]] = {}

    def add(self, name: str, labels: str, value: float) -> None:
        pairs = tuple(sorted((k, _unescape(v)) for k, v in _LABEL.findall(labels)))
        self._by_name.setdefault(name, []).append((pairs, value))

    def series(self, name: str) -> Iterator[tuple[tuple[tuple[str, str], ...], float]]:
        yield from self._by_name.get(name, ())


def _unescape(value: str) -> str:
    return value.replace('\\"', '"').replace("\\\\", "\\") if "\\" in value else value


def _samples(text: str, http: _HttpSeries) -> Iterator[tuple[str, str, float]]:
    """(name, labels text, value) of every wanted sample line; the HTTP counters' samples
    go to `http`. ValueError on a bad value."""
    for line in _wanted_lines(text):
        brace, space = line.find("{"), line.find(" ")
        if 0 < brace < space or (brace > 0 and space < 0):
            name, close = line[:brace], line.rfind("}")
            if close < brace:
                raise ValueError(f"unclosed labels in {line[:80]!r}")
            labels, rest = line[brace + 1 : close], line[close + 1 :]
        elif space > 0:
            name, labels, rest = line[:space], "", line[space:]
        else:
            raise ValueError(f"a sample line without a value: {line[:80]!r}")
        if name in _HTTP or name in _WANTED:
            fields = rest.split()
            if not fields:
                raise ValueError(f"a sample line without a value: {line[:80]!r}")
            if name in _HTTP:
                http.add(name, labels, float(fields[0]))
            else:
                yield name, labels, float(fields[0])


def parse_metrics_text(worker: int, taken_at: float, text: str) -> WorkerSample:
    """A sample from SGLang's Prometheus text. Raises ValueError on text that does not parse."""
    sums: dict[str, float] = {}
    maxes: dict[str, float] = {}
    hit_rates: list[float] = []
    model: str | None = None
    http = _HttpSeries()
    for name, labels, value in _samples(text, http):
        if model is None and (m := _MODEL_LABEL.search(labels)):
            model = _unescape(m.group(1))
        sums[name] = sums.get(name, 0.0) + value
        maxes[name] = max(maxes.get(name, value), value)
        if name == "sglang:cache_hit_rate":
            hit_rates.append(value)
    answered, server_errors = http_responses(http)
    return WorkerSample(
        worker=worker,
        taken_at=taken_at,
        ok=True,
        source="metrics",
        running=sums.get("sglang:num_running_reqs"),
        queued=sums.get("sglang:num_queue_reqs"),
        token_usage=maxes.get("sglang:token_usage"),
        gen_throughput=sums.get("sglang:gen_throughput"),
        cache_hit_rate=_mean(hit_rates),
        model_name=model,
        progress=tuple((n, sums[n]) for n in PROGRESS_SAMPLES if n in sums),
        answered=answered,
        server_errors=server_errors,
    )


def _num(d: Mapping[str, object], key: str) -> float | None:
    v = d.get(key)
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def parse_loads_json(worker: int, taken_at: float, body: object) -> WorkerSample:
    """A sample from `/v1/loads` JSON. Raises ValueError when it is not a loads document."""
    if not isinstance(body, dict) or not isinstance(body.get("loads"), list):
        raise ValueError("not a /v1/loads document (no 'loads' list)")
    loads = [x for x in body["loads"] if isinstance(x, dict)]

    def col(key: str) -> list[float]:
        return [v for x in loads if (v := _num(x, key)) is not None]

    def total(key: str) -> float | None:
        vs = col(key)
        return sum(vs) if vs else None

    usage = col("token_usage")
    version = body.get("version")
    # Each LoadSnapshot's own timestamp moves whenever the scheduler publishes
    # (at least every 15 decode steps); the top-level one is the response time.
    stamps = tuple((f"timestamp[{i}]", v) for i, v in enumerate(col("timestamp")))
    return WorkerSample(
        worker=worker,
        taken_at=taken_at,
        ok=True,
        source="loads",
        running=total("num_running_reqs"),
        queued=total("num_waiting_reqs"),
        token_usage=max(usage) if usage else None,
        gen_throughput=total("gen_throughput"),
        cache_hit_rate=_mean(col("cache_hit_rate")),
        sglang_version=str(version) if isinstance(version, str) else None,
        progress=stamps,
    )


# --- polling (I/O) ----------------------------------------------------------------


async def poll_worker(
    client: httpx.AsyncClient | LocalHttp,
    base_url: str,
    timeout: float,
    *,
    worker: int,
    known_version: str | None = None,
    api_key: str | None = None,
    clock: Callable[[], float] = time.time,
) -> WorkerSample:
    """Poll one worker within `timeout` seconds in all. Never raises.

    `/metrics` first; on 404 (no `--enable-metrics`) `/v1/loads`. While the SGLang
    version is unknown (`known_version` None), `/v1/loads` is also read once for
    its `version`. `api_key` is sent to `/v1/loads` (SGLang's `/metrics` is always open).
    At most `BODY_LIMIT` bytes of an answer are read; a longer one is a failed sample.
    """
    taken_at = clock()
    t0 = time.monotonic()
    base = base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with asyncio.timeout(timeout):
            url = f"{base}/metrics"
            status, text = await _get(client, url, {}, timeout)
            if status == 404:
                url = f"{base}/v1/loads"
                status, text = await _get(client, url, headers, timeout)
                if not 200 <= status < 300:
                    return _failed(worker, taken_at, t0, f"{url} answered {status}")
                sample = parse_loads_json(worker, taken_at, json.loads(text))
            else:
                if not 200 <= status < 300:
                    return _failed(worker, taken_at, t0, f"{url} answered {status}")
                sample = parse_metrics_text(worker, taken_at, text)
                if known_version is None:
                    sample = await _with_version(client, base, headers, timeout, sample)
    except TimeoutError:
        return _failed(worker, taken_at, t0, f"no answer within {timeout:g}s from {base}")
    except BodyTooLarge as exc:
        return _failed(worker, taken_at, t0, str(exc))
    except httpx.HTTPError as exc:
        return _failed(worker, taken_at, t0, f"{base}: {type(exc).__name__}: {exc}")
    except (HttpFailure, OSError) as exc:  # LocalHttp's; OSError: the agent's own (EMFILE, ...)
        return _failed(worker, taken_at, t0, f"{base}: {exc}")
    except ValueError as exc:  # json.JSONDecodeError is a ValueError; so are parser errors
        return _failed(worker, taken_at, t0, f"{base}: unreadable answer: {exc}")
    return replace(sample, duration_s=time.monotonic() - t0)


class BodyTooLarge(Exception):
    """A worker's answer went past `BODY_LIMIT`; the rest was not read."""


async def _get(
    client: httpx.AsyncClient | LocalHttp, url: str, headers: Mapping[str, str], timeout: float
) -> tuple[int, str]:
    """(status, body as text) of GET `url`, reading at most `BODY_LIMIT` bytes of the body."""
    if isinstance(client, LocalHttp):
        answer = await client.get(url, headers=headers, limit=BODY_LIMIT)
        if answer.truncated:
            raise BodyTooLarge(f"{url} answered more than {BODY_LIMIT >> 20} MiB; not read further")
        return answer.status, answer.body.decode("utf-8", "replace")
    async with client.stream("GET", url, headers=headers, timeout=timeout) as r:
        chunks: list[bytes] = []
        size = 0
        async for chunk in r.aiter_bytes():  # decoded: a compressed bomb is bounded too
            size += len(chunk)
            if size > BODY_LIMIT:
                raise BodyTooLarge(
                    f"{url} answered more than {BODY_LIMIT >> 20} MiB; not read further"
                )
            chunks.append(chunk)
    return r.status_code, b"".join(chunks).decode("utf-8", "replace")


async def _with_version(
    client: httpx.AsyncClient | LocalHttp,
    base: str,
    headers: Mapping[str, str],
    timeout: float,
    sample: WorkerSample,
) -> WorkerSample:
    try:
        status, text = await _get(client, f"{base}/v1/loads?include=core", headers, timeout)
        body = json.loads(text) if status == 200 else None
    except (httpx.HTTPError, HttpFailure, OSError, ValueError, BodyTooLarge):
        return sample  # the version is a nicety; the figures already came from /metrics
    version = body.get("version") if isinstance(body, dict) else None
    if not isinstance(version, str):
        return sample
    return replace(sample, sglang_version=version)


def _failed(worker: int, taken_at: float, t0: float, error: str) -> WorkerSample:
    return WorkerSample(
        worker=worker,
        taken_at=taken_at,
        ok=False,
        duration_s=time.monotonic() - t0,
        error=error,
    )
