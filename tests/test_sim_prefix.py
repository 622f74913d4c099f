"""The simulator's prefix (radix) cache (issue 34 §1): pure, the engine, the HTTP surface."""

from __future__ import annotations

import httpx
import pytest

from sglang_farm.sim.engine import Engine
from sglang_farm.sim.prefix import BLOCK_TOKENS, CHARS_PER_TOKEN, PrefixCache, blocks
from sglang_farm.sim.settings import SettingsError, load_settings
from simproc import FAST, StartSim, metric_values, wait_until

BLOCK_CHARS = BLOCK_TOKENS * CHARS_PER_TOKEN
SYSTEM = "You are a careful assistant. " * 40  # 1,160 characters: 18 whole blocks


def tokens(text: str) -> int:
    return max(1, len(text) // CHARS_PER_TOKEN)


def test_a_shared_prefix_is_a_hit_up_to_where_the_prompts_differ() -> None:
    cache = PrefixCache(10_000)
    a = SYSTEM + "first question"
    b = SYSTEM + "another one, longer than the first"
    assert cache.admit(blocks(a), tokens(a)).cached_tokens == 0  # cold
    hit = cache.admit(blocks(b), tokens(b))
    assert hit.cached_tokens == (len(SYSTEM) // BLOCK_CHARS) * BLOCK_TOKENS
    assert hit.uncached_tokens == tokens(b) - hit.cached_tokens
    again = cache.admit(blocks(a), tokens(a))
    assert again.cached_tokens == len(blocks(a)) * BLOCK_TOKENS  # every whole block of it
    other = "Something else entirely. " * 10
    assert cache.admit(blocks(other), tokens(other)).cached_tokens == 0


def test_the_last_prompt_token_is_always_computed() -> None:
    cache = PrefixCache(10_000)
    text = "x" * (BLOCK_CHARS * 3)  # exactly 3 blocks, 48 tokens
    cache.admit(blocks(text), tokens(text))
    assert cache.admit(blocks(text), tokens(text)).cached_tokens == 3 * BLOCK_TOKENS - 1


def test_a_full_cache_evicts_the_least_recently_used_prompt() -> None:
    p1, p2, p3 = ("A" * 8 * BLOCK_CHARS, "B" * 8 * BLOCK_CHARS, "C" * 8 * BLOCK_CHARS)
    cache = PrefixCache(16 * BLOCK_TOKENS)  # room for two of them
    cache.admit(blocks(p1), tokens(p1))
    cache.admit(blocks(p2), tokens(p2))
    assert cache.admit(blocks(p1), tokens(p1)).cached_tokens > 0  # p1 used again: p2 is older
    cache.admit(blocks(p3), tokens(p3))  # evicts p2
    assert cache.cached_blocks == 16 and cache.evicted_blocks == 8
    assert cache.admit(blocks(p1), tokens(p1)).cached_tokens > 0
    assert cache.admit(blocks(p2), tokens(p2)).cached_tokens == 0


def test_a_zero_capacity_cache_never_hits() -> None:
    cache = PrefixCache(0)
    for _ in range(3):
        assert cache.admit(blocks(SYSTEM), tokens(SYSTEM)).cached_tokens == 0
    with pytest.raises(ValueError, match="capacity"):
        PrefixCache(-1)


def test_settings_read_the_prefill_cost_and_the_capacity() -> None:
    s = load_settings(
        {"SGLANG_SIM_PREFILL_TOKEN_SECONDS": "0.001", "SGLANG_SIM_PREFIX_CACHE_TOKENS": "4096"}
    )
    assert (s.prefill_token_seconds, s.prefix_cache_tokens) == (0.001, 4096)
    d = load_settings({})
    assert (d.prefill_token_seconds, d.prefix_cache_tokens) == (0.0, None)
    with pytest.raises(SettingsError, match="SGLANG_SIM_PREFIX_CACHE_TOKENS"):
        load_settings({"SGLANG_SIM_PREFIX_CACHE_TOKENS": "lots"})


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def test_the_engine_prefills_only_the_uncached_tokens_so_a_hit_answers_sooner() -> None:
    t = FakeTime()
    engine = Engine(
        max_running=4,
        max_queued=None,
        max_total_tokens=100_000,
        token_seconds=0.01,
        prefill_token_seconds=0.001,
        prefix_cache_tokens=100_000,
        clock=t.clock,
        sleep=t.sleep,
    )
    text = SYSTEM + "the question"
    cold = engine.generate(tokens(text), 2, blocks=blocks(text))
    warm = engine.generate(tokens(text), 2, blocks=blocks(text))
    assert cold.cached_tokens == 0 and warm.cached_tokens > 0
    assert cold.ttft_s == pytest.approx(tokens(text) * 0.001 + 0.01)
    assert warm.ttft_s == pytest.approx((tokens(text) - warm.cached_tokens) * 0.001 + 0.01)
    engine.publish()
    rate = engine.scheduler_stats().cache_hit_rate
    assert rate == pytest.approx(warm.cached_tokens / (2 * tokens(text)), abs=1e-4)
    engine.publish()  # nothing prefilled since: the gauge keeps its value
    assert engine.scheduler_stats().cache_hit_rate == rate
    assert engine.flush_cache()
    assert engine.generate(tokens(text), 2, blocks=blocks(text)).cached_tokens == 0


def chat(sim_url: str, content: str, *, stream: bool = False) -> httpx.Response:
    body = {
        "model": "/models/llama-3-8b",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}],
        "max_tokens": 2,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return httpx.post(sim_url + "/v1/chat/completions", json=body, timeout=30)


def test_cached_tokens_in_usage_with_enable_cache_report_and_the_hit_rate_gauge(
    sims: StartSim,
) -> None:
    sim = sims("--enable-metrics", "--enable-cache-report")
    sim.wait_ready()
    first = chat(sim.url, "What is 2 + 3?").json()["usage"]
    second = chat(sim.url, "What is 4 + 4?").json()["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < second["prompt_tokens"]
    streamed = chat(sim.url, "What is 9 + 1?", stream=True).text
    assert f'"prompt_tokens_details":{{"cached_tokens":{cached}}}' in streamed
    with httpx.Client(base_url=sim.url) as c:
        wait_until(
            "a cache hit rate above 0", lambda: metric_values(c)["sglang:cache_hit_rate"] > 0
        )


def test_without_enable_cache_report_no_details_and_disable_radix_cache_never_hits(
    sims: StartSim,
) -> None:
    plain = sims("--enable-metrics")
    off = sims("--enable-metrics", "--enable-cache-report", "--disable-radix-cache")
    plain.wait_ready()
    off.wait_ready()
    for _ in range(2):
        assert "prompt_tokens_details" not in chat(plain.url, "hello").json()["usage"]
        details = chat(off.url, "hello").json()["usage"]["prompt_tokens_details"]
        assert details == {"cached_tokens": 0}
    with httpx.Client(base_url=off.url) as c:
        assert metric_values(c)["sglang:cache_hit_rate"] == 0


def test_a_prefill_cost_makes_the_cold_request_slower_over_http(sims: StartSim) -> None:
    env = {**FAST, "SGLANG_SIM_PREFILL_TOKEN_SECONDS": "0.002", "SGLANG_SIM_TOKEN_SECONDS": "0"}
    sim = sims("--enable-cache-report", env=env)
    sim.wait_ready()
    # The system prompt's 290 uncached tokens cost 0.58 s once; then only the tail's few.
    cold = chat(sim.url, "one")
    warm = chat(sim.url, "two")
    assert cold.elapsed.total_seconds() > 0.5
    assert warm.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 250
    assert warm.elapsed.total_seconds() < cold.elapsed.total_seconds()


def test_a_client_that_resets_its_connection_leaves_no_traceback_in_the_log(
    sims: StartSim,
) -> None:
    # A traceback on a worker's stderr reads as the worker failing (the farm's log
    # classifier: fatal_traceback); a client's reset is no failure of the server's.
    import socket
    import struct

    sim = sims()
    sim.wait_ready()
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", sim.port)) as s:
            s.sendall(b"GET /ready HTTP/1.1\r\nHost: x\r\n\r\n")
            s.recv(10)  # part of the answer; the connection stays open (keep-alive)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    assert httpx.get(sim.url + "/ready", timeout=10).status_code == 200
    assert "Traceback" not in sim.log and "Connection reset" not in sim.log, sim.log
