"""The eval gate end to end (issue 23 #3): the shipped eval set sent to real simulators over
/v1/chat/completions, scored, and judged canary against baseline; failed requests (500s,
timeouts, a missing api key) are wrong answers counted apart."""

from __future__ import annotations

import asyncio
import json
import socket
from decimal import Decimal
from pathlib import Path

import httpx
import pytest

from sglang_farm.canary.evalrun import EvalOptions, request_body, run_eval, run_gate
from sglang_farm.canary.evalset import EvalItem, load
from sglang_farm.sim import regress
from simproc import FAST, StartSim

SHIPPED = Path(__file__).resolve().parent.parent / "etc" / "sglang-farm" / "eval" / "arith.jsonl"
ITEMS = load(SHIPPED.read_text(encoding="utf-8"), source=str(SHIPPED))
QUICK = {**FAST, "SGLANG_SIM_TOKEN_SECONDS": "0"}


def wrong_under(seed: int, rate: float) -> list[str]:
    """The shipped questions the simulator answers wrong under this seed and rate."""
    out = []
    for item in ITEMS:
        q = regress.find_question(item.prompt)
        assert q is not None
        if regress.answer(q, seed, rate) != str(q.a + q.b):
            out.append(item.name)
    return out


def test_the_request_is_greedy_seeded_bounded_and_names_the_model_when_given() -> None:
    item = EvalItem(3, "What is 1 + 2?", Decimal(3))
    body = request_body(item, EvalOptions(seed=7, max_tokens=32, model="m"))
    assert body == {
        "messages": [{"role": "user", "content": "What is 1 + 2?"}],
        "temperature": 0,
        "seed": 7,
        "max_tokens": 32,
        "stream": False,
        "model": "m",
    }
    assert "model" not in request_body(item, EvalOptions())
    for bad, match in [
        ({"concurrency": 0}, "concurrency must be at least 1"),
        ({"timeout_s": 0.0}, "timeout_s must be more than 0"),
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
    ]:
        with pytest.raises(ValueError, match=match):
            EvalOptions(**bad)  # type: ignore[arg-type]


def test_a_correct_canary_passes_against_a_correct_baseline(sims: StartSim) -> None:
    canary = sims("--served-model-name", "m", env=QUICK)
    baseline = sims("--served-model-name", "m", env=QUICK)
    canary.wait_ready()
    baseline.wait_ready()
    gate = asyncio.run(
        run_gate(
            ITEMS,
            canary_url=canary.url,
            baseline_url=baseline.url,
            tolerance=0.05,
            options=EvalOptions(model="m", timeout_s=30),
        )
    )
    assert gate.verdict.passed
    assert gate.verdict.evidence_line == (
        "eval: canary 40/40 (100 %) vs baseline 40/40 (100 %), tolerance 5 %: passed"
    )
    assert (gate.canary.score.correct, gate.canary.score.failed) == (40, 0)
    assert gate.canary.errors == ()
    # The replies are the sums, in the set's order.
    assert [Decimal(r or "nan") for r in gate.canary.replies] == [i.answer for i in ITEMS]


def test_a_canary_answering_30_percent_wrong_fails_with_the_seeded_questions(
    sims: StartSim,
) -> None:
    wrong = wrong_under(23, 0.3)
    assert len(wrong) == 13  # the seed's draw over these 40 questions (about 30 %)
    canary = sims(env={**QUICK, "SGLANG_SIM_WRONG_RATE": "0.3", "SGLANG_SIM_SEED": "23"})
    baseline = sims(env=QUICK)
    canary.wait_ready()
    baseline.wait_ready()
    gate = asyncio.run(
        run_gate(ITEMS, canary_url=canary.url, baseline_url=baseline.url, tolerance=0.05)
    )
    assert not gate.verdict.passed
    assert gate.verdict.evidence_line == (
        "eval: canary 27/40 (67.5 %) vs baseline 40/40 (100 %), tolerance 5 %: "
        "failed, the canary 32.5 points below"
    )
    assert [g.item.name for g in gate.canary.score.wrong] == wrong
    assert gate.canary.score.failed == 0 and gate.baseline.score.correct == 40
    # Deterministic: the same seed answers the same questions wrong on a second run.
    again = asyncio.run(run_eval(canary.url, ITEMS))
    assert again.replies == gate.canary.replies


def test_500s_count_as_wrong_answers_and_are_counted_apart(sims: StartSim) -> None:
    # The simulator errs on the seeded request numbers (1.. in arrival order); the order
    # among 4 concurrent requests varies, the set of numbers 1..40 does not.
    failing = sum(regress.errs(1, 0.2, n) for n in range(1, len(ITEMS) + 1))
    assert failing == 6
    sim = sims(env={**QUICK, "SGLANG_SIM_ERROR_RATE": "0.2", "SGLANG_SIM_SEED": "1"})
    sim.wait_ready()
    run = asyncio.run(run_eval(sim.url, ITEMS, options=EvalOptions(concurrency=4)))
    assert (run.score.correct, run.score.failed, run.score.total) == (34, 6, 40)
    assert len(run.errors) == 6
    assert all("HTTP 500" in e and "SGLANG_SIM_ERROR_RATE" in e for e in run.errors)
    assert run.errors[0].startswith("'add-")  # each names its question
    assert sum(r is None for r in run.replies) == 6


def test_the_api_key_is_sent_and_without_it_every_request_fails(sims: StartSim) -> None:
    sim = sims("--api-key", "s3cret", env=QUICK)
    sim.wait_ready()
    items = ITEMS[:5]
    keyed = asyncio.run(run_eval(sim.url, items, api_key="s3cret"))
    assert (keyed.score.correct, keyed.score.failed) == (5, 0)
    bare = asyncio.run(run_eval(sim.url, items))
    assert (bare.score.correct, bare.score.failed) == (0, 5)
    assert all("HTTP 401" in e for e in bare.errors), bare.errors


def test_a_request_past_its_timeout_is_a_failed_answer() -> None:
    # A listening socket nobody accepts on: the kernel completes the connection, the
    # request is sent, and no reply ever comes (a hung worker).
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(8)
        url = f"http://127.0.0.1:{hung.getsockname()[1]}"
        run = asyncio.run(run_eval(url, ITEMS[:2], options=EvalOptions(timeout_s=0.5)))
    assert (run.score.correct, run.score.failed) == (0, 2)
    assert all(e.endswith("no reply within 0.5 s") for e in run.errors), run.errors


def test_a_worker_that_is_not_there_fails_every_request_without_raising() -> None:
    from simproc import free_port

    run = asyncio.run(run_eval(f"http://127.0.0.1:{free_port()}", ITEMS[:3]))
    assert (run.score.correct, run.score.failed) == (0, 3)
    assert all("ConnectError" in e for e in run.errors), run.errors


def test_bodies_without_a_reply_are_failed_and_an_empty_content_is_a_wrong_answer() -> None:
    bodies = iter(
        [
            (200, b"not json"),
            (200, json.dumps({"choices": []}).encode()),
            (200, json.dumps({"choices": [{"message": {"content": 42}}]}).encode()),
            (200, json.dumps({"choices": [{"message": {"content": None}}]}).encode()),
            (200, json.dumps({"choices": [{"message": {"content": "#### 4"}}]}).encode()),
        ]
    )

    def answer(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/chat/completions"
        code, content = next(bodies)
        return httpx.Response(code, content=content)

    items = [EvalItem(n, f"q{n}", Decimal(4)) for n in range(1, 6)]
    run = asyncio.run(
        run_eval(
            "http://worker",
            items,
            options=EvalOptions(concurrency=1),
            transport=httpx.MockTransport(answer),
        )
    )
    assert run.replies == (None, None, None, "", "#### 4")
    assert run.errors == (
        "line 1: HTTP 200 with a body that is not JSON",
        "line 2: HTTP 200 without choices[0].message.content",
        "line 3: choices[0].message.content is int, not text",
    )
    assert (run.score.correct, run.score.failed) == (1, 3)
