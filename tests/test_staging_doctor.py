"""The doctor and [model] (issue 16): a model path on /dev/shm is the [model] section's to
fill; a missing one with [model] is not a failure (the agent stages it before any worker)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from fake_sglang_env import (
    Sm120Poller,
    _by_id,
    _fails,
    _with_worker_flags,
    fake_runner,
    make_fake_env,
    seed_spec,
)
from sglang_farm.doctor import CheckId, Status, preflight_blocking, run_doctor
from sglang_farm.spec import ModelSpec


def test_missing_model_in_shm_says_model_section_fixes_it(tmp_path: Path) -> None:
    env = make_fake_env(tmp_path / "env", flashinfer=True)
    spec = seed_spec(tmp_path, gpus=1)
    missing = _with_worker_flags(spec, {**spec.workers[0].flags, "model_path": "/dev/shm/nope-x"})
    missing = replace(missing, model=None)
    report = run_doctor(missing, Sm120Poller(count=1), run_probe=fake_runner(env, tmp_path))
    model = _fails(report)[CheckId.MODEL_PATH]
    assert "emptied at every boot" in model.message
    assert "add a [model] section" in model.fix and "docs/staging.md" in model.fix


def test_with_model_a_missing_path_is_staged_not_a_blocking_failure(tmp_path: Path) -> None:
    env = make_fake_env(tmp_path / "env", flashinfer=True)
    spec = seed_spec(tmp_path, gpus=1)
    missing = _with_worker_flags(spec, {**spec.workers[0].flags, "model_path": "/dev/shm/nope-x"})
    staged = replace(missing, model=ModelSpec("/srv/models/Qwen3.6-27B"))
    report = run_doctor(staged, Sm120Poller(count=1), run_probe=fake_runner(env, tmp_path))
    (m,) = _by_id(report, CheckId.MODEL_PATH)
    assert m.status is Status.PASS and "stages it from /srv/models/Qwen3.6-27B" in m.message
    assert CheckId.MODEL_PATH not in [c.id for c in preflight_blocking(staged, 0, report)]


def test_a_model_on_shm_without_model_section_warns_about_the_next_boot(tmp_path: Path) -> None:
    env = make_fake_env(tmp_path / "env", flashinfer=True)
    spec = seed_spec(tmp_path, gpus=1)
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return  # no /dev/shm on this machine: nothing to place the model on
    model = shm / f"sf-test-model-{tmp_path.name}"
    model.mkdir()
    try:
        (model / "config.json").write_text("{}")
        on_shm = _with_worker_flags(spec, {**spec.workers[0].flags, "model_path": str(model)})
        report = run_doctor(
            replace(on_shm, model=None), Sm120Poller(count=1), run_probe=fake_runner(env, tmp_path)
        )
        warns = [c for c in _by_id(report, CheckId.SHM) if c.status is Status.WARN]
        assert any("emptied at every boot" in c.message and "[model]" in c.fix for c in warns)
        report = run_doctor(
            replace(on_shm, model=ModelSpec("/srv/m")),
            Sm120Poller(count=1),
            run_probe=fake_runner(env, tmp_path),
        )
        assert not any("emptied at every boot" in c.message for c in _by_id(report, CheckId.SHM))
    finally:
        (model / "config.json").unlink()
        model.rmdir()
