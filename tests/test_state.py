"""What the agent remembers across restarts: round trip; a broken file loses nothing else."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from sglang_farm import state
from sglang_farm.farm_view import Phase
from sglang_farm.sglang.failures import Failure, FailureKind
from sglang_farm.workers.supervisor import FailurePast, Supervisor, WorkerState


def restore_into(
    store: state.StateStore, sup: Supervisor, gpus: Mapping[int, Sequence[int]]
) -> dict[int, Phase | None]:
    """The agent's restore at start: what the store remembers, put back into `sup`."""
    remembered = store.restore(sup.workers, gpus)
    sup.restore_remembered(remembered.states, remembered.held_out_since)
    return dict(remembered.phases)


def test_round_trip_keeps_counts_failures_and_oom_step(tmp_path: Path) -> None:
    failure = Failure(FailureKind.CUDA_OOM_SERVING, "CUDA out of memory", "lower it", ("l1",))
    s = WorkerState(
        3,
        phase=Phase.READY,
        failures=2,
        oom_step=1,
        restarts=((100.0, "crash"), (150.0, "oom")),
        restarts_by_reason={"crash": 1, "oom": 1},
        oom_events={"cuda": 1},
        last_failure=failure,
        last_failure_at=150.0,
        last_action="stepped",
        last_load_seconds=41.5,
    )
    path = tmp_path / "state.json"
    # Agent 1: monotonic 0 = wall 1000. Agent 2: monotonic 0 = wall 5000.
    state.save(path, {3: state.worker_to_dict(s, 1000.0)})
    restored = state.restore_worker(WorkerState(3), state.load(path)[3], -5000.0)
    assert restored.failures == 2 and restored.oom_step == 1
    assert restored.restarts == ((100.0 - 4000.0, "crash"), (150.0 - 4000.0, "oom"))
    assert restored.restarts_by_reason == {"crash": 1, "oom": 1}
    assert restored.oom_events == {"cuda": 1}
    assert restored.last_failure == failure
    assert restored.last_load_seconds == 41.5
    assert restored.phase is Phase.STOPPED  # the phase is observed anew, never remembered


def test_a_failure_the_worker_has_served_since_stays_its_past_across_a_restart(
    tmp_path: Path,
) -> None:
    """Issue 31 item 4: the word that the last failure is past is remembered; an unknown
    word (a later version's) shows the failure as current, never breaks the restore."""
    failure = Failure(FailureKind.CRASH, "exited with status 1", "see the log")
    s = WorkerState(3, last_failure=failure, last_failure_at=10.0, failure_past=FailurePast.SERVED)
    d = state.worker_to_dict(s, 1000.0)
    assert d["failure_past"] == "served"
    assert state.worker_to_dict(WorkerState(3), 0.0)["failure_past"] is None
    path = tmp_path / "state.json"
    state.save(path, {3: d})
    assert state.restore_worker(WorkerState(3), state.load(path)[3], 0.0).failure_past is (
        FailurePast.SERVED
    )
    for odd in ("forgotten", 7, None):
        got = state.restore_worker(WorkerState(3), {**d, "failure_past": odd}, 0.0)
        assert got.failure_past is None and got.last_failure == failure
    # Its change alone is worth a write.
    before = {3: state.worker_to_dict(replace(s, failure_past=None), 1000.0)}
    assert state._compare_key(before) != state._compare_key({3: d})


def test_missing_or_broken_file_means_nothing_remembered(tmp_path: Path) -> None:
    assert state.load(tmp_path / "absent.json") == {}
    broken = tmp_path / "state.json"
    broken.write_text("{not json")
    assert state.load(broken) == {}


def test_bad_fields_are_skipped_not_fatal(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text(
        json.dumps(
            {
                "format": 1,
                "workers": {
                    "0": {
                        "failures": "many",
                        "oom_step": 2,
                        "restarts": [[1.0], "x", [2.0, "hang"]],
                        "last_failure": {"kind": "no-such-kind"},
                    }
                },
            }
        )
    )
    s = state.restore_worker(WorkerState(0), state.load(path)[0], 0.0)
    assert s.failures == 0 and s.oom_step == 2
    assert s.restarts == ((2.0, "hang"),)
    assert s.last_failure is None


def test_save_is_atomic_and_leaves_no_temp_files(tmp_path: Path) -> None:
    path = tmp_path / "d" / "state.json"
    state.save(path, {0: {"failures": 1}})
    state.save(path, {0: {"failures": 2}})
    assert state.load(path) == {0: {"failures": 2}}
    # Issue 30: and its second copy, the same bytes.
    assert sorted(p.name for p in path.parent.iterdir()) == ["state.json", "state.json.copy"]
    assert (path.parent / "state.json.copy").read_bytes() == path.read_bytes()


def test_a_state_file_with_huge_numbers_or_deep_nesting_is_kept_aside_not_fatal(
    tmp_path: Path,
) -> None:
    """#16: such a file is corrupt: a copy is kept, the farm starts clean and says so."""
    from sglang_farm.spec import HealthPolicy, RestartPolicy, StartupPolicy
    from sglang_farm.workers.supervisor import Policy, Supervisor

    policy = Policy(StartupPolicy(), HealthPolicy(), RestartPolicy())
    for text in (
        '{"format": 1, "workers": {"0": {"failures": 1e999, "oom_step": 1e999}}}',
        '{"format": 1, "workers": {"0": {"failures": 2, "x": '
        + "[" * 100_000
        + "]" * 100_000
        + "}}}",
    ):
        path = tmp_path / "state.json"
        path.write_text(text)
        store = state.StateStore(path, clock=lambda: 0.0, wall=lambda: 1000.0)
        sup = Supervisor([0, 1], policy)
        remembered = restore_into(store, sup, {0: (0,), 1: (1,)})  # must not raise
        assert sup.workers[0].failures in (0, 2)
        assert isinstance(remembered, dict)
        kept = sorted(tmp_path.glob("state.json.corrupt-*"))
        assert kept, "a copy of the unreadable file is kept for a post-mortem"
        for k in kept:
            k.unlink()


def test_restore_drops_a_quarantine_nothing_could_release_and_says_why(tmp_path: Path) -> None:
    """Issue 22 item 7: a quarantine on a GPU the worker no longer uses, or a QUARANTINED
    phase without its record, is dropped at restore (a warning names worker and GPUs);
    one on a GPU the worker still uses is kept."""
    from structlog.testing import capture_logs

    from sglang_farm.spec import HealthPolicy, RestartPolicy, StartupPolicy
    from sglang_farm.workers.supervisor import GpuQuarantine, Policy, Supervisor

    q = {"gpu": 2, "reason": "xid 79", "detail": "fell off the bus", "at": 900.0}
    path = tmp_path / "state.json"
    state.save(
        path,
        {
            0: {"phase": "quarantined", "quarantine": {**q, "gpu": 0}},
            1: {"phase": "quarantined", "quarantine": q, "quarantines_by_reason": {"xid 79": 1}},
            2: {"phase": "quarantined"},
        },
    )
    store = state.StateStore(path, clock=lambda: 0.0, wall=lambda: 1000.0)
    sup = Supervisor([0, 1, 2], Policy(StartupPolicy(), HealthPolicy(), RestartPolicy()))
    with capture_logs() as logs:
        phases = restore_into(store, sup, {0: (0,), 1: (5,), 2: (2, 3)})
    assert phases == {0: Phase.QUARANTINED, 1: None, 2: None}
    assert sup.workers[0].quarantine == GpuQuarantine(0, "xid 79", "fell off the bus", -100.0)
    assert sup.workers[1].quarantine is None and sup.workers[2].quarantine is None
    assert sup.workers[1].quarantines_by_reason == {"xid 79": 1}
    dropped = [
        (e["worker"], e["gpu"], e["quarantined_gpu"])
        for e in logs
        if e["event"] == "quarantine_dropped" and e["log_level"] == "warning"
    ]
    assert dropped == [(1, 5, 2), (2, "2,3", None)]


def test_a_host_held_out_of_the_gateway_stays_held_out_across_an_agent_restart(
    tmp_path: Path,
) -> None:
    """Issue 26 item 2: the agent restart of a package upgrade must not put a drained host
    back in the gateway by itself; undrain-host is remembered too."""
    from sglang_farm.spec import HealthPolicy, RestartPolicy, StartupPolicy
    from sglang_farm.workers.supervisor import Policy, Supervisor

    policy = Policy(StartupPolicy(), HealthPolicy(), RestartPolicy())
    path = tmp_path / "state.json"
    before = Supervisor([0, 1], policy)
    before.hold_out(True, 5.0)  # monotonic 5.0 = wall 1005.0
    store = state.StateStore(path, clock=lambda: 0.0, wall=lambda: 1000.0)
    store.save(before.workers, held_out_since=before.held_out_since)
    assert json.loads(path.read_text())["host"] == {"held_out_since": 1005.0}

    after = Supervisor([0, 1], policy)
    restore_into(state.StateStore(path, clock=lambda: 50.0, wall=lambda: 2000.0), after, {0: (0,)})
    assert after.held_out and after.held_out_since == 1005.0 + 50.0 - 2000.0
    assert all(s.held_out for s in after.workers.values())

    after.hold_out(False, 60.0)
    again = state.StateStore(path, clock=lambda: 50.0, wall=lambda: 2000.0)
    restore_into(again, Supervisor([0, 1], policy), {})
    again.save(after.workers, held_out_since=after.held_out_since)  # only the host changed
    assert json.loads(path.read_text())["host"] == {"held_out_since": None}
    third = Supervisor([0, 1], policy)
    restore_into(state.StateStore(path, clock=lambda: 0.0, wall=lambda: 1000.0), third, {})
    assert not third.held_out and not third.workers[0].held_out


# --- issue 30, items 5 and 9: state that fails closed --------------------------------------


def _store_and_sup(path: Path) -> tuple[state.StateStore, Any]:
    from sglang_farm.spec import HealthPolicy, RestartPolicy, StartupPolicy
    from sglang_farm.workers.supervisor import Policy, Supervisor

    policy = Policy(StartupPolicy(), HealthPolicy(), RestartPolicy())
    return state.StateStore(path, clock=lambda: 0.0, wall=lambda: 1000.0), Supervisor(
        [0, 1], policy
    )


def _drained_with_a_quarantine(path: Path) -> None:
    from sglang_farm.workers.supervisor import GpuQuarantine

    store, sup = _store_and_sup(path)
    sup.hold_out(True, 0.0)
    sup.restore(
        1,
        WorkerState(
            1, phase=Phase.QUARANTINED, quarantine=GpuQuarantine(1, "xid 79", "off the bus", 0.0)
        ),
    )
    store.save(sup.workers, held_out_since=sup.held_out_since)


def _cut_in_half(path: Path) -> None:
    text = path.read_bytes()
    path.write_bytes(text[: len(text) // 2])


def test_a_drain_and_a_quarantine_survive_a_state_file_cut_in_half(tmp_path: Path) -> None:
    """drain-host, kill -9, state.json cut in half, start: the hold was dropped
    (`state_unreadable`) and the gateway routed all 8 again. The second copy holds it."""
    from structlog.testing import capture_logs

    path = tmp_path / "state.json"
    _drained_with_a_quarantine(path)
    _cut_in_half(path)
    store, sup = _store_and_sup(path)
    with capture_logs() as logs:
        restore_into(store, sup, {0: (0,), 1: (1,)})
    assert sup.held_out_since is not None
    q = sup.workers[1].quarantine
    assert q is not None and q.gpu == 1 and q.reason == "xid 79"
    (alert,) = store.alerts()
    assert alert.kind == "unreadable" and alert.file == str(path)
    assert alert.kept is not None and Path(alert.kept).exists()
    assert "second copy" in alert.then and "state.json.copy" in alert.then
    assert any(e["event"] == "state_unreadable" and e.get("kept") for e in logs)
    store.save(sup.workers, held_out_since=sup.held_out_since)  # whole in both again
    assert path.read_bytes() == (tmp_path / "state.json.copy").read_bytes()
    assert state.load_all(path)[1]["held_out_since"] is not None


def test_with_both_copies_damaged_the_host_stays_held_and_the_loss_is_said(
    tmp_path: Path,
) -> None:
    """Fail closed: nothing says whether a drain was in force, so the host stays out of
    the gateway until an operator says; the quarantine that may be lost is announced."""
    path = tmp_path / "state.json"
    _drained_with_a_quarantine(path)
    _cut_in_half(path)
    _cut_in_half(tmp_path / "state.json.copy")
    store, sup = _store_and_sup(path)
    restore_into(store, sup, {0: (0,), 1: (1,)})
    assert sup.held_out_since is not None  # held: the drain may have been in the file
    assert sup.workers[1].quarantine is None
    (alert,) = store.alerts()
    assert "held out of the gateway" in alert.then and "undrain-host" in alert.then
    assert "quarantine" in alert.then and "dropped" in alert.then
    assert "its copy" in alert.error


def test_a_missing_file_is_still_a_first_start_held_nothing(tmp_path: Path) -> None:
    store, sup = _store_and_sup(tmp_path / "state.json")
    restore_into(store, sup, {0: (0,), 1: (1,)})
    assert sup.held_out_since is None and store.alerts() == ()


def test_a_full_state_dir_is_said_counted_and_cleared_once_a_save_succeeds(
    tmp_path: Path,
) -> None:
    """Issue 30 item 5, on a real full file system (a small tmpfs)."""
    from fulldisk import fill, small_tmpfs

    with small_tmpfs(tmp_path / "state") as d:
        path = d / "state.json"
        store, sup = _store_and_sup(path)
        restore_into(store, sup, {0: (0,), 1: (1,)})
        store.save(sup.workers)
        filler = fill(d)
        sup.hold_out(True, 0.0)
        store.save(sup.workers, held_out_since=sup.held_out_since)
        assert store.save_failures == 1
        (alert,) = store.alerts()
        assert alert.kind == "not_saved" and "No space left" in alert.error
        assert "restart would forget" in alert.line()
        assert not [p for p in d.iterdir() if p.name.endswith(".tmp")]  # no leftovers
        filler.unlink()
        store.save(sup.workers, held_out_since=sup.held_out_since)
        assert store.alerts() == () and store.save_failures == 1
        assert state.load_all(path)[1]["held_out_since"] is not None
