"""A two-worker simulated farm whose worker 1 holds an API key: the pollers' tests and the
key guard's share it.
"""

from __future__ import annotations

import sys

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
