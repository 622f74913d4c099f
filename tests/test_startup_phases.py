"""A worker's start phase by phase (issue 34 §4): SGLang's milestone lines (as 0.5.12 and
0.5.23 print them, and the simulator), the capacity line, and the slow-phase rule."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from farmproc import Farm, farm_config, new_marker
from farmtoml import rewritten
from sglang_farm.sglang.startup import (
    Capacity,
    StartPhase,
    StartTimeline,
    capacity_of,
    phase_begun,
    slow_phase,
)

# A start as SGLang logs it (TP 1: no rank tags), one line per milestone and some between.
LINES = [
    "[2026-12-02 06:35:54] server_args=ServerArgs(model_path='/dev/shm/Qwen3.6-27B', ...)",
    "[2026-12-02 06:35:54] Load weight begin. avail mem=139.29 GB",
    "[2026-12-02 06:35:55] Load weight end. elapsed=0.60 s, type=Qwen3ForCausalLM, "
    "avail mem=123.99 GB, mem usage=15.30 GB.",
    "[2026-12-02 06:35:55] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 821868, "
    "K size: 53.86 GB, V size: 53.86 GB",
    "[2026-12-02 06:35:55] Memory pool end. avail mem=16.27 GB",
    "[2026-12-02 06:35:55] Capture target decode CUDA graph begin. backend=full, "
    "num_tokens_per_req=1, avail mem=16.27 GB",
    "[2026-12-02 06:35:55] Capture target decode CUDA graph end. bs=[1, 2, 4], elapsed=0.30 s, "
    "mem usage=0.52 GB, avail mem=15.75 GB.",
    "[2026-12-02 06:35:55] max_total_num_tokens=821868, chunked_prefill_size=8192, "
    "max_prefill_tokens=16384, max_running_requests=72, context_len=8192, "
    "available_gpu_mem=15.75 GB",
    "[2026-12-02 06:35:55] INFO:     Uvicorn running on http://0.0.0.0:30000 (Press CTRL+C "
    "to quit)",
    "[2026-12-02 06:35:56] The server is fired up and ready to roll!",
]


def test_each_milestone_begins_its_phase_whatever_the_rank_tags() -> None:
    assert [phase_begun(line) for line in LINES] == [
        None,
        StartPhase.LOADING_WEIGHTS,
        StartPhase.ALLOCATING_KV_CACHE,
        None,
        None,
        StartPhase.CAPTURING_CUDA_GRAPHS,
        None,
        StartPhase.STARTING_SERVER,
        StartPhase.WARMING_UP,
        StartPhase.SERVED,
    ]
    assert phase_begun("[2026-12-02 06:35:54 DP0 TP3] Load weight begin. avail mem=1 GB") is (
        StartPhase.LOADING_WEIGHTS
    )
    assert phase_begun("Prefill batch, #new-seq: 1, Load weight begin.") is None


def test_the_capacity_line_is_read_and_nothing_else_is() -> None:
    assert capacity_of(LINES[7]) == Capacity(821868, 72, 8192)
    assert capacity_of(LINES[3]) is None
    assert (
        capacity_of("[x] warning: max_total_num_tokens=1 max_running_requests=2 context_len=3")
        is None
    )


def test_a_timeline_moves_forward_only_and_times_each_phase() -> None:
    t = StartTimeline.launched(100.0)
    at = [100.0, 101.0, 131.0, 131.5, 132.0, 140.0, 141.0, 161.0, 162.0, 170.0]
    for line, when in zip(LINES, at, strict=True):
        t = t.advance(line, when)
        t = t.advance(line, when + 0.1)  # the same line again (another TP rank): nothing moves
    assert t.done and t.capacity == Capacity(821868, 72, 8192)
    assert t.durations() == {
        StartPhase.LAUNCHING: 1.0,
        StartPhase.LOADING_WEIGHTS: 30.0,
        StartPhase.ALLOCATING_KV_CACHE: 9.0,
        StartPhase.CAPTURING_CUDA_GRAPHS: 21.0,
        StartPhase.STARTING_SERVER: 1.0,
        StartPhase.WARMING_UP: 8.0,
    }
    assert StartPhase.LOADING_WEIGHTS.words == "loading weights"


def test_without_cuda_graphs_the_phase_is_skipped() -> None:
    t = StartTimeline.launched(0.0)
    for line, when in ((LINES[1], 1.0), (LINES[2], 2.0), (LINES[7], 3.0)):
        t = t.advance(line, when)
    assert t.phase is StartPhase.STARTING_SERVER and t.phase_since == 3.0
    assert StartPhase.CAPTURING_CUDA_GRAPHS not in t.durations()


@pytest.mark.parametrize(
    ("seconds", "siblings", "slow"),
    [
        (95.0, [40.0, 42.0, 41.0], True),
        (60.0, [40.0, 42.0, 41.0], False),  # under twice the median
        (0.9, [0.3, 0.3], False),  # the simulator's fractions of a second: not 10 s longer
        (95.0, [], False),  # no sibling to compare with
    ],
)
def test_a_phase_is_slow_only_well_above_its_siblings(
    seconds: float, siblings: list[float], slow: bool
) -> None:
    got = slow_phase(StartPhase.LOADING_WEIGHTS, seconds, siblings)
    assert (got is not None) is slow
    if got is not None:
        assert got.text() == "loading weights took 95 s, against 41 s for its 3 siblings (median)"


def test_a_farm_shows_each_start_phase_by_phase_and_names_the_slow_one(short_tmp: Path) -> None:
    """Three simulated workers (process runtime); worker 2 loads its weights 20 times slower
    and settles on 37 running requests where its siblings have 72. The status JSON and
    `farmctl status`/`why` show each start's phases and capacity, the metrics export them,
    and one warning names worker 2's slow phase."""
    marker = new_marker()
    slow = {"SGLANG_SIM_LOAD_SECONDS": "20", "SGLANG_FARM_TEST_MARKER": marker}
    cfg = farm_config(
        short_tmp,
        workers=3,
        parallel=3,
        marker=marker,
        sglang={
            "model_path": "sim/Qwen3.6-27B",
            "enable_metrics": True,
            "max_running_requests": 72,
        },
    )
    overrides = {"2": {"env": slow, "sglang": {"max_running_requests": 37}}}
    cfg.write_text(rewritten(cfg.read_text(), workers={"overrides": overrides}))
    farm = Farm(cfg, marker)
    try:
        # While worker 2 loads: its phase in status, from its log's milestones.
        farm.wait_for(lambda e: e.get("event") == "worker_ready" and e.get("worker") == 1, 120)
        starting = json.loads(farm.farmctl("--json", "status").stdout)["workers"][2]["start"]
        assert starting["in_progress"] is True
        assert starting["phase"] in ("launching", "loading_weights"), starting
        text = farm.farmctl("status").stdout
        assert re.search(r"starting · (launching|loading weights) \d", text), text
        farm.wait_for(lambda e: e.get("event") == "rollout_done", 180)
        st = json.loads(farm.farmctl("--json", "status").stdout)
        address = farm.named("metrics_listening")[0]["address"]
        metrics = httpx.get(f"http://{address}/metrics", timeout=30).text
        why = farm.farmctl("why", "2").stdout
        text = farm.farmctl("status").stdout
        warnings = farm.named("worker_start_slow")
    finally:
        farm.stop()
    starts = [w["start"] for w in st["workers"]]
    assert all(s["phase"] == "served" and not s["in_progress"] for s in starts), starts
    for s in starts:
        assert list(s["durations"]) == [
            "launching",
            "loading_weights",
            "allocating_kv_cache",
            "capturing_cuda_graphs",
            "starting_server",
            "warming_up",
        ]
    assert starts[2]["durations"]["loading_weights"] > 10
    assert starts[0]["durations"]["loading_weights"] < starts[2]["durations"]["loading_weights"]
    assert [s["capacity"]["max_running_requests"] for s in starts] == [72, 72, 37]
    assert all(s["capacity"]["kv_tokens"] > 0 and s["capacity"]["context_len"] > 0 for s in starts)
    assert [w["worker"] for w in warnings] == [2], warnings
    assert warnings[0]["phase"] == "loading_weights"
    assert "loading weights took" in warnings[0]["why"]
    # ... and said where the operator looks, not in the log alone.
    assert [[x["phase"] for x in s["slow"]] for s in starts] == [[], [], ["loading_weights"]]
    assert "worker 2: slow start: loading weights took" in text, text
    assert "slow: loading weights took" in why, why
    assert "CAPACITY" in text and " tok · 37 req" in text, text
    assert "worker 2: SGLang chose 37 running requests at its start, 2 of its siblings 72" in text
    assert "start (its last): launching" in why and "loading weights" in why, why
    assert "capacity SGLang chose:" in why and "37 running requests at most" in why, why
    assert 'sglang_farm_worker_max_running_requests{gpu="2",worker="2"} 37.0' in metrics
    assert re.search(
        r'sglang_farm_worker_startup_seconds\{gpu="2",phase="loading_weights",worker="2"\} 1\d',
        metrics,
    ), metrics


def test_a_slow_phase_is_kept_with_its_start_and_shown_by_status_and_why() -> None:
    """The slow-phase line is not the agent's log alone (issue 34 §4, Done-when): the start
    in the status JSON carries it, `farmctl status` has a note line and `why` says it; a
    new launch of the worker starts with none."""
    from sglang_farm.cli.ctl.status import format_status
    from sglang_farm.cli.startview import start_lines
    from sglang_farm.control.results import start_result
    from sglang_farm.farm_view import start_view
    from sglang_farm.workers.startup_book import StartupBook

    book = StartupBook()
    for w in range(3):
        book.launched(w, 0.0)
        book.line(w, LINES[1], 1.0)  # loading weights from 1 s ...
        book.line(w, LINES[2], 60.0 if w == 2 else 6.0)  # ... to 6 s; worker 2's to 60 s
    assert [s.worker for s in book.take_slow()] == [2]  # the log's line, as before
    slow = book.slow_phases()
    assert list(slow) == [2] and slow[2][0].phase is StartPhase.LOADING_WEIGHTS
    view = start_view(book.starts()[2], 1000.0, starting=True, slow=slow[2])
    result = start_result(view)
    assert result is not None
    slow_rows = result["slow"]
    assert isinstance(slow_rows, list)
    (entry,) = slow_rows
    assert entry == {
        "phase": "loading_weights",
        "seconds": 59.0,
        "siblings_median": 5.0,
        "siblings": 2,
        "text": "loading weights took 59 s, against 5 s for its 2 siblings (median)",
    }
    row = {"id": 2, "gpus": [2], "port": 30002, "state": "starting", "since": 1.0, "start": result}
    text = format_status(
        {"farm": "f", "runtime": "process", "rollout": "rolling", "now": 1070.0, "workers": [row]}
    )
    assert (
        "worker 2: slow start: loading weights took 59 s, against 5 s for its 2 siblings "
        "(median)" in text
    )
    assert any("slow: loading weights took 59 s" in ln for ln in start_lines(result))
    book.launched(2, 100.0)
    assert 2 not in book.slow_phases()


def test_why_says_how_long_a_starting_worker_has_been_in_its_phase() -> None:
    """Issue 34 §4: the phase and how long it has lasted, in `why` as in `status`."""
    from sglang_farm.cli.startview import start_lines

    start = {
        "phase": "capturing_cuda_graphs",
        "phase_since": 1000.0,
        "in_progress": True,
        "durations": {"launching": 1.0, "loading_weights": 40.0},
        "capacity": None,
        "slow": [],
    }
    assert start_lines(start, now=1042.0)[0] == (
        "start (in progress): launching 1.0 s, loading weights 40 s; now capturing cuda graphs "
        "for 42 s"
    )
