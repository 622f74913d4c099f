"""I/O: the HTTP side of the simulator: SGLang's routes on a ThreadingHTTPServer.

Each route answers the way SGLang 0.5.23's does (docs/reference/sglang.md §6): `/health`
is 503 while starting or exiting and otherwise takes `health_delay` (SGLang sleeps
1 s before its first check); when the scheduler hangs it waits
SGLANG_HEALTH_CHECK_TIMEOUT, logs SGLang's "Health check failed" line and answers
503, so a probe with a shorter timeout simply times out. `/server_info` blocks
while the scheduler hangs; `/metrics` and `/v1/loads` keep answering frozen values.
With SGLANG_SIM_HEALTH_QUEUES, `/health` is SGLang's generating check instead
(`Engine.health_generate`): it answers once any output reached the tokenizer, so it is
slow behind a full batch of long non-streamed requests while their tokens flow. A wedged
engine (SGLANG_SIM_WEDGE_AFTER) makes no token, yet `/health` and `/server_info` answer.
The generation routes run each request through the engine (queue, then one token per
`token_seconds`) and, with `"stream": true`, write server-sent events as the tokens come
(bodies and events in `replies.py`). After SIGTERM they keep admitting, as SGLang's do.
The regressions of `regress.py` apply to those routes: SGLANG_SIM_ERROR_RATE answers a
fraction of them 500 before they reach the engine (counted, as SGLang 0.5.20+ counts
every answer, only in `sglang:http_responses_total{endpoint,status_code,method}`; off
with SGLANG_SIM_NO_HTTP_METRICS, as before 0.5.20), and a prompt asking "What is A + B?"
is answered with the sum (wrong at SGLANG_SIM_WRONG_RATE).
"""

from __future__ import annotations

import itertools
import json
import socket
import socketserver
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs

from sglang_farm.sim import prefix, regress, replies
from sglang_farm.sim.engine import Completion, Engine, Generation, QueueFull
from sglang_farm.sim.exposition import (
    HttpStats,
    MetricContext,
    load_snapshot,
    loads_body,
    loads_prometheus,
    parse_include,
    render_metrics,
)
from sglang_farm.sim.log import SimLog
from sglang_farm.sim.options import ServerOptions
from sglang_farm.sim.settings import SimSettings, has_ready_route

SGLANG_VERSION = "0.5.23"
DEFAULT_MAX_NEW_TOKENS = 128
_COMPLETIONS_MAX_TOKENS = 16  # CompletionRequest.max_tokens' default (OpenAI's too)
# No API key needed on these (docs/reference/sglang.md §6.2).
_PUBLIC_PREFIXES = ("/health", "/ready", "/metrics")
_METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Status(StrEnum):
    STARTING = "Starting"
    UP = "Up"


@dataclass(slots=True)
class ServerState:
    """Shared by the launcher and the HTTP threads (mutable on purpose: it is the live server)."""

    opts: ServerOptions
    settings: SimSettings
    engine: Engine
    ctx: MetricContext
    log: SimLog
    launch_command: str
    startup_time: float
    status: Status = Status.STARTING
    exiting: threading.Event = field(default_factory=threading.Event)
    # A /health probe timed out on the hung scheduler (SGLang's ServerStatus.UnHealthy):
    # a SIGTERM then exits at once instead of draining.
    unhealthy: bool = False
    busy_cond: threading.Condition = field(default_factory=threading.Condition)
    busy: int = 0  # generation requests whose response is not written yet
    arrived: int = 0  # generation requests so far: numbers them for SGLANG_SIM_ERROR_RATE
    # SGLang 0.5.20+'s sglang:http_requests_total / http_responses_total (exposition.HttpStats).
    http_lock: threading.Lock = field(default_factory=threading.Lock)
    http_requests: dict[tuple[str, str], int] = field(default_factory=dict)
    http_responses: dict[tuple[str, str, str], int] = field(default_factory=dict)

    def count_request(self, endpoint: str, method: str) -> None:
        with self.http_lock:
            key = (endpoint, method)
            self.http_requests[key] = self.http_requests.get(key, 0) + 1

    def count_response(self, endpoint: str, status: int, method: str) -> None:
        with self.http_lock:
            key = (endpoint, str(status), method)
            self.http_responses[key] = self.http_responses.get(key, 0) + 1

    def http_stats(self) -> HttpStats | None:
        """The HTTP counters now; None as SGLang before 0.5.20 (SGLANG_SIM_NO_HTTP_METRICS,
        or SGLANG_SIM_VERSION older than 0.5.20: both came in that release)."""
        if self.settings.no_http_metrics or not has_ready_route(self.settings):
            return None
        with self.http_lock:
            return HttpStats(dict(self.http_requests), dict(self.http_responses))

    def generation_in_flight(self) -> int:
        with self.busy_cond:
            return self.busy

    def wait_idle(self, timeout: float | None) -> bool:
        """Block until no generation is in flight (True) or `timeout` s pass (False)."""
        with self.busy_cond:
            return self.busy_cond.wait_for(lambda: self.busy == 0, timeout)


class BadRequest(Exception):
    """A request body SGLang would answer with 400."""


def _error(message: str, status: HTTPStatus, err_type: str = "BadRequestError") -> dict[str, Any]:
    return {
        "object": "error",
        "message": message,
        "type": err_type,
        "param": None,
        "code": int(status),
    }


def _int_field(body: dict[str, Any], *names: str, default: int = DEFAULT_MAX_NEW_TOKENS) -> int:
    """The first of `names` present: a non-negative int; raises BadRequest otherwise."""
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise BadRequest(f"{name} must be a non-negative integer, got {value!r}")
        return value
    return default


def _include_usage(body: dict[str, Any]) -> bool:
    """`stream_options.include_usage`; SGLang's `--stream-response-default-include-usage` is off."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise BadRequest("stream_options must be an object")
    return bool(options.get("include_usage"))


def _completion_prompt(prompt: object) -> int:
    """Prompt tokens of a /v1/completions `prompt`: a string or a list of token ids.

    Raises BadRequest for a batch (a list of prompts), which the simulator does not serve.
    """
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str):
        return _prompt_tokens(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    raise BadRequest(
        "prompt must be a string or a list of token ids (the sglang-farm simulator "
        f"serves one prompt per request), got {type(prompt).__name__}"
    )


def _prompt_tokens(text: str) -> int:
    return max(1, len(text) // 4)  # about four characters per token


def _within_context(prompt_tokens: int, context_length: int) -> int:
    """`prompt_tokens`, or BadRequest with SGLang's words for an input that does not fit
    (its tokenizer manager refuses an input of the context length or more, before it is
    scheduled; the OpenAI routes and /generate answer 400 with the message)."""
    if prompt_tokens >= context_length:
        raise BadRequest(
            f"The input ({prompt_tokens} tokens) is longer than the model's context length "
            f"({context_length} tokens)."
        )
    return prompt_tokens


def _script(settings: SimSettings, prompt: object, max_new: int) -> tuple[replies.Script, int]:
    """What the reply says, and how many tokens it makes: an arithmetic question in a
    text prompt is answered with one token (when any is asked for); else " sim" each."""
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    question = regress.find_question(prompt) if isinstance(prompt, str) else None
    if question is None or max_new == 0:
        return replies.PLAIN, max_new
    return replies.Script(regress.answer(question, settings.seed, settings.wrong_rate)), 1


@dataclass(frozen=True, slots=True)
class _OpenAIStream:
    """An OpenAI route's stream once its first token is out: what its chunks carry."""

    rid: str
    created: int
    model: str
    first: int  # tokens when the stream opened: 0 only when max_tokens is 0
    tokens: Iterator[int]  # the token count after each token, from `first` on
    cached: int | None  # prompt tokens the prefix cache held (None: no --enable-cache-report)


def make_handler(state: ServerState) -> type[BaseHTTPRequestHandler]:
    """A handler class bound to `state` (http.server wants a class, not an instance)."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # As uvicorn (SGLang's server) does: no Nagle stall between a reply's head and body.
        disable_nagle_algorithm = True
        server_version = "uvicorn"
        sys_version = ""

        def log_message(self, format: str, *args: Any) -> None:
            pass  # access lines are written by _send, in uvicorn's format

        def do_GET(self) -> None:
            self._route("GET")

        def do_POST(self) -> None:
            self._route("POST")

        # -- plumbing --------------------------------------------------------------------

        # The route being answered (SGLang's `endpoint` label), None for an unknown path.
        _endpoint: str | None = None

        def _counted(self, status: int) -> None:
            """The response's status as SGLang's middleware counts it, once it is sent."""
            if self._endpoint is not None:
                state.count_response(self._endpoint, status, self.command)

        def _send(self, status: int, body: bytes = b"", ctype: str = "application/json") -> None:
            self._counted(status)
            try:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                self.wfile.flush()
            except OSError:
                self.close_connection = True  # the client gave up; nothing to tell it
            self._access(status)

        def _json(self, status: int, obj: Any) -> None:
            self._send(status, json.dumps(obj).encode())

        def _access(self, status: int) -> None:
            opts = state.opts
            if (opts.log_level_http or opts.log_level).lower() not in ("info", "debug"):
                return
            path = self.path.split("?", 1)[0]
            if any(path.startswith(p) for p in opts.uvicorn_access_log_exclude_prefixes):
                return
            host, port = self.client_address[:2]
            phrase = HTTPStatus(status).phrase
            state.log.uvicorn("INFO", f'{host}:{port} - "{self.requestline}" {status} {phrase}')

        def _body(self) -> dict[str, Any]:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw or b"{}")
            except ValueError as exc:
                raise BadRequest(f"Invalid JSON body: {exc}") from None
            if not isinstance(body, dict):
                raise BadRequest("The request body must be a JSON object")
            return body

        def _authorized(self, path: str) -> bool:
            key = state.opts.api_key
            if key is None or path.startswith(_PUBLIC_PREFIXES):
                return True
            return self.headers.get("Authorization", "") == f"Bearer {key}"

        def _route(self, method: str) -> None:
            path, _, query = self.path.partition("?")
            self._endpoint = None
            if (method, path) in _ROUTES:
                self._endpoint = path
            elif method == "GET" and path.startswith("/v1/models/"):
                self._endpoint = "/v1/models/{model:path}"
            if self._endpoint is not None:
                state.count_request(self._endpoint, method)
            body: dict[str, Any] = {}
            try:
                if method == "POST":
                    body = self._body()
            except BadRequest as exc:
                self._json(400, _error(str(exc), HTTPStatus.BAD_REQUEST))
                return
            if not self._authorized(path):
                self._json(401, {"error": "Unauthorized"})
                return
            route = _ROUTES.get((method, path))
            if route is None and method == "GET" and path.startswith("/v1/models/"):
                self._model(path.removeprefix("/v1/models/"))
                return
            if route is None:
                self._json(404, {"detail": "Not Found"})
                return
            route(self, parse_qs(query), body)

        # -- routes ----------------------------------------------------------------------

        def health(self, _q: dict[str, list[str]], _b: dict[str, Any]) -> None:
            if state.exiting.is_set() or state.status is Status.STARTING:
                self._send(503)
                return
            tic = time.time()
            settings = state.settings
            if settings.health_queues and not state.engine.wedged:
                ok = state.engine.health_generate(
                    settings.health_timeout, settings.health_delay, stop=state.exiting.is_set
                )
                if ok and not state.exiting.is_set():
                    self._send(200)
                    return
                if not state.exiting.is_set():
                    self._health_failed(tic)
                self._send(503)
                return
            deadline = time.monotonic() + max(
                state.settings.health_timeout, state.settings.health_delay
            )
            # SGLang sleeps 1 s before it first looks for the probe's output.
            time.sleep(state.settings.health_delay)
            while state.engine.hung and time.monotonic() < deadline and not state.exiting.is_set():
                time.sleep(0.1)
            if state.engine.hung or state.exiting.is_set():
                if state.engine.hung:
                    self._health_failed(tic)
                self._send(503)
                return
            self._send(200)

        def _health_failed(self, tic: float) -> None:
            """SGLang's ServerStatus.UnHealthy: logged, and a SIGTERM then skips the drain."""
            state.unhealthy = True
            state.log.info(
                "Health check failed. Server couldn't get a response from detokenizer "
                "for last "
                f"{state.settings.health_timeout:g} seconds. tic start time: {tic:.2f}. "
                f"last_heartbeat time: {state.engine.scheduler_stats().timestamp:.2f}"
            )

        def ready(self, _q: dict[str, list[str]], _b: dict[str, Any]) -> None:
            if not has_ready_route(state.settings):
                self._json(404, {"detail": "Not Found"})  # FastAPI's answer: no such route
                return
            up = state.status is Status.UP and not state.exiting.is_set()
            self._send(200 if up else 503)

        def ping(self, _q: dict[str, list[str]], _b: dict[str, Any]) -> None:
            self._send(503 if state.exiting.is_set() else 200)

        def model_info(self, _q: dict[str, list[str]], _b: dict[str, Any]) -> None:
            if self.path.startswith("/get_model_info"):
                state.log.info(
                    "WARNING: Endpoint '/get_model_info' is deprecated and will be removed "
                    "in a future version. Please use '/model_info' instead."
                )
            o = state.opts
            self._json(
                200,
                {
                    "model_path": o.model_path,
                    "tokenizer_path": o.tokenizer_path,
                    "is_generation": True,
                    "preferred_sampling_params": None,
                    "weight_version": "default",
                    "load_format": "auto",
                    "reasoning_parser": None,
                    "tool_call_parser": None,
                    "disaggregation_mode": "null",
                    "has_image_understanding": False,
                    "has_audio_understanding": False,
                    "model_type": "llama",
                    "architectures": ["LlamaForCausalLM"],
                    "served_model_name": o.served_model_name,
                },
            )

        def server_info(self, _q: dict[str, list[str]], _b: dict[str, Any]) -> None:
            if self.path.startswith("/get_server_info"):
                state.log.info(
                    "WARNING: Endpoint '/get_server_info' is deprecated and will be removed "
                    "in a future version. Please use '/server_info' instead."
                )
            # A scheduler round-trip with no server-side timeout: it hangs with the scheduler.
            while state.engine.hung and not state.exiting.wait(0.5):
                pass
            if state.engine.hung:
                self._send(503)
                return
            info: dict[str, Any] = {}
            for key, value in asdict(state.opts).items():
                info[key] = list(value) if isinstance(value, tuple) else value
            info["extra_metric_labels"] = dict(state.opts.extra_metric_labels) or None
            if state.opts.api_key is not None:
                info["api_key"] = "<redacted>"
            sched = state.engine.scheduler_stats()
            info.update(
                {
                    "launch_command": state.launch_command,
                    "max_total_num_tokens": sched.max_total_num_tokens,
                    "max_req_input_len": state.opts.context_length - 1,
                    "startup_time": state.startup_time,
                    "internal_states": [
                        {
                            "world_size": state.opts.tp_size,
                            "effective_max_running_requests_per_dp": (
                                state.opts.max_running_requests
                            ),
                            "last_gen_throughput": sched.gen_throughput,
                            "memory_usage": {
                                "weight": state.ctx.weight_gb,
                                "kvcache": state.ctx.kv_cache_gb,
                                "graph": state.ctx.graph_gb,
                                "token_capacity": sched.max_total_num_tokens,
                            },
                        }
                    ],
                    "version": state.settings.version,
                    "frontend": "python",
                    "simulated": True,
                }
            )
            self._json(200, info)

        def models(self, _q: dict[str, list[str]], _b: dict[str, Any]) -> None:
            self._json(200, {"object": "list", "data": [self._model_card()]})

        def _model_card(self) -> dict[str, Any]:
            o = state.opts
            return {
                "id": o.served_model_name,
                "object": "model",
                "created": int(state.startup_time),
                "owned_by": "sglang",
                "root": o.served_model_name,
                "parent": None,
                "max_model_len": o.context_length,
            }

        def _model(self, model_id: str) -> None:
            if model_id == state.opts.served_model_name:
                self._json(200, self._model_card())
                return
            self._json(
                404,
                {
                    "error": {
                        "message": f"The model '{model_id}' does not exist",
                        "type": "NotFoundError",
                        "param": "model",
                        "code": "model_not_found",
                    }
                },
            )

        def loads(self, q: dict[str, list[str]], _b: dict[str, Any]) -> None:
            try:
                include = parse_include(q.get("include", [""])[0])
            except ValueError as exc:
                self._json(400, {"detail": str(exc)})
                return
            dp_rank = q.get("dp_rank", [None])[0]
            sched = state.engine.scheduler_stats()
            if q.get("format", [""])[0] == "prometheus":
                text = loads_prometheus(load_snapshot(state.ctx, sched, include))
                self._send(200, text.encode(), _METRICS_TYPE)
                return
            body = loads_body(
                datetime.now(UTC).isoformat(),
                state.settings.version,
                state.ctx,
                sched,
                include,
                state.opts.tp_size * state.opts.pp_size,
            )
            if dp_rank not in (None, "0"):
                body["loads"] = []
            self._json(200, body)

        def metrics(self, _q: dict[str, list[str]], _b: dict[str, Any]) -> None:
            if not state.opts.enable_metrics:
                self._json(404, {"detail": "Not Found"})
                return
            text = render_metrics(
                state.ctx,
                state.engine.scheduler_stats(),
                state.engine.tokenizer_stats(),
                state.http_stats(),
            )
            self._send(200, text.encode(), _METRICS_TYPE)

        def flush_cache(self, _q: dict[str, list[str]], _b: dict[str, Any]) -> None:
            if not state.engine.flush_cache():
                self._send(
                    400,
                    b"Cache not flushed. Please check backend logs for more details. "
                    b"(When there are running or waiting requests, the operation will not "
                    b"be performed.)\n",
                    "text/plain",
                )
                return
            self._send(
                200,
                b"Cache flushed.\nPlease check backend logs for more details. (When there "
                b"are running or waiting requests, the operation will not be performed.)\n",
                "text/plain",
            )

        def _run(
            self, prompt_tokens: int, max_new: int, blocks: tuple[bytes, ...] = ()
        ) -> Completion | None:
            """Run a generation; returns None when an error response was already sent.

            Admitted while draining too: SGLang's SIGTERM flag gates only /health
            (`http_server.py::health_generate`); every generation route keeps admitting.
            """
            try:
                return state.engine.generate(prompt_tokens, max_new, blocks=blocks)
            except QueueFull as exc:
                self._queue_full(exc)
                return None

        def _queue_full(self, exc: QueueFull) -> None:
            self._json(
                503, _error(str(exc), HTTPStatus.SERVICE_UNAVAILABLE, "ServiceUnavailableError")
            )

        # -- server-sent events ------------------------------------------------------------

        def _start_stream(self) -> None:
            """200 with `text/event-stream`, chunked, as Starlette's StreamingResponse sends."""
            self._counted(200)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream; charset=utf-8")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self._access(200)

        def _event(self, data: bytes) -> None:
            """Write one chunk now; raises OSError when the client has gone."""
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        def _stream(self, gen: Generation, events: Iterator[bytes], *, started: bool) -> None:
            """Send `events`, then `data: [DONE]`; a client that hangs up aborts `gen`."""
            try:
                if not started:
                    self._start_stream()
                for data in events:
                    self._event(data)
                self._event(replies.DONE)
                self._event(b"")  # the last chunk of a chunked body
            except OSError:
                self.close_connection = True
            finally:
                gen.close()  # a no-op once the generation has finished

        def _kick(self, gen: Generation) -> int | None:
            """Wait for the first token before answering, as SGLang's OpenAI routes do.

            Returns the token count (0 when max_tokens is 0), or None when a 503 was sent.
            """
            try:
                return next(gen, 0)
            except QueueFull as exc:
                self._queue_full(exc)
                return None

        # -- generation routes -------------------------------------------------------------

        def generate(self, _q: dict[str, list[str]], body: dict[str, Any]) -> None:
            self._tracked(self._generate, body)

        def chat(self, _q: dict[str, list[str]], body: dict[str, Any]) -> None:
            self._tracked(self._chat, body)

        def completions(self, _q: dict[str, list[str]], body: dict[str, Any]) -> None:
            self._tracked(self._completions, body)

        def _tracked(self, fn: Callable[[dict[str, Any]], None], body: dict[str, Any]) -> None:
            with state.busy_cond:
                state.busy += 1
                state.arrived += 1
                number = state.arrived
            try:
                settings = state.settings
                if regress.errs(settings.seed, settings.error_rate, number):
                    # SGLANG_SIM_ERROR_RATE: an internal error before the engine sees it.
                    self._json(
                        500,
                        _error(
                            regress.ERROR_MESSAGE,
                            HTTPStatus.INTERNAL_SERVER_ERROR,
                            "InternalServerError",
                        ),
                    )
                    return
                fn(body)
            except BadRequest as exc:
                self._json(400, _error(str(exc), HTTPStatus.BAD_REQUEST))
            finally:
                with state.busy_cond:
                    state.busy -= 1
                    state.busy_cond.notify_all()

        def _generate(self, body: dict[str, Any]) -> None:
            params = body.get("sampling_params") or {}
            if not isinstance(params, dict):
                raise BadRequest("sampling_params must be an object")
            max_new = _int_field(params, "max_new_tokens")
            ids = body.get("input_ids")
            text = body.get("text")
            blocks: tuple[bytes, ...] = ()
            if isinstance(ids, list) and ids:
                prompt = len(ids)
            elif isinstance(text, str):
                prompt = _prompt_tokens(text)
                blocks = prefix.blocks(text)
            else:
                raise BadRequest("Either text or input_ids should be provided.")
            prompt = _within_context(prompt, state.opts.context_length)
            script, max_new = _script(state.settings, text, max_new)
            rid = uuid.uuid4().hex
            if body.get("stream"):
                gen = state.engine.stream(prompt, max_new, blocks=blocks)
                t0 = time.monotonic()

                def events() -> Iterator[bytes]:
                    try:
                        for n in gen:
                            done = n == max_new
                            elapsed = time.monotonic() - t0
                            yield replies.sse(
                                replies.generate_body(
                                    rid,
                                    prompt,
                                    n,
                                    finished=done,
                                    e2e_s=elapsed,
                                    script=script,
                                    cached_tokens=gen.cached_tokens,
                                )
                            )
                        if max_new == 0:
                            elapsed = time.monotonic() - t0
                            yield replies.sse(
                                replies.generate_body(rid, prompt, 0, finished=True, e2e_s=elapsed)
                            )
                    except QueueFull as exc:
                        yield replies.sse({"error": {"message": str(exc)}})

                # /generate answers 200 at once; errors then travel as an event.
                self._stream(gen, events(), started=False)
                return
            c = self._run(prompt, max_new, blocks)
            if c is None:
                return
            self._json(
                200,
                replies.generate_body(
                    rid,
                    c.prompt_tokens,
                    c.completion_tokens,
                    finished=True,
                    e2e_s=c.e2e_s,
                    script=script,
                    cached_tokens=c.cached_tokens,
                ),
            )

        def _openai(
            self,
            body: dict[str, Any],
            prompt: int,
            max_new: int,
            answer: Callable[..., dict[str, Any]],
            events: Callable[[_OpenAIStream], Iterator[bytes]],
            script: replies.Script,
            blocks: tuple[bytes, ...] = (),
        ) -> None:
            """Answer an OpenAI route whole, or as server-sent chunks with `"stream": true`.

            `answer(rid, created, model, prompt_tokens, tokens, script, cached)` builds the
            whole body (`cached`: the prompt tokens the prefix cache held, reported with
            --enable-cache-report, else None);
            `events` makes the chunks once the first token is out (see `_kick`).
            """
            rid = uuid.uuid4().hex
            model = body.get("model") or state.opts.served_model_name
            report = state.opts.enable_cache_report
            if not body.get("stream"):
                c = self._run(prompt, max_new, blocks)
                if c is not None:
                    body_out = answer(
                        rid,
                        int(time.time()),
                        model,
                        c.prompt_tokens,
                        c.completion_tokens,
                        script,
                        c.cached_tokens if report else None,
                    )
                    self._json(200, body_out)
                return
            gen = state.engine.stream(prompt, max_new, blocks=blocks)
            first = self._kick(gen)
            if first is None:
                return
            tokens = itertools.chain([first] if first else [], gen)
            cached = gen.cached_tokens if report else None
            opened = _OpenAIStream(rid, int(time.time()), model, first, tokens, cached)
            self._stream(gen, events(opened), started=False)

        def _chat(self, body: dict[str, Any]) -> None:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("messages must be a non-empty list")
            max_new = _int_field(body, "max_completion_tokens", "max_tokens")
            include_usage = _include_usage(body)
            text = "".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
            prompt = _within_context(
                _prompt_tokens(text) + 4 * len(messages), state.opts.context_length
            )
            # The chat template's text, as the prefix cache sees it: roles and contents in order.
            templated = "".join(
                f"<|{m.get('role', '')}|>{m.get('content', '')}\n"
                for m in messages
                if isinstance(m, dict)
            )
            script, max_new = _script(state.settings, text, max_new)

            def events(s: _OpenAIStream) -> Iterator[bytes]:
                yield replies.sse(
                    replies.chat_chunk(s.rid, s.created, s.model, role="assistant", content="")
                )
                for n in s.tokens:
                    yield replies.sse(
                        replies.chat_chunk(
                            s.rid, s.created, s.model, content=replies.chat_delta(n, script)
                        )
                    )
                yield replies.sse(
                    replies.chat_chunk(s.rid, s.created, s.model, finish_reason=script.finish)
                )
                if include_usage:
                    yield replies.sse(
                        replies.usage_chunk(
                            s.rid,
                            s.created,
                            s.model,
                            "chat.completion.chunk",
                            prompt,
                            max_new,
                            s.cached,
                        )
                    )

            self._openai(
                body, prompt, max_new, replies.chat_body, events, script, prefix.blocks(templated)
            )

        def _completions(self, body: dict[str, Any]) -> None:
            prompt = _within_context(
                _completion_prompt(body.get("prompt")), state.opts.context_length
            )
            max_new = _int_field(body, "max_tokens", default=_COMPLETIONS_MAX_TOKENS)
            script, max_new = _script(state.settings, body.get("prompt"), max_new)
            include_usage = _include_usage(body)

            def events(s: _OpenAIStream) -> Iterator[bytes]:
                if not s.first:
                    yield replies.sse(
                        replies.completion_chunk(s.rid, s.created, s.model, "", script.finish)
                    )
                for n in s.tokens:
                    finish = script.finish if n == max_new else None
                    yield replies.sse(
                        replies.completion_chunk(s.rid, s.created, s.model, script.token(n), finish)
                    )
                if include_usage:
                    yield replies.sse(
                        replies.usage_chunk(
                            s.rid, s.created, s.model, "text_completion", prompt, max_new, s.cached
                        )
                    )

            raw = body.get("prompt")
            if isinstance(raw, list) and len(raw) == 1:
                raw = raw[0]
            blocks = prefix.blocks(raw) if isinstance(raw, str) else ()
            self._openai(body, prompt, max_new, replies.completion_body, events, script, blocks)

    _ROUTES: dict[
        tuple[str, str], Callable[[Handler, dict[str, list[str]], dict[str, Any]], None]
    ] = {
        ("GET", "/health"): Handler.health,
        ("GET", "/health_generate"): Handler.health,
        ("GET", "/ready"): Handler.ready,
        ("GET", "/ping"): Handler.ping,
        ("GET", "/model_info"): Handler.model_info,
        ("GET", "/get_model_info"): Handler.model_info,
        ("GET", "/server_info"): Handler.server_info,
        ("GET", "/get_server_info"): Handler.server_info,
        ("GET", "/v1/models"): Handler.models,
        ("GET", "/v1/loads"): Handler.loads,
        ("GET", "/metrics"): Handler.metrics,
        ("GET", "/flush_cache"): Handler.flush_cache,
        ("POST", "/flush_cache"): Handler.flush_cache,
        ("POST", "/generate"): Handler.generate,
        ("POST", "/v1/chat/completions"): Handler.chat,
        ("POST", "/v1/completions"): Handler.completions,
    }
    return Handler


class SimHTTPServer(ThreadingHTTPServer):
    """uvicorn-like listener: big backlog, daemon threads, no reverse DNS at bind."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 2048  # uvicorn's default backlog

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that reset or dropped its connection is no server error (uvicorn logs
        nothing for it): only other exceptions get socketserver's traceback on stderr,
        which the farm's log classifier would read as the server failing."""
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)

    def server_bind(self) -> None:
        # HTTPServer.server_bind calls socket.getfqdn(), a DNS lookup that can stall startup.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name = str(host)
        self.server_port = int(port)


class SimHTTPServer6(SimHTTPServer):
    address_family = socket.AF_INET6


def bind(host: str, port: int, state: ServerState) -> SimHTTPServer:
    """Bind the listener; raises OSError (EADDRINUSE ...) as uvicorn would meet it."""
    cls = SimHTTPServer6 if ":" in host else SimHTTPServer
    return cls((host, port), make_handler(state))
