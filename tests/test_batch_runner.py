"""The runner (`sglang_farm.batch.runner`) in this process, on a real SQLite store, against a
fake front door (a real HTTP server answering as the test says: SGLang's 400 for a prompt
over the context length, 503 of a drain, 500, 429 of a full gateway) and a scripted status
of the farm: retries, error lines, the concurrency target, and a full store."""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from batchsvc import chat_lines, fake_front_door
from sglang_farm.batch.lifecycle import BatchStatus
from sglang_farm.batch.metrics import BatchMetrics
from sglang_farm.batch.runner import Runner, RunnerSettings
from sglang_farm.batch.sqlite import SqliteStore
from sglang_farm.batch.store import BatchRow
from sglang_farm.batch.validate import check_line

CONTEXT_LEN = 100


class Door:
    """What the fake front door saw and how it answers."""

    def __init__(self) -> None:
        self.seen: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.in_flight = 0
        self.most_in_flight = 0
        self.rule: Callable[[str, int], tuple[int, dict[str, Any]] | None] = lambda cid, n: None
        self.delay = 0.0

    def answer(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        content = body["messages"][0]["content"]
        cid = content.split()[-1]
        with self.lock:
            self.seen[cid] += 1
            n = self.seen[cid]
        special = self.rule(cid, n)
        if special is not None:
            return special
        if len(content) > CONTEXT_LEN:
            return 400, {
                "object": "error",
                "message": f"The input ({len(content)} tokens) is longer than the model's "
                f"context length ({CONTEXT_LEN} tokens).",
                "type": "BadRequestError",
                "code": 400,
            }
        return 200, {
            "id": f"chatcmpl-{cid}",
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9},
        }


@pytest.fixture
def door() -> Iterator[tuple[Door, str]]:
    d = Door()
    with fake_front_door(d.answer) as url:
        yield d, url


def batch_of(store: SqliteStore, rows: list[dict[str, Any]], bid: str = "batch_t") -> None:
    store.add_batch(
        BatchRow(bid, "/v1/chat/completions", "file-x", "24h", BatchStatus.VALIDATING, 0.0, 1e12)
    )
    items = [check_line(n, json.dumps(r), "/v1/chat/completions") for n, r in enumerate(rows, 1)]
    assert store.load(bid, [i for i in items if i is not None], now=0.0) == []


def rows_named(n: int) -> list[dict[str, Any]]:
    rows = chat_lines(n)
    for r in rows:
        r["body"]["messages"][0]["content"] = f"q {r['custom_id']}"
    return rows


class Script:
    """The farm's status as the agent would answer it, changed by the test."""

    def __init__(self, workers: int) -> None:
        self.status: dict[str, Any] = {
            "workers": [
                {"id": i, "state": "ready", "in_gateway": True, "quarantine": None}
                for i in range(workers)
            ],
            "gateway": {"url": "http://gw"},
        }

    async def read(self) -> Mapping[str, object] | None:
        return self.status


def runner_for(
    store: SqliteStore,
    url: str,
    *,
    farm: Script | None = None,
    max_attempts: int = 5,
    max_running: int = 4,
    workers: int = 2,
) -> tuple[Runner, BatchMetrics]:
    metrics = BatchMetrics()

    async def no_validation(b: BatchRow) -> None:
        raise AssertionError(f"nothing to validate: {b.id}")

    settings = RunnerSettings(
        frontdoors=(url,),
        owner="test",
        max_attempts=max_attempts,
        retry_backoff_s=0.01,
        request_timeout_s=30,
        max_running=dict.fromkeys(range(workers), max_running),
        config_slots=workers * max_running,
        poll_s=0.02,
        status_every_s=0.05,
    )
    return Runner(store, settings, metrics, farm=farm, validate=no_validation), metrics


async def until(ok: Callable[[], bool], within: float = 60) -> None:
    """Wait for `ok()`, at most `within` seconds (a give-up bound)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        if ok():
            return
        if loop.time() > deadline:
            raise AssertionError(f"not within {within} s")
        await asyncio.sleep(0.02)


async def run_until(runner: Runner, done: Callable[[], bool], within: float = 60) -> None:
    task = asyncio.create_task(runner.run())
    try:
        async with asyncio.timeout(within):
            while not done():
                if task.done():
                    task.result()  # the runner's own error, if it stopped
                await asyncio.sleep(0.02)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def finished(store: SqliteStore, bid: str = "batch_t") -> Callable[[], bool]:
    return lambda: store.batch(bid).status is BatchStatus.COMPLETED


def out_ids(store: SqliteStore, kind: str, bid: str = "batch_t") -> list[str]:
    return [json.loads(x)["custom_id"] for x in store.result_lines(bid, kind)]


def sample(metrics: BatchMetrics, name: str, **labels: str) -> float:
    v = metrics.registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


async def test_an_over_long_prompt_is_an_error_line_and_the_rest_complete(
    tmp_path: Path, door: tuple[Door, str]
) -> None:
    d, url = door
    store = SqliteStore(str(tmp_path / "b.db"))
    rows = rows_named(30)
    rows[11]["body"]["messages"][0]["content"] = "x" * 500 + " req-11"
    batch_of(store, rows)
    runner, metrics = runner_for(store, url)
    await run_until(runner, finished(store))
    assert sorted(out_ids(store, "output")) == sorted(f"req-{i}" for i in range(30) if i != 11)
    (err,) = [json.loads(x) for x in store.result_lines("batch_t", "error")]
    assert err["custom_id"] == "req-11"
    assert err["error"]["code"] == "http_400"
    assert "longer than the model's context length" in err["error"]["message"]
    assert err["response"]["status_code"] == 400
    assert d.seen["req-11"] == 1  # not retried: the same prompt gets the same answer
    assert sample(metrics, "sglang_farm_batch_tokens_total", kind="prompt") == 29 * 7
    assert sample(metrics, "sglang_farm_batch_tokens_total", kind="completion") == 29 * 2


async def test_the_farms_failures_are_retried_and_each_attempt_recorded(
    tmp_path: Path, door: tuple[Door, str]
) -> None:
    d, url = door
    answers = {1: (503, {"error": "draining"}), 2: (500, {"error": "boom"}), 3: (429, {})}

    def rule(cid: str, n: int) -> tuple[int, dict[str, Any]] | None:
        if cid in ("req-3", "req-4"):
            return answers.get(n)
        return None

    d.rule = rule
    store = SqliteStore(str(tmp_path / "b.db"))
    batch_of(store, rows_named(10))
    runner, metrics = runner_for(store, url)
    await run_until(runner, finished(store))
    assert sorted(out_ids(store, "output")) == sorted(f"req-{i}" for i in range(10))
    assert out_ids(store, "error") == []
    assert d.seen["req-3"] == 4 and d.seen["req-0"] == 1
    assert store.attempts_of("batch_t", "req-3") == [
        (1, "pending", "unavailable"),
        (2, "pending", "server_error"),
        (3, "pending", "rate_limited"),
        (4, "completed", None),
    ]
    for reason in ("unavailable", "server_error", "rate_limited"):
        assert sample(metrics, "sglang_farm_batch_retries_total", reason=reason) == 2


async def test_attempts_are_bounded(tmp_path: Path, door: tuple[Door, str]) -> None:
    d, url = door
    d.rule = lambda cid, n: (500, {"error": "boom"}) if cid == "req-1" else None
    store = SqliteStore(str(tmp_path / "b.db"))
    batch_of(store, rows_named(3))
    runner, _ = runner_for(store, url, max_attempts=3)
    await run_until(runner, finished(store))
    (err,) = [json.loads(x) for x in store.result_lines("batch_t", "error")]
    assert err["custom_id"] == "req-1" and err["error"]["code"] == "attempts_exhausted"
    assert "after 3 attempts" in err["error"]["message"]
    assert d.seen["req-1"] == 3
    assert sorted(out_ids(store, "output")) == ["req-0", "req-2"]


async def test_a_connection_refused_is_retried_at_the_next_front_door(
    tmp_path: Path, door: tuple[Door, str]
) -> None:
    _, url = door
    from batchsvc import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    store = SqliteStore(str(tmp_path / "b.db"))
    batch_of(store, rows_named(12))
    metrics = BatchMetrics()

    async def no_validation(b: BatchRow) -> None:
        raise AssertionError(b.id)

    settings = RunnerSettings(
        frontdoors=(dead, url), owner="t", retry_backoff_s=0.01, max_attempts=10, poll_s=0.02
    )
    runner = Runner(store, settings, metrics, farm=None, validate=no_validation)
    await run_until(runner, finished(store))
    assert sorted(out_ids(store, "output")) == sorted(f"req-{i}" for i in range(12))
    assert sample(metrics, "sglang_farm_batch_retries_total", reason="connection") > 0


async def test_the_target_follows_the_farm_and_is_never_overfilled(
    tmp_path: Path, door: tuple[Door, str]
) -> None:
    d, url = door
    script = Script(4)
    store = SqliteStore(str(tmp_path / "b.db"))
    batch_of(store, rows_named(400))
    gate = threading.Event()
    most: list[int] = []
    live = [0]
    lock = threading.Lock()

    def rule(cid: str, n: int) -> tuple[int, dict[str, Any]] | None:
        with lock:
            live[0] += 1
            most.append(live[0])
        gate.wait(30)
        with lock:
            live[0] -= 1
        return None

    d.rule = rule
    runner, metrics = runner_for(store, url, farm=script, workers=4, max_running=3)

    async def body() -> None:
        task = asyncio.create_task(runner.run())
        try:
            async with asyncio.timeout(60):
                await until(lambda: max(most, default=0) >= 12)
                assert runner.target == 12
                # worker 1 quarantined, worker 2 draining: 2 workers' slots left
                script.status["workers"][1]["quarantine"] = {"gpu": 1}
                script.status["workers"][2]["state"] = "draining"
                await until(lambda: runner.target == 6)
                assert sample(metrics, "sglang_farm_batch_concurrency_target") in (6, 12)
                most.clear()
                gate.set()  # answers flow; new sends keep to the smaller target
                await until(lambda: store.batch("batch_t").completed >= 100)
                gate.clear()
                most.clear()
                await asyncio.sleep(0.5)
                assert 0 < max(most, default=1) <= 6
                # the farm whole again: the slots come back
                script.status["workers"][1]["quarantine"] = None
                script.status["workers"][2]["state"] = "ready"
                await until(lambda: runner.target == 12)
                gate.set()
                await until(finished(store))
        finally:
            gate.set()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    await body()
    assert sorted(out_ids(store, "output")) == sorted(f"req-{i}" for i in range(400))


async def test_overload_answers_cut_the_target(tmp_path: Path, door: tuple[Door, str]) -> None:
    d, url = door
    d.rule = lambda cid, n: (429, {"error": "busy"}) if n == 1 else None
    store = SqliteStore(str(tmp_path / "b.db"))
    batch_of(store, rows_named(50))
    runner, _ = runner_for(store, url, farm=Script(2), max_running=8)
    seen: list[int] = []

    def done() -> bool:
        seen.append(runner.target)
        return store.batch("batch_t").status is BatchStatus.COMPLETED

    await run_until(runner, done)
    assert min(seen) < 16 and max(seen) == 16


async def test_a_full_store_pauses_the_batch_and_it_resumes_losing_nothing(
    tmp_path: Path, door: tuple[Door, str]
) -> None:
    _, url = door
    store = SqliteStore(str(tmp_path / "b.db"))
    big = rows_named(300)
    for r in big:
        r["body"]["pad"] = "p" * 2000  # rows worth several pages
    batch_of(store, big)
    runner, metrics = runner_for(store, url)
    store.set_max_pages(store.page_count() + 2)  # the disk fills after a few results
    task = asyncio.create_task(runner.run())
    try:
        async with asyncio.timeout(60):
            await until(lambda: runner.paused is not None)
            reason = runner.paused
            assert reason is not None and "full" in reason and "Free space" in reason
            held = store.batch("batch_t")
            await asyncio.sleep(0.5)
            assert store.batch("batch_t").completed == held.completed  # nothing half-written
            assert sample(metrics, "sglang_farm_batch_paused") == 1
            store.set_max_pages(1 << 30)  # space is back
            await until(finished(store))
            assert runner.paused is None
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert sorted(out_ids(store, "output")) == sorted(f"req-{i}" for i in range(300))


async def test_a_refused_key_pauses_the_batch_and_uses_no_attempt(
    tmp_path: Path, door: tuple[Door, str]
) -> None:
    d, url = door
    refusing = threading.Event()
    refusing.set()
    d.rule = lambda cid, n: (401, {"error": "Unauthorized"}) if refusing.is_set() else None
    store = SqliteStore(str(tmp_path / "b.db"))
    batch_of(store, rows_named(20))
    runner, metrics = runner_for(store, url, max_attempts=2)
    task = asyncio.create_task(runner.run())
    try:
        await until(lambda: runner.paused is not None)
        reason = runner.paused
        assert reason is not None and "refuses the batch service's key (401)" in reason
        assert "gateway_key_file" in reason
        await until(lambda: sum(d.seen.values()) >= 30)  # tried again, more than max_attempts
        assert store.batch("batch_t").failed == 0
        refusing.clear()  # the key is accepted again
        await until(finished(store))
        assert runner.paused is None
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert sorted(out_ids(store, "output")) == sorted(f"req-{i}" for i in range(20))
    assert sample(metrics, "sglang_farm_batch_retries_total", reason="unauthorized") > 0


class Flaky(Script):
    """The agent answers, then is gone (killed, restarting): `read` gives None."""

    def __init__(self, workers: int) -> None:
        super().__init__(workers)
        self.up = True

    async def read(self) -> Mapping[str, object] | None:
        return self.status if self.up else None


async def test_with_the_agent_gone_the_last_known_slots_stand(
    tmp_path: Path, door: tuple[Door, str]
) -> None:
    _, url = door
    farm = Flaky(3)
    store = SqliteStore(str(tmp_path / "b.db"))
    batch_of(store, rows_named(40))
    runner, _ = runner_for(store, url, farm=farm, workers=8, max_running=2)
    task = asyncio.create_task(runner.run())
    try:
        await until(lambda: runner.target == 6)  # 3 ready workers x 2, not the config's 16
        farm.status["workers"][0]["state"] = "stopped"
        farm.up = False  # the agent is killed: its last answer stands, not the config's
        await asyncio.sleep(0.3)
        assert runner.target == 6
        await until(finished(store))
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_an_answer_is_read_for_its_usage_and_id_and_kept_as_it_came() -> None:
    from sglang_farm.batch.retry import Outcome, Reason
    from sglang_farm.batch.runner import read_answer

    body = b'{"id":"chatcmpl-1","usage":{"prompt_tokens":7,"completion_tokens":2},"x":"\xc3\xa9"}'
    outcome, reason, r = read_answer(200, body, None)
    assert (outcome, reason) == (Outcome.SUCCESS, None) and r is not None
    assert (r.status_code, r.request_id, r.body) == (200, "chatcmpl-1", body.decode())
    assert (r.prompt_tokens, r.completion_tokens) == (7, 2)
    assert read_answer(200, body, "rid-9")[2].request_id == "rid-9"  # type: ignore[union-attr]
    # cut short, or not text at all: tried again
    assert read_answer(200, body[:20], None)[:2] == (Outcome.RETRY, Reason.BAD_ANSWER)
    assert read_answer(200, b'{"a":"\xff"}', None)[:2] == (Outcome.RETRY, Reason.BAD_ANSWER)
    outcome, _, r = read_answer(400, b'{"error":{"message":"too long"}}', "rid")
    assert outcome is Outcome.FAIL and r is not None
    assert (r.error_code, r.error_message, r.request_id) == ("http_400", "too long", "rid")
    assert read_answer(422, b"\xff", None)[2].error_message == "\ufffd"  # type: ignore[union-attr]
    assert read_answer(503, b"draining", None) == (Outcome.RETRY, Reason.UNAVAILABLE, None)


class TakenOver(SqliteStore):
    """A store where, once, every request the runner holds is taken from it (its lease
    passed and another runner claimed it) just before its answers are recorded."""

    taken = False

    def exchange(self, outcomes: Any, owner: str, n: int, *, now: float, lease_s: float) -> Any:
        if outcomes and not self.taken:
            self.taken = True
            assert self.release_owner(owner) > 0
        return super().exchange(outcomes, owner, n, now=now, lease_s=lease_s)


async def test_the_tokens_count_only_answers_whose_claim_still_held(
    tmp_path: Path, door: tuple[Door, str]
) -> None:
    """An answer recorded too late (its request was taken over) is not a result: its tokens
    are not the batch's, and the request's answer that is recorded counts once."""
    _, url = door
    store = TakenOver(str(tmp_path / "b.db"))
    batch_of(store, rows_named(20))
    runner, metrics = runner_for(store, url)
    await run_until(runner, finished(store))
    assert store.taken
    assert sorted(out_ids(store, "output")) == sorted(f"req-{i}" for i in range(20))
    assert sample(metrics, "sglang_farm_batch_tokens_total", kind="prompt") == 20 * 7
    assert sample(metrics, "sglang_farm_batch_tokens_total", kind="completion") == 20 * 2


# smg 1.13's answer when no worker is routable for the model (all drained, or restarting in
# a wave), as it comes from the real gateway (tests/test_batch_smg.py asks one).
SMG_NO_WORKER = (
    b'{"error":{"type":"invalid_request_error","code":"model_not_found",'
    b'"message":"No worker available for model \'sim/model\'","param":null}}'
)


def test_smg_s_no_worker_available_is_retried_not_the_request_s_error_line() -> None:
    from sglang_farm.batch.retry import Outcome, Reason
    from sglang_farm.batch.runner import read_answer

    assert read_answer(404, SMG_NO_WORKER, "rid") == (Outcome.RETRY, Reason.UNROUTABLE, None)
    # any other 404 is still the engine's answer about the request itself
    outcome, _, r = read_answer(404, b'{"detail":"Not Found"}', None)
    assert outcome is Outcome.FAIL and r is not None and r.error_code == "http_404"
    other = SMG_NO_WORKER.replace(b"No worker available", b"Unknown model")
    assert read_answer(404, other, None)[0] is Outcome.FAIL
    # the same words with another status are that status's
    assert read_answer(400, SMG_NO_WORKER, None)[0] is Outcome.FAIL
