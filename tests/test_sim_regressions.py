"""The simulator's regressions for a canary to catch (issue 23 #4): 500s at a rate, wrong
sums in arithmetic mode, the inter-token latency histogram; deterministic under a seed."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sglang_farm.sim import regress
from sglang_farm.sim.engine import ITL_BUCKETS, Engine
from sglang_farm.sim.exposition import MetricContext, render_metrics
from sglang_farm.sim.settings import SettingsError, load_settings
from simproc import FAST, StartSim, metric_values, post_stream, sim_help

# -- pure parts ----------------------------------------------------------------------------


def test_questions_are_found_in_any_spacing_and_the_last_one_counts() -> None:
    assert regress.find_question("What is 2 + 3?") == regress.Question(2, 3)
    assert regress.find_question("Q: what is -12+40 ?") == regress.Question(-12, 40)
    many = "What is 1 + 1? 2. What is 20 + 22?"
    assert regress.find_question(many) == regress.Question(20, 22)
    assert regress.find_question("What is two plus three?") is None
    assert regress.find_question("The capital city of France is") is None


def test_answers_are_the_sum_unless_wrong_and_the_wrong_ones_are_fixed_by_the_seed() -> None:
    questions = [regress.Question(a, a + 7) for a in range(1000)]
    assert all(regress.answer(q, 0, 0.0) == str(q.a + q.b) for q in questions)

    def wrong(seed: int, rate: float) -> list[int]:
        return [
            i for i, q in enumerate(questions) if regress.answer(q, seed, rate) != str(q.a + q.b)
        ]

    at_20 = wrong(5, 0.2)
    assert 150 <= len(at_20) <= 250  # a rate, over distinct questions
    assert wrong(5, 0.2) == at_20  # the same seed, the same questions
    assert wrong(6, 0.2) != at_20
    assert len(wrong(5, 1.0)) == 1000
    for i in at_20:
        q = questions[i]
        assert 1 <= int(regress.answer(q, 5, 0.2)) - (q.a + q.b) <= 9


def test_errors_fall_on_numbered_requests_fixed_by_the_seed() -> None:
    first = [n for n in range(1, 2001) if regress.errs(3, 0.1, n)]
    assert 150 <= len(first) <= 250
    assert [n for n in range(1, 2001) if regress.errs(3, 0.1, n)] == first
    assert [n for n in range(1, 2001) if regress.errs(4, 0.1, n)] != first
    assert not any(regress.errs(3, 0.0, n) for n in range(1, 2001))
    assert all(regress.errs(3, 1.0, n) for n in range(1, 2001))


def test_rates_and_seed_refuse_what_they_do_not_know_by_name() -> None:
    s = load_settings(
        {"SGLANG_SIM_ERROR_RATE": "0.1", "SGLANG_SIM_WRONG_RATE": "1", "SGLANG_SIM_SEED": "42"}
    )
    assert (s.error_rate, s.wrong_rate, s.seed) == (0.1, 1.0, 42)
    assert (load_settings({}).error_rate, load_settings({}).wrong_rate) == (0.0, 0.0)
    for name, bad in [
        ("SGLANG_SIM_ERROR_RATE", "1.5"),
        ("SGLANG_SIM_ERROR_RATE", "-0.1"),
        ("SGLANG_SIM_WRONG_RATE", "often"),
        ("SGLANG_SIM_SEED", "0.5"),
    ]:
        with pytest.raises(SettingsError, match=name):
            load_settings({name: bad})


def test_help_explains_each_regression_control() -> None:
    out = sim_help("--help").stdout
    for name in ("SGLANG_SIM_ERROR_RATE", "SGLANG_SIM_WRONG_RATE", "SGLANG_SIM_SEED"):
        assert name in out
    assert "What is A + B?" in out


def test_inter_token_latency_is_one_observation_per_token_after_the_first() -> None:
    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += s

    engine = Engine(
        max_running=4,
        max_queued=None,
        max_total_tokens=1000,
        token_seconds=0.03,
        clock=lambda: now[0],
        sleep=sleep,
    )
    engine.generate(10, 5)
    itl = engine.tokenizer_stats().itl
    assert itl.bounds == ITL_BUCKETS
    assert itl.count == 4
    assert itl.total == pytest.approx(0.12)
    # every gap is 0.03 s: all four in the (0.025, 0.030] bucket
    assert itl.counts[ITL_BUCKETS.index(0.030)] == 4
    engine.publish()
    ctx = MetricContext("m", (), 32768, 1, 15.3, 60.0, 1.0)
    text = render_metrics(ctx, engine.scheduler_stats(), engine.tokenizer_stats())
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    fam = fams["sglang:inter_token_latency_seconds"]
    assert fam.type == "histogram"
    samples = {(s.name, s.labels.get("le")): s.value for s in fam.samples}
    assert samples[("sglang:inter_token_latency_seconds_count", None)] == 4
    assert samples[("sglang:inter_token_latency_seconds_bucket", "0.025")] == 0
    assert samples[("sglang:inter_token_latency_seconds_bucket", "0.03")] == 4
    assert samples[("sglang:inter_token_latency_seconds_bucket", "+Inf")] == 4
    assert "is_streaming" not in fam.samples[0].labels  # as SGLang's: no is_streaming


# -- a real simulator ----------------------------------------------------------------------


def test_error_rate_answers_the_seeded_requests_500_and_counts_them_in_no_sglang_family(
    sims: StartSim,
) -> None:
    env = {**FAST, "SGLANG_SIM_ERROR_RATE": "0.3", "SGLANG_SIM_SEED": "7"}
    sim = sims(
        "--enable-metrics", "--served-model-name", "m", env={**env, "SGLANG_SIM_TOKEN_SECONDS": "0"}
    )
    sim.wait_ready()
    expected = [500 if regress.errs(7, 0.3, n) else 200 for n in range(1, 31)]
    assert 500 in expected and 200 in expected
    bodies: dict[str, dict[str, object]] = {
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
        "/v1/completions": {"prompt": "hi"},
        "/generate": {"text": "hi"},
    }
    got = []
    with httpx.Client(base_url=sim.url, timeout=10) as client:
        before = metric_values(client)  # the warm-up request is counted, as in SGLang
        for n in range(30):
            route = ("/v1/chat/completions", "/v1/completions", "/generate")[n % 3]
            r = client.post(route, json={**bodies[route], "max_tokens": 2})
            got.append(r.status_code)
            if r.status_code == 500:
                err = r.json()
                assert (err["object"], err["type"], err["code"]) == (
                    "error",
                    "InternalServerError",
                    500,
                )
                assert "SGLANG_SIM_ERROR_RATE" in err["message"]
        values = metric_values(client)
    assert got == expected
    ok = expected.count(200)

    def grew(name: str) -> float:
        return values[name] - before[name]

    assert grew("sglang:num_requests_total") == ok
    assert grew("sglang:num_aborted_requests_total") == 0
    assert grew("sglang:e2e_request_latency_seconds_count") == ok


def test_arithmetic_questions_are_answered_with_the_sum_on_every_route(sims: StartSim) -> None:
    sim = sims("--served-model-name", "m", env={**FAST, "SGLANG_SIM_TOKEN_SECONDS": "0"})
    sim.wait_ready()
    chat = {"model": "m", "messages": [{"role": "user", "content": "What is 19 + 23?"}]}
    with httpx.Client(base_url=sim.url, timeout=10) as client:
        r = client.post("/v1/chat/completions", json={**chat, "max_tokens": 64}).json()
        assert r["choices"][0]["message"]["content"] == "42"
        assert r["choices"][0]["finish_reason"] == "stop"
        assert r["usage"]["completion_tokens"] == 1
        r = client.post("/v1/completions", json={"prompt": "What is 1 + 2?"}).json()
        assert (r["choices"][0]["text"], r["choices"][0]["finish_reason"]) == (" 3", "stop")
        r = client.post("/generate", json={"text": "What is 5 + 5?"}).json()
        assert r["text"] == " 10"
        assert r["meta_info"]["finish_reason"]["type"] == "stop"
        _, events = post_stream(client, "/v1/chat/completions", {**chat, "stream": True})
        content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1])
        assert content == "42"
        assert events[-2]["choices"][0]["finish_reason"] == "stop"
        # Any other prompt: " sim" tokens, as before.
        other = {"model": "m", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3}
        r = client.post("/v1/chat/completions", json=other).json()
        assert r["choices"][0]["message"]["content"] == "sim sim sim"


def test_wrong_rate_answers_the_seeded_questions_wrong_on_every_run(sims: StartSim) -> None:
    env = {**FAST, "SGLANG_SIM_TOKEN_SECONDS": "0", "SGLANG_SIM_WRONG_RATE": "0.5"}
    sim = sims(env={**env, "SGLANG_SIM_SEED": "11"})
    sim.wait_ready()
    questions = [regress.Question(a, 100 + a) for a in range(20)]
    with httpx.Client(base_url=sim.url, timeout=10) as client:
        runs = [
            [
                client.post("/generate", json={"text": f"What is {q.a} + {q.b}?"}).json()["text"]
                for q in questions
            ]
            for _ in range(2)
        ]
    assert runs[0] == runs[1]
    wrong = [q for q, text in zip(questions, runs[0], strict=True) if int(text) != q.a + q.b]
    assert wrong == [q for q in questions if regress.answer(q, 11, 0.5) != str(q.a + q.b)]
    assert 0 < len(wrong) < len(questions)


def _responses(client: httpx.Client) -> dict[tuple[str, str, str], float]:
    """sglang:http_responses_total by (endpoint, status_code, method), read with
    prometheus_client's own parser (the format as Prometheus reads it)."""
    fams = text_string_to_metric_families(client.get("/metrics").text)
    return {
        (s.labels["endpoint"], s.labels["status_code"], s.labels["method"]): s.value
        for f in fams
        for s in f.samples
        if s.name == "sglang:http_responses_total"
    }


def test_http_responses_count_each_answer_by_route_and_status_an_aborted_stream_a_200(
    sims: StartSim,
) -> None:
    """SGLang 0.5.20+'s `sglang:http_responses_total{endpoint,status_code,method}` (issue
    30 #1): the 500s of SGLANG_SIM_ERROR_RATE counted under their route, a bad body as
    400, and a stream whose client hung up after its first event as the 200 it was sent
    (and as an abort); with SGLANG_SIM_NO_HTTP_METRICS, as SGLang 0.5.12: no such family."""
    env = {**FAST, "SGLANG_SIM_ERROR_RATE": "0.3", "SGLANG_SIM_SEED": "7"}
    sim = sims("--enable-metrics", env={**env, "SGLANG_SIM_TOKEN_SECONDS": "0.05"})
    sim.wait_ready()
    with httpx.Client(base_url=sim.url, timeout=10) as client:
        before = _responses(client)
        codes = [
            client.post("/generate", json={"text": "hi", "max_tokens": 1}).status_code
            for _ in range(20)
        ]
        assert client.post("/generate", content=b"{nope").status_code == 400
        aborted_before = metric_values(client)["sglang:num_aborted_requests_total"]
        hung_up = 0
        while hung_up < 3:  # streams answered 200 (the 500s are no stream), then dropped
            body = {"text": "hi", "max_tokens": 50, "stream": True}
            with client.stream("POST", "/generate", json=body) as r:
                if r.status_code == 200:
                    next(r.iter_bytes())
                    hung_up += 1
                codes.append(r.status_code)
        after = _responses(client)
        deadline = 200
        while metric_values(client)["sglang:num_aborted_requests_total"] < aborted_before + 3:
            deadline -= 1
            assert deadline > 0, "the dropped streams were never counted as aborted"
            httpx.get(sim.url + "/ready", timeout=10)

    def grew(code: str) -> float:
        key = ("/generate", code, "POST")
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert grew("500") == codes.count(500) > 0
    assert grew("200") == codes.count(200) > 3
    assert grew("400") == 1
    assert ("/metrics", "200", "GET") in after  # every route, the scrapes too

    old = sims("--enable-metrics", env={**FAST, "SGLANG_SIM_NO_HTTP_METRICS": "1"})
    old.wait_ready()
    with httpx.Client(base_url=old.url, timeout=10) as client:
        client.post("/generate", json={"text": "hi", "max_tokens": 1})
        names = set(metric_values(client))
    assert "sglang:num_requests_total" in names
    assert not any(n.startswith("sglang:http_re") for n in names)
