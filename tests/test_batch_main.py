"""`sglang-farm-batch` refuses to start, with one line saying what and what to do, where it
cannot serve safely: not enabled, no usable API key, a SQLite store another service holds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from batchsvc import BatchService, write_config

pytestmark = pytest.mark.slow


def run(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sglang_farm.batch", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_not_enabled_is_refused(tmp_path: Path) -> None:
    r = run(write_config(tmp_path, workers=1, base_port=30000, batch={"enabled": False}))
    assert r.returncode == 2
    assert "[batch] enabled is false; set enabled = true" in r.stderr


def test_an_empty_or_missing_key_file_is_refused(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, workers=1, base_port=30000)
    (tmp_path / "batch.key").write_text("\n")
    r = run(cfg)
    assert r.returncode == 2 and "batch.key is empty; write the key there" in r.stderr
    (tmp_path / "batch.key").unlink()
    r = run(cfg)
    assert r.returncode == 2 and "cannot read [batch] api_key_file" in r.stderr


def test_an_invalid_config_is_refused_with_its_problems(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, workers=1, base_port=30000, batch={"concurrency": 0})
    r = run(cfg)
    assert r.returncode == 2 and "batch.concurrency" in r.stderr


def test_a_second_service_on_the_same_sqlite_store_is_refused(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, workers=1, base_port=30000)
    with BatchService(cfg):
        r = run(cfg)
    assert r.returncode == 2
    assert "another batch service holds" in r.stderr and "state_dir" in r.stderr
