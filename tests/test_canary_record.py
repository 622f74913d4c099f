"""The rejected-change record (issue 23 #2): a stable hash of what the workers would run,
and a rejected change held until the config changes (or an operator retries it)."""

from __future__ import annotations

import hashlib
import json

import pytest

from sglang_farm.canary.record import (
    MAX_REJECTED,
    Decision,
    RejectedChanges,
    change_hash,
    short,
    workload,
)

ARGV = ["/opt/sglang/bin/python", "-m", "sglang.launch_server", "--tp-size", "1"]
ENV = {"CUDA_VISIBLE_DEVICES": "0", "SGLANG_SIM_TOKEN_SECONDS": "0.01"}


def farm(**changes: object) -> dict[str, dict[str, dict[str, object]]]:
    w = workload(ARGV, ENV, "/opt/sglang/bin/python", "abc123")
    w.update(changes)
    return {"workers": {"0": w, "1": dict(w)}}


def test_hash_is_stable_across_key_order_and_pinned() -> None:
    h = change_hash(farm())
    workers = farm()["workers"]
    reordered = {"workers": {k: dict(reversed(list(workers[k].items()))) for k in ("1", "0")}}
    assert change_hash(reordered) == h
    # Pinned: the canonical form must never drift, or a restarted agent would retry a
    # rejected change (and forget an accepted one).
    canonical = '{"a":{"é":1.5},"b":[1,"x",null,true]}'
    expected = "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()
    assert change_hash({"b": [1, "x", None, True], "a": {"é": 1.5}}) == expected
    assert short(h) == h[:19] and short(h).startswith("sha256:")


@pytest.mark.parametrize(
    "change",
    [
        {"argv": [*ARGV[:3], "--tp-size", "2"]},
        {"argv": [ARGV[0], ARGV[2], ARGV[1], *ARGV[3:]]},  # order matters in argv
        {"env": {**ENV, "SGLANG_SIM_TOKEN_SECONDS": "0.05"}},
        {"env": {**ENV, "NEW": ""}},
        {"python": "/opt/sglang-0.5.24/bin/python"},
        {"model_revision": "def456"},
    ],
)
def test_any_difference_in_what_a_worker_runs_is_another_change(change: dict[str, object]) -> None:
    assert change_hash(farm(**change)) != change_hash(farm())


def test_only_plain_data_is_hashed_and_the_culprit_is_named() -> None:
    with pytest.raises(TypeError, match=r"change.workers.0.env: set is not plain data"):
        change_hash({"workers": {"0": {"env": {"A"}}}})
    with pytest.raises(TypeError, match="has no stable JSON form"):
        change_hash({"x": float("nan")})


def test_a_rejected_change_is_held_until_the_config_changes_or_an_operator_retries() -> None:
    accepted, bad, fixed = change_hash(farm()), change_hash(farm(python="/new")), "sha256:ff"
    record = RejectedChanges()
    assert record.decide(bad, accepted) is Decision.ROLL
    record = record.reject(bad, "rolled back: canary ITL p99 5.2x", at=1000.0)
    assert record.decide(bad, accepted) is Decision.HELD  # a reload of the same config
    assert record.decide(accepted, accepted) is Decision.NOTHING
    assert record.decide(fixed, accepted) is Decision.ROLL  # the config changed again
    rejection = record.rejection(bad)
    assert rejection is not None and rejection.evidence.startswith("rolled back")
    # Back to the rejected config later: still held, until an explicit retry.
    assert record.decide(bad, fixed) is Decision.HELD
    assert record.forget(bad).decide(bad, fixed) is Decision.ROLL


def test_the_record_survives_a_restart_as_json_and_stays_bounded() -> None:
    record = RejectedChanges()
    for i in range(MAX_REJECTED + 5):
        record = record.reject(f"sha256:{i:064x}", f"evidence {i}", at=float(i))
    assert len(record.entries) == MAX_REJECTED
    assert record.entries[0].change == f"sha256:{5:064x}"  # the oldest were dropped
    again = record.reject(f"sha256:{10:064x}", "again", 99.0)
    assert again.entries[-1].evidence == "again" and len(again.entries) == MAX_REJECTED
    restored = RejectedChanges.from_json(json.loads(json.dumps(record.to_json())))
    assert restored == record
    with pytest.raises(ValueError, match=r"rejected changes\[0\].change"):
        RejectedChanges.from_json([{"change": "md5:1", "evidence": "", "at": 1}])
    with pytest.raises(ValueError, match="expected a list"):
        RejectedChanges.from_json({"change": "x"})
    with pytest.raises(ValueError, match=r"\[0\].at: expected a number"):
        RejectedChanges.from_json([{"change": "sha256:1", "evidence": "", "at": True}])


def test_the_record_keeps_the_latest_32_rejections_as_docs_canary_md_says() -> None:
    # docs/canary.md promises 32 (the constant spelled out: a test reusing MAX_REJECTED
    # would follow any change of it). Also on the way in from JSON.
    record = RejectedChanges()
    for i in range(33):
        record = record.reject(f"sha256:{i:064x}", f"evidence {i}", at=float(i))
    assert [r.at for r in record.entries] == [float(i) for i in range(1, 33)]
    stored = [{"change": f"sha256:{i:064x}", "evidence": "", "at": i} for i in range(40)]
    assert [r.at for r in RejectedChanges.from_json(stored).entries] == [
        float(i) for i in range(8, 40)
    ]
