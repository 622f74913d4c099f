"""The canary driver's and rollout's correctness under the operator's and the farm's
interference during an analysis (issue 23's review, B1-B6): restarts, stops,
quarantines, crashes while judging, reloads of the same change, edits of the file.
Agent tests on the virtual clock (tests/agent_harness.py), plus pure `observe` cases."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from agent_harness import Farm, farm
from canary_farm import Metrics, _start, _toml
from sglang_farm.canary.driver import Host
from sglang_farm.canary.rollout import Analysis, CanaryObs, Fail, Inconclusive, Stopped, observe
from sglang_farm.canary.view import CanaryState
from sglang_farm.config import load_spec
from sglang_farm.spec import FarmSpec
from sglang_farm.workers.commands import FarmCommand
from sglang_farm.workers.phase import Phase
from sglang_farm.workers.supervisor import GpuFailing, StopIntent, WorkerState, farm_policy
from virtual_time import run_virtual


def _in_window(f: Farm) -> bool:
    v = f.agent.view().canary
    return v is not None and v.state is CanaryState.ANALYSING and v.ends_at is not None


def _env_of(f: Farm, worker: int) -> dict[str, str]:
    return f.runtime.procs[worker].command.env_dict


def _state(f: Farm) -> CanaryState | None:
    v = f.agent.view().canary
    return None if v is None else v.state


# ---- B4, B5: pure -------------------------------------------------------------------------


def _analysing() -> Analysis:
    return Analysis("sha256:" + "0" * 64, 0, 60.0, 0.0, None, window_start=50.0)


def test_a_quarantine_stop_of_the_canary_is_inconclusive_not_a_crash() -> None:
    obs = CanaryObs(phase=Phase.STOPPING, in_gateway=False, stop_intent=StopIntent.QUARANTINE)
    _, step = observe(_analysing(), obs, 100.0, gateway=True)
    assert isinstance(step, Inconclusive)
    draining = CanaryObs(phase=Phase.DRAINING, in_gateway=False, stop_intent=StopIntent.QUARANTINE)
    assert isinstance(observe(_analysing(), draining, 100.0, gateway=True)[1], Inconclusive)


def test_an_operator_restart_of_the_canary_rearms_the_window_not_a_crash() -> None:
    obs = CanaryObs(phase=Phase.STOPPING, in_gateway=False, stop_intent=StopIntent.RESTART)
    a, step = observe(_analysing(), obs, 100.0, gateway=True)
    assert not isinstance(step, Fail)
    assert a.window_start is None  # judged again once it serves again, in a new window
    # ...and a crash after that restart still fails it.
    crashed = CanaryObs(phase=Phase.FAILED, in_gateway=False)
    assert isinstance(observe(a, crashed, 110.0, gateway=True)[1], Fail)


def test_a_canary_restarted_for_its_own_failure_is_failed_not_rearmed() -> None:
    """An OOM of the canary while serving, then the ladder's restart (scope "all"): the
    restart is the farm's reaction to the change's failure, not an operator's."""
    from sglang_farm.sglang.failures import Failure, FailureKind

    oom = Failure(FailureKind.CUDA_OOM_SERVING, "CUDA out of memory while serving", "")
    obs = CanaryObs(
        phase=Phase.DRAINING,
        in_gateway=False,
        stop_intent=StopIntent.RESTART,
        last_failure=oom,
        last_failure_at=90.0,
    )
    assert isinstance(observe(_analysing(), obs, 100.0, gateway=True)[1], Fail)


def test_an_operator_stop_of_the_canary_is_stopped() -> None:
    obs = CanaryObs(phase=Phase.DRAINING, in_gateway=False, stop_intent=StopIntent.STOP)
    assert isinstance(observe(_analysing(), obs, 100.0, gateway=True)[1], Stopped)


# ---- B4 -----------------------------------------------------------------------------------


def test_operator_restart_of_the_canary_in_the_window_does_not_reject(tmp: Path) -> None:
    new = _toml(tmp, {"HARMLESS": "1"})
    m = Metrics()

    async def scenario() -> None:
        loader = lambda: load_spec(new, source="test.toml")  # noqa: E731
        async with farm(tmp, text=_toml(tmp), loader=loader, scrape=m) as f:
            await _start(f, m)
            assert (await f.ops.reload()).applied
            await f.until(lambda: _in_window(f), within=300)
            await asyncio.sleep(5)
            await f.ops.restart([0])
            await f.until(lambda: _state(f) is CanaryState.PROMOTED, within=400)
            assert all(f.runtime.procs[w].command.env_dict.get("HARMLESS") == "1" for w in range(4))

    run_virtual(scenario())


# ---- B5 -----------------------------------------------------------------------------------


def test_a_canary_gpu_quarantined_in_the_window_is_inconclusive_not_rejected(tmp: Path) -> None:
    new = _toml(tmp, {"HARMLESS": "1"})
    m = Metrics()

    async def scenario() -> None:
        loader = lambda: load_spec(new, source="test.toml")  # noqa: E731
        async with farm(tmp, text=_toml(tmp), loader=loader, scrape=m) as f:
            await _start(f, m)
            assert (await f.ops.reload()).applied
            await f.until(lambda: _in_window(f), within=300)
            f.agent.feed(0, GpuFailing(0, "xid 79", "fell off the bus"))
            await f.until(lambda: _state(f) is not CanaryState.ANALYSING, within=300)
            v = f.agent.view().canary
            assert v is not None and v.state is CanaryState.HELD, v and v.evidence
            assert "inconclusive" in v.evidence
            rec = json.loads((tmp / "canary.json").read_text())
            assert rec["rejected"] == []

    run_virtual(scenario())


# ---- B6 -----------------------------------------------------------------------------------


def test_stopped_canary_then_same_reload_is_not_rejected(tmp: Path) -> None:
    new = _toml(tmp, {"HARMLESS": "1"})
    m = Metrics()

    async def scenario() -> None:
        loader = lambda: load_spec(new, source="test.toml")  # noqa: E731
        async with farm(tmp, text=_toml(tmp), loader=loader, scrape=m) as f:
            await _start(f, m)
            assert (await f.ops.reload()).applied
            await f.until(lambda: _in_window(f), within=300)
            await f.ops.stop([0])
            await f.until(lambda: _state(f) is CanaryState.HELD, within=100)
            await f.ops.reload()  # "reload to judge the change again"
            await f.until(lambda: _state(f) is not CanaryState.ANALYSING, within=300)
            v = f.agent.view().canary
            assert v is not None and v.state is CanaryState.PROMOTED, v and v.evidence
            rec = json.loads((tmp / "canary.json").read_text())
            assert rec["rejected"] == []
            await f.until(f.all_ready, within=300)
            assert all(_env_of(f, w).get("HARMLESS") == "1" for w in range(4))

    run_virtual(scenario())


# ---- B3 -----------------------------------------------------------------------------------


class CrashAtEndScrape(Metrics):
    """The canary dies while the window's final scrape is under way (a slow scrape)."""

    def __init__(self) -> None:
        super().__init__()
        self.end: float | None = None
        self.f: Farm | None = None
        self.fired = False

    async def __call__(self, url: str, key: str | None) -> str:
        body = await super().__call__(url, key)
        loop = asyncio.get_running_loop()
        if self.end is not None and not self.fired and loop.time() >= self.end and ":30000" in url:
            self.fired = True
            assert self.f is not None
            self.f.runtime.crash(0, 1, ("RuntimeError: boom",))
            await asyncio.sleep(2)  # the rest of the scrape (other workers) takes a while
        return body


def test_a_canary_crash_during_the_final_scrape_is_not_promoted(tmp: Path) -> None:
    new = _toml(tmp, {"HARMLESS": "1"})
    m = CrashAtEndScrape()

    async def scenario() -> None:
        loader = lambda: load_spec(new, source="test.toml")  # noqa: E731
        async with farm(tmp, text=_toml(tmp), loader=loader, scrape=m) as f:
            m.f = f
            await _start(f, m)
            assert (await f.ops.reload()).applied
            await f.until(lambda: _in_window(f), within=300)
            v = f.agent.view().canary
            assert v is not None and v.ends_at is not None
            m.end = v.ends_at - 1.8e9  # the harness's wall clock is 1.8e9 + loop time
            await f.until(lambda: m.fired, within=200)
            await asyncio.sleep(60)
            v = f.agent.view().canary
            assert v is not None and v.state is CanaryState.ROLLED_BACK, v and v.evidence
            assert all(
                f.runtime.procs[w].command.env_dict.get("HARMLESS") is None for w in (1, 2, 3)
            )

    run_virtual(scenario())


# ---- B2 -----------------------------------------------------------------------------------


def test_a_rollback_during_a_reload_of_the_same_change_does_not_accept_it(tmp: Path) -> None:
    new = _toml(tmp, {"BAD": "1"})
    m = Metrics()
    slow = {"on": False}
    ref: dict[str, Farm] = {}

    async def refresh(_spec: FarmSpec) -> None:
        if slow["on"]:  # the canary crashes while the reload awaits its preflight
            ref["f"].runtime.crash(0, 1, ("RuntimeError: boom",))
            await asyncio.sleep(10)

    async def scenario() -> None:
        loader = lambda: load_spec(new, source="test.toml")  # noqa: E731
        async with farm(tmp, text=_toml(tmp), loader=loader, scrape=m, refresh=refresh) as f:
            ref["f"] = f
            await _start(f, m)
            assert (await f.ops.reload()).applied
            await f.until(lambda: _in_window(f), within=300)
            slow["on"] = True
            await f.ops.reload()  # the same change again (an operator's impatience)
            slow["on"] = False
            await asyncio.sleep(120)
            rec = json.loads((tmp / "canary.json").read_text())
            rejected = {x["change"] for x in rec["rejected"]}
            assert rejected and rec["accepted"]["change"] not in rejected
            assert all(p.command.env_dict.get("BAD") is None for p in f.runtime.procs.values())
            assert f.agent.spec.farm.env.get("BAD") is None

    run_virtual(scenario())


# ---- B1 -----------------------------------------------------------------------------------


def test_a_rejected_change_in_the_file_is_not_run_after_restart_when_edited_during_a_window(
    tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp)
    old, bad, good = _toml(tmp), _toml(tmp, {"SLOW": "1"}), _toml(tmp, {"HARMLESS": "1"})
    cfg = tmp / "test.toml"
    cfg.write_text(old)
    m1, m2 = Metrics(), Metrics()

    def loader() -> FarmSpec:
        return load_spec(cfg.read_text(), source="test.toml")

    async def scenario() -> None:
        async with farm(tmp, text=old, loader=loader, scrape=m1) as f:
            await _start(f, m1)
            cfg.write_text(bad)
            assert (await f.ops.reload()).applied
            await f.until(lambda: _state(f) is CanaryState.ROLLED_BACK, within=300)
            await f.until(f.all_ready)
            cfg.write_text(good)
            assert (await f.ops.reload()).applied
            await f.until(lambda: _in_window(f), within=300)
            cfg.write_text(bad)  # the operator edits the file during the window (not reloaded)
            await f.until(lambda: _state(f) is CanaryState.PROMOTED, within=300)
            assert json.loads((tmp / "canary.json").read_text())["accepted"]["text"] == good
        async with farm(tmp, text=bad, loader=loader, scrape=m2) as f:
            m2.runtime = f.runtime
            await f.until(lambda: len(f.runtime.starts) >= 4)
            await asyncio.sleep(60)
            slow = [w for w, c in f.runtime.starts if c.env_dict.get("SLOW") == "1"]
            assert not slow
            assert all(c.env_dict.get("HARMLESS") == "1" for _, c in f.runtime.starts)

    run_virtual(scenario())


# ---- B1 (the last fallback), item 16 (a window of 0 s) --------------------------------------


def _record(tmp: Path, *, accepted_text: str | None, rejected: FarmSpec) -> None:
    from sglang_farm.canary import record, store
    from sglang_farm.canary.record import RejectedChanges
    from sglang_farm.canary.rollout import spec_change

    bad = spec_change(rejected)
    store.save(
        str(tmp),
        store.CanaryRecord(
            record.Accepted("sha256:" + "1" * 64, accepted_text, 1.8e9),
            RejectedChanges().reject(bad, "canary ITL p50 5.0x the baseline's", 1.8e9),
        ),
    )


class _IdleFarm:
    """The agent's entry as the driver sees it, never asked to change anything."""

    def __init__(self, spec: FarmSpec) -> None:
        self.spec = spec
        self.policy = farm_policy(spec)

    def states(self) -> Mapping[int, WorkerState]:
        return {}

    def submit(self, command: FarmCommand) -> None:
        raise AssertionError(f"the driver acted at construction: {command}")


def _idle_host(spec: FarmSpec) -> Host:
    """A host the driver never calls: these tests read only its start-up choice."""

    def never(*_a: object) -> Any:
        raise AssertionError("the driver acted at construction")

    return Host(
        farm=_IdleFarm(spec),
        rollout_over=never,
        spawn=never,
        refresh=never,
        reload=never,
        startup_done=never,
        clock=never,
        wall=never,
        gateway=never,
        restore_model=never,
    )


def test_a_rejected_change_with_no_usable_accepted_config_starts_nothing(tmp: Path) -> None:
    from sglang_farm.canary.driver import CanaryDriver
    from sglang_farm.errors import ConfigError

    bad = load_spec(_toml(tmp, {"SLOW": "1"}), source="test.toml")
    _record(tmp, accepted_text=None, rejected=bad)
    with pytest.raises(ConfigError) as exc:
        CanaryDriver(bad, _idle_host(bad))
    (problem,) = exc.value.problems
    assert "was rejected by its canary" in problem and "nothing starts" in problem
    assert "canary.json" in problem


def test_a_rejected_change_is_not_started_with_analysis_off_either(tmp: Path) -> None:
    from sglang_farm.canary.driver import CanaryDriver

    old_text = _toml(tmp)
    bad = load_spec(_toml(tmp, {"SLOW": "1"}, analysis_window="0s"), source="test.toml")
    _record(tmp, accepted_text=old_text, rejected=bad)
    d = CanaryDriver(bad, _idle_host(bad))
    assert d.spec.farm.env.get("SLOW") is None  # the accepted config, held
    assert d.held(bad) is not None and "rejected" in (d.held(bad) or "")


def test_a_rejected_change_reloaded_with_a_window_of_0s_is_refused(tmp: Path) -> None:
    bad = _toml(tmp, {"SLOW": "1"})
    bad0 = _toml(tmp, {"SLOW": "1"}, analysis_window="0s")
    m = Metrics()
    texts = [bad]

    async def scenario() -> None:
        loader = lambda: load_spec(texts[-1], source="test.toml")  # noqa: E731
        async with farm(tmp, text=_toml(tmp), loader=loader, scrape=m) as f:
            await _start(f, m)
            assert (await f.ops.reload()).applied
            await f.until(lambda: _state(f) is CanaryState.ROLLED_BACK, within=300)
            await f.until(f.all_ready)
            texts.append(bad0)  # the same workers' change, analysis switched off
            r = await f.ops.reload()
            assert not r.applied and r.held is not None
            await asyncio.sleep(60)
            assert all(p.command.env_dict.get("SLOW") is None for p in f.runtime.procs.values())

    run_virtual(scenario())


# ---- item 9: a refused reload leaves the analysis alone ------------------------------------


def test_a_refused_reload_during_an_analysis_leaves_the_canary_on_the_change(tmp: Path) -> None:
    from agent_harness import farm_toml
    from canary_farm import WINDOW

    new = _toml(tmp, {"HARMLESS": "1"})
    refused = farm_toml(
        tmp,
        workers=4,
        rollout=dict(WINDOW),
        farm={"state_dir": str(tmp), "env": {"OTHER": "1"}},
        gateway={"drain_timeout": "9s"},  # a [gateway] change: refused by a reload
    )
    texts = [new]
    m = Metrics()

    async def scenario() -> None:
        loader = lambda: load_spec(texts[-1], source="test.toml")  # noqa: E731
        async with farm(tmp, text=_toml(tmp), loader=loader, scrape=m) as f:
            await _start(f, m)
            assert (await f.ops.reload()).applied
            await f.until(lambda: _in_window(f), within=300)
            starts = f.runtime.starts_of(0)
            texts.append(refused)
            r = await f.ops.reload()
            assert not r.applied and "[gateway] changed" in r.problems[0]
            assert _in_window(f) and f.runtime.starts_of(0) == starts
            await f.until(lambda: _state(f) is CanaryState.PROMOTED, within=300)
            assert f.runtime.starts_of(0) == starts
            assert all(p.command.env_dict.get("HARMLESS") == "1" for p in f.runtime.procs.values())

    run_virtual(scenario())


# ---- fleet review: a [gateway] change with a worker change, applied by an agent restart --


def test_a_gateway_change_with_a_worker_change_is_applied_by_the_agent_restart(
    tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `farmctl reload` refuses a [gateway] change (exit 10: restart the agent). The agent
    # restarted on a file whose worker change was never accepted starts on the accepted
    # config and rolls the file's change canary first; it used to take the accepted
    # config's [gateway] too, so the re-roll was refused again ("[gateway] changed") and
    # the worker change never rolled, the config pending for good.
    from agent_harness import GATEWAY, farm_toml
    from fake_gateway import FakeGateway

    monkeypatch.chdir(tmp)
    window = {"analysis_window": "60s"}
    old = farm_toml(tmp, workers=4, rollout=window, gateway=GATEWAY)
    new = farm_toml(
        tmp,
        workers=4,
        rollout=window,
        gateway={**GATEWAY, "drain_timeout": "40s"},
        farm={"state_dir": str(tmp), "env": {"HARMLESS": "1"}},
    )
    seen: dict[str, object] = {}
    conf = tmp / "test.toml"  # the accepted config's text is recorded from the file
    conf.write_text(old)

    async def scenario() -> None:
        m1, m2 = Metrics(), Metrics()
        async with farm(
            tmp, text=old, loader=lambda: load_spec(new, source="test.toml"), scrape=m1,
            gateway=FakeGateway(),
        ) as f:  # fmt: skip
            await _start(f, m1)
            assert json.loads((tmp / "canary.json").read_text())["accepted"]["text"] == old
            conf.write_text(new)
            r = await f.ops.reload()
            seen["reload"] = (r.applied, r.restart_needed)
        async with farm(
            tmp, text=new, loader=lambda: load_spec(new, source="test.toml"), scrape=m2,
            gateway=FakeGateway(),
        ) as f:  # fmt: skip
            m2.runtime = f.runtime
            m2.t0 = asyncio.get_running_loop().time()
            await f.until(lambda: len(f.runtime.starts) >= 4)
            await asyncio.sleep(400)
            seen["drain_timeout"] = f.agent.spec.gateway.drain_timeout
            seen["env"] = [("HARMLESS" in _env_of(f, w)) for w in range(4)]
            r = await f.ops.reload()
            seen["reload_after"] = (r.applied, r.restart_needed)

    run_virtual(scenario())
    assert seen["reload"] == (False, True)  # refused: needs the agent's restart
    assert seen["drain_timeout"] == 40.0  # the file's [gateway], set up at the agent's start
    assert seen["env"] == [True] * 4  # the worker change rolled, canary first, and promoted
    assert seen["reload_after"] in ((True, False), (False, False))  # no restart needed now
