"""The SGLang simulator: real processes, real sockets, SGLang's texts and exit statuses."""

from __future__ import annotations

import os
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

import sglang_farm.sim
from sglang_farm.cli.main import cli
from sglang_farm.sglang.stats import parse_metrics_text
from sglang_farm.sim import web
from sglang_farm.sim.engine import Engine
from sglang_farm.sim.exposition import MetricContext, render_metrics
from sglang_farm.sim.options import build_parser, human_readable_int, parse_options
from sglang_farm.sim.settings import FailMode, SettingsError, load_settings
from simproc import FAST, StartSim, metric_values, post_stream, sim_help, wait_until


def children_of(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc (no psutil)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    """True if `pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


# -- pure parts ----------------------------------------------------------------------------


class RecordingEnv(Mapping[str, str]):
    """An empty environment that remembers every variable looked up in it."""

    def __init__(self) -> None:
        self.asked: set[str] = set()

    def __getitem__(self, key: str) -> str:
        self.asked.add(key)
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


SIM_PACKAGE = Path(sglang_farm.sim.__file__).parent
DOCS = Path(__file__).resolve().parents[1] / "docs" / "simulator.md"


def sim_environment_variables() -> set[str]:
    """Every variable the simulator reads, from its code: what `load_settings` looks up, and
    every SGLANG_SIM_* name in the package's source (not `_SGLANG_SIM_CHILD`, the launcher's
    private hand-over to its children), so a variable added anywhere counts."""
    env = RecordingEnv()
    load_settings(env)
    named = {
        m
        for f in SIM_PACKAGE.glob("*.py")
        for m in re.findall(r"\bSGLANG_SIM_[A-Z0-9_]+", f.read_text())
    }
    assert "SGLANG_SIM_FAIL" in env.asked and "SGL_FORCE_SHUTDOWN" in env.asked
    return env.asked | named


def test_help_is_the_simulators_own_and_names_every_control_flag_and_failure_mode() -> None:
    done = sim_help("--help")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith("usage: python -m sglang_farm.sim --model-path PATH"), out[:200]
    assert "usage: sglang serve" not in out
    assert "It is not SGLang" in out and "not SGLang's" in out
    for name in sorted(sim_environment_variables()):
        lines = [line for line in out.splitlines() if line.strip().startswith(name + " ")]
        assert len(lines) == 1, f"{name} is not documented once in --help"
        assert "(default" in lines[0], lines[0]
    for mode in FailMode:
        assert re.search(rf"^  {mode.value} ", out, re.M), f"failure mode {mode} not in --help"
    modelled = [a for a in build_parser()._actions if a.option_strings != ["-h", "--help"]]
    for action in modelled:
        assert ", ".join(action.option_strings) in out, action.option_strings
    assert "SGLANG_SIM_LOAD_SECONDS  (default 2)" in out
    assert "SGLANG_SIM_DRAIN_SECONDS  (default unset" in out
    assert sim_help("-h").stdout == out
    assert sim_help("--model-path", "m", "--some-future-flag", "7", "--help").stdout == out


def test_sglang_farm_sim_help_prints_the_same_help() -> None:
    result = CliRunner().invoke(cli, ["sim", "--help"])
    assert result.exit_code == 0, result.output
    assert result.output == sim_help("--help").stdout


def test_parse_errors_keep_sglangs_usage_and_prog_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as missing:
        parse_options(["--port", "30000"])
    assert missing.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: sglang serve [-h] ")
    assert "sglang serve: error: the following arguments are required: --model-path" in err


def test_docs_name_every_simulator_control_and_failure_mode() -> None:
    docs = DOCS.read_text()
    for name in sorted(sim_environment_variables()):
        assert f"| `{name}` |" in docs, f"{name} has no row in docs/simulator.md"
    for mode in FailMode:
        assert f"| `{mode.value}` |" in docs, f"failure mode {mode} has no row in docs/simulator.md"
    for action in build_parser()._actions:
        for flag in action.option_strings:
            assert f"`{flag}`" in docs, f"{flag} is not in docs/simulator.md"


def test_human_readable_int_follows_sglang_si_and_binary_suffixes() -> None:
    assert human_readable_int("32k") == 32000
    assert human_readable_int("32Ki") == 32768
    assert human_readable_int("4096") == 4096


def test_unknown_flags_are_ignored_and_modelled_ones_parsed() -> None:
    opts, ignored = parse_options(
        [
            "--model-path",
            "m",
            "--tp",
            "2",
            "--enable-metrics",
            "--some-future-flag",
            "7",
            "--context-length",
            "32k",
        ]
    )
    assert (opts.tp_size, opts.enable_metrics, opts.context_length) == (2, True, 32000)
    assert opts.served_model_name == "m"
    assert ignored == ["--some-future-flag", "7"]


def test_removed_and_ambiguous_flags_exit_2_like_sglang(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as removed:
        parse_options(["--model-path", "m", "--mamba-scheduler-strategy", "extra_buffer"])
    assert removed.value.code == 2
    assert (
        "error: unrecognized arguments: --mamba-scheduler-strategy extra_buffer"
        in capsys.readouterr().err
    )
    with pytest.raises(SystemExit) as ambiguous:
        parse_options(["--model-path", "m", "--cuda-graph-max-bs", "8"])
    assert ambiguous.value.code == 2
    assert "ambiguous option: --cuda-graph-max-bs could match" in capsys.readouterr().err


def test_settings_reject_unknown_mode_and_bad_numbers_by_name() -> None:
    assert load_settings({"SGLANG_SIM_FAIL": "cuda_oom"}).fail is FailMode.CUDA_OOM
    with pytest.raises(SettingsError, match=r"SGLANG_SIM_FAIL='nope'.*cuda_oom"):
        load_settings({"SGLANG_SIM_FAIL": "nope"})
    with pytest.raises(SettingsError, match="SGLANG_SIM_LOAD_SECONDS='soon'"):
        load_settings({"SGLANG_SIM_LOAD_SECONDS": "soon"})


def test_wedge_and_health_queue_settings_and_switches_refuse_what_they_do_not_know() -> None:
    d = load_settings({})
    assert (d.wedge_after, d.health_queues, d.ignore_sigterm) == (None, False, False)
    s = load_settings(
        {
            "SGLANG_SIM_WEDGE_AFTER": "7.5",
            "SGLANG_SIM_HEALTH_QUEUES": "yes",
            "SGLANG_SIM_IGNORE_SIGTERM": "True",
        }
    )
    assert (s.wedge_after, s.health_queues, s.ignore_sigterm) == (7.5, True, True)
    assert not load_settings({"SGLANG_SIM_HEALTH_QUEUES": "0"}).health_queues
    with pytest.raises(SettingsError, match=r"SGLANG_SIM_HEALTH_QUEUES='maybe'.*1, true or yes"):
        load_settings({"SGLANG_SIM_HEALTH_QUEUES": "maybe"})
    with pytest.raises(SettingsError, match="SGLANG_SIM_WEDGE_AFTER='-1' is negative"):
        load_settings({"SGLANG_SIM_WEDGE_AFTER": "-1"})


def test_sigterm_drain_is_unbounded_unless_asked_and_force_shutdown_is_sglangs_name() -> None:
    assert load_settings({}).drain_seconds is None
    assert load_settings({"SGLANG_SIM_DRAIN_SECONDS": "2.5"}).drain_seconds == 2.5
    assert load_settings({"SGL_FORCE_SHUTDOWN": "true"}).force_shutdown
    assert not load_settings({"SGLANG_FORCE_SHUTDOWN": "1"}).force_shutdown  # not read by SGLang


def test_engine_stream_yields_each_token_and_an_early_close_aborts_and_frees_the_slot() -> None:
    engine = Engine(max_running=1, max_queued=None, max_total_tokens=1000, token_seconds=0.0)
    gen = engine.stream(10, 3)
    assert next(gen) == 1
    engine.publish()
    assert engine.scheduler_stats().num_running_reqs == 1
    gen.close()  # the client hung up after one token
    engine.publish()
    assert engine.scheduler_stats().num_running_reqs == 0
    assert engine.scheduler_stats().num_used_tokens == 0
    assert engine.tokenizer_stats().num_aborted == 1
    full = engine.stream(10, 3)
    assert list(full) == [1, 2, 3]
    assert full.completion.completion_tokens == 3
    assert engine.tokenizer_stats().num_requests == 1
    assert engine.tokenizer_stats().generation_tokens == 3
    assert engine.inflight() == 0


def test_rendered_metrics_parse_with_sglang_names_types_and_labels() -> None:
    engine = Engine(max_running=4, max_queued=None, max_total_tokens=1000, token_seconds=0.0)
    engine.generate(10, 5)
    engine.publish()
    ctx = MetricContext(
        model_name='m"x',
        extra_labels=(("gpu", "3"),),
        context_len=8192,
        page_size=1,
        weight_gb=1.0,
        kv_cache_gb=2.0,
        graph_gb=0.5,
    )
    text = render_metrics(ctx, engine.scheduler_stats(), engine.tokenizer_stats())
    families = {f.name: f for f in text_string_to_metric_families(text)}
    expected = {
        "sglang:num_running_reqs": "gauge",
        "sglang:num_queue_reqs": "gauge",
        "sglang:token_usage": "gauge",
        "sglang:gen_throughput": "gauge",
        "sglang:cache_hit_rate": "gauge",
        "sglang:num_used_tokens": "gauge",
        "sglang:max_total_num_tokens": "gauge",
        "sglang:prompt_tokens": "counter",
        "sglang:generation_tokens": "counter",
        "sglang:num_requests": "counter",
        "sglang:e2e_request_latency_seconds": "histogram",
    }
    assert {name: families[name].type for name in expected} == expected
    gauge = families["sglang:max_total_num_tokens"].samples[0]
    assert gauge.labels == {
        "model_name": 'm"x',
        "engine_type": "unified",
        "tp_rank": "0",
        "pp_rank": "0",
        "moe_ep_rank": "0",
        "gpu": "3",
    }
    assert gauge.value == 1000
    counter = families["sglang:generation_tokens"].samples[0]
    assert counter.name == "sglang:generation_tokens_total"
    assert counter.labels["is_streaming"] == "false"
    assert counter.value == 5
    e2e = {
        s.name: s.value
        for s in families["sglang:e2e_request_latency_seconds"].samples
        if s.name.endswith(("_count", "_sum"))
    }
    assert e2e["sglang:e2e_request_latency_seconds_count"] == 1


# -- real processes (marked slow: each starts a simulator) ----------------------------------


@pytest.mark.slow
def test_port_unbound_while_loading_then_health_503_then_200_after_a_second(sims: StartSim) -> None:
    env = {"SGLANG_SIM_LOAD_SECONDS": "1.0", "SGLANG_SIM_WARMUP_SECONDS": "0.5"}  # default delay
    sim = sims("--unknown-flag", "x", env=env)
    seen: list[object] = []

    def probe() -> object:
        try:
            r = httpx.get(sim.url + "/health", timeout=5)
        except httpx.ConnectError:
            seen.append("refused")
            return None
        seen.append(r.status_code)
        return r.status_code == 200

    wait_until("/health 200", probe, timeout=10)
    assert seen[0] == "refused"
    assert 503 in seen
    assert seen.index(503) > seen.index("refused")
    assert "Uvicorn running on http://127.0.0.1" in sim.log
    # The last probe took SGLang's ~1 s.
    t = time.monotonic()
    assert httpx.get(sim.url + "/health", timeout=5).status_code == 200
    assert time.monotonic() - t >= 0.95
    order = [
        "server_args=ServerArgs(",
        "Load weight begin",
        "Load weight end",
        "KV Cache is allocated",
        "Capture target decode CUDA graph end",
        "Uvicorn running on",
        "The server is fired up and ready to roll!",
    ]
    positions = [sim.log.index(marker) for marker in order]
    assert positions == sorted(positions)
    assert httpx.get(sim.url + "/metrics", timeout=5).status_code == 404  # no --enable-metrics


@pytest.mark.slow
def test_metrics_and_loads_count_running_and_queued_requests(sims: StartSim) -> None:
    env = {**FAST, "SGLANG_SIM_TOKEN_SECONDS": "0.03"}
    sim = sims(
        "--enable-metrics", "--max-running-requests", "2", "--served-model-name", "llama", env=env
    )
    sim.wait_ready()
    with httpx.Client(base_url=sim.url, timeout=60) as client, ThreadPoolExecutor(5) as pool:
        # 100 tokens of 0.03 s: 2 running and 3 queued for 3 s (with 20 tokens, 0.6 s, CI's
        # busy cores missed it), waited for with a give-up bound.
        body = {"text": "The capital city of France is", "sampling_params": {"max_new_tokens": 100}}
        futures = [pool.submit(client.post, "/generate", json=body) for _ in range(5)]

        def scrape() -> dict[str, float] | None:
            fams = text_string_to_metric_families(client.get("/metrics").text)
            values = {f.name: f.samples[0].value for f in fams if f.samples}
            if values["sglang:num_running_reqs"] == 2 and values["sglang:num_queue_reqs"] == 3:
                return values
            return None

        wait_until("2 running and 3 queued in /metrics", scrape, timeout=30)
        loads = client.get("/v1/loads").json()["loads"][0]
        assert (loads["num_running_reqs"], loads["num_waiting_reqs"]) == (2, 3)
        assert loads["max_running_requests"] == 2
        replies = [f.result() for f in futures]
        assert [r.status_code for r in replies] == [200] * 5
        assert replies[0].json()["meta_info"]["completion_tokens"] == 100
        chat = client.post(
            "/v1/chat/completions",
            json={
                "model": "llama",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
            },
        )
        assert chat.json()["usage"]["completion_tokens"] == 3
        assert client.post("/v1/chat/completions", json={"messages": []}).status_code == 400
        fams = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
        requests = fams["sglang:num_requests"].samples[0]
        assert requests.labels["model_name"] == "llama"
        assert requests.value == 5 + 1 + 1  # five generates, one chat, SGLang's warmup request
        assert fams["sglang:generation_tokens"].samples[0].value == 500 + 3 + 8
        t1 = client.get("/v1/loads").json()["loads"][0]["timestamp"]
        wait_until(
            "a newer /v1/loads timestamp",
            lambda: client.get("/v1/loads").json()["loads"][0]["timestamp"] > t1,
            30,
        )
        assert client.get("/v1/loads", params={"include": "bogus"}).status_code == 400
        models = client.get("/v1/models").json()
        assert models["data"][0]["id"] == "llama"


@pytest.mark.slow
def test_stream_true_answers_server_sent_events_the_way_sglang_does(sims: StartSim) -> None:
    sim = sims("--served-model-name", "llama", env={**FAST, "SGLANG_SIM_TOKEN_SECONDS": "0.02"})
    sim.wait_ready()
    messages = [{"role": "user", "content": "The capital city of France is"}]
    with httpx.Client(base_url=sim.url, timeout=10) as client:
        # /v1/chat/completions: role chunk, one content chunk per token, finish, usage, [DONE].
        ctype, events = post_stream(
            client,
            "/v1/chat/completions",
            {
                "model": "llama",
                "messages": messages,
                "max_tokens": 4,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        assert ctype.startswith("text/event-stream")
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert {c["id"] for c in chunks} == {chunks[0]["id"]}
        assert {c["model"] for c in chunks} == {"llama"}
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        content = [c["choices"][0]["delta"]["content"] for c in chunks[1:5]]
        assert [c["choices"][0]["finish_reason"] for c in chunks[:5]] == [None] * 5
        finish = chunks[5]["choices"][0]
        assert (finish["delta"], finish["finish_reason"]) == ({}, "length")
        assert chunks[6]["choices"] == []
        assert chunks[6]["usage"]["completion_tokens"] == 4
        assert len(chunks) == 7
        whole = client.post(
            "/v1/chat/completions", json={"model": "llama", "messages": messages, "max_tokens": 4}
        ).json()
        assert "".join(content) == whole["choices"][0]["message"]["content"]
        # Without stream_options there is no usage chunk.
        _, plain = post_stream(
            client,
            "/v1/chat/completions",
            {"messages": messages, "max_tokens": 2, "stream": True},
        )
        assert len(plain) == 1 + 2 + 1 + 1 and "usage" not in plain[-2]

        # /generate: one event per token, text cumulative, finish_reason on the last, [DONE].
        _, gen = post_stream(
            client,
            "/generate",
            {"text": "hi", "sampling_params": {"max_new_tokens": 3}, "stream": True},
        )
        assert gen[-1] == "[DONE]"
        assert [e["meta_info"]["completion_tokens"] for e in gen[:-1]] == [1, 2, 3]
        assert [e["meta_info"]["finish_reason"] for e in gen[:-2]] == [None, None]
        assert gen[-2]["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
        non_stream = client.post(
            "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 3}}
        ).json()
        assert gen[-2]["text"] == non_stream["text"]

        # /v1/completions: one text chunk per token, finish_reason on the last one.
        _, comp = post_stream(
            client, "/v1/completions", {"prompt": "hi", "max_tokens": 3, "stream": True}
        )
        assert comp[-1] == "[DONE]"
        texts = [c["choices"][0]["text"] for c in comp[:-1]]
        assert [c["choices"][0]["finish_reason"] for c in comp[:-1]] == [None, None, "length"]
        whole_c = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3}).json()
        assert "".join(texts) == whole_c["choices"][0]["text"]
        assert whole_c["object"] == "text_completion" and whole_c["model"] == "llama"

        # Events leave as tokens are made, not all at the end.
        seen: list[float] = []
        body = {"text": "hi", "sampling_params": {"max_new_tokens": 25}, "stream": True}
        with client.stream("POST", "/generate", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    seen.append(time.monotonic())
        assert len(seen) == 25
        assert seen[-1] - seen[0] >= 24 * 0.02 * 0.8


@pytest.mark.slow
def test_stream_client_that_hangs_up_aborts_its_request_and_frees_the_slot(sims: StartSim) -> None:
    sim = sims("--enable-metrics", env={**FAST, "SGLANG_SIM_TOKEN_SECONDS": "0.02"})
    sim.wait_ready()
    with httpx.Client(base_url=sim.url, timeout=10) as client:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 500, "stream": True}
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
        wait_until(
            "the aborted stream to leave the running batch",
            lambda: (
                (v := metric_values(client))["sglang:num_running_reqs"] == 0
                and v["sglang:num_aborted_requests_total"] == 1
            ),
            5,
        )


@pytest.mark.slow
def test_per_token_delay_makes_a_longer_request_take_longer(sims: StartSim) -> None:
    sim = sims(env={**FAST, "SGLANG_SIM_TOKEN_SECONDS": "0.02"})
    sim.wait_ready()
    took: dict[int, float] = {}
    with httpx.Client(base_url=sim.url, timeout=10) as client:
        for tokens in (5, 60):
            t = time.monotonic()
            reply = client.post(
                "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": tokens}}
            )
            took[tokens] = time.monotonic() - t
            assert reply.json()["meta_info"]["e2e_latency"] >= tokens * 0.02 * 0.9
    assert took[60] - took[5] >= 55 * 0.02 * 0.9
    assert took[5] < took[60] / 3


def test_kept_alive_replies_are_not_held_back_by_nagle() -> None:
    """SGLang's server (uvicorn) sets TCP_NODELAY: a small reply on a kept-alive connection
    must not wait for the client's delayed ACK (~40 ms on Linux) between head and body.
    Checked on the socket the simulator's server accepts, not by a clock: a median under
    30 ms, as this test first read, failed on a busy machine."""
    server = web.bind("127.0.0.1", 0, cast(web.ServerState, None))  # setup() reads no state
    try:
        host, port = server.server_address[:2]
        with socket.create_connection((str(host), int(port)), timeout=10):
            conn, addr = server.get_request()
            with conn:
                handler_class: Any = server.RequestHandlerClass
                handler = handler_class.__new__(handler_class)
                handler.request, handler.client_address, handler.server = conn, addr, server
                handler.setup()  # what the server runs on each accepted connection
                try:
                    assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
                finally:
                    handler.finish()
    finally:
        server.server_close()


@pytest.mark.slow
def test_streams_count_as_running_and_queued_in_metrics_until_they_finish(sims: StartSim) -> None:
    env = {**FAST, "SGLANG_SIM_TOKEN_SECONDS": "0.03"}
    sim = sims("--enable-metrics", "--max-running-requests", "2", env=env)
    sim.wait_ready()
    # 100 tokens of 0.03 s: the state waited for lasts 3 s, not 0.6 s (a busy machine's
    # scrapes missed 0.6 s); the waits are give-up bounds.
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100, "stream": True}
    with httpx.Client(base_url=sim.url, timeout=60) as client, ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(post_stream, client, "/v1/chat/completions", body) for _ in range(4)]

        def counts() -> tuple[float, float]:
            v = metric_values(client)
            return v["sglang:num_running_reqs"], v["sglang:num_queue_reqs"]

        wait_until("2 running and 2 queued in /metrics", lambda: counts() == (2, 2), 30)
        streams = [f.result()[1] for f in futures]
        assert [len(events) for events in streams] == [1 + 100 + 1 + 1] * 4
        wait_until("nothing running or queued", lambda: counts() == (0, 0), 30)
        assert metric_values(client)["sglang:num_requests_total"] == 4 + 1  # + the warmup


@pytest.mark.slow
def test_model_id_is_the_same_on_every_route_a_gateway_registers_from(sims: StartSim) -> None:
    sim = sims("--served-model-name", "sim/llama")
    sim.wait_ready()
    with httpx.Client(base_url=sim.url, timeout=5) as client:
        ids = {
            client.get("/v1/models").json()["data"][0]["id"],
            client.get("/model_info").json()["served_model_name"],
            client.get("/get_model_info").json()["served_model_name"],
            client.get("/server_info").json()["served_model_name"],
            client.get("/get_server_info").json()["served_model_name"],
            client.get("/v1/models/sim/llama").json()["id"],
        }
        assert ids == {"sim/llama"}
        assert client.get("/model_info").json()["model_path"] == "/models/llama-3-8b"


MODES = [
    (FailMode.CUDA_OOM, -9, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate"),
    (
        FailMode.NOT_ENOUGH_MEMORY,
        -9,
        "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static.",
    ),
    (
        FailMode.WEIGHTS_LEAVE_NO_MEMORY,
        -9,
        "ValueError: Loaded weights leave no GPU memory for the KV cache",
    ),
    (FailMode.CUDA_GRAPH, -9, "Capture cuda graph failed:"),
    (FailMode.DEEP_GEMM, -9, "    assert cuda_home is not None\nAssertionError"),
    (
        FailMode.ATTENTION_BACKEND,
        -9,
        "AssertionError: FlashAttention v3 Backend requires SM>=80 and SM<=90.",
    ),
    (FailMode.SGL_KERNEL, 1, "[sgl_kernel] CRITICAL: Could not load any common_ops library!"),
    (FailMode.HOST_OOM, 1, "Rank 0 scheduler died during initialization (exit code: -9)."),
    (
        FailMode.BAD_FLAG,
        2,
        "error: unrecognized arguments: --mamba-scheduler-strategy extra_buffer",
    ),
    (
        FailMode.PORT_IN_USE,
        3,
        "[Errno 98] error while attempting to bind on address ('127.0.0.1', {port}): "
        "address already in use",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "code", "text"), MODES, ids=[m.value for m, _, _ in MODES])
def test_failure_mode_prints_sglang_text_and_exits_like_sglang(
    sims: StartSim, mode: FailMode, code: int, text: str
) -> None:
    sim = sims(env={**FAST, "SGLANG_SIM_LOAD_SECONDS": "0.2", "SGLANG_SIM_FAIL": mode.value})
    assert sim.wait() == code
    assert text.format(port=sim.port) in sim.log
    if code == -9:
        assert "Scheduler hit an exception: Traceback (most recent call last):" in sim.log
    assert "The server is fired up" not in sim.log
    with pytest.raises(httpx.ConnectError):
        httpx.get(sim.url + "/health", timeout=1)


@pytest.mark.slow
def test_port_taken_by_another_process_exits_3_after_load(sims: StartSim) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        sim = sims(port=holder.getsockname()[1])
        assert sim.wait() == 3
    assert "Load weight end" in sim.log
    assert "address already in use" in sim.log


@pytest.mark.slow
def test_runtime_cuda_oom_after_serving_kills_the_tree_with_minus_9(sims: StartSim) -> None:
    # It serves for 3 s, far longer than the probe below takes even on 2 busy cores (at
    # 0.3 s CI's probe found it already dead: "Server disconnected").
    sim = sims(env={**FAST, "SGLANG_SIM_FAIL_AFTER": "3"})
    sim.wait_ready()
    assert httpx.get(sim.url + "/health", timeout=5).status_code == 200
    kids = children_of(sim.proc.pid)
    assert sim.wait(timeout=60) == -9
    assert "torch.OutOfMemoryError: CUDA out of memory." in sim.log
    assert "SIGQUIT received." in sim.log
    wait_until("children gone", lambda: not any(alive(k) for k in kids), 3)


@pytest.mark.slow
def test_hang_stops_health_while_metrics_and_loads_answer_frozen_values(sims: StartSim) -> None:
    sim = sims("--enable-metrics", env={**FAST, "SGLANG_SIM_HANG_AFTER": "0.2"})
    sim.wait_ready()
    time.sleep(0.4)
    with httpx.Client(base_url=sim.url, timeout=1.0) as client:
        t1 = client.get("/v1/loads").json()["loads"][0]["timestamp"]
        with pytest.raises(httpx.ReadTimeout):
            client.get("/health")
        assert client.get("/metrics").status_code == 200
        assert client.get("/v1/loads").json()["loads"][0]["timestamp"] == t1
        assert client.get("/ready").status_code == 200  # a flag check, as in SGLang
        with pytest.raises(httpx.ReadTimeout):
            client.get("/server_info")


def progress(client: httpx.Client) -> tuple[tuple[str, float], ...]:
    """The farm's progress fingerprint of the worker (what `sglang.stats` compares)."""
    return parse_metrics_text(0, 0.0, client.get("/metrics").text).progress


class Streams:
    """Streamed /generate requests in daemon threads, counting the events each received."""

    def __init__(self, url: str, n: int, max_new_tokens: int) -> None:
        self.events = [0] * n
        body = {"text": "hi", "sampling_params": {"max_new_tokens": max_new_tokens}}
        for i in range(n):
            threading.Thread(target=self._run, args=(url, i, body), daemon=True).start()

    def _run(self, url: str, i: int, body: dict[str, object]) -> None:
        try:
            with (
                httpx.Client(base_url=url, timeout=60) as client,
                client.stream("POST", "/generate", json={**body, "stream": True}) as r,
            ):
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events[i] += 1
        except httpx.HTTPError:
            pass  # the simulator is killed at teardown with the requests still open

    def total(self) -> int:
        return sum(self.events)


@pytest.mark.slow
def test_health_queues_waits_behind_a_full_long_batch_while_its_counters_advance(
    sims: StartSim,
) -> None:
    env = {
        **FAST,
        "SGLANG_SIM_HEALTH_QUEUES": "1",
        "SGLANG_SIM_TOKEN_SECONDS": "0.02",
        "SGLANG_HEALTH_CHECK_TIMEOUT": "1.5",
    }
    sim = sims("--enable-metrics", "--max-running-requests", "2", env=env)
    sim.wait_ready()
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 175}}  # 3.5 s each
    with httpx.Client(base_url=sim.url, timeout=10) as client, ThreadPoolExecutor(3) as pool:
        t = time.monotonic()
        assert client.get("/health").status_code == 200  # idle: its own token, at the first look
        assert time.monotonic() - t < 0.5
        futures = [pool.submit(client.post, "/generate", json=body) for _ in range(3)]

        def counts() -> tuple[float, float]:
            v = metric_values(client)
            return v["sglang:num_running_reqs"], v["sglang:num_queue_reqs"]

        wait_until("2 running and 1 queued", lambda: counts() == (2, 1), 30)
        before = progress(client)
        with pytest.raises(httpx.ReadTimeout):  # a farm's probe with a 1 s timeout
            client.get("/health", timeout=1.0)
        assert progress(client) != before  # tokens flow all the while
        t = time.monotonic()
        assert client.get("/health").status_code == 503  # SGLANG_HEALTH_CHECK_TIMEOUT passed
        assert time.monotonic() - t >= 1.4
        assert "Health check failed. Server couldn't get a response from detokenizer" in sim.log
        # The probe left the queue when it gave up; the batch is as it was.
        wait_until("the probes gone from the queue", lambda: counts() == (2, 1), 30)
        # A request finishing is an output: the next look answers 200.
        t = time.monotonic()
        with httpx.Client(base_url=sim.url, timeout=10) as slow:
            status = slow.get("/health").status_code
            while status != 200 and time.monotonic() - t < 6:
                status = slow.get("/health").status_code
        assert status == 200
        assert futures[0].result().status_code == 200 or futures[1].result().status_code == 200
        # One streamed request in a full batch sends each token: /health answers at once.
        streams = Streams(sim.url, 1, 200)
        wait_until("a streamed token", lambda: streams.total() > 0, 5)
        wait_until("the batch full again", lambda: counts()[0] == 2, 30)
        t = time.monotonic()
        assert client.get("/health").status_code == 200
        assert time.monotonic() - t < 0.5
        assert all(f.result().status_code == 200 for f in futures)


@pytest.mark.slow
def test_wedge_freezes_tokens_and_counters_while_health_and_server_info_answer(
    sims: StartSim,
) -> None:
    env = {
        **FAST,
        # Long after ready: both streams are under way (well under a second on a quiet
        # machine) long before it, on a busy one too.
        "SGLANG_SIM_WEDGE_AFTER": "20.0",
        "SGLANG_SIM_HEALTH_QUEUES": "1",  # the wedge answers even SGLang's generating /health
        "SGLANG_SIM_TOKEN_SECONDS": "0.02",
    }
    sim = sims("--enable-metrics", "--max-running-requests", "2", env=env)
    sim.wait_ready()
    streams = Streams(sim.url, 2, 3000)  # 60 s each: still running when the engine wedges
    with httpx.Client(base_url=sim.url, timeout=2.0) as client:
        wait_until("both streams under way before the wedge", lambda: all(streams.events), 19)

        def now() -> tuple[int, tuple[tuple[str, float], ...], float]:
            stamp = client.get("/v1/loads").json()["loads"][0]["timestamp"]
            return streams.total(), progress(client), stamp

        def still() -> tuple[int, tuple[tuple[str, float], ...], float] | None:
            first = now()
            time.sleep(0.5)
            return first if now() == first else None

        # Past the wedge: nothing moves over half a second (tokens flow every 20 ms before).
        frozen = wait_until("the engine wedged", still, 60)
        time.sleep(1.0)
        t = time.monotonic()
        assert client.get("/health").status_code == 200
        assert time.monotonic() - t < 0.5
        assert client.get("/server_info").status_code == 200
        assert client.get("/ready").status_code == 200
        assert now() == frozen  # no token, same fingerprint, same snapshot time
        values = metric_values(client)
        assert values["sglang:num_running_reqs"] == 2
        assert values["sglang:num_requests_total"] == 1  # the warmup; neither stream finished
        assert 0 < streams.total() < 2 * 3000
        with pytest.raises(httpx.ReadTimeout):  # a new request is never admitted either
            client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}})
        assert now() == frozen


@pytest.mark.slow
def test_sigterm_drains_in_flight_request_exits_0_and_leaves_no_child(sims: StartSim) -> None:
    sim = sims("--tp-size", "2", env={**FAST, "SGLANG_SIM_TOKEN_SECONDS": "0.02"})
    sim.wait_ready()
    kids = children_of(sim.proc.pid)
    titles = sorted(Path(f"/proc/{k}/cmdline").read_bytes().split(b"\0")[0].decode() for k in kids)
    assert titles == ["sglang::detokenizer", "sglang::scheduler_TP0", "sglang::scheduler_TP1"]
    assert {os.getpgid(k) for k in kids} == {os.getpgid(sim.proc.pid)}
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(
            httpx.post,
            sim.url + "/generate",
            timeout=5,
            json={"text": "hi", "sampling_params": {"max_new_tokens": 30}},
        )
        wait_until(
            "a running request",
            lambda: (
                "POST" not in sim.log
                and httpx.get(sim.url + "/v1/loads").json()["loads"][0]["num_running_reqs"] == 1
            ),
            2,
        )
        sim.proc.send_signal(signal.SIGTERM)
        assert sim.wait() == 0
        assert reply.result().status_code == 200
    assert "SIGTERM received." in sim.log
    assert "Draining requests and shutting down..." in sim.log
    assert not [k for k in kids if alive(k)]


@pytest.mark.slow
def test_sigterm_drains_streams_keeps_admitting_then_refuses_connections_and_exits_0(
    sims: StartSim,
) -> None:
    sim = sims("--enable-metrics", env={**FAST, "SGLANG_SIM_TOKEN_SECONDS": "0.03"})
    sim.wait_ready()
    # 100 tokens of 0.03 s: both streams run for 3 s, long after a busy machine's scrape.
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 100}, "stream": True}
    with httpx.Client(base_url=sim.url, timeout=60) as client, ThreadPoolExecutor(2) as pool:
        streams = [pool.submit(post_stream, client, "/generate", body) for _ in range(2)]
        wait_until(
            "two streams running",
            lambda: metric_values(client)["sglang:num_running_reqs"] == 2,
            30,
        )
        sim.proc.send_signal(signal.SIGTERM)
        sim.wait_log("Draining requests and shutting down...", 30)
        assert client.get("/health").status_code == 503
        # SGLang's SIGTERM flag gates only /health: a request that still arrives is served.
        late = client.post(
            "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}
        )
        assert late.status_code == 200
        assert late.json()["meta_info"]["completion_tokens"] == 2
        for future in streams:
            events = future.result()[1]
            assert events[-1] == "[DONE]"
            assert events[-2]["meta_info"]["completion_tokens"] == 100
    assert sim.wait(timeout=60) == 0
    assert "Gracefully exiting... Remaining number of requests 2." in sim.log
    with pytest.raises(httpx.ConnectError):
        httpx.get(sim.url + "/health", timeout=2)


@pytest.mark.slow
def test_sgl_force_shutdown_skips_the_drain(sims: StartSim) -> None:
    env = {**FAST, "SGLANG_SIM_TOKEN_SECONDS": "0.05", "SGL_FORCE_SHUTDOWN": "1"}
    sim = sims(env=env)
    sim.wait_ready()
    with ThreadPoolExecutor(1) as pool:
        body = {"text": "hi", "sampling_params": {"max_new_tokens": 200}}  # 10 s
        reply = pool.submit(httpx.post, sim.url + "/generate", json=body, timeout=15)
        wait_until(
            "a running request",
            lambda: httpx.get(sim.url + "/v1/loads").json()["loads"][0]["num_running_reqs"] == 1,
            8,  # a give-up bound inside the request's 10 s
        )
        t = time.monotonic()
        sim.proc.send_signal(signal.SIGTERM)
        assert sim.wait() == 0
        assert time.monotonic() - t < 3
        with pytest.raises(httpx.HTTPError):
            reply.result()
    assert "force shutdown flag set. Force exiting." in sim.log


@pytest.mark.slow
def test_ignored_sigterm_survives_and_children_die_with_a_killed_parent(sims: StartSim) -> None:
    sim = sims(env={**FAST, "SGLANG_SIM_IGNORE_SIGTERM": "1"})
    sim.wait_ready()
    kids = children_of(sim.proc.pid)
    os.killpg(sim.proc.pid, signal.SIGTERM)
    time.sleep(0.3)
    assert sim.proc.poll() is None
    assert all(alive(k) for k in kids)
    sim.proc.kill()  # the parent only: PR_SET_PDEATHSIG takes the children with it
    assert sim.wait() == -9
    wait_until("children gone", lambda: not any(alive(k) for k in kids), 3)


@pytest.mark.slow
def test_scheduler_killed_while_serving_takes_the_server_down(sims: StartSim) -> None:
    sim = sims()
    sim.wait_ready()
    scheduler = next(
        k
        for k in children_of(sim.proc.pid)
        if Path(f"/proc/{k}/cmdline").read_bytes().startswith(b"sglang::scheduler")
    )
    os.kill(scheduler, signal.SIGKILL)
    assert sim.wait() == -9
    assert f"Subprocess scheduler (pid={scheduler}) crashed with exit code -9." in sim.log


def _torch_cuda() -> bool:
    try:
        import torch  # type: ignore[import-not-found]
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not _torch_cuda(), reason="needs torch with a CUDA device")
def test_gpu_memory_is_really_held_by_the_scheduler_child(sims: StartSim) -> None:
    import pynvml

    sim = sims(env={**FAST, "SGLANG_SIM_GPU_MEM_GIB": "2"})
    sim.wait_ready(timeout=60)
    assert "holding 2.00 GiB of GPU memory on cuda:0" in sim.log
    scheduler = next(
        k
        for k in children_of(sim.proc.pid)
        if Path(f"/proc/{k}/cmdline").read_bytes().startswith(b"sglang::scheduler")
    )
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        used = {p.pid: p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
    finally:
        pynvml.nvmlShutdown()
    assert used.get(scheduler, 0) >= 2 * 2**30


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not _torch_cuda(), reason="needs torch with a CUDA device")
def test_real_cuda_oom_prints_torchs_own_message_and_exits_minus_9(sims: StartSim) -> None:
    sim = sims(env={**FAST, "SGLANG_SIM_FAIL": "real_cuda_oom"})
    assert sim.wait(timeout=120) == -9
    assert "Scheduler hit an exception: Traceback (most recent call last):" in sim.log
    assert "torch.OutOfMemoryError: CUDA out of memory." in sim.log
    assert "372.53 GiB" not in sim.log  # torch's real figures, not the canned text


@pytest.mark.slow
def test_help_names_the_process_titles_ps_shows(sims: StartSim) -> None:
    """--help promised `sglang::scheduler_TPn`; a one-rank sim's child is `sglang::scheduler`."""
    sim = sims(env=FAST)
    sim.wait_ready()
    titles = {
        Path(f"/proc/{k}/cmdline").read_bytes().split(b"\0")[0].decode()
        for k in children_of(sim.proc.pid)
    }
    assert titles == {"sglang::scheduler", "sglang::detokenizer"}
    out = " ".join(sim_help("--help").stdout.split())
    for title in titles:
        assert re.search(rf"{title}(?!_TP)\b", out), f"{title} (what ps shows) not in --help"


def test_a_prompt_over_the_context_length_is_refused_with_400_as_sglang_does(
    sims: StartSim,
) -> None:
    sim = sims("--context-length", "64", env=FAST)
    sim.wait_ready()
    long_text = "word " * 100  # 500 characters: about 125 tokens, over 64
    with httpx.Client(base_url=sim.url, timeout=10) as client:
        for path, body in (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": long_text}]}),
            ("/v1/completions", {"prompt": long_text}),
            ("/generate", {"text": long_text}),
        ):
            r = client.post(path, json=body)
            assert r.status_code == 400, (path, r.text)
            message = r.json()["message"]
            assert "is longer than the model's context length (64 tokens)" in message, path
        ok = client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
        )
        assert ok.status_code == 200
