"""The journal follower (runtime.journal): its pure parts, and the follower run against a
fake `journalctl` on PATH that prints scripted JSON entries the way journalctl does:
only those its matches select (two matches on one field are alternatives, `+` separates
alternatives), after `--after-cursor=` (else from `--since=@`, by `__REALTIME_TIMESTAMP`),
then it keeps following (sleeps) like `-f`. It can fail the way journalctl does: the next
reads while journald is away (`FAKE_JOURNAL_FAILS`), every read after a vacuumed cursor
(`FAKE_JOURNAL_LOST_CURSOR`); both name a file the test writes when the trouble starts.
The real journalctl is exercised in the systemd container (test_systemd_runtime.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import textwrap
import time
from collections.abc import Callable, Iterator, MutableMapping
from pathlib import Path
from typing import Any

import pytest
import structlog

from sglang_farm.runtime import Exited, LogLine, RuntimeEvent
from sglang_farm.runtime import journal as jr
from sglang_farm.runtime.unit_state import worker_of


def _ours(unit: str) -> int | None:
    return worker_of(unit, "sglang")


# -- pure: entries -------------------------------------------------------------------------


def test_worker_output_entry_gives_its_worker_lines_and_cursor() -> None:
    entry = {"_SYSTEMD_UNIT": "sglang@3.service", "MESSAGE": "a\nb", "__CURSOR": "c1"}
    assert jr.worker_entry_lines(entry, _ours) == (3, ["a", "b"], "c1")


def test_systemd_line_about_a_worker_unit_counts_for_that_worker() -> None:
    entry = {
        "_PID": "1",
        "_SYSTEMD_UNIT": "init.scope",
        "UNIT": "sglang@2.service",
        "MESSAGE": "sglang@2.service: Main process exited, code=killed, status=9/KILL",
        "__CURSOR": "c2",
    }
    assert jr.worker_entry_lines(entry, _ours)[:2] == (
        2,
        ["sglang@2.service: Main process exited, code=killed, status=9/KILL"],
    )
    assert jr.entry_unit(entry, _ours) == "sglang@2.service"


def test_unit_field_from_a_process_other_than_systemd_is_not_the_workers() -> None:
    # Anyone can log UNIT=sglang@2.service; only PID 1's word about a unit counts.
    entry = {"_PID": "4242", "_SYSTEMD_UNIT": "evil.service", "UNIT": "sglang@2.service"}
    assert jr.worker_entry_lines(entry | {"MESSAGE": "x"}, _ours)[:2] == (None, [])
    assert jr.entry_unit(entry, _ours) is None


def test_other_units_and_other_prefixes_are_ignored() -> None:
    for unit in ("sglang-farm.service", "sglang@x.service", "other@1.service"):
        assert jr.worker_entry_lines({"_SYSTEMD_UNIT": unit, "MESSAGE": "m"}, _ours)[:2] == (
            None,
            [],
        )
    mine = {"_SYSTEMD_UNIT": "gpu@1.service", "MESSAGE": "m"}
    assert jr.worker_entry_lines(mine, lambda u: worker_of(u, "gpu"))[:2] == (1, ["m"])


def test_message_as_bytes_repeated_field_or_null() -> None:
    unit = {"_SYSTEMD_UNIT": "sglang@0.service"}
    raw = [*"caf\u00e9 ".encode(), 0xFF]  # not UTF-8: journalctl prints a byte array
    assert jr.worker_entry_lines(unit | {"MESSAGE": raw}, _ours)[1] == ["caf\u00e9 \ufffd"]
    assert jr.worker_entry_lines(unit | {"MESSAGE": ["one", "two"]}, _ours)[1] == ["one", "two"]
    assert jr.worker_entry_lines(unit | {"MESSAGE": None}, _ours)[1] == []
    assert jr.worker_entry_lines(unit | {"MESSAGE": ""}, _ours)[1] == [""]
    assert jr.worker_entry_lines(["not", "an", "entry"], _ours) == (None, [], None)


# -- pure: the command line ------------------------------------------------------------------


def test_follow_args_select_the_farm_units_and_few_fields_no_glob() -> None:
    args = jr.follow_args({"sglang@1.service", "sglang@0.service"}, after_cursor="s=1")
    # One-shot reads, polled: `--follow` delivers nothing under the agent's
    # ProtectKernelTunables=/ProtectControlGroups= (runtime/journal.py).
    assert args[0] == "journalctl" and "--follow" not in args
    assert "--all" in args and "--output=json" in args and "--after-cursor=s=1" in args
    assert "--output-fields=MESSAGE,_SYSTEMD_UNIT,UNIT,_PID,__CURSOR" in args
    matches = args[args.index("--after-cursor=s=1") + 1 :]
    assert matches == [
        "_SYSTEMD_UNIT=sglang@0.service",
        "_SYSTEMD_UNIT=sglang@1.service",
        "+",
        "_PID=1",
        "UNIT=sglang@0.service",
        "UNIT=sglang@1.service",
        "+",
        "_PID=1",
        f"MESSAGE_ID={jr.UNIT_STARTING}",
    ]
    assert not any("*" in a for a in args)  # journalctl expands globs once, at start


def test_follow_args_without_units_follow_only_systemds_starting_entries() -> None:
    args = jr.follow_args((), after_cursor=None, since=1700000000)
    assert "--since=@1700000000" in args
    assert args[-2:] == ["_PID=1", f"MESSAGE_ID={jr.UNIT_STARTING}"]
    assert "--lines=0" in jr.follow_args((), after_cursor=None)


# -- pure: line splitting ----------------------------------------------------------------------


def test_splitter_drops_an_overlong_line_across_chunks_and_keeps_the_next() -> None:
    sp = jr.LineSplitter(10)
    assert sp.feed(b"short\nabcdefgh") == ([b"short"], 0)
    assert sp.feed(b"ijklmnop") == ([], 1)  # 16 bytes without a newline: dropped
    assert sp.feed(b"qrstuvwxyz" * 3) == ([], 0)  # still the same line: discarded
    assert sp.feed(b"xyz\nnext\nexactly10!") == ([b"next"], 0)
    assert sp.feed(b"\n\n") == ([b"exactly10!", b""], 0)


# -- the follower against a fake journalctl ----------------------------------------------------

FAKE_JOURNALCTL = textwrap.dedent(
    """\
    #!{python}
    import json, os, sys, time
    args = sys.argv[1:]
    with open(os.environ["FAKE_JOURNAL_CALLS"], "a") as f:
        f.write(json.dumps(args) + "\\n")
    if any(a.startswith("--field=") for a in args):
        slow = os.environ.get("FAKE_JOURNAL_FIELD_PID")  # a file: a slow --field (big journal)
        if slow:
            open(slow, "w").write(str(os.getpid()))
            time.sleep(3600)
        print(os.environ.get("FAKE_JOURNAL_UNITS", ""))
        sys.exit(0)
    after = since = None
    groups, group = [], {{}}
    for i, a in enumerate(args):
        if a.startswith("--after-cursor="):
            after = a.split("=", 1)[1]
        elif a.startswith("--since=@"):
            since = float(a.split("@", 1)[1])
        elif a == "--after-cursor":
            after = args[i + 1]
        elif a == "+":
            groups.append(group)
            group = {{}}
        elif not a.startswith("-") and "=" in a:
            k, v = a.split("=", 1)
            group.setdefault(k, set()).add(v)
    if group:
        groups.append(group)
    follower = any(a.startswith("MESSAGE_ID=") for a in args)  # not an exit's catch-up
    fails = os.environ.get("FAKE_JOURNAL_FAILS")  # a file: how many follower reads fail next
    left = int(open(fails).read() or 0) if follower and fails else 0
    if left > 0:
        open(fails, "w").write(str(left - 1))
        sys.stderr.write("Failed to get journal: Connection refused\\n")  # journald away
        sys.exit(1)
    lost = os.environ.get("FAKE_JOURNAL_LOST_CURSOR")  # a file: the cursor it cannot seek to
    if after is not None and lost and after == open(lost).read():
        sys.stderr.write("Failed to seek to cursor: Invalid argument\\n")  # its file vacuumed
        sys.exit(1)
    entries = [json.loads(ln) for ln in open(os.environ["FAKE_JOURNAL_ENTRIES"])]
    if after is not None:
        entries = entries[[e["__CURSOR"] for e in entries].index(after) + 1 :]
    elif since is not None:
        entries = [e for e in entries if int(e.get("__REALTIME_TIMESTAMP", 1e18)) >= since * 1e6]
    out = sys.stdout.buffer
    if follower and os.environ.get("FAKE_JOURNAL_FOLLOW_DELAY"):
        time.sleep(float(os.environ["FAKE_JOURNAL_FOLLOW_DELAY"]))  # a silent or late follower
    for e in entries:
        if not groups or any(all(e.get(k) in vs for k, vs in g.items()) for g in groups):
            out.write(e.get("__RAW", json.dumps(e)).encode() + b"\\n")
    if "--follow" not in args:
        sys.exit(0)  # a one-shot read (the exit catch-up)
    out.flush()
    time.sleep(3600)  # -f: keep following
    """
)


@pytest.fixture
def fake_journal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Path]]:
    """Install the fake journalctl; call it with the entries it holds. Returns its calls log."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "journalctl"
    script.write_text(FAKE_JOURNALCTL.format(python=sys.executable))
    script.chmod(0o755)
    calls = tmp_path / "calls.jsonl"
    calls.touch()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_JOURNAL_CALLS", str(calls))

    def install(entries: list[dict[str, Any]], units: str = "") -> Path:
        path = tmp_path / "entries.jsonl"
        path.write_text("".join(json.dumps(e) + "\n" for e in entries))
        monkeypatch.setenv("FAKE_JOURNAL_ENTRIES", str(path))
        monkeypatch.setenv("FAKE_JOURNAL_UNITS", units)
        return calls

    yield install


def _follow_calls(calls: Path) -> list[list[str]]:
    rows = [json.loads(ln) for ln in calls.read_text().splitlines()]
    return [r for r in rows if not any(a.startswith("--field=") for a in r)]


def _live_reads(calls: Path) -> list[list[str]]:
    """The live follower's reads (not a catch-up or a learned unit's look-back)."""
    return [r for r in _follow_calls(calls) if any(a.startswith("MESSAGE_ID=") for a in r)]


async def _run_follower(
    want: Callable[[list[LogLine]], bool], timeout: float = 10
) -> list[LogLine]:
    """Run a follower until the lines seen satisfy `want` (or `timeout`); return them."""
    seen: list[LogLine] = []
    done = asyncio.Event()

    def emit(ev: RuntimeEvent) -> None:
        if isinstance(ev, LogLine):
            seen.append(ev)
            if want(seen):
                done.set()

    follower = jr.JournalFollower(emit, _ours)
    follower.start()
    try:
        await asyncio.wait_for(done.wait(), timeout)
    except TimeoutError:
        pass
    finally:
        await follower.close()
    return seen


def _out(unit: str, msg: str, cursor: str) -> dict[str, Any]:
    return {"_SYSTEMD_UNIT": unit, "_PID": "77", "MESSAGE": msg, "__CURSOR": cursor}


def _pid1(unit: str, msg: str, cursor: str, starting: bool = False) -> dict[str, Any]:
    e = {"_SYSTEMD_UNIT": "init.scope", "_PID": "1", "UNIT": unit, "MESSAGE": msg}
    return e | {"__CURSOR": cursor} | ({"MESSAGE_ID": jr.UNIT_STARTING} if starting else {})


def test_a_2mib_entry_is_skipped_and_the_next_line_arrives(
    fake_journal: Callable[..., Path],
) -> None:
    huge = "x" * (2 << 20)
    calls = fake_journal(
        [
            _out("sglang@0.service", "before", "c1"),
            _out("sglang@0.service", huge, "c2"),
            _out("sglang@0.service", "after", "c3"),
        ],
        units="sglang@0.service\nsshd.service",
    )
    seen = asyncio.run(_run_follower(lambda s: any(x.text == "after" for x in s), timeout=8))
    assert [(x.worker, x.text) for x in seen] == [(0, "before"), (0, "after")]
    # Never read again from before the long entry (the old follower replayed it forever).
    assert all("--after-cursor=c3" in c for c in _follow_calls(calls)[1:]), _follow_calls(calls)


def test_a_unit_never_seen_is_learned_from_its_starting_entry_without_losing_lines(
    fake_journal: Callable[..., Path],
) -> None:
    calls = fake_journal(
        [
            _out("sshd.service", "noise", "c0"),
            _pid1("sglang@3.service", "Starting sglang@3.service...", "c1", starting=True),
            _out("sglang@3.service", "hello from 3", "c2"),
            _out("sshd.service", "more noise", "c3"),
            _pid1("sglang@3.service", "sglang@3.service: Main process exited, code=exited", "c4"),
            _pid1("cron.service", "cron.service: Main process exited, code=exited", "c5"),
        ]
    )
    seen = asyncio.run(_run_follower(lambda s: any("Main process" in x.text for x in s)))
    assert [(x.worker, x.text) for x in seen] == [
        (3, "Starting sglang@3.service..."),
        (3, "hello from 3"),
        (3, "sglang@3.service: Main process exited, code=exited"),
    ]
    first, *later = _follow_calls(calls)
    assert "_SYSTEMD_UNIT=sglang@3.service" not in first
    assert later and all("_SYSTEMD_UNIT=sglang@3.service" in c for c in later)
    # The live reads go on after the "Starting" entry, with the new unit matched.
    assert all("--after-cursor=c1" in c or "--after-cursor=c4" in c for c in _live_reads(calls)[1:])


def test_a_new_units_line_journald_stored_before_its_starting_entry_is_not_lost(
    fake_journal: Callable[..., Path],
) -> None:
    # journald reads PID 1's "Starting" (its native socket) and the unit's stdout stream in
    # whichever order it gets to them: the unit's first line can be stored first. The CI's
    # hardening probe lost exactly that line (a oneshot `echo`) on a loaded 2-core machine.
    now = int(time.time() * 1e6)

    def at(e: dict[str, Any], s: float) -> dict[str, Any]:
        return e | {"__REALTIME_TIMESTAMP": str(now + int(s * 1e6))}

    fake_journal(
        [
            at(_out("sshd.service", "noise", "c0"), 0),
            at(_out("sglang@3.service", "hello early", "c1"), 1.0),
            at(_pid1("sglang@3.service", "Starting sglang@3.service...", "c2", True), 1.1),
            at(_out("sglang@3.service", "hello after", "c3"), 1.2),
            at(_pid1("sglang@3.service", "sglang@3.service: Main process exited, code=", "c4"), 2),
        ]
    )
    seen = asyncio.run(
        _run_follower(lambda s: sum("hello" in x.text or "Main" in x.text for x in s) >= 3)
    )
    texts = [x.text for x in seen]
    assert "hello early" in texts, texts
    assert sorted(texts) == sorted(set(texts)), texts  # each line once


def test_a_follower_closed_while_it_reads_the_known_units_leaves_no_journalctl_running(
    fake_journal: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A farm stopped while journalctl still lists the journal's units (slow on a big
    # journal): that journalctl was left running and unreaped, a process and a pipe leaked
    # by every such stop (CI saw its ResourceWarning fail an unrelated test).
    fake_journal([])
    pid_file = tmp_path / "field.pid"
    monkeypatch.setenv("FAKE_JOURNAL_FIELD_PID", str(pid_file))

    async def run() -> int:
        follower = jr.JournalFollower(lambda ev: None, _ours)
        follower.start()
        for _ in range(500):
            if pid_file.exists() and pid_file.read_text():
                break
            await asyncio.sleep(0.02)
        pid = int(pid_file.read_text())
        await follower.close()
        return pid

    pid = asyncio.run(run())
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return  # killed and reaped by close()
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, 9)
    pytest.fail(f"journalctl {pid} still running after the follower closed")


def test_units_in_the_journal_already_are_followed_from_the_start(
    fake_journal: Callable[..., Path],
) -> None:
    # A worker that outlived the agent logged before; it is not "Starting" again.
    calls = fake_journal(
        [_out("sglang@1.service", "still serving", "c1")],
        units="sglang@1.service\nsglang@x.service\nsglang-farm.service",
    )
    seen = asyncio.run(_run_follower(lambda s: bool(s)))
    assert [(x.worker, x.text) for x in seen] == [(1, "still serving")]
    first = _follow_calls(calls)[0]
    assert [a for a in first if a.startswith("_SYSTEMD_UNIT=")] == [
        "_SYSTEMD_UNIT=sglang@1.service"
    ]


# -- an exit while the live follower is silent (the soak's OOM counted as a crash) -------------

OOM_TEXT = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"


def _oom_exit_events(silent: bool) -> list[RuntimeEvent]:
    """Worker 2 dies of an OOM; its exit arrives over D-Bus. What leaves the ordering?"""
    out: list[RuntimeEvent] = []
    done = asyncio.Event()

    def record(ev: RuntimeEvent) -> None:
        out.append(ev)
        if isinstance(ev, Exited):
            done.set()

    async def scenario() -> None:
        follower: jr.JournalFollower | None = None

        async def catch_up(worker: int) -> None:
            assert follower is not None
            await follower.catch_up([f"sglang@{worker}.service"])

        ordering = jr.ExitOrdering(record, 0.3, lambda w: False, catch_up)
        follower = jr.JournalFollower(ordering.feed, _ours)
        follower.start()
        try:
            await asyncio.sleep(0.5 if not silent else 0.2)
            ordering.feed(Exited(2, 4242, 1))
            await asyncio.wait_for(done.wait(), 15)
            await asyncio.sleep(0.3)  # anything the live follower adds after the exit
        finally:
            ordering.close()
            await follower.close()

    asyncio.run(scenario())
    return out


def _oom_entries() -> list[dict[str, Any]]:
    return [
        _out("sglang@2.service", "Traceback (most recent call last):", "c1"),
        _out("sglang@2.service", OOM_TEXT, "c2"),
        _pid1("sglang@2.service", "sglang@2.service: Main process exited, code=exited", "c3"),
    ]


def test_an_exit_seen_while_the_follower_is_silent_still_comes_after_its_oom_lines(
    fake_journal: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The 10-minute soak (seed 20261130) counted an OOM as a crash: the follower had gone
    # silent, the exit was released after the grace without the OOM text before it.
    monkeypatch.setenv("FAKE_JOURNAL_FOLLOW_DELAY", "3600")  # silent: nothing, ever
    calls = fake_journal(_oom_entries(), units="sglang@2.service")
    events = _oom_exit_events(silent=True)
    texts = [e.text if isinstance(e, LogLine) else "EXIT" for e in events]
    assert texts.index(OOM_TEXT) < texts.index("EXIT"), texts
    assert texts.count(OOM_TEXT) == 1
    catch_ups = [c for c in _follow_calls(calls) if not any("MESSAGE_ID=" in a for a in c)]
    assert catch_ups and "_SYSTEMD_UNIT=sglang@2.service" in catch_ups[0]


def test_lines_read_by_both_a_catch_up_and_the_late_follower_are_emitted_once(
    fake_journal: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_JOURNAL_FOLLOW_DELAY", "0.5")  # the live follower is late
    fake_journal(_oom_entries(), units="sglang@2.service")

    async def both() -> list[str]:
        seen: list[str] = []
        follower = jr.JournalFollower(
            lambda ev: seen.append(ev.text) if isinstance(ev, LogLine) else None, _ours
        )
        follower.start()
        try:
            await asyncio.sleep(0.1)
            await follower.catch_up(["sglang@2.service"])  # reads all three first
            assert len(seen) == 3, seen
            await asyncio.sleep(1.5)  # ...then the live follower delivers them again
        finally:
            await follower.close()
        return seen

    seen = asyncio.run(both())
    assert seen.count(OOM_TEXT) == 1 and len(seen) == 3, seen


# -- journalctl failing (journald restarting, a vacuumed cursor) -------------------------------


def _stamped(entry: dict[str, Any], at: float) -> dict[str, Any]:
    return entry | {"__REALTIME_TIMESTAMP": str(int(at * 1e6))}


def _early_in_a_second() -> float:
    """Now, at least 0.2 s before the next whole second: the follower about to start reads
    from the same whole second (`--since=@<now>`), so an entry logged now is its first."""
    now = time.time()
    if now % 1 > 0.8:
        time.sleep(1.01 - now % 1)
        now = time.time()
    return now


async def _follow_through_failures(
    entries_path: Path,
    t0: float,
    later: list[dict[str, Any]],
    trouble: Callable[[], object],
    want: int,
) -> tuple[list[str], list[MutableMapping[str, Any]]]:
    """Run a follower; once it has read the first entry (logged at `t0`) and the wall
    clock is two seconds on (so that "now" is past the `later` entries' second),
    `trouble` makes journalctl fail and the `later` entries are logged. Returns the
    texts emitted (until `want` of them, or 10 s) and the events logged."""
    seen: list[str] = []
    first = asyncio.Event()
    done = asyncio.Event()

    def emit(ev: RuntimeEvent) -> None:
        if isinstance(ev, LogLine):
            seen.append(ev.text)
            first.set()
            if len(seen) >= want:
                done.set()

    follower = jr.JournalFollower(emit, _ours)
    with structlog.testing.capture_logs() as logged:
        follower.start()
        try:
            await asyncio.wait_for(first.wait(), 10)
            await asyncio.sleep(max(0.0, int(t0) + 2 - time.time()))
            trouble()
            with entries_path.open("a") as f:
                f.writelines(json.dumps(e) + "\n" for e in later)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), 10)
            await asyncio.sleep(0.3)  # anything emitted twice
        finally:
            await follower.close()
    return seen, logged


def _oom_through_failures(
    fake_journal: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    knob: str,
    before: str,
    during: str,
) -> tuple[float, Path, list[str], list[MutableMapping[str, Any]]]:
    """Worker 2 serving (cursor c1), then its OOM logged while the fake journalctl fails:
    `knob` names the file that makes it fail, holding `before` until the failures start
    and `during` from then on. Returns (t0, the calls file, lines seen, events logged)."""
    monkeypatch.setattr(jr, "FOLLOW_RETRY_S", 0.05)
    control = tmp_path / knob.lower()
    control.write_text(before)
    monkeypatch.setenv(knob, str(control))
    t0 = _early_in_a_second()
    calls = fake_journal(
        [_stamped(_out("sglang@2.service", "serving", "c1"), t0)], units="sglang@2.service"
    )
    later = [_stamped(e, t0 + 0.01) for e in _oom_entries()[1:]]  # before the failures end
    seen, logged = asyncio.run(
        _follow_through_failures(
            tmp_path / "entries.jsonl", t0, later, lambda: control.write_text(during), want=3
        )
    )
    return t0, calls, seen, logged


def test_a_transient_journalctl_failure_loses_no_line_logged_meanwhile(
    fake_journal: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # journald restarts while worker 2 dies of an OOM: the traceback logged during the
    # outage must still reach the classifier (the follower used to start over from "now").
    _t0, calls, seen, logged = _oom_through_failures(
        fake_journal, monkeypatch, tmp_path, "FAKE_JOURNAL_FAILS", "0", "3"
    )
    assert seen == ["serving", OOM_TEXT, "sglang@2.service: Main process exited, code=exited"]
    follows = [c for c in _follow_calls(calls) if any("MESSAGE_ID=" in a for a in c)]
    assert all("--after-cursor=c1" in c for c in follows[1:5]), follows  # retried from it
    assert not any(a.startswith("--since=") for c in follows[1:] for a in c), follows
    failed = [e for e in logged if e["event"] == "journal_read_failed"]
    assert len(failed) == 3 and failed[0]["retry_from"] == "cursor", failed


def test_a_cursor_that_keeps_failing_is_given_up_for_its_entrys_time_not_now(
    fake_journal: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # journalctl cannot seek to the last cursor any more (its file vacuumed): after
    # FOLLOW_FAILURES_BEFORE_SINCE failures the follower reads from that entry's second.
    t0, calls, seen, logged = _oom_through_failures(
        fake_journal, monkeypatch, tmp_path, "FAKE_JOURNAL_LOST_CURSOR", "", "c1"
    )
    # "serving" is read again from that second, and not emitted twice.
    assert seen == ["serving", OOM_TEXT, "sglang@2.service: Main process exited, code=exited"]
    follows = [c for c in _follow_calls(calls) if any("MESSAGE_ID=" in a for a in c)]
    since = [i for i, c in enumerate(follows) if f"--since=@{int(t0)}" in c]
    assert len(since) == 2 and since[0] == 0, follows  # the start, then the fallback
    tried = follows[since[1] - jr.FOLLOW_FAILURES_BEFORE_SINCE : since[1]]
    assert all("--after-cursor=c1" in c for c in tried), follows
    failed = [e for e in logged if e["event"] == "journal_read_failed"]
    assert len(failed) == jr.FOLLOW_FAILURES_BEFORE_SINCE - 1, failed
    gave_up = [e for e in logged if e["event"] == "journal_cursor_abandoned"]
    assert len(gave_up) == 1 and gave_up[0]["since"] == int(t0), gave_up
    assert gave_up[0]["cursor"] == "c1" and gave_up[0]["failures"] == len(tried), gave_up
