"""The control commands against FakeOps, without a socket (control/handlers.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping

import pytest

from fake_ops import FakeOps
from sglang_farm.control.codec import (
    Command,
    ErrorCode,
    LogsArgs,
    NoArgs,
    Request,
    RequestError,
    StopArgs,
    TargetArgs,
    WaitArgs,
    WorkerArgs,
)
from sglang_farm.control.handlers import ClientGone, Handlers
from sglang_farm.farm_view import GatewayStatus, Phase


class Channel:
    """Records stream messages; `leave()` plays the client hanging up."""

    def __init__(self) -> None:
        self.streamed: list[tuple[str, dict[str, object]]] = []
        self._gone = asyncio.Event()

    async def stream(self, kind: str, payload: Mapping[str, object]) -> None:
        self.streamed.append((kind, dict(payload)))

    async def hangup(self) -> None:
        await self._gone.wait()

    def leave(self) -> None:
        self._gone.set()


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
