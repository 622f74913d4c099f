"""FarmView.rollout is the supervisor's `Rollout` (issue 32 §2), its wire strings unchanged;
a worker's GPUs named by one helper."""

from __future__ import annotations

from dataclasses import replace

from metrics_fixtures import farm
from sglang_farm.control import wire
from sglang_farm.farm_view import Rollout
from sglang_farm.service import status_line
from sglang_farm.spec import gpu_field, gpu_label


def test_the_rollout_goes_on_the_wire_as_its_old_strings() -> None:
    assert [str(r) for r in Rollout] == ["idle", "canary", "rolling", "done", "halted"]
    for r in Rollout:
        assert wire.line({"rollout": r}) == b'{"rollout":"%s"}\n' % str(r).encode()


def test_the_status_line_names_a_halted_rollout_and_its_reason() -> None:
    view = replace(farm(), rollout=Rollout.HALTED, rollout_reason="the canary failed")
    assert "; rollout halted: the canary failed" in status_line(view)
    assert "rollout halted" not in status_line(replace(view, rollout=Rollout.DONE))


def test_a_workers_gpus_are_named_one_way_in_metrics_and_logs() -> None:
    assert gpu_label((3,)) == "3" and gpu_label((0, 1)) == "0,1"
    assert gpu_field((3,)) == 3  # a number, as the lines about one GPU say it
    assert gpu_field((0, 1)) == "0,1"
    assert str(gpu_field((3,))) == gpu_label((3,))
