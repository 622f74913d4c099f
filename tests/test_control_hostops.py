"""settled, drain-host and undrain-host on the control socket (issue 26 item 2): the
codec's shapes and the handlers against FakeOps, without a socket."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from fake_channel import Channel
from fake_ops import FakeOps
from sglang_farm.control import codec
from sglang_farm.control.codec import (
    Command,
    DrainHostArgs,
    ErrorCode,
    NoArgs,
    Request,
    RequestError,
    WaitArgs,
    WorkerArgs,
)
from sglang_farm.control.handlers import Handlers
from sglang_farm.farm_view import GatewayStatus

GW = GatewayStatus("http://127.0.0.1:8000", up=True, members=0, errors=0)


def test_settled_is_read_only_and_the_host_commands_change_state() -> None:
    assert Command.SETTLED in codec.READ_ONLY
    assert {Command.DRAIN_HOST, Command.UNDRAIN_HOST} <= codec.STATE_CHANGING


@pytest.mark.parametrize(
    ("line", "args"),
    [
        (b'{"cmd": "settled"}', NoArgs()),
        (b'{"cmd": "undrain-host"}', NoArgs()),
        (b'{"cmd": "drain-host"}', DrainHostArgs(None)),
        (b'{"cmd": "drain-host", "args": {"timeout": 90}}', DrainHostArgs(90.0)),
        (b'{"cmd": "drain-host", "args": {"timeout": 0}}', DrainHostArgs(0.0)),
    ],
)
def test_the_host_commands_decode(line: bytes, args: object) -> None:
    assert codec.decode_request(line).args == args


@pytest.mark.parametrize(
    ("line", "words"),
    [
        (b'{"cmd": "drain-host", "args": {"timeout": -1}}', "'timeout' must be in [0, 3600]"),
        (b'{"cmd": "drain-host", "args": {"timeout": "1m"}}', "'timeout' must be a number"),
        (b'{"cmd": "drain-host", "args": {"worker": 1}}', "unknown arguments ['worker']"),
        (b'{"cmd": "settled", "args": {"timeout": 1}}', "it takes no arguments"),
    ],
)
def test_bad_host_command_args_are_refused(line: bytes, words: str) -> None:
    with pytest.raises(RequestError) as e:
        codec.decode_request(line)
    assert e.value.error_code is ErrorCode.BAD_REQUEST and words in e.value.message


@pytest.fixture
async def ops() -> AsyncIterator[FakeOps]:
    o = FakeOps(4, gateway=GW)
    yield o
    await o.aclose()


def _h(ops: FakeOps) -> Handlers:
    return Handlers(ops, version="1.2.3", wall_clock=lambda: 1234.5)


async def test_settled_answers_the_rule_over_the_view(ops: FakeOps) -> None:
    r = await _h(ops).handle(Request(1, Command.SETTLED, NoArgs()), Channel())
    assert r["settled"] is True and r["serving"] == 4
    ops.rolling = 1
    r = await _h(ops).handle(Request(2, Command.SETTLED, NoArgs()), Channel())
    assert r["state"] == "waiting"


async def test_drain_host_result_and_undrain(ops: FakeOps) -> None:
    ops.drain_left = {1: 3}
    h = _h(ops)
    r = await h.handle(Request(1, Command.DRAIN_HOST, DrainHostArgs(30.0)), Channel())
    assert r == {
        "workers": [0, 1, 2, 3],
        "drained": [0, 2, 3],
        "left": {"1": 3},
        "drained_all": False,
        "waited_s": ops.step,
        "unconfirmed": {},
    }
    assert ops.drain_timeouts == [30.0]
    r = await h.handle(Request(2, Command.UNDRAIN_HOST, NoArgs()), Channel())
    assert r == {"workers": [0, 1, 2, 3]} and ops.held_out_since is None


async def test_a_second_drain_host_while_one_runs_is_busy(ops: FakeOps) -> None:
    ops.issue_delay = 0.2
    h = _h(ops)
    first = asyncio.create_task(
        h.handle(Request(1, Command.DRAIN_HOST, DrainHostArgs()), Channel())
    )
    await asyncio.sleep(0.05)
    with pytest.raises(RequestError) as e:
        await h.handle(Request(2, Command.UNDRAIN_HOST, NoArgs()), Channel())
    assert e.value.error_code is ErrorCode.BUSY and "already in progress" in e.value.message
    await first


async def test_host_commands_wait_for_the_agents_start_up(ops: FakeOps) -> None:
    ops.startup_reason = "the agent is restoring its state"
    with pytest.raises(RequestError) as e:
        await _h(ops).handle(Request(1, Command.DRAIN_HOST, DrainHostArgs()), Channel())
    assert e.value.error_code is ErrorCode.BUSY and ops.calls == []


async def test_drain_host_without_a_gateway_is_refused_before_the_agent_is_asked() -> None:
    ops = FakeOps(2)
    with pytest.raises(RequestError) as e:
        await _h(ops).handle(Request(1, Command.DRAIN_HOST, DrainHostArgs()), Channel())
    assert e.value.error_code is ErrorCode.FAILED and "no gateway" in e.value.message
    assert ops.calls == []
    await ops.aclose()


async def test_wait_ready_while_the_host_is_held_out_does_not_wait_for_the_gateway(
    ops: FakeOps,
) -> None:
    """A restart on a drained host comes back ready and stays out of the gateway on
    purpose: `farmctl restart` must not wait the join grace for each worker."""
    ops.workers[0] = replace(ops.workers[0], in_gateway=False, since=time.time())
    ops.held_out_since = time.time()
    began = time.monotonic()
    r = await _h(ops).handle(Request(1, Command.WAIT_READY, WaitArgs(0, timeout=20.0)), Channel())
    assert r["ready"] is True and r["timed_out"] is False and r["routed"] is False
    assert time.monotonic() - began < 10


async def test_why_of_a_ready_worker_on_a_drained_host_says_it_is_held_out(ops: FakeOps) -> None:
    ops.workers[1] = replace(ops.workers[1], in_gateway=False)
    ops.held_out_since = time.time()
    r = await _h(ops).handle(Request(1, Command.WHY, WorkerArgs(1)), Channel())
    note = r["state_note"]
    assert isinstance(note, str) and "farmctl undrain-host" in note and "held out" in note
