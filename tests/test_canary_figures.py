"""Canary figures (issue 23 #1): the Prometheus text parser, histogram_quantile as PromQL
computes it, deltas over a window with counter resets, a worker's requests and errors."""

from __future__ import annotations

import math

import pytest

from sglang_farm.canary import figures, promtext
from sglang_farm.canary.figures import Histogram, quantile
from sglang_farm.sim.engine import ITL_BUCKETS, Engine
from sglang_farm.sim.exposition import MetricContext, render_metrics

H = Histogram((0.1, 0.2, 0.4), (10.0, 20.0, 30.0, 30.0), 4.5)


def test_quantile_interpolates_inside_the_bucket_as_histogram_quantile_does() -> None:
    assert quantile(0.5, H) == pytest.approx(0.15)  # rank 15: halfway through (0.1, 0.2]
    assert quantile(0.25, H) == pytest.approx(0.075)  # the first bucket starts at 0
    assert quantile(1.0, H) == pytest.approx(0.4)
    assert quantile(0.9, H) == pytest.approx(0.2 + 0.2 * 7 / 10)
    in_inf = Histogram((0.1, 0.2, 0.4), (10.0, 20.0, 30.0, 40.0))
    assert quantile(0.9, in_inf) == 0.4  # a rank in +Inf: the highest finite bound
    assert quantile(-0.1, H) == -math.inf and quantile(1.1, H) == math.inf
    assert quantile(0.5, Histogram.empty((0.1, 0.2))) is None


def test_histogram_delta_is_the_window_and_a_reset_makes_the_later_one_whole() -> None:
    later = Histogram((0.1, 0.2, 0.4), (15.0, 30.0, 45.0, 46.0), 7.0)
    delta = later.since(H)
    assert delta.cumulative == (5.0, 10.0, 15.0, 16.0)
    assert delta.total == pytest.approx(2.5)
    assert delta.counts() == (5.0, 5.0, 5.0, 1.0)
    restarted = Histogram((0.1, 0.2, 0.4), (2.0, 3.0, 3.0, 3.0), 0.3)
    assert restarted.since(H) == restarted
    with pytest.raises(ValueError, match="different buckets"):
        H.since(Histogram((0.1, 0.5), (1.0, 1.0, 1.0)))
    with pytest.raises(ValueError, match="one cumulative count per bound"):
        Histogram((0.1,), (1.0,))
    assert figures.counter_since(120.0, 100.0) == 20.0
    assert figures.counter_since(7.0, 100.0) == 7.0  # reset: counted from 0 again


def test_parser_reads_labels_escapes_timestamps_and_special_values() -> None:
    text = (
        "# HELP x a counter\n# TYPE x counter\n"
        'x_total{a="1",b="q\\"uote\\\\back\\nline"} 3 1700000000000\n'
        "y 4.5e+02\n"
        'sglang:h_bucket{le="+Inf",model_name="m"} +Inf\n'
        "\n"
    )
    s = promtext.parse(text)
    assert s.samples[("x_total", (("a", "1"), ("b", 'q"uote\\back\nline')))] == 3.0
    assert s.total("y") == 450.0
    assert s.total("sglang:h_bucket", le="+Inf") == math.inf
    assert s.total("absent") is None
    with pytest.raises(ValueError, match=r"w:3: labels do not parse at 'd='"):
        promtext.parse("a 1\nb 2\nc{d=} 3\n", source="w")
    with pytest.raises(ValueError, match=r"w:2: not a Prometheus sample line"):
        promtext.parse('a 1\n{x="1"} 2\n', source="w")
    with pytest.raises(ValueError, match=r"metrics:1: value 'many' is not a number"):
        promtext.parse("a many\n")


def test_histogram_from_the_simulators_metrics_equals_its_own_snapshot() -> None:
    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += s

    engine = Engine(
        max_running=4,
        max_queued=None,
        max_total_tokens=1000,
        token_seconds=0.012,
        clock=lambda: now[0],
        sleep=sleep,
    )
    for _ in range(3):
        engine.generate(10, 6)
    engine.publish()
    ctx = MetricContext("m", (("gpu", "0"),), 32768, 1, 15.3, 60.0, 1.0)
    text = render_metrics(ctx, engine.scheduler_stats(), engine.tokenizer_stats())
    sample = figures.worker_sample(promtext.parse(text), None, "http://127.0.0.1:30000")
    own = engine.tokenizer_stats().itl
    assert sample.itl == Histogram.from_counts(own.bounds, own.counts, own.total)
    assert sample.itl is not None and sample.itl.bounds == ITL_BUCKETS
    assert sample.itl.count == 15  # 5 gaps in each of 3 requests
    assert quantile(0.5, sample.itl) == pytest.approx(0.010 + 0.005 * 7.5 / 15)
    assert sample.requests >= 3 and sample.aborted == 0
    assert sample.gateway_ok is None


def _sglang(requests: float, aborted: float, itl: tuple[float, ...]) -> promtext.Scrape:
    lines = [
        f'sglang:num_requests_total{{is_streaming="false"}} {requests}',
        f'sglang:num_requests_total{{is_streaming="true"}} {requests}',
        f"sglang:num_aborted_requests_total {aborted}",
    ]
    for le, v in zip(("0.01", "0.02", "+Inf"), itl, strict=True):
        lines.append(f'sglang:inter_token_latency_seconds_bucket{{le="{le}"}} {v}')
    lines.append(f"sglang:inter_token_latency_seconds_sum {itl[-1] * 0.01}")
    return promtext.parse("\n".join(lines))


def _gateway(ok: float, failed: float) -> promtext.Scrape:
    return promtext.parse(
        f'smg_worker_cb_outcomes_total{{worker="http://w:1",outcome="success"}} {ok}\n'
        f'smg_worker_cb_outcomes_total{{worker="http://w:1",outcome="failure"}} {failed}\n'
        f'smg_worker_cb_outcomes_total{{worker="http://other:2",outcome="failure"}} 99\n'
    )


def test_a_window_counts_requests_and_errors_from_the_gateway_alone_never_an_abort() -> None:
    """Issue 30 #1: an abort (a client that hung up) is not the change's error, and the
    gateway's outcomes are not mixed with SGLang's aborts in one ratio."""
    a = figures.worker_sample(_sglang(100, 1, (10, 20, 20)), _gateway(200, 2), "http://w:1")
    b = figures.worker_sample(_sglang(150, 4, (30, 60, 61)), _gateway(290, 12), "http://w:1")
    f = figures.window(a, b, 30.0)
    assert (f.requests, f.errors) == (100.0, 10.0)  # 90 ok + 10 failed; the 3 aborts: none
    assert f.source is figures.ErrorSource.GATEWAY
    assert f.error_ratio == pytest.approx(0.1)
    assert f.itl is not None and f.itl.cumulative == (20.0, 40.0, 41.0)
    assert f.ttft is None
    # Without a gateway or SGLang's response counter: its finished requests (both label
    # sets), and no error source at all (errors not judged), aborts or not.
    g = figures.window(
        figures.worker_sample(_sglang(100, 1, (10, 20, 20)), None, "http://w:1"),
        figures.worker_sample(_sglang(150, 4, (30, 60, 61)), None, "http://w:1"),
        30.0,
    )
    assert (g.requests, g.errors, g.source) == (100.0, 0.0, figures.ErrorSource.NONE)


def _responses(codes: dict[tuple[str, str], float], *, requests: bool = True) -> str:
    lines = [
        f'sglang:http_responses_total{{endpoint="{e}",method="POST",status_code="{c}"}} {v}'
        for (e, c), v in codes.items()
    ]
    if requests:
        lines.append('sglang:http_requests_total{endpoint="/metrics",method="GET"} 3')
    return "\n".join(lines) + "\n"


def test_the_workers_own_http_responses_count_2xx_and_5xx_on_the_serving_routes() -> None:
    """SGLang >= 0.5.20's `sglang:http_responses_total`: a 2xx or 5xx answer on a serving
    route is a request, a 5xx an error; a 4xx (bad request, no key, a client that hung
    up on a non-streamed request) is neither; probes and scrapes are not traffic."""
    body = _responses(
        {
            ("/v1/chat/completions", "200"): 40,
            ("/generate", "200"): 10,
            ("/v1/completions", "500"): 4,
            ("/v1/chat/completions", "503"): 1,
            ("/v1/chat/completions", "400"): 7,
            ("/v1/chat/completions", "401"): 900,
            ("/health", "503"): 30,
            ("/metrics", "200"): 12,
        }
    )
    assert figures.http_responses(promtext.parse(body)) == (55.0, 5.0)
    # A worker with the counters but no response yet (only its first scrape arrived).
    assert figures.http_responses(promtext.parse(_responses({}))) == (0.0, 0.0)
    # SGLang before 0.5.20: neither family.
    assert figures.http_responses(promtext.parse("sglang:num_requests_total 5\n")) == (None, None)
    only_responses = _responses({("/generate", "200"): 2}, requests=False)
    assert figures.http_responses(promtext.parse(only_responses)) == (2.0, 0.0)


def test_the_workers_own_counter_is_preferred_to_the_gateways_and_aborts_count_for_nothing() -> (
    None
):
    """1,000 aborted streams straight to a worker's port (issue 30 #1): each one had its
    200 sent, so it is an answer, never an error; the worker's counter is judged, not the
    gateway's."""

    def sample(ok: float, failed: float, aborted: float) -> figures.WorkerSample:
        body = _responses({("/v1/chat/completions", "200"): ok, ("/generate", "500"): failed})
        body += f"sglang:num_aborted_requests_total {aborted}\nsglang:num_requests_total {ok}\n"
        return figures.worker_sample(promtext.parse(body), _gateway(ok, failed), "http://w:1")

    f = figures.window(sample(10, 0, 0), sample(1_110, 0, 1_000), 30.0)
    assert (f.source, f.requests, f.errors) == (figures.ErrorSource.WORKERS, 1_100.0, 0.0)
    assert [c.source for c in f.counts] == list(figures.ErrorSource)
    gw = f.on(figures.ErrorSource.GATEWAY)
    assert gw is not None and (gw.requests, gw.errors) == (1_100.0, 0.0)
    f = figures.window(sample(10, 0, 0), sample(100, 10, 50), 30.0)
    assert (f.requests, f.errors) == (100.0, 10.0)


def test_a_side_and_a_comparison_use_only_a_source_every_worker_has() -> None:
    """Never one source's ratio against another's: a baseline worker without the
    response counter (SGLang 0.5.12) puts its whole side, and then the comparison, on
    the gateway's outcomes; with no source in common, errors are not judged."""
    new = figures.Figures(
        30.0, 100.0, 10.0, None, None, figures.ErrorSource.WORKERS,
        (
            figures.Counts(figures.ErrorSource.WORKERS, 100.0, 10.0),
            figures.Counts(figures.ErrorSource.GATEWAY, 90.0, 9.0),
            figures.Counts(figures.ErrorSource.NONE, 95.0, 0.0),
        ),
    )  # fmt: skip
    old = figures.Figures(
        30.0, 80.0, 0.0, None, None, figures.ErrorSource.GATEWAY,
        (
            figures.Counts(figures.ErrorSource.GATEWAY, 80.0, 0.0),
            figures.Counts(figures.ErrorSource.NONE, 70.0, 0.0),
        ),
    )  # fmt: skip
    side = new.plus(old)
    assert (side.source, side.requests, side.errors) == (figures.ErrorSource.GATEWAY, 170.0, 9.0)
    assert [c.source for c in side.counts] == [
        figures.ErrorSource.GATEWAY,
        figures.ErrorSource.NONE,
    ]
    canary, baseline = figures.common(new, old)
    assert (canary.source, canary.requests, canary.errors) == (
        figures.ErrorSource.GATEWAY,
        90.0,
        9.0,
    )
    assert (baseline.source, baseline.requests) == (figures.ErrorSource.GATEWAY, 80.0)
    canary, baseline = figures.common(new, new)
    assert (canary.source, baseline.source) == (figures.ErrorSource.WORKERS,) * 2
    bare = figures.Figures(30.0, 60.0, 0.0, None, None, figures.ErrorSource.NONE)
    canary, baseline = figures.common(new, bare)
    assert (canary.source, canary.requests, canary.errors) == (figures.ErrorSource.NONE, 95.0, 0.0)
    assert (baseline.source, baseline.requests) == (figures.ErrorSource.NONE, 60.0)
    assert (
        new.on(figures.ErrorSource.GATEWAY) is not None
        and bare.on(figures.ErrorSource.GATEWAY) is None
    )


def test_outcomes_the_gateway_does_not_show_yet_count_zero() -> None:
    # smg makes a worker's series at its first outcome of each kind: a canary just added
    # has none at the start of its window, and its first failure adds the series later.
    empty = promtext.parse("smg_http_connections_active 1\n")
    a = figures.worker_sample(_sglang(0, 0, (0, 0, 0)), empty, "http://w:1")
    b = figures.worker_sample(_sglang(90, 0, (9, 9, 9)), _gateway(90, 10), "http://w:1")
    assert (a.gateway_ok, a.gateway_failed) == (0.0, 0.0)
    f = figures.window(a, b, 30.0)
    assert (f.requests, f.errors) == (100.0, 10.0)


def test_a_worker_restarted_inside_the_window_counts_from_zero() -> None:
    a = figures.worker_sample(_sglang(500, 9, (100, 200, 200)), _gateway(900, 5), "http://w:1")
    b = figures.worker_sample(_sglang(20, 1, (5, 8, 8)), _gateway(950, 6), "http://w:1")
    f = figures.window(a, b, 30.0)
    assert f.itl is not None and f.itl.cumulative == (5.0, 8.0, 8.0)
    assert (f.requests, f.errors) == (51.0, 1.0)  # the gateway's 50 ok + 1 failed


def test_the_baseline_is_its_workers_added_up() -> None:
    one = figures.Figures(30.0, 100.0, 1.0, Histogram((0.01,), (50.0, 60.0)), None)
    two = figures.Figures(30.0, 300.0, 2.0, Histogram((0.01,), (10.0, 90.0)), None)
    both = figures.combined([one, two])
    assert both is not None
    assert (both.requests, both.errors) == (400.0, 3.0)
    assert both.itl == Histogram((0.01,), (60.0, 150.0))
    assert figures.combined([]) is None
