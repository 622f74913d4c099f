"""Issue 33's "done when", reduced: in the demo farm (8 simulator workers behind the real
smg, the batch service run by the agent with its embedded store), two batches of the
shipped example, one submitted with `farmctl batch submit` and one with the real `openai`
client's `client.batches.create`, each with one prompt over the context length, run
through a `kill -9` of a worker, of the batch service and of the agent (a new agent is
started on the same config, as systemd would), and a `farmctl restart all`, one after
the other while both batches are under way. Both complete with exactly one line per
custom_id: the over-long prompt's in the error file (the engine's 400, its message), every
other one in the output file.

Reduced from the demo's, and only this: 1,000 requests a batch instead of 10,000, each
worker at 2 running requests (`max_running_requests = 2`: the batches last through the
four faults on a shared machine), and a context length of 4,096 tokens so that the
over-long prompt is a 20,000-character line, not a 130,000-character one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import openai
import pytest

from batchfarm import REPO, DemoFarm, wait_for

pytestmark = pytest.mark.slow

COUNT = 1_000
CONTEXT = 4_096
LONG_ID = "prompt-too-long"


def example(path: Path, model: str) -> list[str]:
    """The shipped example (`scripts/batch_example.py`), one over-long prompt in its middle;
    the custom_ids it holds."""
    out = subprocess.run(
        [sys.executable, "scripts/batch_example.py", "--count", str(COUNT), "--model", model],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    long_line = {
        "custom_id": LONG_ID,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": model,
            "messages": [{"role": "user", "content": "word " * CONTEXT}],
            "max_tokens": 8,
        },
    }
    out.insert(COUNT // 2, json.dumps(long_line))
    path.write_text("\n".join(out) + "\n")
    return [json.loads(x)["custom_id"] for x in out]


def lines(c: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id is not None
    return [json.loads(x) for x in c.files.content(file_id).text.splitlines() if x.strip()]


def test_two_batches_complete_each_request_once_through_every_kill_and_a_restart_all(
    short_tmp: Path,
) -> None:
    demo = DemoFarm(
        short_tmp,
        env={"SGLANG_SIM_LOAD_SECONDS": "1", "SGLANG_SIM_TOKEN_SECONDS": "0.01"},
        sglang={"max_running_requests": 2, "context_length": CONTEXT},
    )
    with demo:
        demo.wait_serving(240)
        import tomllib

        model = tomllib.loads(demo.config.read_text())["sglang"]["model_path"]
        ids = example(short_tmp / "a.jsonl", model)
        example(short_tmp / "b.jsonl", model)
        total = 2 * len(ids)

        submit = demo.farmctl("batch", "submit", str(short_tmp / "a.jsonl"))
        assert submit.returncode == 0, submit.stdout + submit.stderr
        first = submit.stdout.split()[0]
        assert first.startswith("batch_"), submit.stdout
        c = openai.OpenAI(base_url=demo.batch_url + "/v1", api_key=demo.api_key, max_retries=3)
        with open(short_tmp / "b.jsonl", "rb") as fh:
            f = c.files.create(file=fh, purpose="batch")
        second = c.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        ).id

        def past(share: float) -> None:
            wait_for(
                f"{share:.0%} of both batches done",
                lambda: (demo.done() >= share * total, demo.done()),
                300,
            )

        def under_way() -> None:
            done = demo.done()
            assert done < total, f"the batches ended before the fault ({done} of {total})"

        past(0.05)
        under_way()
        subprocess.run(["kill", "-9", str(demo.worker_pid(5))], check=True)

        past(0.15)
        under_way()
        service = demo.service_pid()
        assert service is not None
        subprocess.run(["kill", "-9", str(service)], check=True)
        wait_for(
            "a new batch service",
            lambda: (demo.service_pid() not in (None, service), demo.service_pid()),
            120,
        )

        past(0.30)
        under_way()
        demo.kill_agent()
        before = demo.done()
        demo.start()
        demo.wait_serving(240)
        wait_for("progress after the agent's restart", lambda: (demo.done() > before, before), 120)

        past(0.45)
        under_way()
        restart = demo.farmctl("restart", "all", timeout=600)
        assert restart.returncode == 0, restart.stdout + restart.stderr

        for bid in (first, second):
            waited = demo.farmctl("batch", "wait", bid, "--timeout", "600", timeout=660)
            assert waited.returncode == 0, waited.stdout + waited.stderr
            assert "completed" in waited.stdout, waited.stdout

        for bid in (first, second):
            b = c.batches.retrieve(bid)
            assert b.status == "completed", b
            out, err = lines(c, b.output_file_id), lines(c, b.error_file_id)
            seen = Counter(x["custom_id"] for x in out + err)
            assert [k for k, v in seen.items() if v > 1] == []  # none twice
            assert sorted(seen) == sorted(ids)  # none lost
            assert [x["custom_id"] for x in err] == [LONG_ID]
            e = err[0]
            assert e["response"]["status_code"] == 400, e
            assert "longer than the model's context length" in e["error"]["message"], e
            assert all(x["response"]["status_code"] == 200 for x in out)
            assert b.request_counts is not None
            assert (b.request_counts.completed, b.request_counts.failed) == (COUNT, 1)

        # farmctl's own results command writes the same two files
        res = demo.farmctl("batch", "results", first, "-o", str(short_tmp / "results.jsonl"))
        assert res.returncode == 0, res.stdout + res.stderr
        got = (short_tmp / "results.jsonl").read_text().splitlines()
        assert len(got) == COUNT
        assert len((short_tmp / "results.errors.jsonl").read_text().splitlines()) == 1
