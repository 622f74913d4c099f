"""The README's batch walkthrough ("Run a batch job, and kill what runs it"), run as written.

The demo farm (etc/sglang-farm/demo.toml: 8 simulator workers behind the managed smg, the
batch service run by the agent with its embedded SQLite store) on ports and paths of this
test's own, never the demo's (another test owns those). Then the section's commands in
order, each comment's backquoted promise checked against what the command printed (`...`
matches anything): the example made and submitted, `batch wait` in the background, and
mid-run a `kill -9` of worker 5 and of the batch service; the wait rides it out and ends
completed, and the results hold every custom_id once.

What differs from the README, and only this: the config's path (a copy of demo.toml with
its own ports and folders) and the files under /tmp (this test's folder), and the size:
2,000 requests (`--count 2000`) instead of the README's 10,000, so the promises' 10,000
read 2,000. The README says so too.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from batchfarm import batch_service_pid
from farmproc import Farm, free_port_block, new_marker
from farmtoml import rewritten

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
SECTION = "### Run a batch job, and kill what runs it"
DEMO = "etc/sglang-farm/demo.toml"
COUNT = 2_000  # the README's 10,000, reduced (see the docstring)
WORKER_PID = "<worker 5's PID from status>"
BATCH_PID = "<the batch service's PID>"
BATCH_ID = "<the batch id>"
T = TypeVar("T")


@dataclass(frozen=True)
class Step:
    command: str
    promises: tuple[str, ...]  # the comment's `backquoted` parts


def section(readme: str) -> str:
    return re.split(r"\n##+ ", readme.split(SECTION, 1)[1], maxsplit=1)[0]


def section_blocks(readme: str) -> list[list[str]]:
    """The `sh` code blocks of the section (up to its next heading), as lines."""
    return [
        b.strip("\n").splitlines() for b in re.findall(r"```sh\n(.*?)```", section(readme), re.S)
    ]


def steps(lines: list[str]) -> list[Step]:
    """Commands and their promises: the `backquoted` parts of each command's comment."""
    out = []
    for line in lines:
        code, _, comment = line.partition("  # ")
        if code.strip():
            out.append(Step(code.strip(), tuple(re.findall(r"`([^`]+)`", comment))))
    return out


def promise_pattern(promise: str) -> re.Pattern[str]:
    return re.compile(".*".join(re.escape(part) for part in promise.split("...")), re.S)


def reduced(text: str) -> str:
    """The README's full size made this test's."""
    return text.replace("10,000", f"{COUNT:,}").replace("10000", str(COUNT))


def test_the_walkthrough_is_parsed_as_the_reader_reads_it() -> None:
    blocks = section_blocks((REPO / "README.md").read_text())
    assert len(blocks) == 3
    first, kills, last = (steps(b) for b in blocks)
    assert first[0].command == "python3 scripts/batch_example.py > /tmp/prompts.jsonl"
    assert [len(s.promises) for s in first] == [0, 1, 0]
    assert [s.command.split()[-1] for s in kills] == [WORKER_PID.split()[-1], "PID>"]
    assert [len(s.promises) for s in last] == [1, 1]
    assert reduced("`10000 lines, 10000 custom_ids`") == "`2000 lines, 2000 custom_ids`"


def wait_until(what: str, probe: Callable[[], tuple[bool, T]], timeout: float) -> T:
    """Poll `probe` until it holds (a give-up bound, never a timing assertion)."""
    deadline = time.monotonic() + timeout
    while True:
        ok, seen = probe()
        if ok:
            return seen
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s; last seen: {seen!r}")
        time.sleep(0.5)


class Walk:
    """The section's commands, as the reader types them, on this test's farm."""

    def __init__(self, tmp: Path, config: Path) -> None:
        self.tmp = tmp
        self.config = config

    def text(self, command: str) -> str:
        cmd = reduced(command).replace(DEMO, str(self.config))
        cmd = cmd.replace("/tmp/prompts.jsonl", str(self.tmp / "prompts.jsonl"))
        cmd = cmd.replace("/tmp/results.jsonl", str(self.tmp / "results.jsonl"))
        if cmd.startswith("python3 scripts/batch_example.py"):
            cmd = cmd.replace("batch_example.py", f"batch_example.py --count {COUNT}", 1)
        return cmd

    def run(self, command: str, timeout: float = 120) -> str:
        r = subprocess.run(
            ["bash", "-c", self.text(command)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert r.returncode == 0, f"{command}: exit {r.returncode}\n{r.stdout}\n{r.stderr}"
        return r.stdout + r.stderr

    def farmctl_json(self, *args: str) -> Any:
        r = subprocess.run(
            [str(REPO / ".venv/bin/farmctl"), "--config", str(self.config), "--json", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        return json.loads(r.stdout) if r.returncode == 0 else None


def check(walk: Walk, out: str, promises: tuple[str, ...], command: str) -> None:
    """Each promise, with the test's own size and paths, is in `out`."""
    for promise in promises:
        want = walk.text(promise)
        assert promise_pattern(want).search(out), f"{command!r} did not print `{want}`:\n{out}"


@pytest.fixture
def demo_copy(short_tmp: Path) -> Iterator[tuple[Path, Farm]]:
    """demo.toml with this test's own ports and folders, running as `./scripts/demo` runs it."""
    base = free_port_block(20)
    text = rewritten(
        (REPO / DEMO).read_text(),
        farm={"state_dir": f"{short_tmp}/state"},
        workers={"base_port": base, "nccl_base_port": base + 8},
        metrics={"listen": f"127.0.0.1:{base + 16}"},
        control={"socket": f"{short_tmp}/control.sock"},
        gateway={"listen": f"127.0.0.1:{base + 17}", "metrics_listen": f"127.0.0.1:{base + 18}"},
        batch={
            "listen": f"127.0.0.1:{base + 19}",
            "api_key_file": f"{short_tmp}/batch-api.key",
            "state_dir": f"{short_tmp}/batch",
        },
    )
    config = short_tmp / "demo.toml"
    config.write_text(text)
    farm = Farm(config, new_marker())
    try:
        yield config, farm
    finally:
        farm.stop(signal.SIGINT, timeout=60)


def test_the_readme_batch_walkthrough_as_written(
    short_tmp: Path, demo_copy: tuple[Path, Farm]
) -> None:
    config, farm = demo_copy
    walk = Walk(short_tmp, config)
    readme = (REPO / "README.md").read_text()
    first, kills, last = (steps(b) for b in section_blocks(readme))

    def ready() -> tuple[bool, Any]:
        st = walk.farmctl_json("status")
        n = sum(w["state"] == "ready" for w in st["workers"]) if st else 0
        answers = walk.farmctl_json("batch", "list") is not None
        return n == 8 and answers, (n, answers)

    wait_until("8/8 ready and the batch service answering", ready, 180)
    key = short_tmp / "batch-api.key"
    assert oct(key.stat().st_mode & 0o777) == "0o600"  # made by the agent at its start

    walk.run(first[0].command)  # the example
    assert len((short_tmp / "prompts.jsonl").read_text().splitlines()) == COUNT
    out = walk.run(first[1].command)  # submit
    check(walk, out, first[1].promises, first[1].command)
    batch_id = out.split()[0]
    assert batch_id.startswith("batch_")
    wait_cmd = walk.text(first[2].command.replace(BATCH_ID, batch_id))
    wait_log = short_tmp / "wait.log"
    with open(wait_log, "w") as log:
        waiting = subprocess.Popen(["bash", "-c", wait_cmd], cwd=REPO, stdout=log, stderr=log)
    try:
        # Mid-run: some results in, most still to do.
        def moving() -> tuple[bool, Any]:
            b = walk.farmctl_json("batch", "status", batch_id) or {}
            rc = b.get("request_counts") or {}
            return rc.get("completed", 0) >= COUNT // 20, rc

        wait_until("the batch under way", moving, 300)
        st = walk.farmctl_json("status")
        worker5 = next(w for w in st["workers"] if w["id"] == 5)
        service = batch_service_pid(config)
        assert service is not None
        b = walk.farmctl_json("batch", "status", batch_id)
        assert b["status"] == "in_progress" and b["request_counts"]["completed"] < COUNT, b
        walk.run(kills[0].command.replace(WORKER_PID, str(worker5["pid"])))
        walk.run(kills[1].command.replace(BATCH_PID, str(service)))
        code = waiting.wait(timeout=600)
    finally:
        if waiting.poll() is None:
            waiting.kill()
    waited = wait_log.read_text()
    assert code == 0, waited
    # The prose's promises about the wait's output, as the README has them.
    prose = section(readme).split("```", 4)[4]
    gap = ("the batch service ... does not answer; waiting", "answers again")
    done = "batch batch_... completed: 10,000 of 10,000 requests succeeded"
    for promise in (*gap, done):
        assert f"`{promise}`" in prose.replace("\n", " "), promise
    # The service is back within a fraction of a second: the wait says the gap only when
    # one of its polls fell in it, and then says it ended too.
    if promise_pattern(walk.text(gap[0])).search(waited):
        check(walk, waited, gap, first[2].command)
    check(walk, waited, (done,), first[2].command)
    # The killed service came back: the agent started it again, a new process.
    assert batch_service_pid(config) not in (None, service)
    assert len(farm.named("batch_service_started")) >= 2
    for s in last:
        out = walk.run(s.command.replace(BATCH_ID, batch_id))
        check(walk, out, s.promises, s.command)
    results = [json.loads(ln) for ln in (short_tmp / "results.jsonl").read_text().splitlines()]
    assert sorted(r["custom_id"] for r in results) == sorted(
        json.loads(ln)["custom_id"] for ln in (short_tmp / "prompts.jsonl").read_text().splitlines()
    )
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in results)
