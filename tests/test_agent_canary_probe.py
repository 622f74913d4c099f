"""Paired probes in the real Agent over the fakes, on the virtual clock (issue 34 §1).

The gateway routes the canary nothing (as smg's cache_aware policy does when every
request shares one prefix and the baseline's caches hold it): without probes the change
can never be judged (held: too little traffic); with `[rollout] probe_concurrency` the
farm's own paired probes give the canary traffic, which its /metrics count like any
request, and the verdict judges TTFT on the pairs.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

from structlog.testing import capture_logs

from agent_harness import Farm, farm
from canary_farm import ANSWERED_200, Metrics, _start, _toml
from sglang_farm.canary.figures import ProbeResult
from sglang_farm.canary.view import CanaryState, CheckView
from sglang_farm.config import load_spec
from virtual_time import run_virtual

PROBE_S = 0.1  # a probe's answer takes this long (the loop's seconds)
PROBE_TTFT_S = 0.05


class Probed(Metrics):
    """/metrics where a worker whose process runs UNROUTED=1 gets no gateway traffic at
    all, and every worker counts the probes sent to it (one request, 8 tokens of 10-20 ms
    each), as SGLang counts any request on its port."""

    def __init__(self, probe_s: float = PROBE_S) -> None:
        super().__init__()
        self.probe_s = probe_s
        self.probes: Counter[int] = Counter()  # worker -> probe requests answered
        self.sent: list[tuple[str, str | None, dict[str, Any]]] = []

    async def send(self, url: str, key: str | None, payload: dict[str, Any]) -> ProbeResult:
        self.sent.append((url, key, payload))
        await asyncio.sleep(self.probe_s)
        self.probes[int(url.rsplit(":", 1)[1]) - 30000] += 1
        return ProbeResult(PROBE_TTFT_S, True, 0)

    async def __call__(self, url: str, key: str | None) -> str:
        assert self.runtime is not None
        worker = int(url.rsplit(":", 1)[1].split("/")[0]) - 30000
        proc = self.runtime.procs.get(worker)
        if proc is None or proc.command.env_dict.get("UNROUTED") != "1":
            return await super().__call__(url, key)
        self.scrapes.append(url)
        n = float(self.probes[worker])
        lines = [f"sglang:num_requests_total {n}", "sglang:num_aborted_requests_total 0"]
        lines.append(f"{ANSWERED_200} {n}")
        for le, v in zip(("0.01", "0.02", "0.05", "0.1", "+Inf"), (0, *[8 * n] * 4), strict=True):
            lines.append(f'sglang:inter_token_latency_seconds_bucket{{le="{le}"}} {v}')
        lines.append(f"sglang:inter_token_latency_seconds_sum {0.015 * 8 * n}")
        return "\n".join(lines) + "\n"


def _state(f: Farm) -> CanaryState | None:
    v = f.agent.view().canary
    return None if v is None else v.state


def _run(
    tmp: Path, concurrency: int, *, probe_s: float = PROBE_S, max_extensions: int = 0
) -> tuple[Probed, str, tuple[CheckView, ...], list[str]]:
    new = _toml(
        tmp, {"UNROUTED": "1"}, probe_concurrency=concurrency, max_extensions=max_extensions
    )
    m = Probed(probe_s)
    out: dict[str, Any] = {}

    async def scenario() -> None:
        async with farm(
            tmp,
            text=_toml(tmp, probe_concurrency=concurrency, max_extensions=max_extensions),
            loader=lambda: load_spec(new, source="test.toml"),
            scrape=m,
            probe_send=m.send,
        ) as f:
            await _start(f, m)
            assert (await f.ops.reload()).applied
            await f.until(lambda: _state(f) in (CanaryState.PROMOTED, CanaryState.HELD), within=400)
            v = f.agent.view().canary
            assert v is not None
            out["evidence"] = v.evidence
            out["checks"] = v.checks
            if _state(f) is CanaryState.PROMOTED:
                await f.until(
                    lambda: all(f.runtime.starts_of(w) == 2 for w in range(4)), within=600
                )

    with capture_logs() as logged:
        run_virtual(scenario())
    return m, out["evidence"], out["checks"], [str(e["event"]) for e in logged]


def test_a_canary_the_gateway_routes_nothing_is_held_without_probes(tmp: Path) -> None:
    m, evidence, _checks, _events = _run(tmp, 0)
    assert evidence.startswith("held: too little traffic to judge: 0 canary requests"), evidence
    assert m.sent == []


def test_a_canary_the_gateway_routes_nothing_is_judged_on_its_paired_probes(tmp: Path) -> None:
    m, evidence, checks, events = _run(tmp, 2)
    assert evidence.startswith("promoted: canary within limits"), evidence
    assert "canary_probes_started" in events
    # The pairs: the same body to the canary and to a baseline worker, the baseline in turn.
    by_body: dict[str, set[int]] = {}
    for url, _key, payload in m.sent:
        assert payload["stream"] is True and payload["max_tokens"] == 8
        text = str(payload["messages"])
        by_body.setdefault(text, set()).add(int(url.rsplit(":", 1)[1]) - 30000)
    assert all(0 in workers and len(workers) >= 2 for workers in by_body.values())
    assert {1, 2, 3} <= {w for ws in by_body.values() for w in ws}
    # The canary served only probes, and enough of them to judge; TTFT judged on the pairs.
    assert m.probes[0] >= 50
    # (The fake workers export no TTFT histogram: a TTFT judged is the probes'.)
    (ttft,) = [c for c in checks if c.name == "ttft_p50"]
    assert ttft.passed is True and ttft.ratio == 1.0, ttft
    assert ttft.canary is not None and abs(ttft.canary - PROBE_TTFT_S) < 0.1 * PROBE_TTFT_S
    # Bounded: at most 2 pairs in flight, so at most 2 x the window / PROBE_S pairs.
    assert m.probes[0] <= 2 * 60 / PROBE_S + 4


def _missed_probe(tmp: Path, failing: set[int], seconds: float = 3.0) -> str:
    """A harmless change whose canary misses health probes for `seconds` of its window (at
    the harness's 2 s period and threshold of 3, 3 s is one or two missed probes), with the
    workers `failing` (the canary among them)."""
    new = _toml(tmp, {"HARMLESS": "1"})
    m = Metrics()
    out: dict[str, str] = {}

    async def scenario() -> None:
        async with farm(
            tmp, text=_toml(tmp), loader=lambda: load_spec(new, source="test.toml"), scrape=m
        ) as f:
            await _start(f, m)
            assert (await f.ops.reload()).applied
            await f.until(lambda: _state(f) is CanaryState.ANALYSING and _started(f), within=200)
            await asyncio.sleep(10)
            f.prober.failing |= failing
            await asyncio.sleep(seconds)
            f.prober.failing -= failing
            await f.until(
                lambda: _state(f) in (CanaryState.PROMOTED, CanaryState.ROLLED_BACK), within=400
            )
            v = f.agent.view().canary
            assert v is not None
            out["evidence"] = v.evidence

    run_virtual(scenario())
    return out["evidence"]


def _started(f: Farm) -> bool:
    v = f.agent.view().canary
    return v is not None and v.ends_at is not None


def test_a_canary_that_alone_misses_one_health_probe_is_judged_on_its_figures(
    tmp: Path,
) -> None:
    # A miss is the supervisor's to judge, as for any worker: below `failure_threshold`
    # (3) it restarts nothing, and the harmless change is promoted on its figures.
    evidence = _missed_probe(tmp, {0})
    assert evidence.startswith("promoted: "), evidence


def test_a_canary_missing_probes_until_the_supervisor_restarts_it_is_rolled_back(
    tmp: Path,
) -> None:
    # 35 s at the 2 s period: 3 misses in a row, the supervisor's threshold; its restart
    # for them is the change's failure.
    evidence = _missed_probe(tmp, {0}, seconds=35.0)
    assert evidence.startswith("rolled back: canary hung"), evidence


def test_a_missed_probe_the_baseline_misses_too_is_the_hosts_not_the_changes(tmp: Path) -> None:
    evidence = _missed_probe(tmp, {0, 2})
    assert evidence.startswith("promoted: "), evidence


def test_the_probes_go_on_through_an_extension_and_count_from_the_windows_start(
    tmp: Path,
) -> None:
    # One pair at a time, 1.5 s each: 40 in the 60 s window (50 needed), 80 by the end of
    # the first extension, which is judged on all of them.
    m, evidence, _checks, events = _run(tmp, 1, probe_s=1.5, max_extensions=2)
    assert "canary_analysis_extended" in events
    assert events.count("canary_probes_started") == 1  # the same pairs, carried on
    assert evidence.startswith("promoted: ") and "over 120 s" in evidence, evidence
    assert 70 <= m.probes[0] <= 90


def test_a_window_ending_on_an_unhealthy_canary_waits_and_says_why(tmp: Path) -> None:
    """Review of issue 32: a window over while the canary misses probes (below the
    supervisor's threshold) is not judged, and `farmctl status` said "0 s left" without
    saying why; the view now says it, and the change is judged once the canary answers."""
    from sglang_farm.canary.rollout import WINDOW_OVER_UNHEALTHY

    new = _toml(tmp, {"HARMLESS": "1"})
    m = Metrics()
    out: dict[str, str] = {}

    async def scenario() -> None:
        async with farm(
            tmp, text=_toml(tmp), loader=lambda: load_spec(new, source="test.toml"), scrape=m
        ) as f:
            await _start(f, m)
            assert (await f.ops.reload()).applied
            await f.until(lambda: _state(f) is CanaryState.ANALYSING and _started(f), within=200)
            # Missing probes from 2.5 s before the 60 s window's end to 1 s after, at the
            # harness's 2 s period: one or two misses, below the threshold of 3, and one
            # of them before the end.
            await asyncio.sleep(57.5)
            f.prober.failing.add(0)
            await f.until(
                lambda: (
                    (c := f.agent.view().canary) is not None and c.evidence == WINDOW_OVER_UNHEALTHY
                ),
                within=3.4,
            )
            out["state"] = str(_state(f))
            f.prober.failing.discard(0)
            await f.until(
                lambda: _state(f) in (CanaryState.PROMOTED, CanaryState.ROLLED_BACK), within=400
            )
            c = f.agent.view().canary
            assert c is not None
            out["evidence"] = c.evidence

    run_virtual(scenario())
    assert out["state"] == str(CanaryState.ANALYSING)
    assert out["evidence"].startswith("promoted: "), out["evidence"]
