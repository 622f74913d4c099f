"""The canary analysis in the real Agent over the fakes, on the virtual clock (issue 23).

A reload changes `[farm] env`; the fake workers' /metrics (synthetic Prometheus text, fed
through the agent's scrape seam) are slow when a worker runs `SLOW=1`. Pass -> the next
waves; fail -> the canary alone back on the old config, the change refused afterwards; a
crash in the window -> rolled back at once; an agent restarted during the analysis
starts on the accepted config and rolls the change canary first again; a second reload
during the analysis supersedes the first.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from agent_harness import GATEWAY, OOM_LINE, Farm, farm, farm_toml, urls
from canary_farm import ANSWERED_200, WINDOW, Metrics, _start, _toml
from fake_gateway import FakeGateway
from sglang_farm.canary.evalrun import EvalGate, EvalRun
from sglang_farm.canary.evalset import EvalItem, Score, eval_verdict
from sglang_farm.canary.view import CanaryState
from sglang_farm.config import load_spec
from sglang_farm.sglang.argv import Command
from sglang_farm.workers.phase import Phase
from virtual_time import run_virtual


def _env(f: Farm, worker: int) -> dict[str, str]:
    return f.runtime.procs[worker].command.env_dict


def test_a_passing_canary_holds_the_next_waves_for_the_window_then_promotes(tmp: Path) -> None:
    new = _toml(tmp, {"HARMLESS": "1"})
    m = Metrics()

    async def scenario() -> None:
        async with farm(
            tmp, text=_toml(tmp), loader=lambda: load_spec(new, source="test.toml"), scrape=m
        ) as f:
            await _start(f, m)
            result = await f.ops.reload()
            assert result.applied and result.restarted == (0, 1, 2, 3)
            # Issue 31 item 2: only the canary is restarted now; the rest wait on it.
            assert result.gated_on == 0
            await f.until(lambda: f.runtime.starts_of(0) == 2 and f.phase(0) is Phase.READY)
            await asyncio.sleep(30)  # inside the window: the other workers wait
            view = f.agent.view().canary
            assert view is not None and view.state is CanaryState.ANALYSING
            assert view.canary == 0 and view.ends_at is not None
            assert [f.runtime.starts_of(w) for w in (1, 2, 3)] == [1, 1, 1]
            await f.until(lambda: all(f.runtime.starts_of(w) == 2 for w in range(4)), within=200)
            await f.until(f.all_ready)
            view = f.agent.view().canary
            assert view is not None and view.state is CanaryState.PROMOTED
            assert view.evidence.startswith("promoted: ")
            assert {c.name for c in view.checks} >= {"itl_p50"}
            assert all(_env(f, w).get("HARMLESS") == "1" for w in range(4))
            record = json.loads((tmp / "canary.json").read_text())
            assert record["rejected"] == []

    run_virtual(scenario())


def test_a_slow_canary_is_rolled_back_alone_and_its_change_is_not_retried(tmp: Path) -> None:
    new = _toml(tmp, {"SLOW": "1"})
    m = Metrics()

    async def scenario() -> None:
        async with farm(
            tmp, text=_toml(tmp), loader=lambda: load_spec(new, source="test.toml"), scrape=m
        ) as f:
            await _start(f, m)
            result = await f.ops.reload()
            assert result.applied and result.gated_on == 0
            await f.until(
                lambda: (
                    (v := f.agent.view().canary) is not None and v.state is CanaryState.ROLLED_BACK
                ),
                within=300,
            )
            view = f.agent.view().canary
            assert view is not None
            assert view.evidence.startswith("rolled back: ") and "ITL" in view.evidence
            assert view.rollbacks_total == 1
            await f.until(lambda: f.runtime.starts_of(0) == 3 and f.phase(0) is Phase.READY)
            assert "SLOW" not in _env(f, 0)  # back on the old config
            await asyncio.sleep(300)  # the dropped waves never come
            assert [f.runtime.starts_of(w) for w in (1, 2, 3)] == [1, 1, 1]
            ran_slow = {w for w, c in f.runtime.starts if c.env_dict.get("SLOW") == "1"}
            assert ran_slow == {0}
            again = await f.ops.reload()
            assert not again.applied
            assert "rejected by its canary" in again.problems[0]
            assert "edit the config to retry" in again.problems[0]
            record = json.loads((tmp / "canary.json").read_text())
            assert len(record["rejected"]) == 1

    run_virtual(scenario())


def test_a_canary_that_crashes_in_the_window_is_rolled_back_at_once(tmp: Path) -> None:
    new = _toml(tmp, {"CRASHY": "1"}, analysis_window="10m")
    m = Metrics()

    async def scenario() -> None:
        async with farm(
            tmp, text=_toml(tmp), loader=lambda: load_spec(new, source="test.toml"), scrape=m
        ) as f:
            await _start(f, m)
            assert (await f.ops.reload()).applied
            await f.until(
                lambda: (
                    (v := f.agent.view().canary) is not None
                    and v.state is CanaryState.ANALYSING
                    and v.ends_at is not None
                )
            )
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            await asyncio.sleep(20)
            f.runtime.crash(0, 1, ("Traceback (most recent call last):", "RuntimeError: boom"))
            await f.until(
                lambda: (
                    (v := f.agent.view().canary) is not None and v.state is CanaryState.ROLLED_BACK
                ),
                within=30,
            )
            assert loop.time() - t0 < 600  # not at the window's end
            view = f.agent.view().canary
            assert view is not None and "crashed" in view.evidence
            await f.until(lambda: 0 in f.runtime.procs and f.phase(0) is Phase.READY)
            assert "CRASHY" not in _env(f, 0)
            assert f.agent.view().worker(0).oom_step == 0
            assert [f.runtime.starts_of(w) for w in (1, 2, 3)] == [1, 1, 1]

    run_virtual(scenario())


def test_a_canary_oom_in_the_window_is_named_in_the_verdict_and_in_why(tmp: Path) -> None:
    """Issue 31 item 3: a CUDA OOM in the canary's log while it served gave `canary
    crashed 6 s into the window: the canary left serving (stopping)`, and its `why` said
    `no failure recorded` once the rollback had restarted it. The classifier's failure
    (kind and summary) is the verdict's evidence and the canary's last failure."""
    new = _toml(tmp, {"CRASHY": "1"}, analysis_window="10m")
    m = Metrics()

    async def scenario() -> None:
        async with farm(
            tmp, text=_toml(tmp), loader=lambda: load_spec(new, source="test.toml"), scrape=m
        ) as f:
            await _start(f, m)
            assert (await f.ops.reload()).applied
            await f.until(
                lambda: (
                    (v := f.agent.view().canary) is not None
                    and v.state is CanaryState.ANALYSING
                    and v.ends_at is not None
                )
            )
            await asyncio.sleep(6)
            f.runtime.log(0, OOM_LINE)  # SGLang survives it; the farm stops the worker
            await f.until(
                lambda: (
                    (v := f.agent.view().canary) is not None and v.state is CanaryState.ROLLED_BACK
                ),
                within=60,
            )
            view = f.agent.view().canary
            assert view is not None
            assert view.evidence.startswith("rolled back: canary oom "), view.evidence
            assert "into the window: CUDA out of memory" in view.evidence, view.evidence
            assert "left serving" not in view.evidence
            await f.until(lambda: 0 in f.runtime.procs and f.phase(0) is Phase.READY)
            assert "CRASHY" not in _env(f, 0)  # back on the old config
            w = f.agent.view().worker(0)
            assert w.last_failure is not None, "the canary's OOM was forgotten"
            assert w.last_failure.kind.startswith("cuda_oom_")
            # The verdict names what `why` shows: the classifier's summary and kind.
            assert view.evidence.endswith(f"{w.last_failure.summary} [{w.last_failure.kind}]")
            assert [f.runtime.starts_of(x) for x in (1, 2, 3)] == [1, 1, 1]

    run_virtual(scenario())


def test_a_second_reload_during_the_analysis_supersedes_the_first(tmp: Path) -> None:
    texts = [_toml(tmp, {"FIRST": "1"})]
    m = Metrics()

    async def scenario() -> None:
        async with farm(
            tmp, text=_toml(tmp), loader=lambda: load_spec(texts[0], source="test.toml"), scrape=m
        ) as f:
            await _start(f, m)
            assert (await f.ops.reload()).applied
            await f.until(lambda: f.runtime.starts_of(0) == 2 and f.phase(0) is Phase.READY)
            await asyncio.sleep(20)
            texts[0] = _toml(tmp, {"SECOND": "1"})
            assert (await f.ops.reload()).applied
            await f.until(lambda: all(f.runtime.starts_of(w) >= 2 for w in range(4)), within=400)
            await f.until(f.all_ready)
            view = f.agent.view().canary
            assert view is not None and view.state is CanaryState.PROMOTED
            assert all(_env(f, w).get("SECOND") == "1" for w in range(4))
            ran_first = {w for w, c in f.runtime.starts if c.env_dict.get("FIRST") == "1"}
            assert ran_first == {0}  # the first change never left the canary

    run_virtual(scenario())


def test_an_agent_restarted_during_the_analysis_starts_on_the_accepted_config(
    tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The config file says the new change; the record says it was never accepted: the
    restarted agent starts every worker on the accepted config, then rolls the change
    canary first (a reload from the file), judged again."""
    monkeypatch.chdir(tmp)
    old, new = _toml(tmp), _toml(tmp, {"HARMLESS": "1"})
    (tmp / "test.toml").write_text(old)
    m1, m2 = Metrics(), Metrics()

    async def scenario() -> None:
        async with farm(
            tmp, text=old, loader=lambda: load_spec(new, source="test.toml"), scrape=m1
        ) as f:
            await _start(f, m1)
            record = json.loads((tmp / "canary.json").read_text())
            assert record["accepted"]["text"] == old
            (tmp / "test.toml").write_text(new)
            assert (await f.ops.reload()).applied
            await f.until(
                lambda: (v := f.agent.view().canary) is not None and v.ends_at is not None
            )
        # The agent went during the analysis; it comes back with the file's config.
        async with farm(
            tmp, text=new, loader=lambda: load_spec(new, source="test.toml"), scrape=m2
        ) as f:
            m2.runtime = f.runtime
            m2.t0 = asyncio.get_running_loop().time()
            await f.until(lambda: len(f.runtime.starts) >= 4)
            assert all("HARMLESS" not in c.env_dict for _, c in f.runtime.starts[:4])
            await f.until(
                lambda: (
                    (v := f.agent.view().canary) is not None
                    and v.state is CanaryState.ANALYSING
                    and v.ends_at is not None
                ),
                within=300,
            )
            assert [f.runtime.starts_of(w) for w in (1, 2, 3)] == [1, 1, 1]
            await f.until(lambda: all(f.runtime.starts_of(w) == 2 for w in range(4)), within=300)
            assert all(c.env_dict.get("HARMLESS") == "1" for _, c in f.runtime.starts[-3:])

    run_virtual(scenario())


def test_an_agent_restarted_with_a_rejected_change_holds_it_on_the_accepted_config(
    tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp)
    old, bad = _toml(tmp), _toml(tmp, {"SLOW": "1"})
    (tmp / "test.toml").write_text(old)
    m1, m2 = Metrics(), Metrics()

    async def scenario() -> None:
        async with farm(
            tmp, text=old, loader=lambda: load_spec(bad, source="test.toml"), scrape=m1
        ) as f:
            await _start(f, m1)
            (tmp / "test.toml").write_text(bad)
            assert (await f.ops.reload()).applied
            await f.until(
                lambda: (
                    (v := f.agent.view().canary) is not None and v.state is CanaryState.ROLLED_BACK
                ),
                within=300,
            )
        async with farm(
            tmp, text=bad, loader=lambda: load_spec(bad, source="test.toml"), scrape=m2
        ) as f:
            m2.runtime = f.runtime
            await f.until(f.all_ready)
            await asyncio.sleep(120)
            assert len(f.runtime.starts) == 4
            assert all("SLOW" not in c.env_dict for _, c in f.runtime.starts)
            view = f.agent.view().canary
            assert view is not None and view.state is CanaryState.HELD
            assert view.evidence.startswith("held: change sha256:")
            assert "edit the config to retry" in view.evidence

    run_virtual(scenario())


@pytest.mark.parametrize("damage", ["cut in half", "chmod 664"])
def test_a_damaged_or_untrusted_record_still_holds_its_rejected_change(
    tmp: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    """Issue 30 item 6: canary.json cut in half, or chmod 664, made the agent start all
    workers on the change its canary had rejected, and overwrite the file at once. The
    file is kept aside (never overwritten), its second copy read: the change stays held."""
    import os

    monkeypatch.chdir(tmp)
    old, bad = _toml(tmp), _toml(tmp, {"SLOW": "1"})
    (tmp / "test.toml").write_text(old)
    m1, m2 = Metrics(), Metrics()
    record = tmp / "canary.json"

    async def scenario() -> None:
        async with farm(
            tmp, text=old, loader=lambda: load_spec(bad, source="test.toml"), scrape=m1
        ) as f:
            await _start(f, m1)
            (tmp / "test.toml").write_text(bad)
            assert (await f.ops.reload()).applied
            await f.until(
                lambda: (
                    (v := f.agent.view().canary) is not None and v.state is CanaryState.ROLLED_BACK
                ),
                within=300,
            )
        if damage == "cut in half":
            data = record.read_bytes()
            record.write_bytes(data[: len(data) // 2])
        else:
            os.chmod(record, 0o664)
        damaged = record.read_bytes()
        async with farm(
            tmp, text=bad, loader=lambda: load_spec(bad, source="test.toml"), scrape=m2
        ) as f:
            m2.runtime = f.runtime
            await f.until(f.all_ready)
            await asyncio.sleep(120)
            assert all("SLOW" not in c.env_dict for _, c in f.runtime.starts)
            view = f.agent.view()
            assert view.canary is not None and view.canary.state is CanaryState.HELD
            (alert,) = [a for a in view.state_alerts if a.file == str(record)]
            assert alert.kept is not None and ".refused-" in alert.kept
            kept = await asyncio.to_thread(Path(alert.kept).read_bytes)
            assert kept == damaged  # kept whole, never overwritten
            assert "canary.json.copy" in alert.then
        # The record written since still holds the rejection.
        assert len(json.loads(record.read_text())["rejected"]) == 1

    run_virtual(scenario())


class FakeGate:
    """The eval gate (evalrun.run_gate's signature): the canary answers `canary_correct`
    of the set right, the baseline all of it."""

    def __init__(self, canary_correct: int) -> None:
        self.canary_correct = canary_correct
        self.calls: list[tuple[str, str]] = []
        self.routed_then: set[str] | None = None
        self.gateway: FakeGateway | None = None

    async def __call__(
        self,
        items: Sequence[EvalItem],
        *,
        canary_url: str,
        baseline_url: str,
        tolerance: float,
        **_: object,
    ) -> EvalGate:
        self.calls.append((canary_url, baseline_url))
        assert self.gateway is not None
        self.routed_then = self.gateway.routed()
        n = len(items)
        verdict = eval_verdict(self.canary_correct, n, n, tolerance)

        def run(url: str, correct: int) -> EvalRun:
            return EvalRun(url, (), (), Score(correct, n, 0, ()))

        return EvalGate(verdict, run(canary_url, self.canary_correct), run(baseline_url, n))


@pytest.mark.parametrize("canary_correct", [40, 30])
def test_the_eval_gate_runs_before_the_canary_joins_the_gateway(
    tmp: Path, canary_correct: int
) -> None:
    eval_file = Path(__file__).parent.parent / "etc/sglang-farm/eval/arith.jsonl"
    old = farm_toml(tmp, workers=4, gateway=GATEWAY, rollout={**WINDOW, "eval": str(eval_file)})
    new = farm_toml(
        tmp,
        workers=4,
        gateway=GATEWAY,
        farm={"state_dir": str(tmp), "env": {"CHANGED": "1"}},
        rollout={**WINDOW, "eval": str(eval_file)},
    )
    m, gate, gw = Metrics(), FakeGate(canary_correct), FakeGateway()
    gate.gateway = gw

    async def scenario() -> None:
        async with farm(
            tmp,
            text=old,
            loader=lambda: load_spec(new, source="test.toml"),
            scrape=m,
            gateway=gw,
            gate=gate,
        ) as f:
            await _start(f, m)
            await f.until(lambda: gw.routed() == urls(range(4)))
            assert (await f.ops.reload()).applied
            await f.until(lambda: gate.calls != [], within=300)
            assert gate.calls[0] == ("http://127.0.0.1:30000", "http://127.0.0.1:30001")
            assert gate.routed_then == urls([1, 2, 3])  # the canary took no traffic yet
            if canary_correct == 40:
                await f.until(
                    lambda: all(f.runtime.starts_of(w) == 2 for w in range(4)), within=400
                )
                view = f.agent.view().canary
                assert view is not None and view.state is CanaryState.PROMOTED
            else:
                await f.until(
                    lambda: (
                        (v := f.agent.view().canary) is not None
                        and v.state is CanaryState.ROLLED_BACK
                    ),
                    within=60,
                )
                view = f.agent.view().canary
                assert view is not None and view.evidence.startswith("rolled back: eval: ")
                # The gate's own line, once: not "eval: eval: ..." (issue 30 #12).
                line = eval_verdict(canary_correct, 40, 40, 0.05).evidence_line
                assert view.evidence == f"rolled back: {line}", view.evidence
                assert [c.name for c in view.checks] == ["eval"]
                await f.until(lambda: f.runtime.starts_of(0) == 3 and f.phase(0) is Phase.READY)
                assert "CHANGED" not in _env(f, 0)
                assert [f.runtime.starts_of(w) for w in (1, 2, 3)] == [1, 1, 1]

    run_virtual(scenario())


def test_a_canary_that_cannot_start_on_the_change_is_rolled_back_before_its_window(
    tmp: Path,
) -> None:
    """A renamed flag: the canary exits while loading (a deterministic failure, FAILED at
    once); the farm puts it back on the old config, the other waves never start."""
    new = _toml(tmp, {"BROKEN": "1"})
    m = Metrics()

    async def scenario() -> None:
        async with farm(
            tmp, text=_toml(tmp), loader=lambda: load_spec(new, source="test.toml"), scrape=m
        ) as f:
            await _start(f, m)
            assert (await f.ops.reload()).applied
            await f.until(lambda: f.runtime.starts_of(0) == 2 and f.phase(0) is Phase.STARTING)
            f.runtime.crash(0, 2, ("launch_server.py: error: unrecognized arguments: --bogus",))
            await f.until(
                lambda: (
                    (v := f.agent.view().canary) is not None and v.state is CanaryState.ROLLED_BACK
                ),
                within=30,
            )
            view = f.agent.view().canary
            assert view is not None and view.ends_at is None
            await f.until(lambda: f.runtime.starts_of(0) == 3 and f.phase(0) is Phase.READY)
            assert "BROKEN" not in _env(f, 0)
            await asyncio.sleep(120)
            assert [f.runtime.starts_of(w) for w in (1, 2, 3)] == [1, 1, 1]
            assert m.scrapes == []  # no window ever started

    run_virtual(scenario())


def test_a_slow_canary_is_rolled_back_before_a_long_window_ends(tmp: Path) -> None:
    """Judged early inside the window (every window/10): a certain rollback does not wait
    for the end of a 10-minute window."""
    new = _toml(tmp, {"SLOW": "1"}, analysis_window="10m")
    m = Metrics()

    async def scenario() -> None:
        async with farm(
            tmp, text=_toml(tmp), loader=lambda: load_spec(new, source="test.toml"), scrape=m
        ) as f:
            await _start(f, m)
            assert (await f.ops.reload()).applied
            await f.until(
                lambda: (v := f.agent.view().canary) is not None and v.ends_at is not None
            )
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            await f.until(
                lambda: (
                    (v := f.agent.view().canary) is not None and v.state is CanaryState.ROLLED_BACK
                ),
                within=600,
            )
            assert loop.time() - t0 <= 61  # the first early judgement, 60 s in
            view = f.agent.view().canary
            assert view is not None and "ITL" in view.evidence
            assert [f.runtime.starts_of(w) for w in (1, 2, 3)] == [1, 1, 1]

    run_virtual(scenario())


def test_a_baseline_worker_that_crashes_during_the_analysis_comes_back_on_the_old_config(
    tmp: Path,
) -> None:
    """Only the canary runs the change under analysis: another worker restarted meanwhile
    (a crash here) is relaunched with the accepted config."""
    new = _toml(tmp, {"HARMLESS": "1"}, analysis_window="5m")
    m = Metrics()

    async def scenario() -> None:
        async with farm(
            tmp, text=_toml(tmp), loader=lambda: load_spec(new, source="test.toml"), scrape=m
        ) as f:
            await _start(f, m)
            assert (await f.ops.reload()).applied
            await f.until(
                lambda: (v := f.agent.view().canary) is not None and v.ends_at is not None
            )
            f.runtime.crash(2, 1, ("Traceback (most recent call last):", "RuntimeError: boom"))
            await f.until(lambda: f.runtime.starts_of(2) == 2 and f.phase(2) is Phase.READY)
            assert "HARMLESS" not in _env(f, 2)
            assert _env(f, 0).get("HARMLESS") == "1"
            # After the promotion, worker 2 rolls to the change with the others.
            await f.until(
                lambda: all(_env(f, w).get("HARMLESS") == "1" for w in range(4)), within=600
            )

    run_virtual(scenario())


# ---- a change of the model (issue 23, item 2: the old copy kept until a promotion) ----------


def _model_toml(tmp: Path, source: Path, env: dict[str, str] | None = None) -> str:
    """The 4-worker farm staging its model from `source` into tmp/shm/model."""
    farm_table: dict[str, object] = {"state_dir": str(tmp)}
    if env:
        farm_table["env"] = env
    return farm_toml(
        tmp,
        workers=4,
        farm=farm_table,
        rollout=WINDOW,
        sglang={"model_path": str(tmp / "shm" / "model")},
        model={"source": str(source), "headroom": 0},
    )


def _model_source(root: Path, version: bytes) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_bytes(b'{"v": "' + version + b'"}')
    (root / "model.safetensors").write_bytes(version * 5_000)
    return root


def _beside(target: Path) -> list[str]:
    """What is in model_path's folder besides model_path itself (old copies)."""
    return sorted(p.name for p in target.parent.iterdir() if p != target)


def _model_at(target: Path) -> bytes:
    return (target / "config.json").read_bytes()


def test_a_rolled_back_model_change_restarts_the_canary_on_the_old_copy(tmp: Path) -> None:
    """A new model revision (slow here) is staged and swapped into model_path for the
    canary; its rollback puts the old copy back in model_path before the canary restarts,
    and only the rejected copy is removed."""
    v1 = _model_source(tmp / "v1", b"v1")
    v2 = _model_source(tmp / "v2", b"v2")
    target = tmp / "shm" / "model"
    new = _model_toml(tmp, v2, {"SLOW": "1"})
    m = Metrics()
    seen: list[bytes] = []  # what model_path held at each start of the canary

    async def scenario() -> None:
        async with farm(
            tmp,
            text=_model_toml(tmp, v1),
            loader=lambda: load_spec(new, source="test.toml"),
            scrape=m,
        ) as f:
            await _start(f, m)
            start = f.runtime.start

            async def start_and_look(worker: int, command: Command) -> None:
                if worker == 0:
                    seen.append(_model_at(target))
                await start(worker, command)

            f.runtime.start = start_and_look  # type: ignore[method-assign]
            assert (await f.ops.reload()).applied
            assert _model_at(target) == b'{"v": "v2"}'
            assert len(_beside(target)) == 1  # the old copy, kept beside it
            await f.until(
                lambda: (
                    (v := f.agent.view().canary) is not None and v.state is CanaryState.ROLLED_BACK
                ),
                within=300,
            )
            await f.until(lambda: f.runtime.starts_of(0) == 3 and f.phase(0) is Phase.READY)
            assert seen == [b'{"v": "v2"}', b'{"v": "v1"}']
            assert "SLOW" not in _env(f, 0)
            await f.until(lambda: _beside(target) == [])  # the rejected copy goes
            assert _model_at(target) == b'{"v": "v1"}'
            assert [f.runtime.starts_of(w) for w in (1, 2, 3)] == [1, 1, 1]

    run_virtual(scenario())


def test_a_held_model_change_keeps_the_old_copy_until_a_reload_goes_back_to_it(
    tmp: Path,
) -> None:
    """Inconclusive (the canary's /metrics unreadable) holds the change: the old copy is
    kept however long it is held (past the waves' time the removal waits otherwise); a
    reload of the old config supersedes it and the canary restarts on the old copy."""
    v1 = _model_source(tmp / "v1", b"v1")
    v2 = _model_source(tmp / "v2", b"v2")
    target = tmp / "shm" / "model"
    texts = [_model_toml(tmp, v2, {"NOMETRICS": "1"})]
    m = Metrics()

    async def scrape(url: str, key: str | None) -> str:
        assert m.runtime is not None
        proc = m.runtime.procs.get(int(url.rsplit(":", 1)[1].split("/")[0]) - 30000)
        if proc is not None and proc.command.env_dict.get("NOMETRICS") == "1":
            raise ConnectionRefusedError(url)
        return await m(url, key)

    async def scenario() -> None:
        async with farm(
            tmp,
            text=_model_toml(tmp, v1),
            loader=lambda: load_spec(texts[0], source="test.toml"),
            scrape=scrape,
        ) as f:
            await _start(f, m)
            assert (await f.ops.reload()).applied
            await f.until(
                lambda: (v := f.agent.view().canary) is not None and v.state is CanaryState.HELD,
                within=300,
            )
            await asyncio.sleep(1200)  # longer than the waves' time (4 x 130 s + 60 s)
            assert len(_beside(target)) == 1
            assert _model_at(target) == b'{"v": "v2"}'
            texts[0] = _model_toml(tmp, v1)
            assert (await f.ops.reload()).applied
            await f.until(lambda: f.runtime.starts_of(0) == 3 and f.phase(0) is Phase.READY)
            assert _model_at(target) == b'{"v": "v1"}'
            await f.until(lambda: _beside(target) == [])
            assert [f.runtime.starts_of(w) for w in (1, 2, 3)] == [1, 1, 1]

    run_virtual(scenario())


class Starved(Metrics):
    """A worker whose process runs STARVED=1 is sent 0.2 requests a second (12 in a
    60 s window; the others 10 a second) until `feed()`, then 10 a second as well."""

    def __init__(self) -> None:
        super().__init__()
        self.fed_at: float | None = None

    def feed(self) -> None:
        self.fed_at = asyncio.get_running_loop().time()

    async def __call__(self, url: str, key: str | None) -> str:
        assert self.runtime is not None
        proc = self.runtime.procs.get(int(url.rsplit(":", 1)[1].split("/")[0]) - 30000)
        if proc is None or proc.command.env_dict.get("STARVED") != "1":
            return await super().__call__(url, key)
        self.scrapes.append(url)
        now = asyncio.get_running_loop().time()
        n = 0.2 * (now - self.t0) + (0.0 if self.fed_at is None else 10 * (now - self.fed_at))
        lines = [f"sglang:num_requests_total {n}", "sglang:num_aborted_requests_total 0"]
        lines.append(f"{ANSWERED_200} {n}")  # SGLang 0.5.20+: the error source (issue 30)
        for le, v in zip(("0.01", "0.02", "0.05", "0.1", "+Inf"), (0, *[10 * n] * 4), strict=True):
            lines.append(f'sglang:inter_token_latency_seconds_bucket{{le="{le}"}} {v}')
        lines.append(f"sglang:inter_token_latency_seconds_sum {0.01 * n}")
        return "\n".join(lines) + "\n"


def _state(f: Farm) -> CanaryState | None:
    v = f.agent.view().canary
    return None if v is None else v.state


def _evidence(f: Farm) -> str:
    v = f.agent.view().canary
    return "" if v is None else v.evidence


def test_a_starved_canary_is_extended_and_promoted_once_its_traffic_comes(tmp: Path) -> None:
    new = _toml(tmp, {"STARVED": "1"})
    m = Starved()

    async def scenario() -> None:
        async with farm(
            tmp, text=_toml(tmp), loader=lambda: load_spec(new, source="test.toml"), scrape=m
        ) as f:
            await _start(f, m)
            assert (await f.ops.reload()).applied
            await f.until(lambda: "extended 1 of 2" in _evidence(f), within=300)
            view = f.agent.view().canary
            assert view is not None and view.state is CanaryState.ANALYSING
            assert view.extensions == 1 and view.ends_at is not None
            assert view.evidence == (
                "extended 1 of 2: too little traffic to judge: "
                "12 canary requests in 60 s, 50 needed"
            ), view.evidence
            assert [f.runtime.starts_of(w) for w in (1, 2, 3)] == [1, 1, 1]  # still gated
            m.feed()
            await f.until(lambda: _state(f) is CanaryState.PROMOTED, within=200)
            view = f.agent.view().canary
            assert "over 120 s" in _evidence(f), _evidence(f)
            await f.until(lambda: all(f.runtime.starts_of(w) == 2 for w in range(4)), within=600)

    with capture_logs() as logged:
        run_virtual(scenario())
    extended = [e for e in logged if e["event"] == "canary_analysis_extended"]
    assert len(extended) == 1, extended
    assert (extended[0]["worker"], extended[0]["gpu"], extended[0]["extension"]) == (0, 0, 1)
    assert extended[0]["max_extensions"] == 2


@pytest.mark.parametrize(("extensions", "held_after"), [(2, 180), (0, 60)])
def test_a_canary_starved_through_every_extension_is_held(
    tmp: Path, extensions: int, held_after: int
) -> None:
    new_text = _toml(tmp, {"STARVED": "1"}, max_extensions=extensions)
    m = Starved()

    async def scenario() -> None:
        async with farm(
            tmp, text=_toml(tmp), loader=lambda: load_spec(new_text, source="test.toml"), scrape=m
        ) as f:
            await _start(f, m)
            assert (await f.ops.reload()).applied
            await f.until(lambda: _state(f) is CanaryState.HELD, within=600)
            assert _evidence(f).startswith("held: too little traffic to judge: ")
            assert f"canary requests in {held_after} s, 50 needed" in _evidence(f), _evidence(f)
            await asyncio.sleep(600)
            assert [f.runtime.starts_of(w) for w in (1, 2, 3)] == [1, 1, 1]

    run_virtual(scenario())


def test_a_starved_canary_that_crashes_inside_its_extension_is_rolled_back_at_once(
    tmp: Path,
) -> None:
    new = _toml(tmp, {"STARVED": "1"})
    m = Starved()

    async def scenario() -> None:
        async with farm(
            tmp, text=_toml(tmp), loader=lambda: load_spec(new, source="test.toml"), scrape=m
        ) as f:
            await _start(f, m)
            assert (await f.ops.reload()).applied
            await f.until(lambda: "extended 1 of 2" in _evidence(f), within=300)
            await asyncio.sleep(10)
            f.runtime.crash(0, 1, ("Traceback (most recent call last):", "RuntimeError: boom"))
            await f.until(lambda: _state(f) is CanaryState.ROLLED_BACK, within=30)
            assert "crashed" in _evidence(f), _evidence(f)
            await f.until(lambda: 0 in f.runtime.procs and f.phase(0) is Phase.READY)
            assert "STARVED" not in _env(f, 0)
            assert [f.runtime.starts_of(w) for w in (1, 2, 3)] == [1, 1, 1]
            assert len(json.loads((tmp / "canary.json").read_text())["rejected"]) == 1

    run_virtual(scenario())


def test_the_canarys_failure_is_the_one_it_is_being_stopped_for_else_its_last() -> None:
    """The failure the analysis reads (issue 31 item 3): the pending one while the farm
    stops the canary for it (whatever stop was asked since), never a leftover one."""
    from sglang_farm.canary.plan import failure_of as _failure
    from sglang_farm.sglang.failures import Failure, FailureKind
    from sglang_farm.workers.supervisor import StopIntent, WorkerState

    oom = Failure(FailureKind.CUDA_OOM_SERVING, "CUDA out of memory while serving", "")
    old = Failure(FailureKind.CRASH, "exited with status 1", "")
    s = WorkerState(
        0,
        Phase.STOPPING,
        since=9.0,
        stop_intent=StopIntent.FAILURE,
        pending_failure=oom,
        last_failure=old,
        last_failure_at=2.0,
    )
    assert _failure(s) == (oom, 9.0)
    from dataclasses import replace

    assert _failure(replace(s, stop_intent=StopIntent.RESTART)) == (oom, 9.0)
    for later in (Phase.STARTING, Phase.READY, Phase.STOPPED):
        assert _failure(replace(s, phase=later, stop_intent=None)) == (old, 2.0)
    assert _failure(replace(s, pending_failure=None)) == (old, 2.0)


def test_the_eval_gate_is_not_sent_to_a_canary_port_that_is_not_its_own(tmp: Path) -> None:
    """The eval carries the workers' keys: while the canary's port is held by another
    process (`host.keyguard` says so) nothing is sent, and the change cannot pass."""
    eval_file = Path(__file__).parent.parent / "etc/sglang-farm/eval/arith.jsonl"
    old = farm_toml(tmp, workers=4, gateway=GATEWAY, rollout={**WINDOW, "eval": str(eval_file)})
    new = farm_toml(
        tmp,
        workers=4,
        gateway=GATEWAY,
        farm={"state_dir": str(tmp), "env": {"CHANGED": "1"}},
        rollout={**WINDOW, "eval": str(eval_file)},
    )
    m, gate, gw = Metrics(), FakeGate(40), FakeGateway()
    gate.gateway = gw
    held = "port 30000 is held by PID 4242 (user nobody), not by worker 0"

    async def scenario() -> None:
        async with farm(
            tmp,
            text=old,
            loader=lambda: load_spec(new, source="test.toml"),
            scrape=m,
            gateway=gw,
            gate=gate,
        ) as f:
            await _start(f, m)
            await f.until(lambda: gw.routed() == urls(range(4)))

            async def refusal(worker: int, url: str) -> str | None:
                return held if worker == 0 else None

            f.agent.key_guard.refusal = refusal  # type: ignore[method-assign]
            assert (await f.ops.reload()).applied
            await f.until(
                lambda: (
                    (v := f.agent.view().canary) is not None and v.state is CanaryState.ROLLED_BACK
                ),
                within=300,
            )
            view = f.agent.view().canary
            assert view is not None
            assert view.evidence == f"rolled back: eval: not run on the canary: {held}"
            assert gate.calls == []

    run_virtual(scenario())
