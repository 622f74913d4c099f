"""The batch service through a real smg (SGLang's gateway, 1.13, from .venv) with its priority
scheduler on: every request goes in at the `bulk` class (the runner's `x-smg-priority`
header, counted by smg's own `smg_scheduler_admit_total{class}`), and a worker killed
mid-run behind the gateway costs no result."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from batchsvc import API_KEY, BatchService, Sims, chat_lines, jsonl, wait_until, write_config
from farmproc import free_port_block
from smgproc import Smg, key_file

pytestmark = pytest.mark.slow


def scheduler_samples(metrics_url: str) -> dict[str, float]:
    text = httpx.get(metrics_url, timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("smg_scheduler_admit_total", "smg_scheduler_unknown_priority")):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[tuple[Smg, Sims, str]]:
    with Sims(2, env={"SGLANG_SIM_TOKEN_SECONDS": "0.01"}) as sims:
        port = free_port_block(2)
        with Smg(tmp_path, key_file(tmp_path), port, extra=["--priority-scheduler-enabled"]) as smg:
            for i in range(2):
                r = httpx.post(
                    f"{smg.url}/workers",
                    json={"url": sims.url(i)},
                    headers={"Authorization": f"Bearer {smg.key}"},
                    timeout=30,
                )
                assert r.status_code == 202, r.text
            wait_until(lambda: len(smg.routed()) == 2, 60, "both workers routed")
            yield smg, sims, f"http://127.0.0.1:{port + 1}/metrics"


def test_a_batch_through_smg_goes_in_at_the_bulk_class_and_survives_a_dead_worker(
    tmp_path: Path, gateway: tuple[Smg, Sims, str]
) -> None:
    smg, sims, metrics_url = gateway
    n = 200
    before = scheduler_samples(metrics_url)
    cfg = write_config(
        tmp_path,
        workers=2,
        base_port=sims.base,
        max_running=8,
        gateway={"mode": "external", "url": smg.url},
    )
    with BatchService(cfg) as svc:
        c = openai.OpenAI(base_url=svc.url + "/v1", api_key=API_KEY, max_retries=0)
        f = c.files.create(file=("p.jsonl", jsonl(chat_lines(n, max_tokens=8))), purpose="batch")
        b = c.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )

        def completed() -> int:
            rc = c.batches.retrieve(b.id).request_counts
            return rc.completed if rc is not None else 0

        wait_until(lambda: completed() >= 40, 120, "40 done")
        sims.kill(1)  # its requests in flight are cut; smg routes the rest to worker 0
        deadline = time.monotonic() + 180
        while (done := c.batches.retrieve(b.id)).status != "completed":
            assert time.monotonic() < deadline, done
            time.sleep(0.1)
        assert done.output_file_id is not None
        out = [
            json.loads(x)["custom_id"]
            for x in c.files.content(done.output_file_id).text.splitlines()
        ]
        assert sorted(out) == sorted(f"req-{i}" for i in range(n))
    after = scheduler_samples(metrics_url)
    bulk = 'smg_scheduler_admit_total{class="bulk",outcome="admitted"}'
    assert after.get(bulk, 0) - before.get(bulk, 0) >= n
    # nothing the batch sent was read as another class, nor as an unknown priority
    default = 'smg_scheduler_admit_total{class="default",outcome="admitted"}'
    assert after.get(default, 0) == before.get(default, 0)
    assert not any(k.startswith("smg_scheduler_unknown_priority") for k in after)


def retries(svc: BatchService, reason: str) -> float:
    for line in svc.metrics().splitlines():
        if line.startswith(f'sglang_farm_batch_retries_total{{reason="{reason}"}} '):
            return float(line.split()[1])
    return 0.0


def test_a_gateway_with_no_worker_routable_holds_the_batch_and_fails_no_request(
    tmp_path: Path,
) -> None:
    """smg with no worker to route to (all drained, or restarting in a wave) answers 404
    "No worker available for model ..."; that is the farm's moment, not the request's
    fault: retried, and the batch completes once a worker is back."""
    n = 20
    with Sims(1) as sims:
        port = free_port_block(2)
        with Smg(tmp_path, key_file(tmp_path), port) as smg:
            cfg = write_config(
                tmp_path,
                workers=1,
                base_port=sims.base,
                gateway={"mode": "external", "url": smg.url},
                batch={"max_attempts": 1000, "retry_backoff_s": 0.2},
            )
            with BatchService(cfg) as svc:
                c = openai.OpenAI(base_url=svc.url + "/v1", api_key=API_KEY, max_retries=0)
                f = c.files.create(file=("p.jsonl", jsonl(chat_lines(n))), purpose="batch")
                b = c.batches.create(
                    input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
                )

                def failed() -> int:
                    rc = c.batches.retrieve(b.id).request_counts
                    return rc.failed if rc is not None else 0

                wait_until(
                    lambda: retries(svc, "unroutable") >= n or failed() > 0,
                    60,
                    "each request refused once, or a request failed",
                )
                held = c.batches.retrieve(b.id)
                assert held.status == "in_progress", held
                assert held.request_counts is not None and held.request_counts.failed == 0
                r = httpx.post(
                    f"{smg.url}/workers",
                    json={"url": sims.url(0)},
                    headers={"Authorization": f"Bearer {smg.key}"},
                    timeout=30,
                )
                assert r.status_code == 202, r.text
                deadline = time.monotonic() + 120
                while (done := c.batches.retrieve(b.id)).status != "completed":
                    assert time.monotonic() < deadline, done
                    time.sleep(0.1)
                assert done.output_file_id is not None and done.error_file_id is not None
                out = c.files.content(done.output_file_id).text.splitlines()
                assert sorted(json.loads(x)["custom_id"] for x in out) == sorted(
                    f"req-{i}" for i in range(n)
                )
                assert c.files.content(done.error_file_id).text == ""


def gauges(metrics_url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(metrics_url, timeout=10).text.splitlines():
        if line.startswith(("smg_scheduler_inflight", "smg_scheduler_queue_depth")):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_the_farms_admission_config_gives_bulk_every_slot_but_the_users_share(
    tmp_path: Path,
) -> None:
    """smg's built-in class defaults left a bulk batch about 2 of 16 slots (docs/batch.md);
    with the farm's config (`[gateway] priority_user_share = 0.125`: 2 of 16 held for the
    default class) bulk runs 14 at once, and a user's request sent meanwhile is admitted
    in the held slots, ahead of the bulk requests still queued."""
    n = 20
    env = {"SGLANG_SIM_TOKEN_SECONDS": "0.05"}
    with Sims(2, env=env, args=("--max-running-requests", "8")) as sims:
        port = free_port_block(2)
        launcher = ["--scheduler-user-share", "0.125", "--scheduler-user-slots", "2"]
        extra = ["--priority-scheduler-enabled"]
        with Smg(tmp_path, key_file(tmp_path), port, extra=extra, launcher=launcher) as smg:
            for i in range(2):
                r = httpx.post(
                    f"{smg.url}/workers",
                    json={"url": sims.url(i)},
                    headers={"Authorization": f"Bearer {smg.key}"},
                    timeout=30,
                )
                assert r.status_code == 202, r.text
            wait_until(lambda: len(smg.routed()) == 2, 60, "both workers routed")
            metrics_url = f"http://127.0.0.1:{port + 1}/metrics"
            finished: list[str] = []

            def send(name: str, priority: str | None, max_tokens: int) -> None:
                headers = {"x-smg-priority": priority} if priority else {}
                r = httpx.post(
                    f"{smg.url}/v1/chat/completions",
                    json={
                        "model": "sim/model",
                        "messages": [{"role": "user", "content": name}],
                        "max_tokens": max_tokens,
                    },
                    headers=headers,
                    timeout=120,
                )
                assert r.status_code == 200, r.text
                finished.append(name)

            bulk = [
                threading.Thread(target=send, args=(f"bulk-{i}", "bulk", 150)) for i in range(n)
            ]
            for t in bulk:
                t.start()
            # smg samples its gauges every 5 s; a request takes 7.5 s
            wait_until(
                lambda: gauges(metrics_url).get('smg_scheduler_inflight{class="bulk"}') == 14,
                30,
                "14 bulk requests in flight at once",
            )
            send("user", None, 8)
            for t in bulk:
                t.join(120)
            assert len(finished) == n + 1
            # the user's went in ahead of the 6 bulk requests waiting in smg's queue
            assert finished.index("user") < n - 6, finished
