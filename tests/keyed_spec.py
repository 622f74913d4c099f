"""A farm whose workers hold an API key and a token: the secrets tests check that neither
shows on a command line nor in a log.
"""

from __future__ import annotations

import socket
import sys
import time

import httpx

from sglang_farm.config import load_spec
from sglang_farm.spec import FarmSpec

API_KEY = "sk-farm-secret-4f1c"
TOKEN = "hf_token_secret_9a7e"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def keyed_spec(port: int = 30000, state_dir: str = "/var/lib/sglang-farm") -> FarmSpec:
    text = f"""
[farm]
python = "{sys.executable}"
module = "sglang_farm.sim"
user = "root"
group = "root"
state_dir = "{state_dir}"
env = {{ HF_TOKEN = "{TOKEN}", SGLANG_SIM_LOAD_SECONDS = "0.2", SGLANG_SIM_WARMUP_SECONDS = "0.1" }}

[workers]
gpus = [0, 1]
host = "127.0.0.1"
base_port = {port}

[sglang]
model_path = "sim/m"
api_key = "{API_KEY}"
"""
    return load_spec(text, source="/etc/sglang-farm/farm.toml", gpu_count=2)


def _wait_healthy(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code
            if last == 200:
                return
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.1)
    raise AssertionError(f"worker on port {port} never healthy; last: {last!r}")
