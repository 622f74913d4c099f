"""End to end on a real farm: `sglang-farm run` (simulator workers, the managed smg gateway)
and the batch service reading the same farm.toml. The runner's concurrency follows the
agent's status over the control socket (a stopped worker's slots go, and come back), and a
batch finishes with each custom_id once through a `farmctl stop`, a worker's `kill -9`
and a `kill -9` of the batch service itself."""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from pathlib import Path

import openai
import pytest

from batchsvc import API_KEY, BatchService, chat_lines, jsonl, wait_until
from farmproc import farm_config, free_port_block, new_marker
from frontdoor_farm import gateway_section, running_farm

pytestmark = pytest.mark.slow

ADMIN_KEY = "batch-e2e-admin-key-0123456789"
MODEL = "sim/Qwen3.6-27B"  # farm_config's [sglang] model_path: the model smg routes


def target(svc: BatchService) -> float:
    for line in svc.metrics().splitlines():
        if line.startswith("sglang_farm_batch_concurrency_target "):
            return float(line.split()[1])
    raise AssertionError("no sglang_farm_batch_concurrency_target")


def test_a_batch_on_the_farm_follows_its_workers_and_survives_stops_and_kills(
    short_tmp: Path,
) -> None:
    key = short_tmp / "admin.key"
    key.write_text(ADMIN_KEY)
    key.chmod(0o600)
    api_key = short_tmp / "batch.key"
    api_key.write_text(API_KEY)
    api_key.chmod(0o600)
    port = free_port_block(2)
    marker = new_marker()
    config = farm_config(
        short_tmp,
        workers=4,
        parallel=4,
        marker=marker,
        extra=gateway_section("managed", port, key),
        sglang={"max_running_requests": 4},
        batch={
            "enabled": True,
            "listen": f"127.0.0.1:{free_port_block(1)}",
            "api_key_file": str(api_key),
            "state_dir": str(short_tmp / "batch"),
            "retry_backoff_s": 0.05,
        },
    )
    n = 400
    with running_farm(config, marker) as farm:
        wait_until(lambda: farm.farmctl("wait", "--timeout", "60").returncode == 0, 120, "ready")
        svc = BatchService(config)
        svc.start()
        try:
            wait_until(lambda: target(svc) == 16, 60, "4 ready workers x 4 slots")
            c = openai.OpenAI(base_url=svc.url + "/v1", api_key=API_KEY, max_retries=0)
            f = c.files.create(
                file=("p.jsonl", jsonl(chat_lines(n, max_tokens=10, model=MODEL))), purpose="batch"
            )
            bid = c.batches.create(
                input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
            ).id

            def completed() -> int:
                rc = c.batches.retrieve(bid).request_counts
                return rc.completed if rc is not None else 0

            wait_until(lambda: completed() >= 40, 120, "40 done")
            stop = farm.farmctl("stop", "1", timeout=120)
            assert stop.returncode == 0, stop.stderr
            wait_until(lambda: target(svc) == 12, 30, "worker 1's slots gone")
            status = json.loads(farm.farmctl("--json", "status").stdout)
            pid = next(w["pid"] for w in status["workers"] if w["id"] == 2)
            os.kill(pid, signal.SIGKILL)  # the farm restarts it; its requests are cut
            wait_until(lambda: completed() >= 150, 120, "150 done")
            svc.kill()  # the batch service itself, with requests in flight
            svc.start()
            assert farm.farmctl("start", "1", timeout=120).returncode == 0
            wait_until(lambda: target(svc) == 16, 60, "worker 1's slots back")
            deadline = time.monotonic() + 240
            while (b := c.batches.retrieve(bid)).status != "completed":
                assert time.monotonic() < deadline, b
                time.sleep(0.2)
            assert b.output_file_id is not None and b.error_file_id is not None
            out = [
                json.loads(x)["custom_id"]
                for x in c.files.content(b.output_file_id).text.splitlines()
            ]
            assert [k for k, v in Counter(out).items() if v > 1] == []
            assert sorted(out) == sorted(f"req-{i}" for i in range(n))
            assert c.files.content(b.error_file_id).text == ""
        finally:
            if svc.proc is not None:
                svc.kill()
