"""The README's OOM walkthrough, run as written: every command, every promise in backquotes.

A new user who did the Quickstart first found its promises wrong (restart counts carried
over, a check that landed after the second OOM). This test follows the section
"Inject an OOM in the demo and watch the ladder step" line by line: the first block's
commands (the last one, the farm, in the background), then each command of the second
block with the outputs its comment promises (`...` in a promise matches anything), then
the prose's promise (the plain demo restarts worker 3 with the step in force) and the
third block, which undoes it. It runs the demo's real ports and paths, as the reader does.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sglang_farm.host.ports import port_problem

REPO = Path(__file__).resolve().parent.parent
SECTION = "### Inject an OOM in the demo and watch the ladder step"
QUICKSTART = "## Quickstart (simulated, any machine)"
DEMO_PORTS = [(30000, 8), (31000, 8), (8000, 1), (9840, 1), (29000, 1)]
PID_PLACEHOLDER = "<worker 3's PID from status>"
KILLED_PLACEHOLDER = "<worker 5's PID from status>"

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Step:
    command: str
    promises: tuple[str, ...]  # the comment's `backquoted` parts


def section_blocks(readme: str, section: str = SECTION) -> list[list[str]]:
    """The `sh` code blocks of a section (up to its next heading), as lines."""
    body = re.split(r"\n##+ ", readme.split(section, 1)[1], maxsplit=1)[0]
    return [b.strip("\n").splitlines() for b in re.findall(r"```sh\n(.*?)```", body, re.S)]


def steps(lines: list[str]) -> list[Step]:
    """Commands and their promises; a line that is only a comment continues the last one's
    promises, and a line ending in a backslash continues into the next."""
    out: list[tuple[str, list[str]]] = []
    joining = False
    for line in lines:
        code, _, comment = line.partition("  # ")
        if line.lstrip().startswith("#"):
            code, comment = "", line.lstrip()[1:]
        promises = re.findall(r"`([^`]+)`", comment)
        if joining:
            out[-1] = (out[-1][0][:-1] + " " + code.strip(), out[-1][1] + promises)
        elif code.strip():
            out.append((code.strip(), promises))
        else:
            out[-1][1].extend(promises)
        joining = out[-1][0].endswith("\\")
    return [Step(c, tuple(p)) for c, p in out]


def promise_pattern(promise: str) -> re.Pattern[str]:
    return re.compile(".*".join(re.escape(part) for part in promise.split("...")))


def test_the_walkthrough_is_parsed_as_the_reader_reads_it() -> None:
    blocks = section_blocks((REPO / "README.md").read_text())
    assert len(blocks) == 3
    assert steps(blocks[0])[-1].command.startswith(".venv/bin/sglang-farm run")
    checks = steps(blocks[1])
    assert [len(s.promises) for s in checks] == [1, 2, 1, 2]
    assert promise_pattern('a{...x="1"...} 1.0').search('a{w="3",x="1",y="2"} 1.0')


def sh(command: str, timeout: float = 30) -> str:
    r = subprocess.run(
        ["bash", "-c", command], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )
    assert r.returncode == 0, f"{command}: exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout


def status(config: str) -> dict[int, dict[str, object]]:
    r = subprocess.run(
        [str(REPO / ".venv/bin/farmctl"), "--config", config, "--json", "status"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if r.returncode != 0:
        return {}
    return {int(w["id"]): w for w in json.loads(r.stdout)["workers"]}


def wait_for_worker(
    config: str,
    worker: int,
    what: str,
    ok: Callable[[dict[str, object]], bool],
    timeout: float = 240,
) -> dict[str, object]:
    """A worker's status once `ok(worker)` holds (the farm's own pace; no timing asserted)."""
    deadline = time.monotonic() + timeout
    w: dict[str, object] = {}
    while time.monotonic() < deadline:
        w = status(config).get(worker, {})
        if w and ok(w):
            return w
        time.sleep(1)
    raise AssertionError(f"worker {worker} never {what} within {timeout}s; last: {w}")


def wait_for(
    config: str, what: str, ok: Callable[[dict[str, object]], bool], timeout: float = 240
) -> dict[str, object]:
    """Worker 3's status once `ok(worker)` holds."""
    return wait_for_worker(config, 3, what, ok, timeout)


def args_of(pid: object) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


class Farm:
    """A farm started from a README command line, in its own session; stopped with Ctrl-C."""

    def __init__(self, command: str, log: Path) -> None:
        self.log = log
        with log.open("w") as out:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                shlex.split(command),
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)  # what Ctrl-C sends
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired as e:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
                log = self.log.read_text()
                raise AssertionError(f"Ctrl-C did not stop the farm:\n{log}") from e


# The paths the walkthroughs write, as the reader's commands name them (issue 32, 4.6).
DEMO_PATHS = ("/tmp/sglang-farm-demo/state", "/tmp/oom-demo.toml")
CANARY_PATHS = ("/tmp/canary-demo", "/tmp/canary-demo.toml")


@contextlib.contextmanager
def kept(paths: tuple[str, ...]) -> Iterator[None]:
    """Whatever is at `paths` before the walkthrough is there after it, as it was: moved
    aside next to itself (never into the run's TMPDIR, which the run removes) and put
    back; what the walkthrough made there is removed (issue 32, 4.6: the suite deleted
    a reader's own /tmp/oom-demo.toml, /tmp/canary-demo.toml and /tmp/canary-demo/)."""
    aside: dict[str, str] = {}
    try:
        for p in paths:
            if os.path.lexists(p):
                aside[p] = tempfile.mkdtemp(
                    prefix=Path(p).name + ".kept-by-test.", dir=Path(p).parent
                )
                os.rename(p, os.path.join(aside[p], "kept"))
        yield
    finally:
        for p in paths:
            subprocess.run(["rm", "-rf", "--", p], check=True)
            if p in aside:
                os.rename(os.path.join(aside[p], "kept"), p)
                os.rmdir(aside[p])


@pytest.fixture
def clean_demo_paths() -> Iterator[None]:
    for base, n in DEMO_PORTS:
        for port in range(base, base + n):
            problem = port_problem("127.0.0.1", port)  # the farm's own test (TIME_WAIT is fine)
            assert problem is None, f"{problem}: is a demo running? Stop it first"
    with kept(DEMO_PATHS):
        yield


# ---- what the agent says while the reader follows (issue 31) -------------------------------

# A line `--log-format console` writes at warning or above: "HH:MM:SS  LEVEL  event  worker N".
HUMAN_ALARM = re.compile(r"^\d\d:\d\d:\d\d  (WARNING|ERROR|CRITICAL)  (\S+)(?:  worker (\d+))?")


def alarms(log: str) -> list[dict[str, object]]:
    """The agent's warning- and error-level lines in `log` (JSON lines, or a person's
    lines as ./scripts/demo writes them), each as {level, event, worker, line}."""
    out: list[dict[str, object]] = []
    for line in log.splitlines():
        if line.startswith("{"):
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if isinstance(e, dict) and e.get("level") in ("warning", "error", "critical"):
                out.append(
                    {
                        "level": e["level"],
                        "event": e.get("event"),
                        "worker": e.get("worker"),
                        "line": line,
                    }
                )
        elif m := HUMAN_ALARM.match(line):
            worker = int(m[3]) if m[3] else None
            out.append({"level": m[1].lower(), "event": m[2], "worker": worker, "line": line})
    return out


def assert_no_alarm_but(log: Path, caused: Callable[[dict[str, object]], bool], what: str) -> None:
    """No warning or error in the agent's output but those the walkthrough causes."""
    stray = [a["line"] for a in alarms(log.read_text()) if not caused(a)]
    assert not stray, f"{what}: warning- or error-level lines nobody caused:\n" + "\n".join(
        map(str, stray)
    )


def about(*workers: int) -> Callable[[dict[str, object]], bool]:
    return lambda a: a["worker"] in workers


SCREEN_LINES, SCREEN_COLUMNS = 40, 160


def assert_start_fits_a_screen(log: Path) -> None:
    """The demo's output up to the line that says `8/8 ready` fits on one screen (issue 31:
    ~75 JSON lines, each launch its whole command line)."""
    lines = log.read_text().splitlines()
    ready = next((i for i, ln in enumerate(lines) if "8/8 ready" in ln), None)
    assert ready is not None, "\n".join(lines)
    screen = lines[: ready + 1]
    assert len(screen) <= SCREEN_LINES, f"{len(screen)} lines up to 8/8 ready:\n" + "\n".join(
        screen
    )
    wide = [ln for ln in screen if len(ln) > SCREEN_COLUMNS]
    assert not wide, f"lines over {SCREEN_COLUMNS} characters:\n" + "\n".join(wide)


def wait_for_log(log: Path, text: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        assert time.monotonic() < deadline, f"no {text!r} within {timeout}s:\n{log.read_text()}"
        time.sleep(0.5)


def ready_and_restarted(w: dict[str, object]) -> bool:
    return w.get("state") == "ready" and int(str(w.get("restarts_total") or 0)) >= 1


def test_the_oom_walkthrough_does_what_the_readme_says(
    clean_demo_paths: None, tmp_path: Path
) -> None:
    first, checks, undo = (steps(b) for b in section_blocks((REPO / "README.md").read_text()))
    for step in first[:-1]:
        sh(step.command)
    copy = Farm(first[-1].command, tmp_path / "copy.log")
    try:
        # "about 50 s later": once worker 3 serves again after its first OOM.
        w3 = wait_for("/tmp/oom-demo.toml", "restarted after an OOM", ready_and_restarted)
        for step in checks:
            out = sh(step.command.replace(PID_PLACEHOLDER, str(w3["pid"])))
            for promise in step.promises:
                found = promise_pattern(promise).search(out)
                assert found, f"{step.command}: no {promise!r}:\n{out}"
        row = next(ln for ln in sh(checks[0].command).splitlines() if ln.split()[:1] == ["3"])
        assert "1 (oom 1)" in row
    finally:
        copy.stop()
    assert_no_alarm_but(copy.log, about(3), "the OOM copy (its worker 3 runs out of memory)")

    demo = Farm("./scripts/demo", tmp_path / "demo.log")
    try:
        # "worker 3 still starts with --mem-fraction-static 0.8"
        w3 = wait_for("etc/sglang-farm/demo.toml", "ready", lambda w: w.get("state") == "ready")
        assert "--mem-fraction-static 0.8" in args_of(w3["pid"])
        old_pid = w3["pid"]
        for step in undo:
            sh(step.command, timeout=120)
        w3 = wait_for(
            "etc/sglang-farm/demo.toml",
            "restarted",
            lambda w: w.get("state") == "ready" and w.get("pid") != old_pid,
        )
        assert "--mem-fraction-static" not in args_of(w3["pid"])
    finally:
        demo.stop()
    # The step in force is said (worker 3's flag, lowered); and the copy shares the demo's
    # state folder, so the plain demo's own file is a change the copy never accepted
    # (`canary_change_pending`: rolled canary first). Nothing else is alarming.
    assert_no_alarm_but(
        demo.log,
        lambda a: about(3)(a) or a["event"] == "canary_change_pending",
        "the plain demo after the OOM walkthrough",
    )


def test_the_quickstart_parses_as_the_reader_reads_it() -> None:
    (block,) = section_blocks((REPO / "README.md").read_text(), QUICKSTART)
    commands = steps(block)
    assert commands[0].command.startswith("curl -s 127.0.0.1:8000/v1/chat/completions -H")
    assert commands[0].command.endswith("}]}'") and commands[0].promises == ('"choices"',)
    assert [len(s.promises) for s in commands] == [1, 1, 0, 1, 2, 1]


def came_back_from(killed: object) -> Callable[[dict[str, object]], bool]:
    """A worker serving again from a new process, after `killed`."""
    return lambda w: w.get("state") == "ready" and w.get("pid") not in (None, killed)


def test_the_quickstart_does_what_the_readme_says(clean_demo_paths: None, tmp_path: Path) -> None:
    (block,) = section_blocks((REPO / "README.md").read_text(), QUICKSTART)
    config = "etc/sglang-farm/demo.toml"
    demo = Farm("./scripts/demo", tmp_path / "demo.log")
    try:
        for i in range(8):  # the front door routes to every worker
            wait_for_worker(
                config,
                i,
                "ready and routed",
                lambda w: w.get("state") == "ready" and bool(w.get("in_gateway")),
            )
        for step in steps(block):
            victim = status(config).get(5, {}).get("pid")
            out = sh(step.command.replace(KILLED_PLACEHOLDER, str(victim)), timeout=120)
            for promise in step.promises:
                found = promise_pattern(promise).search(out)
                assert found, f"{step.command}: no {promise!r}:\n{out}"
            if step.command.startswith("kill -9"):
                # "...and watch it come back"
                wait_for_worker(config, 5, "back", came_back_from(victim))
        wait_for_log(demo.log, "8/8 ready")  # said once the gateway routes all eight
    finally:
        demo.stop()
    assert_start_fits_a_screen(demo.log)
    # The kill -9 of worker 5 is the one thing the reader did that warns.
    assert_no_alarm_but(demo.log, about(5), "the Quickstart")


# ---- "Make a bad change and watch it rolled back" (issue 23) ---------------------------------

CANARY_SECTION = "### Make a bad change and watch it rolled back"
CANARY_CONFIG = "/tmp/canary-demo.toml"


def test_the_canary_walkthrough_is_parsed_as_the_reader_reads_it() -> None:
    first, change, after = (
        steps(b) for b in section_blocks((REPO / "README.md").read_text(), CANARY_SECTION)
    )
    assert first[0].command == "rm -rf /tmp/canary-demo"
    assert first[-1].command.startswith(".venv/bin/sglang-farm run --config " + CANARY_CONFIG)
    assert change[0].command.startswith("shuf ") and change[0].command.endswith("' &")
    assert '"max_tokens": 16' in change[0].command  # joined over its backslash
    assert [len(s.promises) for s in change] == [0, 0, 4]
    assert [len(s.promises) for s in after] == [1, 2, 2, 1]


def sh_all(command: str, timeout: float = 30) -> str:
    """`command`'s output as the reader's terminal shows it (stdout and stderr)."""
    r = subprocess.run(
        ["bash", "-c", command],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, f"{command}: exit {r.returncode}\n{r.stdout}"
    return r.stdout


@pytest.fixture
def clean_canary_demo(clean_demo_paths: None) -> Iterator[None]:
    with kept(CANARY_PATHS):
        yield


def test_the_canary_walkthrough_does_what_the_readme_says(
    clean_canary_demo: None, tmp_path: Path
) -> None:
    first, change, after = (
        steps(b) for b in section_blocks((REPO / "README.md").read_text(), CANARY_SECTION)
    )
    for step in first[:-1]:
        sh(step.command)
    copy = Farm(first[-1].command, tmp_path / "copy.log")
    traffic: subprocess.Popen[bytes] | None = None
    try:
        for i in range(8):  # "once it says 8/8 ready" (and the front door routes to each)
            wait_for_worker(
                CANARY_CONFIG,
                i,
                "ready and routed",
                lambda w: w.get("state") == "ready" and bool(w.get("in_gateway")),
            )
        for step in [*change, *after]:
            if step.command.endswith("&"):  # the reader's background job: ours, stopped below
                traffic = subprocess.Popen(
                    ["bash", "-c", step.command[:-1]],
                    cwd=REPO,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
                continue
            out = sh_all(step.command, timeout=180)
            for promise in step.promises:
                found = promise_pattern(promise).search(out)
                assert found, f"{step.command}: no {promise!r}:\n{out}"
        # "workers 1 to 7 were never restarted"
        assert all(
            int(str(w.get("restarts_total") or 0)) == 0
            for w in status(CANARY_CONFIG).values()
            if w["id"] != 0
        )
    finally:
        if traffic is not None and traffic.poll() is None:
            os.killpg(traffic.pid, signal.SIGKILL)  # "or `kill %1`"
            traffic.wait(10)
        copy.stop()
    # The bad change is judged on the canary (worker 0) and rolled back: that warns.
    assert_no_alarm_but(copy.log, canary_caused, "the canary walkthrough")


def canary_caused(a: dict[str, object]) -> bool:
    return a["worker"] == 0 or str(a["event"]).startswith(("canary", "reload"))


# ---- issue 32, 4.6: the walkthroughs leave what was there -----------------------------------


def written_paths(lines: list[str]) -> set[str]:
    """The /tmp paths the README's commands write: `rm -rf X`, `cp A X`, `>> X`, `sed -i … X`."""
    out: set[str] = set()
    for step in steps(lines):
        if step.command.split()[0] not in ("rm", "cp", "sed", "printf"):
            continue  # reads, or runs a farm (which writes only under its state_dir)
        words = shlex.split(step.command.replace(">>", " >> "))
        if words[:2] == ["rm", "-rf"]:
            out.update(words[2:])
        elif words[0] in ("cp", "sed") or ">>" in words:
            out.add(words[words.index(">>") + 1] if ">>" in words else words[-1])
    return {p.rstrip("/") for p in out if p.startswith("/tmp/")}


def test_the_walkthroughs_keep_every_path_they_write() -> None:
    readme = (REPO / "README.md").read_text()
    written = set()
    for section in (SECTION, CANARY_SECTION):
        for block in section_blocks(readme, section):
            written |= written_paths(block)
    assert written == {
        "/tmp/sglang-farm-demo/state",
        "/tmp/oom-demo.toml",
        "/tmp/canary-demo",
        "/tmp/canary-demo.toml",
    }
    kept_paths = (*DEMO_PATHS, *CANARY_PATHS)
    assert all(any(p == k or p.startswith(k + "/") for k in kept_paths) for p in written)


def test_what_was_at_a_walkthroughs_paths_is_there_after_it(tmp_path: Path) -> None:
    """Issue 32, 4.6: a reader's own /tmp/oom-demo.toml, /tmp/canary-demo.toml and
    /tmp/canary-demo/, made before the suite ran, were gone after it."""
    mine, folder, absent = tmp_path / "oom-demo.toml", tmp_path / "canary-demo", tmp_path / "new"
    mine.write_text("# the reader's own\n")
    (folder / "state").mkdir(parents=True)
    (folder / "state" / "canary.json").write_text("{}")
    with kept((str(mine), str(folder), str(absent))):
        assert not mine.exists() and not folder.exists()  # the walkthrough starts clean
        mine.write_text("# the walkthrough's copy\n")
        folder.mkdir()
        (folder / "control.sock").write_text("")
        absent.write_text("made by the walkthrough")
    assert mine.read_text() == "# the reader's own\n"
    assert sorted(p.name for p in folder.rglob("*")) == ["canary.json", "state"]
    assert not absent.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["canary-demo", "oom-demo.toml"]
