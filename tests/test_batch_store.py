"""The batch store's contract (`sglang_farm.batch.store.Store`), one module run against both
backends: SQLite (the embedded default) and a real PostgreSQL started by the fixture
(`pgserver`). Each claim, each recorded outcome and each status change is checked through
the store's own answers, as the runner and the API see them."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pgserver import PgServer, postgres
from sglang_farm.batch.lifecycle import BatchStatus
from sglang_farm.batch.sqlite import SqliteStore
from sglang_farm.batch.store import (
    Attempt,
    BatchRow,
    Claimed,
    FileRow,
    NotFound,
    Result,
    Store,
)
from sglang_farm.batch.validate import Problem, Request, check_line

Opener = Callable[[], Store]


@pytest.fixture(scope="module")
def pg() -> Iterator[PgServer]:
    with postgres() as server:
        yield server


@pytest.fixture(params=["sqlite", "postgres"])
def opener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Opener]:
    """A way to open another connection to one fresh store of the backend."""
    opened: list[Store] = []
    if request.param == "sqlite":
        path = str(tmp_path / "batch.db")

        def open_one() -> Store:
            s = SqliteStore(path)
            opened.append(s)
            return s
    else:
        server: PgServer = request.getfixturevalue("pg")
        url = server.new_database()
        from sglang_farm.batch.postgres import PostgresStore

        def open_one() -> Store:
            s = PostgresStore(url)
            opened.append(s)
            return s

    yield open_one
    for s in opened:
        s.close()


@pytest.fixture
def store(opener: Opener) -> Store:
    return opener()


NOW = 1_000_000.0


def lines(n: int, prefix: str = "r", *, first: int = 1) -> list[Request]:
    return [
        Request(first + i, f"{prefix}{i}", "POST", "/v1/chat/completions", json.dumps({"n": i}))
        for i in range(n)
    ]


def new_batch(
    store: Store, bid: str = "batch_a", *, created: float = NOW, window: float = 3600
) -> BatchRow:
    row = BatchRow(
        id=bid,
        endpoint="/v1/chat/completions",
        input_file_id="file-x",
        completion_window="1h",
        status=BatchStatus.VALIDATING,
        created_at=created,
        expires_at=created + window,
        metadata={"job": "test"},
    )
    store.add_batch(row)
    return row


def loaded(store: Store, n: int, bid: str = "batch_a", **kw: float) -> BatchRow:
    new_batch(store, bid, **kw)
    assert store.load(bid, lines(n), now=NOW) == []
    return store.batch(bid)


def ok(c: Claimed, attempts: int = 1, tokens: int = 3) -> Attempt:
    body = json.dumps({"answer": c.custom_id, "usage": {"completion_tokens": tokens}})
    return Attempt(
        c, "completed", attempts, Result(200, f"req-{c.line}", body, None, None, 5, tokens)
    )


def test_files_are_kept_listed_and_deleted(store: Store) -> None:
    store.add_file(FileRow("file-1", "batch", "a.jsonl", 10, NOW))
    store.add_file(FileRow("file-2", "batch", "b.jsonl", 20, NOW + 1))
    assert store.file("file-1").filename == "a.jsonl"
    assert [f.id for f in store.files(purpose="batch")] == ["file-2", "file-1"]
    store.delete_file("file-1")
    with pytest.raises(NotFound):
        store.file("file-1")
    with pytest.raises(NotFound):
        store.delete_file("file-1")
    assert [f.id for f in store.files()] == ["file-2"]


def test_a_load_puts_every_request_in_and_the_batch_in_progress(store: Store) -> None:
    b = loaded(store, 2500)
    assert b.status is BatchStatus.IN_PROGRESS
    assert (b.total, b.completed, b.failed, b.in_flight) == (2500, 0, 0, 0)
    assert b.stamps is not None and b.stamps["in_progress_at"] == NOW
    assert b.metadata == {"job": "test"}
    assert [b.id for b in store.live_batches()] == ["batch_a"]


def test_a_load_with_bad_lines_and_duplicates_fails_the_batch_and_keeps_no_request(
    store: Store,
) -> None:
    new_batch(store)
    raw = [
        json.dumps(
            {
                "custom_id": "a",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": "x"}]},
            }
        ),
        "{not json",
        json.dumps(
            {
                "custom_id": "a",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": "y"}]},
            }
        ),
        json.dumps(
            {
                "custom_id": "b",
                "method": "GET",
                "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": "z"}]},
            }
        ),
    ]
    items = [
        got for n, line in enumerate(raw, 1) if (got := check_line(n, line, "/v1/chat/completions"))
    ]
    problems = store.load("batch_a", items, now=NOW)
    assert sorted((p.line, p.param) for p in problems) == [
        (2, None),
        (3, "custom_id"),
        (4, "method"),
    ]
    dup = next(p for p in problems if p.line == 3)
    assert "first on line 1" in dup.message and dup.code == "duplicate_custom_id"
    b = store.batch("batch_a")
    assert b.status is BatchStatus.FAILED
    assert sorted(int(str(e["line"])) for e in b.errors if e["line"] is not None) == [2, 3, 4]
    assert b.total == 0
    assert store.claim("me", 10, now=NOW, lease_s=60) == []


def test_duplicates_across_load_chunks_are_named(store: Store) -> None:
    new_batch(store)
    reqs = lines(2500)
    reqs.append(Request(2501, "r7", "POST", "/v1/chat/completions", "{}"))
    problems = store.load("batch_a", reqs, now=NOW)
    assert [(p.line, p.code) for p in problems] == [(2501, "duplicate_custom_id")]
    assert "first on line 8" in problems[0].message


def test_an_empty_load_fails(store: Store) -> None:
    new_batch(store)
    problems = store.load("batch_a", [], now=NOW)
    assert len(problems) == 1 and "no requests" in problems[0].message
    assert store.batch("batch_a").status is BatchStatus.FAILED


def test_a_claim_takes_each_request_once_until_its_lease_passes(store: Store) -> None:
    loaded(store, 10)
    first = store.claim("a", 4, now=NOW, lease_s=60)
    assert [c.line for c in first] == [1, 2, 3, 4]
    second = store.claim("b", 100, now=NOW + 1, lease_s=60)
    assert [c.line for c in second] == [5, 6, 7, 8, 9, 10]
    assert store.claim("b", 100, now=NOW + 2, lease_s=60) == []
    assert store.batch("batch_a").in_flight == 10
    # a's lease passes: b takes a's four over; a's late answers are not recorded.
    again = store.claim("b", 100, now=NOW + 61, lease_s=60)
    assert [c.line for c in again] == [1, 2, 3, 4]
    assert store.record([ok(c) for c in first], now=NOW + 62) == [False] * 4
    assert store.record([ok(c) for c in again], now=NOW + 62) == [True] * 4
    b = store.batch("batch_a")
    assert (b.completed, b.in_flight) == (4, 6)


def test_an_outcome_is_recorded_once(store: Store) -> None:
    loaded(store, 3)
    cs = store.claim("a", 3, now=NOW, lease_s=60)
    assert store.record([ok(cs[0])], now=NOW) == [True]
    assert store.record([ok(cs[0])], now=NOW) == [False]
    failed = Attempt(
        cs[1],
        "failed",
        1,
        Result(400, "r", '{"error":{"message":"too long"}}', "http_400", "too long"),
    )
    assert store.record([failed], now=NOW) == [True]
    b = store.batch("batch_a")
    assert (b.completed, b.failed, b.in_flight) == (1, 1, 1)
    assert (b.prompt_tokens, b.completion_tokens) == (5, 3)


def test_a_retry_waits_for_its_time_and_counts_its_attempt(store: Store) -> None:
    loaded(store, 1)
    (c,) = store.claim("a", 1, now=NOW, lease_s=60)
    retry = Attempt(c, "pending", 1, None, "connection", NOW + 10)
    assert store.record([retry], now=NOW) == [True]
    assert store.batch("batch_a").in_flight == 0
    assert store.claim("a", 1, now=NOW + 5, lease_s=60) == []
    (again,) = store.claim("a", 1, now=NOW + 10, lease_s=60)
    assert again.attempts == 1 and again.token != c.token
    assert store.record([ok(again, attempts=2)], now=NOW + 11) == [True]


def test_release_owner_gives_back_what_a_dead_runner_held(store: Store) -> None:
    loaded(store, 5)
    store.claim("dead", 3, now=NOW, lease_s=600)
    store.claim("alive", 1, now=NOW, lease_s=600)
    assert store.release_owner("dead") == 3
    assert store.batch("batch_a").in_flight == 1
    assert [c.line for c in store.claim("dead", 10, now=NOW + 1, lease_s=600)] == [1, 2, 3, 5]


def test_at_start_the_embedded_store_frees_every_claim_and_a_shared_one_only_its_own(
    store: Store,
) -> None:
    """SQLite is held by one service alone (its lock file): whatever is in flight at its
    start was claimed by a dead process, whatever name it had (an owner file lost or
    rewritten), and is sent again at once. A shared PostgreSQL store's other claimants may
    be alive on other hosts: theirs wait for their lease."""
    loaded(store, 5)
    store.claim("an-old-name", 2, now=NOW, lease_s=600)
    store.claim("me", 1, now=NOW, lease_s=600)
    released = store.release_at_start("me")
    if store.sole_claimant:
        assert released == 3 and store.batch("batch_a").in_flight == 0
        assert [c.line for c in store.claim("me", 10, now=NOW + 1, lease_s=600)] == [1, 2, 3, 4, 5]
    else:
        assert released == 1 and store.batch("batch_a").in_flight == 2
        assert [c.line for c in store.claim("me", 10, now=NOW + 1, lease_s=600)] == [3, 4, 5]


def test_only_the_embedded_store_is_its_sole_claimant(opener: Opener) -> None:
    store = opener()
    assert store.sole_claimant is isinstance(store, SqliteStore)


def test_completion_gives_output_and_error_files_each_custom_id_once(store: Store) -> None:
    loaded(store, 4)
    cs = store.claim("a", 4, now=NOW, lease_s=60)
    bad = Attempt(
        cs[3], "failed", 1, Result(400, "x", '{"error":{"message":"no"}}', "http_400", "no")
    )
    store.record([ok(c) for c in cs[:3]] + [bad], now=NOW)
    assert store.set_status("batch_a", BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING, now=NOW)
    assert not store.set_status("batch_a", BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING, now=NOW)
    assert store.set_status("batch_a", BatchStatus.FINALIZING, BatchStatus.COMPLETED, now=NOW + 1)
    b = store.batch("batch_a")
    assert b.status is BatchStatus.COMPLETED and b.output_file_id and b.error_file_id
    out = [json.loads(x) for x in store.result_lines("batch_a", "output")]
    err = [json.loads(x) for x in store.result_lines("batch_a", "error")]
    assert [o["custom_id"] for o in out] == ["r0", "r1", "r2"]
    assert out[0]["response"]["status_code"] == 200 and out[0]["error"] is None
    assert out[0]["response"]["body"]["answer"] == "r0"
    assert [(e["custom_id"], e["error"]["code"]) for e in err] == [("r3", "http_400")]
    assert store.file(b.output_file_id).bytes == sum(
        len(x) for x in store.result_lines("batch_a", "output")
    )
    assert store.file(b.output_file_id).kind == "output"
    assert store.live_batches() == []


@pytest.mark.parametrize(
    ("end", "code"),
    [(BatchStatus.EXPIRED, "batch_expired"), (BatchStatus.CANCELLED, "batch_cancelled")],
)
def test_an_ended_batch_keeps_its_results_and_names_the_rest(
    store: Store, end: BatchStatus, code: str
) -> None:
    loaded(store, 5)
    cs = store.claim("a", 3, now=NOW, lease_s=60)
    store.record([ok(cs[0]), ok(cs[1])], now=NOW)
    old = BatchStatus.IN_PROGRESS
    if end is BatchStatus.CANCELLED:
        assert store.set_status("batch_a", old, BatchStatus.CANCELLING, now=NOW)
        old = BatchStatus.CANCELLING
        assert store.claim("a", 10, now=NOW, lease_s=60) == []  # nothing new is sent
    assert store.set_status("batch_a", old, end, now=NOW + 1)
    b = store.batch("batch_a")
    assert (b.completed, b.failed, b.in_flight) == (2, 3, 0)
    out = [json.loads(x)["custom_id"] for x in store.result_lines("batch_a", "output")]
    err = [json.loads(x) for x in store.result_lines("batch_a", "error")]
    assert out == ["r0", "r1"]
    assert [e["custom_id"] for e in err] == ["r2", "r3", "r4"]
    assert {e["error"]["code"] for e in err} == {code}
    # the answer of the request that was in flight comes too late to count
    assert store.record([ok(cs[2])], now=NOW + 2) == [False]


def test_batches_list_newest_first_with_after_and_limit(store: Store) -> None:
    for i in range(5):
        new_batch(store, f"batch_{i}", created=NOW + i)
    assert [b.id for b in store.batches(limit=2)] == ["batch_4", "batch_3"]
    assert [b.id for b in store.batches(after="batch_3", limit=10)] == [
        "batch_2",
        "batch_1",
        "batch_0",
    ]
    with pytest.raises(NotFound):
        store.batches(after="batch_nope")


def test_older_batches_are_claimed_first(store: Store) -> None:
    loaded(store, 2, "batch_new", created=NOW + 10)
    loaded(store, 2, "batch_old", created=NOW)
    assert [c.batch_id for c in store.claim("a", 3, now=NOW + 20, lease_s=60)] == [
        "batch_old",
        "batch_old",
        "batch_new",
    ]


def test_two_connections_claiming_at_once_never_take_one_request_twice(opener: Opener) -> None:
    first = opener()
    loaded(first, 600)
    stores = [first, opener(), opener()]
    taken: list[list[Claimed]] = [[] for _ in stores]

    def work(i: int) -> None:
        while True:
            got = stores[i].claim(f"host{i}", 7, now=NOW, lease_s=600)
            if not got:
                return
            taken[i].extend(got)
            stores[i].record([ok(c) for c in got], now=NOW)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    lines_taken = [c.line for got in taken for c in got]
    assert sorted(lines_taken) == list(range(1, 601))
    b = first.batch("batch_a")
    assert (b.completed, b.in_flight) == (600, 0)


def test_problems_are_openai_error_objects() -> None:
    p = Problem(3, "url", "must be the batch's endpoint")
    assert p.to_dict() == {
        "code": "invalid_request",
        "message": "must be the batch's endpoint",
        "param": "url",
        "line": 3,
    }


def test_a_load_cut_short_leaves_nothing_claimable_and_the_next_load_starts_clean(
    store: Store,
) -> None:
    new_batch(store)

    def dies_midway() -> Iterator[Request]:
        yield from lines(2500)
        raise KeyboardInterrupt  # the process killed while validating

    with pytest.raises(KeyboardInterrupt):
        store.load("batch_a", dies_midway(), now=NOW)
    b = store.batch("batch_a")
    assert b.status is BatchStatus.VALIDATING and b.total == 0
    assert store.claim("a", 10, now=NOW, lease_s=60) == []  # its rows count for nothing
    assert store.load("batch_a", lines(3000), now=NOW) == []
    b = store.batch("batch_a")
    assert (b.status, b.total) == (BatchStatus.IN_PROGRESS, 3000)
    assert len(store.claim("a", 5000, now=NOW, lease_s=60)) == 3000


def test_a_batch_cancelled_while_it_loads_keeps_no_request(opener: Opener) -> None:
    store, other = opener(), opener()
    new_batch(store)

    def cancelled_midway() -> Iterator[Request]:
        yield from lines(1500)
        assert other.set_status("batch_a", BatchStatus.VALIDATING, BatchStatus.CANCELLING, now=NOW)
        yield from lines(10, prefix="late", first=1501)

    assert store.load("batch_a", cancelled_midway(), now=NOW) == []
    b = store.batch("batch_a")
    assert (b.status, b.total) == (BatchStatus.CANCELLING, 0)
    assert store.set_status("batch_a", BatchStatus.CANCELLING, BatchStatus.CANCELLED, now=NOW)
    b = store.batch("batch_a")
    assert (b.completed, b.failed) == (0, 0)
    assert list(store.result_lines("batch_a", "error")) == []


def test_a_load_of_a_batch_not_validating_does_nothing(store: Store) -> None:
    loaded(store, 3)
    assert store.load("batch_a", lines(5), now=NOW) == []
    assert store.batch("batch_a").total == 3


def _vm_steps(store: SqliteStore, fn: Callable[[], object]) -> int:
    """SQLite's virtual-machine steps (in hundreds) that `fn` costs: the work a query
    does, counted, not timed."""
    steps = [0]

    def tick() -> int:
        steps[0] += 1
        return 0

    store._conn.set_progress_handler(tick, 100)
    try:
        fn()
    finally:
        store._conn.set_progress_handler(None, 0)
    return steps[0]


def test_a_claims_work_does_not_grow_with_the_requests_already_done(tmp_path: Path) -> None:
    """A claim reads the pending requests it takes, not every finished one before them:
    one that walked the batch from its first line cost O(done) each, O(n^2) a batch
    (20,000 requests: the last claims hundreds of times dearer than the first)."""
    store = SqliteStore(str(tmp_path / "batch.db"))
    loaded(store, 20_010)

    def claim_and_record(n: int) -> None:
        cs = store.claim("a", n, now=NOW, lease_s=60)
        assert len(cs) == n
        assert store.record([ok(c) for c in cs], now=NOW) == [True] * n

    first = _vm_steps(store, lambda: claim_and_record(10))
    for n in [1000] * 19 + [990]:
        claim_and_record(n)
    assert store.batch("batch_a").completed == 20_000
    late = _vm_steps(store, lambda: claim_and_record(10))  # the 20,000 before it done
    assert late <= 3 * first + 10, (first, late)


def test_an_exchange_records_the_answers_and_claims_again_in_one_step(store: Store) -> None:
    loaded(store, 10)
    first = store.claim("a", 4, now=NOW, lease_s=60)
    taken_over = store.claim("b", 1, now=NOW + 61, lease_s=60)  # a's line 1, lease passed
    assert [c.line for c in taken_over] == [1]
    done, again = store.exchange([ok(c) for c in first], "a", 3, now=NOW + 62, lease_s=60)
    assert done == [False, True, True, True]  # line 1 is b's now
    assert [c.line for c in again] == [5, 6, 7]
    b = store.batch("batch_a")
    assert (b.completed, b.in_flight) == (3, 4)
    assert store.exchange([], "a", 0, now=NOW + 63, lease_s=60) == ([], [])
    done, rest = store.exchange([ok(c) for c in again], "a", 100, now=NOW + 64, lease_s=60)
    assert done == [True] * 3 and [c.line for c in rest] == [8, 9, 10]
    assert store.batch("batch_a").completed == 6
