"""The batch service through crashes, end to end: `kill -9` of the service mid-run (and the
restart that resumes it), a worker killed mid-run, and two services sharing one PostgreSQL
store finishing one batch. Each time: every custom_id exactly once in the output."""

from __future__ import annotations

import functools
import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from batchsvc import (
    API_KEY,
    BatchService,
    Sims,
    chat_lines,
    fake_front_door,
    jsonl,
    wait_until,
    write_config,
)
from pgserver import PgServer, postgres

pytestmark = pytest.mark.slow


def client_of(svc: BatchService) -> openai.OpenAI:
    return openai.OpenAI(base_url=svc.url + "/v1", api_key=API_KEY, max_retries=0)


def counts(c: openai.OpenAI, bid: str) -> tuple[str, int, int]:
    b = c.batches.retrieve(bid)
    rc = b.request_counts
    assert rc is not None
    return b.status, rc.completed, rc.failed


def exactly_once(c: openai.OpenAI, bid: str, n: int) -> None:
    b = c.batches.retrieve(bid)
    assert b.status == "completed", b
    assert b.output_file_id is not None and b.error_file_id is not None
    out = [json.loads(x)["custom_id"] for x in c.files.content(b.output_file_id).text.splitlines()]
    err = c.files.content(b.error_file_id).text.splitlines()
    assert err == []
    dupes = [k for k, v in Counter(out).items() if v > 1]
    assert dupes == []
    assert sorted(out) == sorted(f"req-{i}" for i in range(n))


def at_least(c: openai.OpenAI, bid: str, n: int) -> bool:
    return counts(c, bid)[1] >= n


def submit(c: openai.OpenAI, rows: list[dict[str, Any]]) -> str:
    f = c.files.create(file=("p.jsonl", jsonl(rows)), purpose="batch")
    return c.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    ).id


def test_kill_9_of_the_service_mid_run_then_a_restart_finishes_each_request_once(
    tmp_path: Path,
) -> None:
    n = 400
    with Sims(2, env={"SGLANG_SIM_TOKEN_SECONDS": "0.01"}) as sims:
        svc = BatchService(write_config(tmp_path, workers=2, base_port=sims.base, max_running=8))
        svc.start()
        try:
            c = client_of(svc)
            bid = submit(c, chat_lines(n, max_tokens=8))
            for kill_at in (40, 160):
                done = functools.partial(at_least, c, bid, kill_at)
                wait_until(done, 120, f"{kill_at} done")
                svc.kill()  # with requests in flight
                svc.start()
                assert counts(c, bid)[0] == "in_progress"
            wait_until(lambda: counts(c, bid)[0] == "completed", 180, "the batch completes")
            exactly_once(c, bid, n)
            log = svc.log_path.read_text()
            assert log.count('"batch_resumed"') >= 1  # in-flight requests sent again
        finally:
            if svc.proc is not None:
                svc.kill()


def test_a_worker_killed_mid_run_costs_no_result(tmp_path: Path) -> None:
    n = 200
    with Sims(2, env={"SGLANG_SIM_TOKEN_SECONDS": "0.01"}) as sims:
        cfg = write_config(tmp_path, workers=2, base_port=sims.base, max_running=8)
        with BatchService(cfg) as svc:
            c = client_of(svc)
            bid = submit(c, chat_lines(n, max_tokens=8))
            wait_until(lambda: counts(c, bid)[1] >= 30, 120, "30 done")
            sims.kill(0)  # its requests in flight are cut
            wait_until(lambda: counts(c, bid)[1] >= 100, 120, "100 done on the other worker")
            sims.start(0)
            wait_until(lambda: counts(c, bid)[0] == "completed", 180, "the batch completes")
            exactly_once(c, bid, n)
            assert 'reason="connection"' in svc.metrics()


@pytest.fixture(scope="module")
def pg() -> Iterator[PgServer]:
    with postgres() as server:
        yield server


def test_two_services_sharing_one_postgresql_finish_one_batch_sending_each_request_once(
    tmp_path: Path, pg: PgServer
) -> None:
    n = 300
    seen: Counter[str] = Counter()
    lock = threading.Lock()

    def answer(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        cid = body["messages"][0]["content"].split()[-1]
        with lock:
            seen[cid] += 1
        time.sleep(0.02)
        return 200, {
            "id": f"chatcmpl-{cid}",
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        }

    rows = chat_lines(n)
    for r in rows:
        r["body"]["messages"][0]["content"] = f"q {r['custom_id']}"
    url = pg.new_database()
    with fake_front_door(answer) as door:
        door_port = int(door.rsplit(":", 1)[1])
        services = []
        for name in ("a", "b"):
            d = tmp_path / name
            d.mkdir()
            # [gateway] external at the fake front door: the runner sends there
            cfg = write_config(
                d,
                workers=1,
                base_port=door_port + 1 if door_port < 65000 else 20000,
                batch={"store": url, "concurrency": 8},
                gateway={"mode": "external", "url": door},
            )
            services.append(BatchService(cfg, name=name))
        for s in services:
            s.start()
        try:
            a, b = (client_of(s) for s in services)
            bid = submit(a, rows)
            wait_until(lambda: counts(b, bid)[0] == "completed", 180, "the batch completes")
            exactly_once(b, bid, n)
            assert sorted(seen) == sorted(f"req-{i}" for i in range(n))
            assert [k for k, v in seen.items() if v != 1] == []  # no request sent twice
            for s in services:  # both hosts did part of the work
                text = s.metrics()
                line = next(
                    x
                    for x in text.splitlines()
                    if x.startswith('sglang_farm_batch_tokens_total{kind="completion"}')
                )
                assert float(line.split()[-1]) > 0, (s.url, text)
        finally:
            for s in services:
                if s.proc is not None:
                    s.kill()
