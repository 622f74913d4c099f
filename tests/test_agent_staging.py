"""The real Agent stages its model before the rollout (issue 16), on a virtual clock.

The harness's fakes (no processes, no sockets, agent_harness.py); the stage is either the
real one on files under tmp_path (`stage_model` runs inline: virtual_time.py runs thread
work at once) or a test's stager that holds the stage open to look at it meanwhile.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

from agent_harness import Farm, farm, farm_toml
from sglang_farm.cli.ctl.status import format_status
from sglang_farm.config import load_spec
from sglang_farm.control.results import status_result, why_result
from sglang_farm.farm_view import FarmView
from sglang_farm.metrics.collectors import MetricsState, build_registry
from sglang_farm.runtime import Running
from sglang_farm.spec import FarmSpec
from sglang_farm.staging.copier import Report
from sglang_farm.staging.failure import StageError, StageFailureKind
from sglang_farm.staging.manifest import MANIFEST_NAME
from sglang_farm.staging.plan import MountFacts
from sglang_farm.staging.progress import StageProgress
from sglang_farm.staging.runner import Stager, stage_model
from sglang_farm.staging.state import StageResult, StageState
from sglang_farm.workers.phase import Phase
from virtual_time import run_virtual

GiB = 1 << 30


def model_toml(tmp: Path, source: Path, *, workers: int = 8) -> str:
    """The harness's farm staging its model from `source` into tmp/shm/model."""
    return farm_toml(
        tmp,
        workers=workers,
        sglang={"model_path": str(tmp / "shm" / "model")},
        model={"source": str(source), "headroom": 0},
    )


def make_source(root: Path, version: bytes = b"v1") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_bytes(b'{"v": "' + version + b'"}')
    (root / "model.safetensors").write_bytes(version * 50_000)
    return root


@asynccontextmanager
async def staged_farm(
    tmp: Path,
    text: str,
    *,
    stager: Stager | None = None,
    loader: Callable[[], FarmSpec] | None = None,
    refresh: Callable[[FarmSpec], Awaitable[None]] | None = None,
    running: Mapping[int, Running] | None = None,
    process_started: Callable[[int], float | None] | None = None,
    observers: Sequence[Callable[[FarmView], None]] = (),
) -> AsyncIterator[Farm]:
    """agent_harness.farm with the agent's `stager` hook, workers found running at start
    (`running`), when each process started (`process_started`: pid -> wall time) and the
    farm views' `observers`."""
    async with farm(
        tmp,
        text=text,
        stager=stager,
        loader=loader,
        refresh=refresh,
        running=running,
        process_started=process_started or (lambda _pid: None),
        observers=observers,
    ) as f:
        yield f


def status_text(f: Farm) -> str:
    view = f.agent.view()
    return format_status(status_result(view, [], version="t", now=view.started_at + 100))


def sample(f: Farm, name: str, labels: dict[str, str] | None = None) -> float | None:
    reg = build_registry(lambda: MetricsState(snapshot_at=0.0, farm=f.agent.view()))
    return reg.get_sample_value(name, labels or {})


def small_tmpfs(path: Path) -> MountFacts:
    return MountFacts("/dev/shm", "tmpfs", "rw,nosuid,nodev,size=64k", 64 << 10, 64 << 10)


def roomy(path: Path) -> MountFacts:
    return MountFacts("/", "ext4", "rw", 1 << 40, 1 << 40)


def stager_with(measure: list[Callable[[Path], MountFacts]]) -> Stager:
    """The real stage, reading free space through `measure[0]` (swappable mid-test)."""

    async def stage(
        spec: FarmSpec, *, report: Report, cancel: threading.Event, keep_old: bool
    ) -> StageResult:
        return stage_model(
            spec, cancel=cancel, report=report, keep_old=keep_old, measure=measure[0]
        )

    return stage


def test_rollout_waits_for_the_stage_and_status_shows_bytes_rate_and_time_left(
    tmp_path: Path,
) -> None:
    gate = asyncio.Event()
    finished: list[float] = []

    async def slow_stage(
        spec: FarmSpec, *, report: Report, cancel: threading.Event, keep_old: bool
    ) -> StageResult:
        report(StageProgress("copying", 0, 10 * GiB, 0.0))
        await asyncio.sleep(10)
        report(StageProgress("copying", 4 * GiB, 10 * GiB, 10.0))
        await gate.wait()
        finished.append(asyncio.get_running_loop().time())
        return StageResult(Path("/x"), 2, 10 * GiB, 10 * GiB, False, None, 25.0, "src")

    refreshed: list[float] = []

    async def refresh(spec: FarmSpec) -> None:
        refreshed.append(asyncio.get_running_loop().time())

    async def scenario() -> None:
        src = make_source(tmp_path / "src")
        async with staged_farm(
            tmp_path, model_toml(tmp_path, src), stager=slow_stage, refresh=refresh
        ) as f:
            await asyncio.sleep(30)
            assert f.runtime.starts == []  # nothing starts while the model is staged
            assert f.agent.startup_pending() is not None
            st = f.agent.view().staging
            assert st is not None and st.state == "staging" and st.bytes_done == 4 * GiB
            text = status_text(f)
            assert (
                f"model {src} -> {tmp_path}/shm/model · staging: copying 4.0 GiB of 10.0 GiB "
                "(40%) at 409.6 MiB/s, about 15s left"
            ) in text
            assert sample(f, "sglang_farm_model_stage_state", {"state": "staging"}) == 1
            assert sample(f, "sglang_farm_model_stage_progress_bytes", {"step": "copying"}) == (
                4 * GiB
            )
            gate.set()
            await f.until(f.all_ready)
            # The canary first, after the stage; then the rest.
            assert f.runtime.starts[0][0] == 0
            assert f.runtime.procs[0].started_at >= finished[0]
            # The doctor judged the staged copy (not the empty path it saw) before the canary.
            assert finished[0] <= refreshed[0] <= f.runtime.procs[0].started_at
            assert f.agent.startup_pending() is None
            st = f.agent.view().staging
            assert st is not None and st.state == "done" and st.last_copied_bytes == 10 * GiB
            assert sample(f, "sglang_farm_model_staged_bytes_total") == 10 * GiB
            assert sample(f, "sglang_farm_model_stage_duration_seconds") == 25.0

    run_virtual(scenario())


def test_real_files_are_staged_then_rolled_out_and_a_restart_copies_nothing(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        src = make_source(tmp_path / "src")
        text = model_toml(tmp_path, src)
        target = tmp_path / "shm" / "model"
        async with staged_farm(tmp_path, text) as f:  # the agent's own stager
            await f.until(f.all_ready)
            assert (target / "model.safetensors").read_bytes() == b"v1" * 50_000
            st = f.agent.view().staging
            assert st is not None and st.state == "done" and st.last_copied_bytes == 100_011
        # The agent restarts (a reboot would have emptied the tmpfs; this one did not).
        async with staged_farm(tmp_path, text) as f:
            await f.until(f.all_ready)
            st = f.agent.view().staging
            assert st is not None and st.state == "current" and st.last_copied_bytes == 0
            assert "staged (the copy in place was current" in status_text(f)
        # Reboot-like: the tmpfs is empty again; the next start stages before the rollout.
        for p in sorted(target.rglob("*"), reverse=True):
            p.unlink() if p.is_file() else p.rmdir()
        target.rmdir()
        async with staged_farm(tmp_path, text) as f:
            await f.until(f.all_ready)
            assert (target / "config.json").exists()
            st = f.agent.view().staging
            assert st is not None and st.state == "done"

    run_virtual(scenario())


def test_a_stage_that_does_not_fit_starts_no_worker_and_status_and_why_say_why(
    tmp_path: Path,
) -> None:
    measure: list[Callable[[Path], MountFacts]] = [small_tmpfs]

    async def scenario() -> None:
        src = make_source(tmp_path / "src")
        async with staged_farm(
            tmp_path, model_toml(tmp_path, src), stager=stager_with(measure)
        ) as f:
            await asyncio.sleep(600)  # ten minutes: no start, no crash loop
            assert f.runtime.starts == []
            assert set(f.phases().values()) == {Phase.STOPPED}
            assert f.agent.startup_pending() is None  # an operator may act now
            st = f.agent.view().staging
            assert st is not None and st.state == "failed" and st.error_kind == "no_space"
            text = status_text(f)
            assert "staging FAILED [no_space]: not enough space for" in text
            assert "size=64k" in text and "no worker starts until a stage succeeds" in text
            why = why_result(f.agent.view().worker(3), None, f.agent.view().staging)
            note = str(why["state_note"])
            assert note.startswith(f"not started: the model could not be staged into {tmp_path}")
            assert "short" in note and "mount -o remount,size=" in note
            assert why["staging"] is not None
            assert sample(f, "sglang_farm_model_stage_failures_total", {"kind": "no_space"}) == 1
            # `farmctl start` stages again: still too small, still nothing started.
            try:
                await f.ops.start(list(range(8)))
                raise AssertionError("start should have failed")
            except StageError as exc:
                assert exc.kind is StageFailureKind.NO_SPACE
            assert f.runtime.starts == []
            assert sample(f, "sglang_farm_model_stage_failures_total", {"kind": "no_space"}) == 2
            # The tmpfs is grown: the next start stages, then the canary, then the rest.
            measure[0] = roomy
            await f.ops.start(list(range(8)))
            await f.until(f.all_ready)
            assert f.runtime.starts[0][0] == 0
            assert (
                why_result(f.agent.view().worker(3), None, f.agent.view().staging)["state_note"]
                is None
            )

    run_virtual(scenario())


def test_reload_with_a_new_revision_stages_beside_rolls_in_waves_then_removes_the_old(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        v1 = make_source(tmp_path / "v1", b"v1")
        v2 = make_source(tmp_path / "v2", b"v2")
        target = tmp_path / "shm" / "model"
        texts = [model_toml(tmp_path, v1)]
        async with staged_farm(
            tmp_path,
            texts[0],
            loader=lambda: load_spec(texts[0], source="test.toml"),
        ) as f:
            await f.until(f.all_ready)
            texts[0] = model_toml(tmp_path, v2)
            before = len(f.runtime.starts)
            r = await f.ops.reload()
            assert r.applied and sorted(r.restarted) == list(range(8))
            # The new copy is in place; the old one waits beside it for the roll.
            assert (target / "config.json").read_bytes() == b'{"v": "v2"}'
            olds = [p for p in target.parent.iterdir() if ".old-" in p.name]
            assert len(olds) == 1 and (olds[0] / "config.json").read_bytes() == b'{"v": "v1"}'
            await f.until(lambda: len(f.runtime.starts) == before + 8 and f.all_ready())
            order = [w for w, _ in f.runtime.starts[before:]]
            assert order[0] == 0  # canary first, then waves of `parallel` (3)
            starts = [f.runtime.procs[w].started_at for w in order]
            assert starts == sorted(starts) and len(set(starts[1:4])) == 1
            assert starts[4] > starts[3]
            await f.until(lambda: not olds[0].exists())
            assert sorted(p.name for p in target.parent.iterdir()) == ["model"]

    run_virtual(scenario())


def test_a_reload_whose_model_cannot_be_staged_is_rejected_and_workers_keep_serving(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        v1 = make_source(tmp_path / "v1")
        texts = [model_toml(tmp_path, v1)]
        shown: list[StageState | None] = []  # every stage state the farm view showed

        def record(view: FarmView) -> None:
            shown.append(view.staging.state if view.staging is not None else None)

        async with staged_farm(
            tmp_path,
            texts[0],
            loader=lambda: load_spec(texts[0], source="test.toml"),
            observers=[record],
        ) as f:
            await f.until(f.all_ready)
            before = len(f.runtime.starts)
            shown.clear()  # from the reload on
            texts[0] = model_toml(tmp_path, tmp_path / "missing")
            r = await f.ops.reload()
            assert not r.applied
            # Never shown as a failed stage (that holds the farm), not even for a moment.
            assert StageState.STAGING in shown and StageState.FAILED not in shown, shown
            assert "[model] not staged: the model source" in r.problems[0]
            assert "does not exist" in r.problems[0]
            await asyncio.sleep(30)
            assert f.all_ready() and len(f.runtime.starts) == before
            assert (tmp_path / "shm" / "model" / "config.json").exists()
            # status says the reload was not applied, not that the farm is held.
            text = status_text(f)
            assert "no worker starts until" not in text
            assert f"model {v1} -> {tmp_path}/shm/model · staged" in text
            assert "reload REJECTED [source_missing]" in text
            assert "the reload was not applied: workers keep the previous copy" in text
            # A stopped worker then starts from the copy in place: no stage holds it.
            await f.ops.stop([3])
            why = why_result(f.agent.view().worker(3), None, f.agent.view().staging)
            assert "no worker starts until" not in str(why["state_note"])
            await f.ops.start([3])
            await f.until(f.all_ready)

    run_virtual(scenario())


def test_source_missing_at_start_is_a_failed_stage_not_a_crash(tmp_path: Path) -> None:
    async def scenario() -> None:
        text = model_toml(tmp_path, tmp_path / "gone")
        async with staged_farm(tmp_path, text) as f:
            await asyncio.sleep(60)
            assert f.runtime.starts == []
            st = f.agent.view().staging
            assert st is not None and st.error_kind == "source_missing"
            assert os.fspath(tmp_path / "gone") in (st.error or "")

    run_virtual(scenario())


def test_a_reload_that_fixes_a_failed_stage_stages_and_begins_the_rollout(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        texts = [model_toml(tmp_path, tmp_path / "typo")]
        async with staged_farm(
            tmp_path, texts[0], loader=lambda: load_spec(texts[0], source="test.toml")
        ) as f:
            await asyncio.sleep(60)
            assert f.runtime.starts == []
            texts[0] = model_toml(tmp_path, make_source(tmp_path / "src"))
            r = await f.ops.reload()
            assert r.applied
            await f.until(f.all_ready)
            assert f.runtime.starts[0][0] == 0
            st = f.agent.view().staging
            assert st is not None and st.state == "done"
            assert st.failures_by_kind == {"source_missing": 1}

    run_virtual(scenario())


def test_an_unexpected_error_in_the_stage_is_a_failed_stage_that_status_and_why_name(
    tmp_path: Path,
) -> None:
    calls: list[int] = []

    async def broken(
        spec: FarmSpec, *, report: Report, cancel: threading.Event, keep_old: bool
    ) -> StageResult:
        calls.append(1)
        raise ValueError("Repo id must not contain '--' or '..'")

    async def scenario() -> None:
        src = make_source(tmp_path / "src")
        async with staged_farm(tmp_path, model_toml(tmp_path, src), stager=broken) as f:
            await asyncio.sleep(60)
            assert calls == [1] and f.runtime.starts == []
            assert f.agent.startup_pending() is None
            st = f.agent.view().staging
            assert st is not None and st.state == "failed", st
            assert st.error_kind == "io_error"
            assert "ValueError" in (st.error or "") and "'--'" in (st.error or "")
            assert "staging FAILED [io_error]" in status_text(f)
            why = why_result(f.agent.view().worker(3), None, f.agent.view().staging)
            assert "ValueError" in str(why["state_note"])
            try:
                await f.ops.start([0])
                raise AssertionError("start should have failed")
            except StageError as exc:
                assert exc.kind is StageFailureKind.IO_ERROR
            assert f.agent.view().staging.state == "failed"  # type: ignore[union-attr]  # set above

    run_virtual(scenario())


def adopted_after_a_swap(
    tmp: Path, text: str, *, before: set[int]
) -> tuple[dict[int, Running], Callable[[int], float | None]]:
    """Eight workers found running after an agent restart mid-reload: the copy at
    model_path was swapped in (its manifest says when); the workers in `before` started
    before that and still load the old copy, the others after it."""
    target = tmp / "shm" / "model"
    installed = (target / MANIFEST_NAME).stat().st_mtime
    running = {w: Running(w, 5000 + w, True) for w in range(8)}

    def started(pid: int) -> float | None:
        if not 5000 <= pid < 5008:
            return None  # the agent's own (fake) launches
        return installed - 100 if pid - 5000 in before else installed + 10

    return running, started


def test_an_agent_restarted_mid_reload_restarts_the_workers_still_on_the_old_copy(
    tmp_path: Path,
) -> None:
    src = make_source(tmp_path / "src", b"v2")
    text = model_toml(tmp_path, src)
    # The reload before the restart swapped v2 in; its waves had restarted workers 0-3.
    stage_model(load_spec(text, source="t"), cancel=threading.Event(), measure=roomy)
    running, started = adopted_after_a_swap(tmp_path, text, before={4, 5, 6, 7})

    async def scenario() -> None:
        async with staged_farm(tmp_path, text, running=running, process_started=started) as f:
            await f.until(lambda: all(f.runtime.starts_of(w) == 1 for w in (4, 5, 6, 7)))
            await f.until(f.all_ready)
            assert all(f.runtime.starts_of(w) == 0 for w in (0, 1, 2, 3))
            st = f.agent.view().staging
            assert st is not None and st.state == "current"
            assert dict(f.agent.view().worker(4).restarts_by_reason) == {"config": 1}

    run_virtual(scenario())


def test_farmctl_start_after_a_failed_stage_restarts_adopted_workers_on_the_old_copy(
    tmp_path: Path,
) -> None:
    measure: list[Callable[[Path], MountFacts]] = [small_tmpfs]
    v1 = make_source(tmp_path / "v1", b"v1")
    stage_model(
        load_spec(model_toml(tmp_path, v1), source="t"), cancel=threading.Event(), measure=roomy
    )
    # The config now names v2 (edited while the agent was down); the workers load v1.
    text = model_toml(tmp_path, make_source(tmp_path / "v2", b"v2"))
    running, started = adopted_after_a_swap(tmp_path, text, before=set(range(8)))

    async def scenario() -> None:
        async with staged_farm(
            tmp_path,
            text,
            stager=stager_with(measure),
            running=running,
            process_started=started,
        ) as f:
            await asyncio.sleep(60)
            st = f.agent.view().staging
            assert st is not None and st.state == "failed"
            assert f.runtime.starts == []
            measure[0] = roomy
            await f.ops.start(list(range(8)))
            await f.until(lambda: all(f.runtime.starts_of(w) == 1 for w in range(8)))
            await f.until(f.all_ready)
            assert (tmp_path / "shm" / "model" / "config.json").read_bytes() == b'{"v": "v2"}'

    run_virtual(scenario())


def test_a_sighup_during_the_start_up_stage_is_refused_and_a_later_one_applies(
    tmp_path: Path,
) -> None:
    gate = asyncio.Event()
    src = make_source(tmp_path / "src")
    texts = [model_toml(tmp_path, src)]
    loads: list[int] = []

    def loader() -> FarmSpec:
        loads.append(1)
        return load_spec(texts[0], source="test.toml")

    async def held_stage(
        spec: FarmSpec, *, report: Report, cancel: threading.Event, keep_old: bool
    ) -> StageResult:
        await gate.wait()
        return StageResult(Path("/x"), 0, 0, 10, True, None, 1.0, "src")

    async def scenario() -> None:
        async with staged_farm(tmp_path, texts[0], stager=held_stage, loader=loader) as f:
            await asyncio.sleep(5)
            # The reload would remove workers 4-7 while the start-up still means to start them.
            texts[0] = model_toml(tmp_path, src, workers=4)
            f.ops.reload_on_signal()
            await asyncio.sleep(5)
            assert loads == []  # refused (logged: retry once started), not raced
            gate.set()
            await f.until(f.all_ready)
            assert len(f.agent.view().workers) == 8
            f.ops.reload_on_signal()
            await f.until(lambda: len(f.agent.view().workers) == 4)
            assert loads == [1]

    run_virtual(scenario())
