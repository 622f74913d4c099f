"""The control commands against FakeOps, without a socket (control/handlers.py)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

import pytest

from fake_channel import Channel
from fake_ops import FakeOps
from sglang_farm.config.load import text_digest
from sglang_farm.control.codec import (
    Command,
    ErrorCode,
    GpuArgs,
    LogsArgs,
    NoArgs,
    ReleaseWorkerArgs,
    Request,
    RequestError,
    StopArgs,
    TargetArgs,
    WaitArgs,
    WorkerArgs,
)
from sglang_farm.control.handlers import ClientGone, Handlers
from sglang_farm.farm_view import GatewayStatus, Phase


@pytest.fixture
async def ops() -> AsyncIterator[FakeOps]:
    o = FakeOps(4)
    yield o
    await o.aclose()


def handlers(ops: FakeOps) -> Handlers:
    return Handlers(ops, version="1.2.3", wall_clock=lambda: 1234.5)


async def until(cond: Callable[[], object]) -> None:
    for _ in range(200):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not met within 1 s")


def test_every_command_has_a_handler(ops: FakeOps) -> None:
    assert set(handlers(ops).table) == set(Command)


async def test_status_and_issued_at_come_from_the_wall_clock(ops: FakeOps) -> None:
    h = handlers(ops)
    st = await h.handle(Request(1, Command.STATUS, NoArgs()), Channel())
    assert st["now"] == 1234.5 and st["agent_version"] == "1.2.3"
    r = await h.handle(Request(2, Command.RESTART, StopArgs("all")), Channel())
    assert r == {"workers": [0, 1, 2, 3], "issued_at": 1234.5}
    assert ops.calls == [("restart", (0, 1, 2, 3))]


async def test_status_compares_the_config_file_on_disk_with_the_one_in_force(
    ops: FakeOps, tmp_path: Path
) -> None:
    """Fleet review #2: the file is compared at each `status`; a refused reload (or an edit
    not reloaded yet) shows as `config_pending` until a reload or restart applies it."""
    conf = tmp_path / "farm.toml"
    conf.write_text("[workers]\ngpus = [0]\n")
    ops.config_source, ops.config_sha256 = str(conf), text_digest(conf.read_text())
    h = handlers(ops)
    st = await h.handle(Request(1, Command.STATUS, NoArgs()), Channel())
    assert st["config_pending"] is False and st["config_file_sha256"] == ops.config_sha256
    conf.write_text("[workers]\ngpus = [0, 1]\n")
    st = await h.handle(Request(2, Command.STATUS, NoArgs()), Channel())
    assert st["config_pending"] is True
    assert st["config_file_sha256"] == text_digest(conf.read_text())
    conf.unlink()
    st = await h.handle(Request(3, Command.STATUS, NoArgs()), Channel())
    assert st["config_pending"] is True and st["config_file_sha256"] is None


async def test_unknown_worker_is_refused_before_the_agent_is_asked(ops: FakeOps) -> None:
    with pytest.raises(RequestError) as ei:
        await handlers(ops).handle(Request(7, Command.STOP, StopArgs(9)), Channel())
    assert ei.value.error_code is ErrorCode.UNKNOWN_WORKER and ei.value.request_id == 7
    assert ei.value.message == "no worker 9; workers are 0-3"
    assert ops.calls == []


async def test_second_change_of_a_changing_worker_is_busy_not_queued(ops: FakeOps) -> None:
    ops.issue_delay = 0.2
    h = handlers(ops)
    first = asyncio.ensure_future(h.handle(Request(1, Command.STOP, StopArgs(2)), Channel()))
    await until(lambda: ops.calls)
    with pytest.raises(RequestError) as ei:
        await h.handle(Request(2, Command.RESET_OOM, WorkerArgs(2)), Channel())
    assert ei.value.error_code is ErrorCode.BUSY and "worker 2 is busy" in ei.value.message
    assert (await first)["workers"] == [2]
    assert ops.oom_resets == []
    # Once the first change is done, the worker takes changes again.
    assert await h.handle(Request(3, Command.RESET_OOM, WorkerArgs(2)), Channel()) == {
        "worker": 2,
        "oom_step": 0,
    }


async def test_a_second_reload_while_one_runs_is_busy(ops: FakeOps) -> None:
    ops.issue_delay = 0.2
    h = handlers(ops)
    first = asyncio.ensure_future(h.handle(Request(1, Command.RELOAD, NoArgs()), Channel()))
    await until(lambda: ops.calls)
    with pytest.raises(RequestError) as ei:
        await h.handle(Request(2, Command.RELOAD, NoArgs()), Channel())
    assert ei.value.error_code is ErrorCode.BUSY
    assert (await first)["applied"] is True
    assert ops.calls == [("reload", ())]


STARTING = "the agent is restoring its state and adopting running workers"

STATE_CHANGES = [
    Request(1, Command.START, TargetArgs(1)),
    Request(2, Command.STOP, StopArgs(1)),
    Request(3, Command.STOP, StopArgs("all")),
    Request(4, Command.RESTART, StopArgs(2)),
    Request(5, Command.RELOAD, NoArgs()),
    Request(6, Command.RESET_OOM, WorkerArgs(3)),
    Request(7, Command.RELEASE_GPU, GpuArgs(1)),
]


@pytest.mark.parametrize("req", STATE_CHANGES, ids=lambda r: f"{r.cmd}-{r.args}")
async def test_state_changes_are_busy_until_restore_and_adoption_are_done(
    ops: FakeOps, req: Request
) -> None:
    ops.startup_reason = STARTING
    h = handlers(ops)
    with pytest.raises(RequestError) as ei:
        await h.handle(req, Channel())
    assert ei.value.error_code is ErrorCode.BUSY and ei.value.request_id == req.id
    assert ei.value.message.startswith(STARTING + "; ")
    assert f"state changes wait until it is done: retry {req.cmd} in" in ei.value.message
    assert ops.calls == [] and ops.oom_resets == []  # the agent was never asked
    ops.startup_reason = None  # restore and adoption done: the same request now runs
    await h.handle(req, Channel())
    assert ops.calls or ops.oom_resets


async def test_read_only_commands_answer_while_the_agent_starts(ops: FakeOps) -> None:
    ops.startup_reason = STARTING
    h = handlers(ops)
    st = await h.handle(Request(1, Command.STATUS, NoArgs()), Channel())
    assert st["ready"] == 4 and st["agent_version"] == "1.2.3"
    assert (await h.handle(Request(2, Command.WHY, WorkerArgs(1)), Channel()))["worker"] == 1
    logs = await h.handle(Request(3, Command.LOGS, LogsArgs(1, 1)), Channel())
    assert logs["lines"] == ["w1 line 49"]
    endpoints = await h.handle(Request(4, Command.ENDPOINTS, NoArgs()), Channel())
    assert endpoints["endpoints"] == [
        {"worker": i, "base_url": f"http://127.0.0.1:{30000 + i}"} for i in range(4)
    ]
    assert (await h.handle(Request(5, Command.VERSION, NoArgs()), Channel()))["agent_version"]
    ready = await h.handle(Request(6, Command.WAIT_READY, WaitArgs(0, 1.0)), Channel())
    assert ready["ready"] is True
    assert ops.calls == []


async def test_follow_streams_the_tail_then_new_lines_until_the_client_leaves(
    ops: FakeOps,
) -> None:
    ch = Channel()
    task = asyncio.ensure_future(
        handlers(ops).handle(Request(1, Command.LOGS, LogsArgs(1, 2, follow=True)), ch)
    )
    await until(lambda: ops.follow_queues)
    ops.push_log("new")
    await until(lambda: len(ch.streamed) == 3)
    assert ch.streamed == [
        ("line", {"line": "w1 line 48"}),
        ("line", {"line": "w1 line 49"}),
        ("line", {"line": "new"}),
    ]
    ch.leave()
    with pytest.raises(ClientGone):
        await task
    assert ops.follow_queues == []  # the log source was closed


async def test_drain_argument_reaches_the_agent_for_stop_and_restart(ops: FakeOps) -> None:
    h = handlers(ops)
    await h.handle(Request(1, Command.STOP, StopArgs(1, drain=False)), Channel())
    await h.handle(Request(2, Command.RESTART, StopArgs(2, drain=False)), Channel())
    await h.handle(Request(3, Command.RESTART, StopArgs(3)), Channel())
    assert ops.drains == [("stop", (1,), False), ("restart", (2,), False), ("restart", (3,), True)]


async def test_status_endpoints_and_why_report_the_gateway() -> None:
    ops = FakeOps(2, step=5.0, gateway=GatewayStatus("http://127.0.0.1:8000", True, 0, 0))
    try:
        h = handlers(ops)
        await h.handle(Request(1, Command.RESTART, StopArgs(1)), Channel())
        st = await h.handle(Request(2, Command.STATUS, NoArgs()), Channel())
        assert st["gateway"] == {
            "url": "http://127.0.0.1:8000",
            "up": True,
            "members": 1,
            "errors": 0,
            "last_error": None,
            "foreign": [],
            "overloaded": [],
        }
        workers = st["workers"]
        assert isinstance(workers, list)
        assert [(w["state"], w["in_gateway"]) for w in workers] == [
            ("ready", True),
            ("draining", False),
        ]
        ep = await h.handle(Request(3, Command.ENDPOINTS, NoArgs()), Channel())
        assert ep["gateway"] == "http://127.0.0.1:8000"
        why = await h.handle(Request(4, Command.WHY, WorkerArgs(1)), Channel())
        assert why["state"] == "draining" and ops.workers[1].phase is Phase.DRAINING
        note = why["state_note"]
        assert isinstance(note, str) and note.startswith("draining before a planned stop")
    finally:
        await ops.aclose()


# --- release-gpu --------------------------------------------------------------------------


async def test_release_gpu_starts_the_quarantined_worker_again(ops: FakeOps) -> None:
    ops.quarantine(2)
    h = handlers(ops)
    st = await h.handle(Request(1, Command.STATUS, NoArgs()), Channel())
    workers = st["workers"]
    assert isinstance(workers, list)
    assert workers[2]["state"] == "quarantined" and workers[2]["quarantine"]["reason"] == "xid 79"
    why = await h.handle(Request(2, Command.WHY, WorkerArgs(2)), Channel())
    step = why["next_step"]
    assert isinstance(step, str) and "`farmctl release-gpu 2`" in step

    r = await h.handle(Request(3, Command.RELEASE_GPU, GpuArgs(2)), Channel())
    assert r == {"released": True, "gpu": 2, "workers": [2], "problems": []}
    assert ops.calls == [("release-gpu", (2,))]
    assert ops.workers[2].quarantine is None
    await until(lambda: ops.workers[2].phase is Phase.READY)


async def test_refused_release_keeps_the_quarantine_and_lists_the_problems(ops: FakeOps) -> None:
    ops.quarantine(2, reason="pending row remaps", detail="2 rows pending")
    ops.release_problems = [
        "GPU 2 has row remaps pending: reset it (nvidia-smi -r -i 2)",
        "GPU 2 still has compute processes (4242): stop them first",
    ]
    r = await handlers(ops).handle(Request(1, Command.RELEASE_GPU, GpuArgs(2)), Channel())
    assert r == {
        "released": False,
        "gpu": 2,
        "workers": [2],
        "problems": ops.release_problems,
    }
    assert ops.workers[2].phase is Phase.QUARANTINED and ops.workers[2].quarantine is not None


async def test_release_of_a_gpu_nothing_is_quarantined_on_is_refused_by_the_agent(
    ops: FakeOps,
) -> None:
    r = await handlers(ops).handle(Request(1, Command.RELEASE_GPU, GpuArgs(1)), Channel())
    assert r == {
        "released": False,
        "gpu": 1,
        "workers": [],
        "problems": ["no worker is quarantined on GPU 1"],
    }
    assert ops.workers[1].phase is Phase.READY


async def test_release_of_a_gpu_no_worker_uses_is_bad_request_naming_the_farms_gpus(
    ops: FakeOps,
) -> None:
    ops.workers[3] = replace(ops.workers[3], gpus=(3, 6))  # a worker with tp 2
    with pytest.raises(RequestError) as ei:
        await handlers(ops).handle(Request(9, Command.RELEASE_GPU, GpuArgs(4)), Channel())
    assert ei.value.error_code is ErrorCode.BAD_REQUEST and ei.value.request_id == 9
    assert ei.value.message == (
        "no worker of this farm uses GPU 4; its workers use GPU 0-3, 6 (farmctl status lists them)"
    )
    assert ops.calls == []  # the agent was never asked


async def test_release_of_the_second_gpu_of_a_worker_reaches_the_agent(ops: FakeOps) -> None:
    ops.workers[3] = replace(ops.workers[3], gpus=(3, 6))
    ops.quarantine(3, gpu=6, reason="gpu lost", detail="GPU is lost")
    r = await handlers(ops).handle(Request(1, Command.RELEASE_GPU, GpuArgs(6)), Channel())
    assert (r["released"], r["workers"]) == (True, [3])
    assert ops.calls == [("release-gpu", (6,))]


async def test_release_is_busy_while_its_worker_changes_and_the_other_way_round(
    ops: FakeOps,
) -> None:
    ops.quarantine(1)
    ops.issue_delay = 0.2
    h = handlers(ops)
    stop = asyncio.ensure_future(h.handle(Request(1, Command.STOP, StopArgs(1)), Channel()))
    await until(lambda: ops.calls)
    with pytest.raises(RequestError) as ei:
        await h.handle(Request(2, Command.RELEASE_GPU, GpuArgs(1)), Channel())
    assert ei.value.error_code is ErrorCode.BUSY and "worker 1 is busy" in ei.value.message
    await stop
    assert ops.calls == [("stop", (1,))]

    ops.calls.clear()
    ops.quarantine(1)
    release = asyncio.ensure_future(
        h.handle(Request(3, Command.RELEASE_GPU, GpuArgs(1)), Channel())
    )
    await until(lambda: ops.calls)
    with pytest.raises(RequestError) as ei:
        await h.handle(Request(4, Command.RESTART, StopArgs("all")), Channel())
    assert ei.value.error_code is ErrorCode.BUSY and "worker 1 is busy" in ei.value.message
    # Other workers' changes go on meanwhile: the GPU's lock is its workers' only.
    await h.handle(Request(5, Command.RESET_OOM, WorkerArgs(0)), Channel())
    assert (await release)["released"] is True
    assert ops.calls == [("release-gpu", (1,))] and ops.oom_resets == [0]


async def test_release_gpu_is_busy_while_the_agent_starts_even_for_an_unknown_gpu(
    ops: FakeOps,
) -> None:
    ops.startup_reason = STARTING
    with pytest.raises(RequestError) as ei:
        await handlers(ops).handle(Request(1, Command.RELEASE_GPU, GpuArgs(99)), Channel())
    assert ei.value.error_code is ErrorCode.BUSY
    assert "retry release-gpu in a few seconds" in ei.value.message


async def test_wait_ready_ends_at_once_on_a_quarantined_worker(ops: FakeOps) -> None:
    # start and restart leave it quarantined: waiting for ready would only run out the clock.
    ops.quarantine(0)
    ch = Channel()
    r = await handlers(ops).handle(
        Request(1, Command.WAIT_READY, WaitArgs(0, timeout=5.0, after=ops.workers[0].since + 1)),
        ch,
    )
    assert (r["state"], r["ready"], r["timed_out"]) == ("quarantined", False, False)
    assert isinstance(r["waited_s"], float) and r["waited_s"] < 1.0
    assert [kind for kind, _ in ch.streamed] == ["phase"]


# --- a quarantine always has a way out (issue 22, item 7) ----------------------------------


async def test_start_or_restart_of_a_quarantined_worker_is_refused_naming_the_release(
    ops: FakeOps,
) -> None:
    """Before: `start 1` answered {"workers": [1]} ("start requested") and nothing happened."""
    ops.quarantine(1)
    h = handlers(ops)
    for rid, cmd, args in (
        (1, Command.START, TargetArgs(1)),
        (2, Command.RESTART, StopArgs(1)),
    ):
        with pytest.raises(RequestError) as ei:
            await h.handle(Request(rid, cmd, args), Channel())
        assert ei.value.error_code is ErrorCode.FAILED and ei.value.request_id == rid
        assert ei.value.message == (
            f"worker 1 is quarantined: GPU 1 is set aside (xid 79), and {cmd} leaves it "
            "stopped; deal with the GPU (farmctl why 1 says how), then release it with "
            "farmctl release-gpu 1, which re-checks the GPU through NVML and starts the worker"
        )
    assert ops.calls == []  # the agent was never asked
    assert ops.workers[1].phase is Phase.QUARANTINED


async def test_start_or_restart_all_acts_on_the_others_and_lists_the_quarantined(
    ops: FakeOps,
) -> None:
    ops.quarantine(2)
    h = handlers(ops)
    r = await h.handle(Request(1, Command.RESTART, StopArgs("all")), Channel())
    assert r == {"workers": [0, 1, 3], "issued_at": 1234.5, "quarantined": [2]}
    r = await h.handle(Request(2, Command.STOP, StopArgs("all")), Channel())
    assert r == {"workers": [0, 1, 2, 3], "issued_at": 1234.5}  # a stop: nothing to refuse
    r = await h.handle(Request(3, Command.START, TargetArgs("all")), Channel())
    assert r == {"workers": [0, 1, 3], "issued_at": 1234.5, "quarantined": [2]}
    assert ops.calls == [("restart", (0, 1, 3)), ("stop", (0, 1, 2, 3)), ("start", (0, 1, 3))]


async def test_a_worker_stopping_for_its_gpu_is_refused_too(ops: FakeOps) -> None:
    ops.quarantine(3)
    ops._set(3, Phase.STOPPING)  # the quarantine decided, its stop under way
    with pytest.raises(RequestError) as ei:
        await handlers(ops).handle(Request(1, Command.RESTART, StopArgs(3)), Channel())
    assert ei.value.error_code is ErrorCode.FAILED
    assert "farmctl release-gpu 3" in ei.value.message


async def test_a_quarantine_on_a_gpu_the_worker_was_moved_off_is_released_by_worker(
    ops: FakeOps,
) -> None:
    """Quarantined on GPU 2, then a reload put worker 2 on GPU 5. Before: `release-gpu 2`
    was bad_request (no worker uses GPU 2), `release-gpu 5` found nothing quarantined on
    it, and nothing else released it."""
    ops.quarantine(2)
    ops.workers[2] = replace(ops.workers[2], gpus=(5,))
    h = handlers(ops)
    with pytest.raises(RequestError) as ei:
        await h.handle(Request(1, Command.RELEASE_GPU, GpuArgs(2)), Channel())
    assert ei.value.error_code is ErrorCode.BAD_REQUEST
    assert ei.value.message.endswith(
        "; worker 2's quarantine names it: farmctl release-gpu --worker 2"
    )
    r = await h.handle(Request(2, Command.RELEASE_GPU, GpuArgs(5)), Channel())
    assert r["released"] is False and r["problems"] == ["no worker is quarantined on GPU 5"]
    # The way out, as `why` and a refused start say it:
    why = await h.handle(Request(3, Command.WHY, WorkerArgs(2)), Channel())
    assert "then `farmctl release-gpu --worker 2`" in str(why["next_step"])
    with pytest.raises(RequestError) as ei:
        await h.handle(Request(4, Command.START, TargetArgs(2)), Channel())
    assert "release it with farmctl release-gpu --worker 2," in ei.value.message

    r = await h.handle(Request(5, Command.RELEASE_GPU, ReleaseWorkerArgs(2)), Channel())
    assert r == {
        "released": True,
        "gpu": 2,
        "workers": [2],
        "problems": [],
        "worker": 2,
        "checked": [5],
    }
    assert ops.calls[-1] == ("release-worker", (2,))
    await until(lambda: ops.workers[2].phase is Phase.READY)
    r = await h.handle(Request(6, Command.RELEASE_GPU, ReleaseWorkerArgs(2)), Channel())
    assert (r["released"], r["workers"], r["problems"]) == (
        False,
        [],
        ["worker 2 is not quarantined (it is ready): nothing to release"],
    )


async def test_release_by_worker_names_an_unknown_worker_and_is_busy_while_it_changes(
    ops: FakeOps,
) -> None:
    h = handlers(ops)
    with pytest.raises(RequestError) as ei:
        await h.handle(Request(1, Command.RELEASE_GPU, ReleaseWorkerArgs(9)), Channel())
    assert ei.value.error_code is ErrorCode.UNKNOWN_WORKER and "workers are 0-3" in ei.value.message
    ops.issue_delay = 0.2
    stop = asyncio.ensure_future(h.handle(Request(2, Command.STOP, StopArgs(1)), Channel()))
    await until(lambda: ops.calls)
    with pytest.raises(RequestError) as ei:
        await h.handle(Request(3, Command.RELEASE_GPU, ReleaseWorkerArgs(1)), Channel())
    assert ei.value.error_code is ErrorCode.BUSY
    await stop


_opened: list[str] = []


def _audit(event: str, args: tuple[object, ...]) -> None:
    if event == "open" and args and isinstance(args[0], str):
        _opened.append(args[0])


sys.addaudithook(_audit)  # (audit hooks cannot be removed: it only records)


async def test_status_reads_the_config_file_only_when_it_changed(
    ops: FakeOps, tmp_path: Path
) -> None:
    """Issue 32, 4.3: `farmctl reload` polls `status` every second, and each one read and
    hashed the whole config file. The file is read again only once it changed (its size,
    inode or change time), and what `status` says stays true."""
    conf = tmp_path / "farm.toml"
    conf.write_text("[workers]\ngpus = [0]\n")
    ops.config_source, ops.config_sha256 = str(conf), text_digest(conf.read_text())
    h = handlers(ops)
    _opened.clear()
    for i in range(5):
        st = await h.handle(Request(i, Command.STATUS, NoArgs()), Channel())
        assert st["config_pending"] is False
    assert _opened.count(str(conf)) == 1, _opened
    conf.write_text("[workers]\ngpus = [0, 1]\n")
    edited = text_digest(conf.read_text())
    _opened.clear()
    for i in range(5):
        st = await h.handle(Request(10 + i, Command.STATUS, NoArgs()), Channel())
        assert st["config_pending"] is True and st["config_file_sha256"] == edited
    assert _opened.count(str(conf)) == 1, _opened
