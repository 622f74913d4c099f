"""Paired probes (issue 34 §1): the pure figures and verdict on them, the Prober's pairs
and bound, and `[rollout] probe_concurrency`."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from sglang_farm.canary import probe
from sglang_farm.canary.figures import (
    Figures,
    Histogram,
    ProbePair,
    ProbeResult,
    probe_figures,
    probe_histogram,
    quantile,
)
from sglang_farm.canary.verdict import CanaryPolicy, Outcome, judge
from sglang_farm.config import load_spec
from sglang_farm.errors import ConfigError
from simproc import FAST, StartSim

# SGLang's TTFT buckets (0.1 ... 400 s) up to 2 s.
TTFT_BOUNDS = (0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0)
ITL_BOUNDS = (0.01, 0.02, 0.05, 0.1)


def _ttft(at: float, n: int) -> Histogram:
    i = next(i for i, b in enumerate(TTFT_BOUNDS) if at <= b)
    counts = [0.0] * (len(TTFT_BOUNDS) + 1)
    counts[i] = n
    return Histogram.from_counts(TTFT_BOUNDS, counts, at * n)


def _side(requests: int, ttft_at: float) -> Figures:
    itl = Histogram.from_counts(ITL_BOUNDS, [0, 10 * requests, 0, 0, 0], 0.015 * 10 * requests)
    return Figures(60.0, requests, 0.0, itl, _ttft(ttft_at, requests))


def _pairs(canary_s: float, baseline_s: float, n: int) -> list[ProbePair]:
    return [
        ProbePair(ProbeResult(canary_s * (1 + i % 5 / 50), True), ProbeResult(baseline_s, True), 1)
        for i in range(n)
    ]


def test_probe_figures_count_only_pairs_both_sides_answered() -> None:
    pairs = [
        *_pairs(0.05, 0.05, 10),
        ProbePair(ProbeResult(None, False, error="HTTP 500"), ProbeResult(0.05, True), 2),
        ProbePair(ProbeResult(0.05, True), ProbeResult(None, False, error="timeout"), 3),
    ]
    f = probe_figures(pairs)
    assert f.pairs == 10 and f.failed_canary == 1 and f.failed_baseline == 1
    assert f.canary_ttft.count == f.baseline_ttft.count == 10
    median = quantile(0.5, f.baseline_ttft)
    assert median is not None and abs(median - 0.05) < 0.005  # buckets 10 % apart


def test_probe_histogram_puts_each_value_in_its_bucket() -> None:
    h = probe_histogram([0.0005, 0.05, 120.0])
    assert h.count == 3 and h.counts()[0] == 1 and h.counts()[-1] == 1


def test_a_cold_cache_canary_is_rolled_back_on_ttft_without_probes_and_promoted_with_them() -> None:
    # The gateway's traffic: the canary misses its cache (0.5 s to the first token), the
    # warm baseline hits (0.05 s): 10x, far past ttft_max_ratio's 3x.
    canary, baseline = _side(200, 0.5), _side(1400, 0.05)
    policy = CanaryPolicy()
    biased = judge(canary, baseline, [], policy)
    assert biased.outcome is Outcome.ROLLBACK and biased.failed[0].name == "ttft_p50"
    # The same window with paired probes: the same prompts, both sides equally fast.
    fair = judge(canary, baseline, [], policy, probes=probe_figures(_pairs(0.06, 0.06, 200)))
    assert fair.outcome is Outcome.PROMOTE, fair.evidence
    (ttft,) = [c for c in fair.checks if c.name == "ttft_p50"]
    assert ttft.passed is True and "on 200 paired probes" in ttft.text


def test_a_slow_prefill_is_still_caught_on_the_paired_probes() -> None:
    canary, baseline = _side(200, 0.05), _side(1400, 0.05)
    v = judge(canary, baseline, [], CanaryPolicy(), probes=probe_figures(_pairs(0.5, 0.05, 200)))
    assert v.outcome is Outcome.ROLLBACK
    assert v.evidence.startswith("canary TTFT p50 on 200 paired probes "), v.evidence


def test_probes_with_no_answered_pair_leave_ttft_to_the_workers_figures() -> None:
    canary, baseline = _side(200, 0.5), _side(1400, 0.05)
    none_paired = probe_figures([ProbePair(ProbeResult(None, False), ProbeResult(0.05, True))])
    v = judge(canary, baseline, [], CanaryPolicy(), probes=none_paired)
    assert v.outcome is Outcome.ROLLBACK and v.failed[0].name == "ttft_p50"
    assert "paired probes" not in v.evidence


def test_the_probe_body_shares_a_system_prompt_that_names_the_change() -> None:
    a, b = probe.body("sha256:abc", 0, "sim/m"), probe.body("sha256:abc", 1, None)
    assert a["messages"][0] == b["messages"][0]
    assert "sha256:abc" in a["messages"][0]["content"]
    assert a["messages"][1] != b["messages"][1]
    assert a["model"] == "sim/m" and "model" not in b
    assert a["stream"] is True and a["max_tokens"] == probe.MAX_TOKENS
    assert probe.body("sha256:def", 0, None)["messages"][0] != a["messages"][0]


def test_the_prober_sends_each_prompt_to_both_sides_at_once_and_stays_bounded() -> None:
    sent: list[tuple[str, str | None, str]] = []
    in_flight = {"now": 0, "most": 0}

    async def send(url: str, key: str | None, payload: dict[str, Any]) -> ProbeResult:
        sent.append((url, key, str(payload["messages"])))
        in_flight["now"] += 1
        in_flight["most"] = max(in_flight["most"], in_flight["now"])
        await asyncio.sleep(0.01)
        in_flight["now"] -= 1
        return ProbeResult(0.01, True, 0)

    async def scenario() -> probe.Prober:
        p = probe.Prober(
            "sha256:abc",
            probe.Target(0, "http://c", "k0"),
            [probe.Target(1, "http://b1", "k1"), probe.Target(2, "http://b2", None)],
            concurrency=3,
            model=None,
            send=send,
        )
        task = asyncio.create_task(p.run())
        # Until 6 pairs are answered: a give-up bound (60 s), not a 0.2 s window, which
        # answered none on a busy machine (CI, 2 cores, 4 test workers).
        for _ in range(6000):
            if len(p.pairs) >= 6:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return p

    p = asyncio.run(scenario())
    assert len(p.pairs) >= 6
    assert in_flight["most"] <= 2 * 3  # 3 pairs of 2 requests
    canary = [m for u, _k, m in sent if u == "http://c"]
    baseline = [m for u, _k, m in sent if u != "http://c"]
    assert sorted(canary)[: len(baseline)] == sorted(baseline)[: len(canary)]  # the same prompts
    assert {(u, k) for u, k, _m in sent} == {
        ("http://c", "k0"),
        ("http://b1", "k1"),
        ("http://b2", None),
    }
    assert {pair.baseline_worker for pair in p.pairs} == {1, 2}


def test_probe_concurrency_is_read_and_bounded(tmp_path: Any) -> None:
    base = "[workers]\ngpus = [0, 1]\n[sglang]\nmodel_path = '/m'\n"
    spec = load_spec(base + "[rollout]\nprobe_concurrency = 4\n", source="t.toml", gpu_count=2)
    assert spec.rollout.probe_concurrency == 4
    assert load_spec(base, source="t.toml", gpu_count=2).rollout.probe_concurrency == 0
    with pytest.raises(ConfigError, match="probe_concurrency"):
        load_spec(base + "[rollout]\nprobe_concurrency = -1\n", source="t.toml", gpu_count=2)


def test_http_send_measures_a_real_simulators_first_token_and_cached_tokens(
    sims: StartSim,
) -> None:
    env = {**FAST, "SGLANG_SIM_PREFILL_TOKEN_SECONDS": "0.001"}
    sim = sims("--enable-cache-report", "--api-key", "k", env=env)
    sim.wait_ready()

    async def two() -> tuple[ProbeResult, ProbeResult, ProbeResult]:
        async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
            payload = probe.body("sha256:abc", 0, None)
            cold = await probe.http_send(client, sim.url, "k", payload)
            warm = await probe.http_send(client, sim.url, "k", payload)
            refused = await probe.http_send(client, sim.url, "wrong", payload)
            return cold, warm, refused

    cold, warm, refused = asyncio.run(two())
    assert cold.ok and warm.ok, (cold, warm)
    assert cold.cached_tokens == 0 and warm.cached_tokens is not None and warm.cached_tokens > 200
    assert cold.ttft_s is not None and warm.ttft_s is not None
    assert cold.ttft_s > 0.2 > warm.ttft_s  # ~300 uncached tokens at 1 ms each, then a hit
    assert not refused.ok and refused.error == "HTTP 401"
    # Each stream was read to its end: no connection reset, no traceback in the log.
    assert "Traceback" not in sim.log, sim.log
