"""Pure: the `[batch]` section of the farm's config (`config.sections._batch`): defaults,
every key's accepted values, and the problems named with their line and fix."""

from __future__ import annotations

from pathlib import Path
from textwrap import dedent

import pytest

from sglang_farm.config import load_spec
from sglang_farm.errors import ConfigError
from sglang_farm.spec import BatchSpec, Endpoint, FarmSpec

ETC = Path(__file__).resolve().parent.parent / "etc" / "sglang-farm"

BASE = """\
[workers]
gpus = [0, 1]

[sglang]
model_path = "/models/m"
"""


def load(batch: str) -> FarmSpec:
    return load_spec(BASE + "\n[batch]\n" + dedent(batch), source="farm.toml")


def problems(batch: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load(batch)
    return list(info.value.problems)


def test_no_batch_section_is_the_defaults_and_off() -> None:
    spec = load_spec(BASE, source="farm.toml")
    assert spec.batch == BatchSpec()
    assert not spec.batch.enabled
    assert spec.batch.listen == Endpoint("127.0.0.1", 8300)
    assert spec.batch.store == "sqlite" and spec.batch.concurrency is None
    assert (spec.batch.max_attempts, spec.batch.retry_backoff_s) == (5, 1.0)
    assert spec.batch.request_timeout_s == 600.0 and spec.batch.priority == "bulk"


def test_the_shipped_farm_toml_spells_out_the_defaults() -> None:
    spec = load_spec((ETC / "farm.toml").read_text(), source="farm.toml", gpu_count=8)
    assert spec.batch == BatchSpec()


def test_every_key_is_read() -> None:
    b = load(
        """\
        enabled = true
        listen = "0.0.0.0:9300"
        api_key_file = "/etc/sglang-farm/batch.key"
        store = "postgresql://batch@db.example:5432/batch"
        state_dir = "/srv/batch"
        concurrency = 96
        max_attempts = 3
        retry_backoff_s = "500ms"
        request_timeout_s = "2m"
        gateway_key_file = "/etc/sglang-farm/bulk.key"
        priority = "default"
        headers = { "X-Job" = "seed-193k" }
        """
    ).batch
    assert b.enabled and b.listen == Endpoint("0.0.0.0", 9300)
    assert b.api_key_file == "/etc/sglang-farm/batch.key"
    assert b.store == "postgresql://batch@db.example:5432/batch"
    assert (b.state_dir, b.concurrency, b.max_attempts) == ("/srv/batch", 96, 3)
    assert (b.retry_backoff_s, b.request_timeout_s) == (0.5, 120.0)
    assert b.gateway_key_file == "/etc/sglang-farm/bulk.key" and b.priority == "default"
    assert dict(b.headers) == {"X-Job": "seed-193k"}
    assert load('concurrency = "auto"').batch.concurrency is None


def test_enabled_needs_an_api_key_file() -> None:
    (p,) = problems("enabled = true\n")
    assert p.startswith("farm.toml:7: batch.api_key_file: missing")
    assert "Authorization: Bearer" in p


@pytest.mark.parametrize(
    ("line", "key", "says"),
    [
        ('store = "mysql://x"', "batch.store", "'sqlite'"),
        ("store = 3", "batch.store", "PostgreSQL URL"),
        ("concurrency = 0", "batch.concurrency", "'auto'"),
        ('concurrency = "lots"', "batch.concurrency", "integer >= 1"),
        ("max_attempts = 0", "batch.max_attempts", "integer"),
        ('retry_backoff_s = "soon"', "batch.retry_backoff_s", "seconds"),
        ("request_timeout_s = 0", "batch.request_timeout_s", ""),
        ('listen = "nowhere"', "batch.listen", ""),
        ('api_key_file = "relative.key"', "batch.api_key_file", "absolute path"),
        ('state_dir = "var/lib"', "batch.state_dir", "absolute path"),
        ('priority = "urgent"', "batch.priority", "bulk"),
        ("enabled = 1", "batch.enabled", "true or false"),
        ('headers = { Authorization = "Bearer x" }', "batch.headers.Authorization", "remove it"),
        ('headers = { "x-smg-priority" = "bulk" }', "batch.headers.x-smg-priority", "priority"),
        ('headers = { "bad header" = "x" }', "batch.headers.'bad header'", "header name"),
        ("headers = { X-N = 3 }", "batch.headers.X-N", "string"),
        ("headers = 3", "batch.headers", "table"),
        ("retries = 3", "batch", "retries"),
    ],
)
def test_bad_values_are_named_with_the_fix(line: str, key: str, says: str) -> None:
    found = problems(line + "\n")
    assert len(found) == 1, found
    assert f": {key}" in found[0] and says in found[0], found[0]
