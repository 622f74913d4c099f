"""`farmctl batch` against the real batch service (`python -m sglang_farm.batch`) in front of
simulator workers (tests/batchsvc.py): what each command prints and exits with, as an
operator reads it (issue 33). One service for the module; each test its own batch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from batchsvc import API_KEY, BatchService, Sims, chat_lines, fake_front_door, jsonl, write_config
from sglang_farm.cli.batchctl import BatchExit

FARMCTL = [sys.executable, "-c", "from sglang_farm.cli.farmctl import main; main()"]

pytestmark = pytest.mark.slow


class Ctl:
    def __init__(self, config: Path) -> None:
        self.config = config

    def __call__(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*FARMCTL, "--config", str(self.config), "batch", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def json(self, *args: str) -> Any:
        r = self("--json", *args)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)


@pytest.fixture(scope="module")
def ctl(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ctl]:
    tmp = tmp_path_factory.mktemp("farmctl-batch")
    with Sims(2) as sims:
        config = write_config(tmp, workers=2, base_port=sims.base, batch={"concurrency": 8})
        with BatchService(config):
            yield Ctl(config)


def test_submit_wait_and_results_every_custom_id_once(ctl: Ctl, tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_bytes(jsonl(chat_lines(60)))
    r = ctl("submit", str(src), "--wait", "--timeout", "300")
    assert r.returncode == BatchExit.OK, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    bid = lines[0].split()[0]
    file_id = lines[0].split(" as ")[1].split(")")[0]
    assert lines[0] == (
        f"{bid} submitted: in_progress, 60 requests ({src} as {file_id}); "
        f"watch it: farmctl batch wait {bid}"
    )
    assert lines[-1] == (
        f"batch {bid} completed: 60 of 60 requests succeeded; fetch the results with: "
        f"farmctl batch results {bid} -o FILE"
    )
    # Not a terminal: plain lines, never a bar redrawn with carriage returns.
    assert "\r" not in r.stdout and "[#" not in r.stdout
    out = tmp_path / "out.jsonl"
    r = ctl("results", bid, "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert r.stdout == (
        f"batch {bid} (completed): 60 results in {out}; 0 failed requests in "
        f"{tmp_path / 'out.errors.jsonl'}\n"
    )
    ids = [json.loads(ln)["custom_id"] for ln in out.read_text().splitlines()]
    assert sorted(ids) == sorted(f"req-{i}" for i in range(60))
    assert not list(tmp_path.glob(".out.jsonl.partial-*"))  # written beside, renamed
    # status and list show it.
    st = ctl("status", bid)
    assert st.returncode == 0
    assert st.stdout.splitlines()[1] == "requests: 60/60 done (100.0 %) · 60 succeeded · 0 failed"
    listed = ctl("list")
    row = next(ln for ln in listed.stdout.splitlines() if ln.startswith(bid))
    assert row.split()[1:4] == ["completed", "60/60", "0"]
    assert ctl.json("status", bid)["id"] == bid
    # Cancelling what has ended is refused, with the service's reason.
    r = ctl("cancel", bid)
    assert r.returncode == BatchExit.FAILED and "(HTTP 409)" in r.stderr


def test_a_malformed_file_is_refused_with_every_bad_line_named(ctl: Ctl, tmp_path: Path) -> None:
    rows = chat_lines(3)
    src = tmp_path / "bad.jsonl"
    src.write_bytes(
        jsonl(rows[:1]) + b"{not json\n" + jsonl([{**rows[1], "custom_id": "req-0"}]) + b"\n"
    )
    r = ctl("submit", str(src))
    assert r.returncode == BatchExit.FAILED, r.stdout + r.stderr
    out = r.stdout.splitlines()
    assert out[0].endswith(f"refused: {src} has bad lines; nothing was sent")
    assert any(ln.startswith("  line 2") for ln in out), out
    assert any(ln.startswith("  line 3") and "custom_id" in ln for ln in out), out
    assert "failed validation, nothing was sent: line 2" in r.stderr
    assert r.stderr.endswith("; fix the file and submit it again\n")


def test_an_unknown_batch_and_a_wrong_key(ctl: Ctl, tmp_path: Path) -> None:
    r = ctl("status", "batch_nope")
    assert r.returncode == BatchExit.USAGE
    assert r.stderr.startswith("farmctl: no batch batch_nope at the batch service http://")
    assert r.stderr.endswith(": farmctl batch list lists them\n")
    for args in (
        ["wait", "batch_nope"],
        ["cancel", "batch_nope"],
        ["results", "batch_nope", "-o", "x"],
    ):
        assert ctl(*args).returncode == BatchExit.USAGE, args
    wrong = tmp_path / "farm.toml"
    key = tmp_path / "wrong.key"
    key.write_text("not-" + API_KEY + "\n")
    text = ctl.config.read_text().replace(str(ctl.config.parent / "batch.key"), str(key))
    wrong.write_text(text)
    r = Ctl(wrong)("list")
    assert r.returncode == BatchExit.FAILED
    assert f"refused the key in {key} (HTTP 401)" in r.stderr


@pytest.fixture
def held(tmp_path: Path) -> Iterator[tuple[Ctl, threading.Event]]:
    """A service whose front door holds every answer until the event is set."""
    release = threading.Event()

    def answer(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        release.wait(120)
        return 200, {
            "id": "x",
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }

    with fake_front_door(answer) as url:
        config = write_config(
            tmp_path,
            workers=1,
            base_port=1,
            gateway={"mode": "external", "url": url},
            batch={"concurrency": 2},
        )
        with BatchService(config):
            try:
                yield Ctl(config), release
            finally:
                release.set()


def test_wait_times_out_then_a_cancelled_batch_keeps_what_it_has(
    held: tuple[Ctl, threading.Event], tmp_path: Path
) -> None:
    ctl, release = held
    src = tmp_path / "in.jsonl"
    src.write_bytes(jsonl(chat_lines(20)))
    bid = ctl("submit", str(src)).stdout.split()[0]
    r = ctl("wait", bid, "--timeout", "2")
    assert r.returncode == BatchExit.TIMED_OUT, r.stdout + r.stderr
    assert r.stderr == (
        f"farmctl: batch {bid} is still in_progress after 2 s (0/20 done); it keeps running: "
        f"farmctl batch wait {bid}\n"
    )
    r = ctl("results", bid, "-o", str(tmp_path / "early.jsonl"))
    assert r.returncode == BatchExit.FAILED
    assert r.stderr == (
        f"farmctl: batch {bid} is in_progress: its files are written when it ends; "
        f"farmctl batch wait {bid}\n"
    )
    r = ctl("cancel", bid)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"batch {bid}: cancelling; what it has finished is kept")
    release.set()
    r = ctl("wait", bid, "--timeout", "120")
    assert r.returncode == BatchExit.NOT_COMPLETED, r.stdout + r.stderr
    assert r.stderr.startswith(f"farmctl: batch {bid} cancelled: ")
    assert r.stderr.endswith(f"the results it has: farmctl batch results {bid} -o FILE\n")
    # Cancelled again: it says so, and nothing changes.
    r = ctl("cancel", bid)
    assert r.returncode == 0 and r.stdout.startswith(f"batch {bid}: cancelled;"), r.stderr


@pytest.mark.skipif(shutil.which("script") is None, reason="script(1) (util-linux) not installed")
def test_on_a_terminal_wait_draws_a_bar_in_place(
    held: tuple[Ctl, threading.Event], tmp_path: Path
) -> None:
    ctl, release = held
    src = tmp_path / "in.jsonl"
    src.write_bytes(jsonl(chat_lines(10)))
    bid = ctl("submit", str(src)).stdout.split()[0]
    cmd = " ".join(
        [
            *FARMCTL[:2],
            repr(FARMCTL[2]),
            "--config",
            str(ctl.config),
            "batch",
            "wait",
            bid,
            "--timeout",
            "3",
        ]
    )
    # Bytes, not text: universal newlines would turn the carriage returns into newlines.
    r = subprocess.run(
        ["script", "-qec", cmd, "/dev/null"],
        capture_output=True,
        timeout=60,
        env={"COLUMNS": "100", "PATH": "/usr/bin:/bin", "TERM": "xterm"},
    )
    out = r.stdout.decode()
    assert r.returncode == BatchExit.TIMED_OUT, out
    assert f"batch {bid} (Ctrl-C stops watching; the batch keeps running):" in out
    drawn = [part for part in out.split("\r") if part.startswith("in_progress [")]
    assert len(drawn) >= 2, out  # redrawn in place, once a second
    assert "] 0/10 · 0 failed · " in drawn[-1] and drawn[-1].endswith("\x1b[K")
    assert len(drawn[-1]) - len("\x1b[K") <= 99  # the terminal's width, less one
    release.set()
