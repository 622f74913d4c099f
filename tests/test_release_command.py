"""The release command (the farmctl command that ends a worker's quarantine): one builder,
`control.release.release_command`, said alike by wait-ready's end, status, why and the
agent's refusals, right also for a worker that a reload moved off the quarantined GPU."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sglang_farm.cli.ctl.exits import NotRunning
from sglang_farm.cli.ctl.follow import _judge

_Q = {"gpu": 2, "reason": "xid 79", "detail": "fell off the bus", "since": 1.0}


def test_wait_ready_names_the_worker_when_a_reload_moved_it_off_the_quarantined_gpu() -> None:
    """Quarantined on GPU 2, then a reload put worker 2 on GPU 5: `release-gpu 2` is
    refused (no worker uses GPU 2), so the way out is by worker."""
    final = {"id": 2, "gpus": [5], "state": "quarantined", "quarantine": _Q}
    with pytest.raises(NotRunning) as exc:
        _judge(2, final, 60.0)
    assert exc.value.format_message() == (
        "worker 2 is quarantined: GPU 2 is set aside (xid 79); start and restart leave it "
        "stopped until farmctl release-gpu --worker 2; see farmctl why 2"
    )


def test_wait_ready_names_the_gpu_when_the_worker_still_uses_it() -> None:
    final = {"id": 2, "gpus": [2], "state": "quarantined", "quarantine": _Q}
    with pytest.raises(NotRunning) as exc:
        _judge(2, final, 60.0)
    assert "until farmctl release-gpu 2; see farmctl why 2" in exc.value.format_message()


def test_wait_ready_says_the_release_the_agent_sends() -> None:
    final = {"id": 2, "gpus": [2], "quarantine": _Q, "release": "farmctl release-gpu --worker 2"}
    with pytest.raises(NotRunning) as exc:
        _judge(2, final, 60.0)
    assert "until farmctl release-gpu --worker 2;" in exc.value.format_message()


def test_the_agent_sends_the_release_of_a_moved_worker_in_its_result() -> None:
    from farm_views import _worker
    from sglang_farm.control import prose, results
    from sglang_farm.farm_view import Phase, Quarantine

    q = Quarantine(gpu=2, reason="xid 79", detail="", since=1.0)
    moved = replace(_worker(Phase.QUARANTINED, in_gateway=False), id=2, gpus=(5,), quarantine=q)
    assert results.worker_result(moved)["release"] == "farmctl release-gpu --worker 2"
    assert prose.release_command(moved) == "farmctl release-gpu --worker 2"
    kept = replace(moved, gpus=(2,))
    assert results.worker_result(kept)["release"] == "farmctl release-gpu 2"
    assert results.worker_result(replace(kept, quarantine=None))["release"] is None
