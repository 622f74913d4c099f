"""A failure that is the worker's past (issue 31 item 4), in the real Agent on the virtual clock.

`why 3` after `reset-oom 3`, `restart 3` and a manual stop still said `gave up after 6
failures in a row` from a run before, as if it ailed the worker now. Once the worker has
served again, or the operator reset it, the failure is its past: the view (and `why`)
say so, and the next agent, reading the state file, too.
"""

from __future__ import annotations

import json
from pathlib import Path

from agent_harness import farm, farm_toml
from sglang_farm.control.results import why_result
from sglang_farm.workers.phase import Phase
from virtual_time import run_virtual

CRASH = ("Traceback (most recent call last):", "RuntimeError: boom")


def test_a_failure_is_past_once_the_worker_served_again_and_after_an_agent_restart(
    tmp: Path,
) -> None:
    text = farm_toml(tmp, workers=4, restart={"max_failures": 2})

    async def scenario() -> None:
        async with farm(tmp, text=text) as f:
            await f.until(f.all_ready)
            # A crash loop: worker 3 dies at every start until the farm gives up.
            while f.phase(3) is not Phase.FAILED:
                await f.until(lambda: 3 in f.runtime.procs or f.phase(3) is Phase.FAILED)
                if 3 in f.runtime.procs:
                    f.runtime.crash(3, 1, CRASH)
                    await f.until(lambda: 3 not in f.runtime.procs)
            w = f.agent.view().worker(3)
            assert w.last_failure is not None and w.failure_past is None
            assert w.last_action is not None and w.last_action.startswith("gave up after")
            why = why_result(w)
            assert why["failure_past"] is None  # it ails the worker now
            # The operator's reset: the failure is past, before the worker has served.
            await f.ops.reset_oom(3)
            assert f.agent.view().worker(3).failure_past == "reset"
            await f.ops.restart([3])
            await f.until(lambda: f.phase(3) is Phase.READY)
            await f.ops.stop([3])
            await f.until(lambda: f.phase(3) is Phase.STOPPED)
            w = f.agent.view().worker(3)
            assert w.last_failure is not None  # kept: when it happened, what it was
            assert w.failure_past == "served"
            assert why_result(w)["failure_past"] == "served"
            assert w.id == 3 and why_result(f.agent.view().worker(0))["failure_past"] is None
        saved = json.loads((tmp / "state.json").read_text())["workers"]["3"]
        assert saved["failure_past"] == "served"
        async with farm(tmp, text=text) as f:
            await f.until(lambda: f.phase(0) is Phase.READY)
            w = f.agent.view().worker(3)
            assert w.last_failure is not None and w.failure_past == "served"

    run_virtual(scenario())


def test_a_new_failure_after_serving_is_the_present_one_again(tmp: Path) -> None:
    text = farm_toml(tmp, workers=2)

    async def scenario() -> None:
        async with farm(tmp, text=text) as f:
            await f.until(f.all_ready)
            f.runtime.crash(1, 1, CRASH)
            await f.until(lambda: f.phase(1) is Phase.READY and 1 in f.runtime.procs)
            assert f.agent.view().worker(1).failure_past == "served"
            f.runtime.crash(1, 1, CRASH)
            await f.until(lambda: f.phase(1) is not Phase.READY)
            w = f.agent.view().worker(1)
            assert w.last_failure is not None and w.failure_past is None

    run_virtual(scenario())
