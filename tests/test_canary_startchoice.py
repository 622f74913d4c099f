"""canary.startchoice: which config the agent starts on, decided from the canary record
and the file alone (issue 32 §1), each branch."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent_harness import farm_toml
from sglang_farm.canary import record, rollout
from sglang_farm.canary.record import Accepted, RejectedChanges
from sglang_farm.canary.startchoice import OnAccepted, OnFile, Refused, start_choice
from sglang_farm.canary.store import CanaryRecord
from sglang_farm.config import load_spec
from sglang_farm.errors import ConfigError
from sglang_farm.spec import FarmSpec

RECORD = "/var/lib/sglang-farm/canary.json"


def _text(tmp: Path, *, window: str = "60s", workers: int = 4, env: str = "0") -> str:
    return farm_toml(
        tmp,
        workers=workers,
        rollout={"analysis_window": window},
        farm={"state_dir": str(tmp), "env": {"CHANGE": env}},
    )


def _load(text: str) -> FarmSpec:
    return load_spec(text, source="farm.toml")


def _change(spec: FarmSpec) -> str:
    return rollout.spec_change(spec, {})


def _choose(spec: FarmSpec, rec: CanaryRecord) -> object:
    return start_choice(spec, _change(spec), rec.accepted, rec.rejected, _load, RECORD)


def test_a_file_whose_change_was_accepted_starts_as_it_is(tmp: Path) -> None:
    spec = _load(_text(tmp))
    rec = CanaryRecord(accepted=Accepted(_change(spec), _text(tmp), 1.0))
    assert _choose(spec, rec) == OnFile()


def test_a_first_start_with_no_record_runs_the_file(tmp: Path) -> None:
    assert _choose(_load(_text(tmp)), CanaryRecord()) == OnFile()


@pytest.mark.parametrize("window", ["1s", "60s"])
def test_a_change_never_accepted_starts_on_the_accepted_config_and_rolls_later(
    tmp: Path, window: str
) -> None:
    """Any window turns the analysis on, the shortest too (a mutant read `<= 1`)."""
    old_text = _text(tmp, env="old", window=window)
    spec = _load(_text(tmp, env="new", window=window))
    rec = CanaryRecord(accepted=Accepted(_change(_load(old_text)), old_text, 1.0))
    choice = _choose(spec, rec)
    assert isinstance(choice, OnAccepted) and choice.held is None
    assert _change(choice.accepted) == _change(_load(old_text))


def test_with_analysis_off_a_change_never_accepted_runs_the_file(tmp: Path) -> None:
    old_text = _text(tmp, env="old", window="0s")
    spec = _load(_text(tmp, env="new", window="0s"))
    rec = CanaryRecord(accepted=Accepted(_change(_load(old_text)), old_text, 1.0))
    assert _choose(spec, rec) == OnFile()


def test_a_rejected_change_is_held_on_the_accepted_config_even_with_analysis_off(
    tmp: Path,
) -> None:
    old_text = _text(tmp, env="old", window="0s")
    spec = _load(_text(tmp, env="bad", window="0s"))
    rejected = RejectedChanges().reject(_change(spec), "ITL p50 4.0x", 5.0)
    rec = CanaryRecord(Accepted(_change(_load(old_text)), old_text, 1.0), rejected)
    choice = _choose(spec, rec)
    assert isinstance(choice, OnAccepted)
    assert choice.held is not None and choice.held.evidence == "ITL p50 4.0x"


def test_the_accepted_config_keeps_the_files_gateway(tmp: Path) -> None:
    old_text = _text(tmp, env="old")
    spec = _load(_text(tmp, env="new"))
    rec = CanaryRecord(accepted=Accepted(_change(_load(old_text)), old_text, 1.0))
    choice = _choose(spec, rec)
    assert isinstance(choice, OnAccepted) and choice.accepted.gateway == spec.gateway


@pytest.mark.parametrize(
    ("accepted", "why"),
    [
        (None, "no accepted config is recorded"),
        ("text-not-recorded", "the accepted config's text was not recorded"),
        ("[farm\nbroken", "the accepted config no longer loads: "),
        ("two-workers", "the accepted config has other workers than the file's"),
    ],
)
def test_an_unusable_accepted_config(tmp: Path, accepted: str | None, why: str) -> None:
    """Never accepted: the file runs unjudged, saying why (with no record at all, a
    first start, there is nothing to say); rejected: nothing starts, and
    the refusal names the change, the evidence, why and both fixes."""
    spec = _load(_text(tmp, env="new"))
    acc = None
    if accepted == "text-not-recorded":
        acc = Accepted("other", None, 1.0)
    elif accepted == "two-workers":
        acc = Accepted("other", _text(tmp, workers=2), 1.0)
    elif accepted is not None:
        acc = Accepted("other", accepted, 1.0)
    unjudged = _choose(spec, CanaryRecord(accepted=acc))
    if acc is None:
        assert unjudged == OnFile()  # a first start: nothing to judge against, nothing to say
    else:
        assert isinstance(unjudged, OnFile) and unjudged.unjudged is not None
        assert unjudged.unjudged.startswith(why)
    rejected = RejectedChanges().reject(_change(spec), "errors 10 %", 0.0)
    refused = _choose(spec, CanaryRecord(acc, rejected))
    assert isinstance(refused, Refused)
    assert refused.problem.startswith(
        f"farm.toml: change {record.short(_change(spec))} was rejected by its canary at "
        "1970-01-01 00:00:00 UTC: errors 10 %; the accepted config cannot be run instead (" + why
    )
    assert refused.problem.endswith(
        f"put the config file back on the accepted config, or remove the change's entry "
        f"from {RECORD} to run it anyway"
    )


def test_the_loader_raising_is_a_reason_not_a_crash(tmp: Path) -> None:
    spec = _load(_text(tmp, env="new"))

    def refuses(text: str) -> FarmSpec:
        raise ConfigError("accepted", ["workers.gpus: GPU 7 is not on this host"])

    choice = start_choice(
        spec, _change(spec), Accepted("other", "x", 1.0), RejectedChanges(), refuses, RECORD
    )
    assert choice == OnFile(
        unjudged="the accepted config no longer loads: workers.gpus: GPU 7 is not on this host"
    )
