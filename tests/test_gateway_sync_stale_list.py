"""One gateway's membership sync (`workers.gateway_sync.MembershipSync`) against a list
that answers late: the gateway as it was when asked, not when it answers."""

from __future__ import annotations

import asyncio
from pathlib import Path

from agent_harness import GATEWAY, farm_toml
from fake_gateway import FakeGateway
from sglang_farm.config import load_spec
from sglang_farm.gateway import normalize_url
from sglang_farm.workers.gateway_sync import MembershipSync
from sglang_farm.workers.phase import Phase
from sglang_farm.workers.records import WorkerState
from virtual_time import run_virtual


def test_a_list_asked_before_an_add_that_failed_does_not_say_the_worker_is_out(
    tmp_path: Path,
) -> None:
    """The send of an add, not only its confirmation, makes a list asked before it stale
    for that worker. Here the list is asked, then worker 1's add is sent: smg registers it
    and answers REFUSED (its add timeout for a slow worker). The list then answers without
    worker 1, as the gateway was when asked. Taking that word would say the gateway does
    not hold worker 1, and a drain would report it out while smg routes users to it."""
    spec = load_spec(farm_toml(tmp_path, gateway=GATEWAY), source="test.toml")
    gw = FakeGateway()
    u1 = normalize_url(spec.gateway_url_of(1))
    gw.refuse_after_add.add(u1)
    gw.list_lag = 5.0
    states = {w: WorkerState(w, Phase.STOPPED) for w in spec.worker_ids}
    sync = MembershipSync(gw, spec=lambda: spec, states=lambda: states, on_member=lambda w, i: None)

    async def scenario() -> None:
        sync.start()
        await asyncio.sleep(1.0)  # the first list is under way (it answers at 5 s)
        states[1] = WorkerState(1, Phase.READY)
        sync.update()  # worker 1's add: registered, then refused
        await asyncio.sleep(0.1)
        assert gw.calls == [("add", u1)] and u1 in gw.members
        assert sync.refused.get(1), "the add was refused"
        states[1] = WorkerState(1, Phase.STOPPED)  # no longer wanted: no retry of the add
        await asyncio.sleep(5.0)  # the first list has answered (at 5 s); a second is asked
        assert sync.held.get(1, True), (
            "a list asked before the add said the gateway does not hold worker 1; "
            f"it does: {sorted(gw.members)}"
        )
        await sync.close()

    run_virtual(scenario())
