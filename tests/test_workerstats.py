"""poll_worker against a real local HTTP server that answers like SGLang, and the staleness rule."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from http_fakes import Sent, endless_body_server
from sglang_farm.sglang.health import LocalHttp
from sglang_farm.sglang.load import WorkerSample, WorkerStats, WorkerStatsTracker
from sglang_farm.sglang.stats import BODY_LIMIT, parse_metrics_text, poll_worker

# What SGLang 0.5.23 serves with --enable-metrics and --dp-size 2 (docs/reference/sglang.md §9):
# scheduler gauges per dp_rank, tokenizer counters, an HTTP counter that moves on every scrape.
METRICS = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{{dp_rank="0",{sched}}} {running0}
sglang:num_running_reqs{{dp_rank="1",{sched}}} 2.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{{dp_rank="0",{sched}}} 4.0
sglang:num_queue_reqs{{dp_rank="1",{sched}}} 1.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{{dp_rank="0",{sched}}} 0.25
sglang:token_usage{{dp_rank="1",{sched}}} 0.75
# HELP sglang:gen_throughput The generation throughput (token/s).
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{{dp_rank="0",{sched}}} 1000.0
sglang:gen_throughput{{dp_rank="1",{sched}}} 500.0
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{{dp_rank="0",{sched}}} 0.5
sglang:cache_hit_rate{{dp_rank="1",{sched}}} 0.25
# HELP sglang:generation_tokens_total Number of generation tokens processed.
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{{{tok},is_streaming="false"}} {gen_tokens}
# HELP sglang:http_requests_total Number of HTTP requests.
# TYPE sglang:http_requests_total counter
sglang:http_requests_total{{endpoint="/metrics",method="GET"}} {http_requests}
"""
SCHED = 'engine_type="unified",model_name="qwen3-8b",moe_ep_rank="0",pp_rank="0",tp_rank="0"'
TOK = 'engine_type="unified",model_name="qwen3-8b"'


def metrics_text(running0: float, gen_tokens: float, http_requests: int) -> str:
    return METRICS.format(
        sched=SCHED,
        tok=TOK,
        running0=running0,
        gen_tokens=gen_tokens,
        http_requests=http_requests,
    )


@dataclass
class Fake:
    """What the fake SGLang answers; the test mutates it between polls."""

    metrics: bool = True  # False: /metrics is 404 (no --enable-metrics)
    running0: float = 3.0
    gen_tokens: float = 100.0
    loads_timestamp: float = 1.7e9
    status: int = 200
    delay_s: float = 0.0
    loads_body: str | None = None
    http_requests: int = 0
    paths: list[str] = field(default_factory=list)
    auth: dict[str, str | None] = field(default_factory=dict)  # path -> Authorization sent


def _loads(fake: Fake) -> str:
    if fake.loads_body is not None:
        return fake.loads_body
    rank = {
        "dp_rank": 0,
        "timestamp": fake.loads_timestamp,
        "num_running_reqs": fake.running0,
        "num_waiting_reqs": 7,
        "token_usage": 0.5,
        "gen_throughput": 321.0,
        "cache_hit_rate": 0.1,
    }
    return json.dumps({"timestamp": time.time(), "version": "0.5.23", "loads": [rank]})


@pytest.fixture
def fake() -> Iterator[tuple[Fake, str]]:
    state = Fake()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            state.paths.append(self.path)
            state.auth[self.path] = self.headers.get("Authorization")
            if state.delay_s:
                time.sleep(state.delay_s)
            if self.path == "/metrics" and state.metrics:
                state.http_requests += 1
                body = metrics_text(state.running0, state.gen_tokens, state.http_requests).encode()
                ctype = "text/plain; version=0.0.4"
            elif self.path.startswith("/v1/loads"):
                body, ctype = _loads(state).encode(), "application/json"
            else:
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(state.status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            # A client that timed out (the hang test) has gone: nothing to tell it.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield state, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


Client = httpx.AsyncClient | LocalHttp


@asynccontextmanager
async def client_of(kind: str) -> AsyncIterator[Client]:
    """The client poll_worker is given: httpx's, or LocalHttp (what the agent's pollers use:
    pollers.py hands poll_worker a LocalHttp)."""
    if kind == "httpx":
        async with httpx.AsyncClient() as client:
            yield client
    else:
        yield LocalHttp()


# Tests that hold for both clients run over both: production polls through LocalHttp.
BOTH_CLIENTS = pytest.mark.parametrize("kind", ["httpx", "local_http"])


async def test_metrics_are_summed_over_dp_ranks_and_version_read_from_loads(
    fake: tuple[Fake, str],
) -> None:
    state, url = fake
    async with httpx.AsyncClient() as client:
        s = await poll_worker(client, url, 2.0, worker=3)
    assert s.ok and s.error is None and s.worker == 3
    assert s.source == "metrics"
    assert (s.running, s.queued) == (5.0, 5.0)
    assert s.token_usage == 0.75  # the fullest rank
    assert s.gen_throughput == 1500.0
    assert s.cache_hit_rate == 0.375
    assert s.model_name == "qwen3-8b"
    assert s.sglang_version == "0.5.23"
    assert s.duration_s > 0  # measured, not left at its default
    assert state.paths == ["/metrics", "/v1/loads?include=core"]


async def test_known_version_skips_the_loads_request(fake: tuple[Fake, str]) -> None:
    state, url = fake
    async with httpx.AsyncClient() as client:
        s = await poll_worker(client, url, 2.0, worker=0, known_version="0.5.23")
    assert s.ok and s.sglang_version is None
    assert state.paths == ["/metrics"]


@BOTH_CLIENTS
async def test_falls_back_to_v1_loads_when_metrics_is_404(
    fake: tuple[Fake, str], kind: str
) -> None:
    state, url = fake
    state.metrics = False
    async with client_of(kind) as client:
        s = await poll_worker(client, url, 2.0, worker=1)
    assert state.paths == ["/metrics", "/v1/loads"]
    assert s.ok and s.source == "loads"
    assert (s.running, s.queued, s.token_usage, s.gen_throughput) == (3.0, 7.0, 0.5, 321.0)
    assert s.sglang_version == "0.5.23"
    assert s.progress == (("timestamp[0]", 1.7e9),)


@BOTH_CLIENTS
async def test_a_worker_that_hangs_is_reported_within_the_timeout(
    fake: tuple[Fake, str], kind: str
) -> None:
    state, url = fake
    state.delay_s = 3.0  # it would answer (ok) after 3 s: a timeout verdict means 0.3 s cut it
    async with client_of(kind) as client:
        s = await poll_worker(client, url, 0.3, worker=2)
    assert not s.ok and s.error is not None and "no answer within 0.3s" in s.error


async def test_a_closed_port_is_a_failed_sample_naming_the_url() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient() as client:
        s = await poll_worker(client, url, 1.0, worker=0)
    assert not s.ok and s.error is not None and url in s.error


async def test_an_error_status_is_a_failed_sample(fake: tuple[Fake, str]) -> None:
    state, url = fake
    state.status = 503
    async with httpx.AsyncClient() as client:
        s = await poll_worker(client, url, 1.0, worker=0)
    assert not s.ok and s.error is not None and "503" in s.error


async def test_a_non_loads_document_is_a_failed_sample(fake: tuple[Fake, str]) -> None:
    state, url = fake
    state.metrics = False
    state.loads_body = '{"hello": 1}'
    async with httpx.AsyncClient() as client:
        s = await poll_worker(client, url, 1.0, worker=0)
    assert not s.ok and s.error is not None and "unreadable" in s.error


async def test_frozen_values_under_load_become_stale_through_real_polls(
    fake: tuple[Fake, str],
) -> None:
    state, url = fake
    tracker = WorkerStatsTracker(window_s=30.0)
    prev: WorkerStats | None = None
    async with httpx.AsyncClient() as client:
        for now in (0.0, 20.0, 40.0):  # scheduler hung: nothing moves but the HTTP counter
            prev = tracker.update(prev, await poll_worker(client, url, 2.0, worker=0), now)
            assert prev.up
        assert prev is not None and prev.stale
        assert prev.stale_reason is not None and "unchanged for 40s" in prev.stale_reason
        state.gen_tokens += 50  # it moves again
        prev = tracker.update(prev, await poll_worker(client, url, 2.0, worker=0), 41.0)
    assert not prev.stale and prev.changed_at == 41.0


_CHUNK = b"x" * (256 * 1024)  # every 10 ms: ~25 MB/s, far past the limit within the timeout


@BOTH_CLIENTS
async def test_a_worker_answering_an_endless_metrics_body_is_cut_off_at_the_limit(
    kind: str,
) -> None:
    sent = Sent()
    with endless_body_server(chunk=_CHUNK, sent=sent) as url:
        async with client_of(kind) as client:
            s = await poll_worker(client, url, 30.0, worker=3, known_version="0.5.23")
        # The limit stopped the read, not the timeout ("no answer within 30s"), and the
        # poll hung up on the rest rather than reading on.
        assert not s.ok and s.error is not None
        assert f"{url}/metrics answered more than {BODY_LIMIT >> 20} MiB" in s.error
        assert await asyncio.to_thread(sent.wait_hung_up)
    assert sent.body_bytes > BODY_LIMIT


@BOTH_CLIENTS
async def test_a_worker_answering_an_endless_loads_body_is_cut_off_at_the_limit(
    kind: str,
) -> None:
    sent = Sent()
    with endless_body_server(chunk=_CHUNK, not_found=("/metrics",), sent=sent) as url:
        async with client_of(kind) as client:
            s = await poll_worker(client, url, 30.0, worker=3)
        assert not s.ok and s.error is not None
        assert f"{url}/v1/loads answered more than {BODY_LIMIT >> 20} MiB" in s.error
        assert await asyncio.to_thread(sent.wait_hung_up)
    assert sent.body_bytes > BODY_LIMIT


@BOTH_CLIENTS
async def test_the_api_key_goes_to_v1_loads_only(fake: tuple[Fake, str], kind: str) -> None:
    state, url = fake
    async with client_of(kind) as client:
        s = await poll_worker(client, url, 2.0, worker=0, api_key="sk-farm")
        state.metrics = False  # the /v1/loads fallback carries it too
        fallback = await poll_worker(client, url, 2.0, worker=0, api_key="sk-farm")
    assert s.ok and s.sglang_version == "0.5.23" and fallback.ok and fallback.source == "loads"
    assert state.auth == {
        "/metrics": None,  # SGLang's /metrics is always open: the key is not sent there
        "/v1/loads?include=core": "Bearer sk-farm",
        "/v1/loads": "Bearer sk-farm",
    }


@BOTH_CLIENTS
async def test_no_api_key_sends_no_authorization(fake: tuple[Fake, str], kind: str) -> None:
    state, url = fake
    async with client_of(kind) as client:
        assert (await poll_worker(client, url, 2.0, worker=0)).ok
    assert state.auth == {"/metrics": None, "/v1/loads?include=core": None}


# --- the pure rule ----------------------------------------------------------------


def _sample(running: float, progress: float, ok: bool = True) -> WorkerSample:
    if not ok:
        return WorkerSample(worker=0, taken_at=0.0, ok=False, error="connection refused")
    return WorkerSample(
        worker=0,
        taken_at=0.0,
        ok=True,
        source="metrics",
        running=running,
        model_name="m",
        progress=(("sglang:generation_tokens_total", progress),),
    )


def test_values_that_keep_changing_are_never_stale() -> None:
    t = WorkerStatsTracker(window_s=30)
    s = None
    for i in range(10):
        s = t.update(s, _sample(4, float(i)), now=i * 20.0)
        assert not s.stale


def test_frozen_values_while_idle_are_not_stale() -> None:
    t = WorkerStatsTracker(window_s=30)
    s = t.update(None, _sample(0, 1.0), now=0)
    s = t.update(s, _sample(0, 1.0), now=300)
    assert not s.stale and s.up


def test_frozen_values_while_running_go_stale_only_after_the_window() -> None:
    t = WorkerStatsTracker(window_s=30)
    s = t.update(None, _sample(2, 1.0), now=0)
    s = t.update(s, _sample(2, 1.0), now=30)
    assert not s.stale  # exactly the window: not yet
    s = t.update(s, _sample(2, 1.0), now=31)
    assert s.stale and s.up


def test_no_answer_is_down_and_stale_and_keeps_model_and_freeze_start() -> None:
    t = WorkerStatsTracker(window_s=30)
    s = t.update(None, _sample(2, 1.0), now=0)
    s = t.update(s, _sample(2, 0, ok=False), now=10)
    assert not s.up and s.stale and s.error == "connection refused"
    assert s.running is None and s.model_name == "m"
    # It answers again with the same frozen values: the freeze still dates from t=0.
    s = t.update(s, _sample(2, 1.0), now=35)
    assert s.up and s.stale and s.changed_at == 0


def test_parse_metrics_ignores_tokenizer_http_counters_in_the_fingerprint() -> None:
    a = parse_metrics_text(0, 0, metrics_text(1, 5, 1))
    b = parse_metrics_text(0, 0, metrics_text(1, 5, 99))
    assert a.progress == b.progress
    assert dict(a.progress)["sglang:generation_tokens_total"] == 5


# --- the agent's own client (LocalHttp, issue 17) gives the same samples as httpx ------


def _same(a: WorkerSample, b: WorkerSample) -> bool:
    return replace(a, taken_at=0.0, duration_s=0.0) == replace(b, taken_at=0.0, duration_s=0.0)


async def test_local_http_polls_give_the_samples_httpx_gives(fake: tuple[Fake, str]) -> None:
    state, url = fake
    async with httpx.AsyncClient() as client:
        via_httpx = await poll_worker(client, url, 2.0, worker=3)
    via_local = await poll_worker(LocalHttp(), url, 2.0, worker=3)
    assert via_local.ok and via_local.sglang_version == "0.5.23"
    assert _same(via_local, via_httpx)
    state.metrics = False  # /metrics 404: the /v1/loads fallback
    async with httpx.AsyncClient() as client:
        loads_httpx = await poll_worker(client, url, 2.0, worker=1)
    loads_local = await poll_worker(LocalHttp(), url, 2.0, worker=1)
    assert loads_local.ok and loads_local.source == "loads"
    assert _same(loads_local, loads_httpx)


async def test_local_http_poll_of_a_closed_port_is_a_failed_sample() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sample = await poll_worker(LocalHttp(), f"http://127.0.0.1:{port}", 2.0, worker=4)
    assert not sample.ok and sample.error is not None and "refused" in sample.error


def test_the_metrics_parser_reads_labels_with_spaces_and_refuses_a_bad_value() -> None:
    text = (
        "# HELP sglang:num_running_reqs x\n"
        'sglang:num_running_reqs{model_name="my model \\"v2\\"",dp_rank="0"} 4.0\n'
        'sglang:num_running_reqs{model_name="my model \\"v2\\"",dp_rank="1"} 2 1700000000\n'
        "sglang:token_usage 0.5\n"
        'sglang:other_bucket{le="+Inf"} 9\n'
    )
    s = parse_metrics_text(0, 0.0, text)
    assert (s.running, s.token_usage, s.model_name) == (6.0, 0.5, 'my model "v2"')
    with pytest.raises(ValueError):
        parse_metrics_text(0, 0.0, 'sglang:num_running_reqs{dp_rank="0"} many\n')


def test_the_metrics_parser_reads_whole_names_at_a_lines_start_with_any_line_ending() -> None:
    """The wanted lines are found by name at a line's start (one regex over the body): a
    longer name that begins with a wanted one, a name inside a comment, CRLF line endings
    and a last line without its newline all read as the line-by-line parser read them."""
    text = (
        "# HELP sglang:num_running_reqs 7\r\n"
        'sglang:num_running_reqs_extra{dp_rank="0"} 100\r\n'
        'xsglang:num_running_reqs{dp_rank="0"} 100\r\n'
        'sglang:num_running_reqs{dp_rank="0"} 4\r\n'
        "sglang:num_queue_reqs 2"
    )
    s = parse_metrics_text(0, 0.0, text)
    assert (s.running, s.queued) == (4.0, 2.0)
    with pytest.raises(ValueError, match="without a value"):
        parse_metrics_text(0, 0.0, "sglang:num_queue_reqs\r\n")
