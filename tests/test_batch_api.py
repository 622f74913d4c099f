"""The batch service's API through OpenAI's own Python client (`openai`), unchanged: the
service runs as its own process (`python -m sglang_farm.batch`) in front of simulator
workers (no agent: the runner falls back to the config's slots)."""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from batchsvc import API_KEY, BatchService, Sims, chat_lines, jsonl, write_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sims() -> Iterator[Sims]:
    with Sims(2) as s:
        yield s


@pytest.fixture(scope="module")
def svc(sims: Sims, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BatchService]:
    tmp = tmp_path_factory.mktemp("batch")
    with BatchService(write_config(tmp, workers=2, base_port=sims.base)) as s:
        yield s


@pytest.fixture
def client(svc: BatchService) -> openai.OpenAI:
    return openai.OpenAI(base_url=svc.url + "/v1", api_key=API_KEY, max_retries=0)


def wait_done(client: openai.OpenAI, batch_id: str, within: float = 120) -> openai.types.Batch:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        b = client.batches.retrieve(batch_id)
        if b.status in ("completed", "failed", "expired", "cancelled"):
            return b
        time.sleep(0.1)
    raise AssertionError(f"batch {batch_id} not done within {within} s: {b}")


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict[str, object]]:
    assert file_id is not None
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def test_a_batch_runs_to_the_end_through_the_openai_client(client: openai.OpenAI) -> None:
    f = client.files.create(file=("prompts.jsonl", jsonl(chat_lines(120))), purpose="batch")
    assert f.purpose == "batch" and f.filename == "prompts.jsonl" and f.bytes > 0
    assert client.files.retrieve(f.id).id == f.id
    assert f.id in [x.id for x in client.files.list()]
    b = client.batches.create(
        input_file_id=f.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "api-test"},
    )
    assert b.status in ("validating", "in_progress")
    assert b.metadata == {"job": "api-test"}
    done = wait_done(client, b.id)
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed) == (120, 120)
    assert done.request_counts.failed == 0
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    out = lines_of(client, done.output_file_id)
    assert sorted(str(o["custom_id"]) for o in out) == sorted(f"req-{i}" for i in range(120))
    first = out[0]
    response = first["response"]
    assert isinstance(response, dict) and response["status_code"] == 200
    assert response["body"]["object"] == "chat.completion"
    assert first["error"] is None and str(first["id"]).startswith("batch_req_")
    assert lines_of(client, done.error_file_id) == []
    # the input file is still there; deleted, it is gone
    assert client.files.content(f.id).content == jsonl(chat_lines(120))
    assert client.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)


def test_batches_list_pages_with_after_and_limit(client: openai.OpenAI) -> None:
    f = client.files.create(file=("p.jsonl", jsonl(chat_lines(2))), purpose="batch")
    ids = [
        client.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        ).id
        for _ in range(3)
    ]
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == ids[::-1][:2]
    assert page.has_more
    rest = client.batches.list(limit=2, after=ids[1])
    assert rest.data[0].id == ids[0]
    for bid in ids:
        assert wait_done(client, bid).status == "completed"


def test_a_malformed_file_is_refused_with_every_bad_line_named(client: openai.OpenAI) -> None:
    good = chat_lines(3)
    rows = [
        json.dumps(good[0]),
        "{broken",
        json.dumps({**good[1], "custom_id": good[0]["custom_id"]}),
        json.dumps({**good[2], "url": "/v1/completions"}),
    ]
    f = client.files.create(file=("bad.jsonl", "\n".join(rows).encode()), purpose="batch")
    b = client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = wait_done(client, b.id)
    assert done.status == "failed"
    assert done.errors is not None and done.errors.data is not None
    named = sorted((e.line, e.param) for e in done.errors.data)
    assert named == [(2, None), (3, "custom_id"), (4, "url")]
    assert all(e.message for e in done.errors.data)
    assert done.request_counts is not None and done.request_counts.total == 0
    assert done.output_file_id is None


def test_a_request_the_engine_refuses_is_an_error_line_and_the_rest_complete(
    client: openai.OpenAI,
) -> None:
    rows = chat_lines(20)
    rows[5]["body"]["max_tokens"] = -1  # the engine answers 400
    f = client.files.create(file=("p.jsonl", jsonl(rows)), purpose="batch")
    b = client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = wait_done(client, b.id)
    assert done.status == "completed"
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (19, 1)
    (err,) = lines_of(client, done.error_file_id)
    assert err["custom_id"] == "req-5"
    assert err["error"] == {"code": "http_400", "message": err["error"]["message"]}  # type: ignore[index]
    assert err["response"]["status_code"] == 400  # type: ignore[index]
    assert len(lines_of(client, done.output_file_id)) == 19


def test_without_the_key_every_route_is_401_but_metrics(svc: BatchService) -> None:
    bad = openai.OpenAI(base_url=svc.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.batches.list()
    with pytest.raises(openai.AuthenticationError):
        bad.files.create(file=("p.jsonl", b"{}"), purpose="batch")
    for path in ("/v1/files", "/v1/batches", "/v1/batches/batch_x"):
        assert httpx.get(svc.url + path, timeout=10).status_code == 401
    m = httpx.get(svc.url + "/metrics", timeout=10)
    assert m.status_code == 200 and "sglang_farm_batch_concurrency_target" in m.text


def test_bad_batch_requests_are_refused_with_the_fix(client: openai.OpenAI) -> None:
    f = client.files.create(file=("p.jsonl", jsonl(chat_lines(1))), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="endpoint must be one of"):
        client.batches.create(
            input_file_id=f.id,
            endpoint="/v1/embeddings",
            completion_window="24h",
        )
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(
            input_file_id=f.id,
            endpoint="/v1/chat/completions",
            completion_window="soon",  # type: ignore[arg-type]
        )
    with pytest.raises(openai.NotFoundError):
        client.batches.create(
            input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h"
        )
    with pytest.raises(openai.BadRequestError, match="purpose must be 'batch'"):
        client.files.create(file=("p.jsonl", b"{}"), purpose="assistants")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")


def test_files_are_the_services_alone_under_opaque_ids(
    client: openai.OpenAI, svc: BatchService
) -> None:
    f = client.files.create(file=("../../etc/passwd", jsonl(chat_lines(1))), purpose="batch")
    assert f.filename == "passwd"
    assert f.id.startswith("file-") and len(f.id) > 20 and "/" not in f.id
    state = svc.config.parent / "batch-state"
    files = state / "files"
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert stat.S_IMODE(files.stat().st_mode) == 0o700
    kept = files / f"{f.id}.jsonl"
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    assert stat.S_IMODE((state / "batch.db").stat().st_mode) == 0o600
    assert sorted(p.name for p in Path(files).iterdir() if p.name.endswith(".part")) == []
    assert not os.path.exists(state / "etc")


@pytest.fixture(scope="module")
def slow_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    """Simulators at 20 ms a token: a request of 25 tokens takes half a second."""
    tmp = tmp_path_factory.mktemp("slow")
    with Sims(1, env={"SGLANG_SIM_TOKEN_SECONDS": "0.02"}) as sims:
        cfg = write_config(tmp, workers=1, base_port=sims.base, max_running=2)
        with BatchService(cfg) as s:
            yield openai.OpenAI(base_url=s.url + "/v1", api_key=API_KEY, max_retries=0)


def test_a_cancelled_batch_keeps_its_results_and_names_the_rest(
    slow_client: openai.OpenAI,
) -> None:
    c = slow_client
    f = c.files.create(file=("p.jsonl", jsonl(chat_lines(40, max_tokens=25))), purpose="batch")
    b = c.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 60
    while (
        got := c.batches.retrieve(b.id)
    ).request_counts is None or got.request_counts.completed < 2:
        assert time.monotonic() < deadline, got
        time.sleep(0.05)
    cancelling = c.batches.cancel(b.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait_done(c, b.id)
    assert done.status == "cancelled" and done.cancelled_at
    counts = done.request_counts
    assert counts is not None and counts.completed >= 2 and counts.failed > 0
    assert counts.completed + counts.failed == 40
    out = lines_of(c, done.output_file_id)
    err = lines_of(c, done.error_file_id)
    assert len(out) == counts.completed
    assert {e["error"]["code"] for e in err} == {"batch_cancelled"}  # type: ignore[index]
    every = sorted(str(x["custom_id"]) for x in out + err)
    assert every == sorted(f"req-{i}" for i in range(40))
    # a second cancel answers the cancelled batch as it is
    assert c.batches.cancel(b.id).status == "cancelled"


def test_a_finished_batch_cannot_be_cancelled(slow_client: openai.OpenAI) -> None:
    c = slow_client
    f = c.files.create(file=("s.jsonl", jsonl(chat_lines(1, max_tokens=1))), purpose="batch")
    b = c.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert wait_done(c, b.id).status == "completed"
    with pytest.raises(openai.ConflictError, match="can be cancelled"):
        c.batches.cancel(b.id)


def test_a_batch_past_its_completion_window_expires_with_its_results(
    slow_client: openai.OpenAI,
) -> None:
    c = slow_client
    f = c.files.create(file=("p.jsonl", jsonl(chat_lines(60, max_tokens=25))), purpose="batch")
    b = c.batches.create(
        input_file_id=f.id,
        endpoint="/v1/chat/completions",
        completion_window="3s",  # type: ignore[arg-type]
    )
    done = wait_done(c, b.id)
    assert done.status == "expired" and done.expired_at
    counts = done.request_counts
    assert counts is not None and 0 < counts.completed < 60
    err = lines_of(c, done.error_file_id)
    assert {e["error"]["code"] for e in err} == {"batch_expired"}  # type: ignore[index]
    assert len(lines_of(c, done.output_file_id)) + len(err) == 60
