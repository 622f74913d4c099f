"""The worker pollers send a worker's API key, which SGLang's /v1/loads requires (#4)."""

from __future__ import annotations

import sys

from sglang_farm.config import load_spec
from sglang_farm.pollers import worker_api_key

TOML = f"""
[farm]
python = "{sys.executable}"
module = "sglang_farm.sim"
[workers]
gpus = [0, 1]
host = "127.0.0.1"
base_port = 30000
[workers.overrides.1]
sglang = {{ api_key = "k-worker-1" }}
[metrics]
gpu_source = "none"
[sglang]
model_path = "sim/model"
"""


def test_the_poller_sends_the_key_a_worker_was_started_with() -> None:
    spec = load_spec(TOML, source="t.toml")
    assert worker_api_key(spec, 1) == "k-worker-1"
    assert worker_api_key(spec, 0) is None
    assert worker_api_key(spec, 7) is None  # not (or no longer) a worker of this farm
