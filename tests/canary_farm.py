"""The canary analysis's farm for the harness's Agent (agent_harness.py): a [rollout] with a
60 s window, and each worker's synthetic /metrics fed through the scrape seam. Shared by the
agent's canary tests.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from agent_harness import (
    Farm,
    farm_toml,
)
from fake_runtime import FakeRuntime

WINDOW = {"analysis_window": "60s"}


def _toml(tmp: Path, env: dict[str, str] | None = None, **rollout: object) -> str:
    tables: dict[str, dict[str, object]] = {"rollout": {**WINDOW, **rollout}}
    if env:
        tables["farm"] = {"state_dir": str(tmp), "env": env}
    return farm_toml(tmp, workers=4, **tables)


ANSWERED_200 = 'sglang:http_responses_total{endpoint="/generate",method="POST",status_code="200"}'


class Metrics:
    """Each worker's /metrics: 10 requests a second of 10 tokens each since the test began;
    tokens take 10-20 ms, or 50-100 ms on a worker whose process runs SLOW=1; every one
    answered 200 (`sglang:http_responses_total`)."""

    def __init__(self) -> None:
        self.runtime: FakeRuntime | None = None
        self.t0 = 0.0
        self.scrapes: list[str] = []

    async def __call__(self, url: str, key: str | None) -> str:
        self.scrapes.append(url)
        assert self.runtime is not None
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        proc = self.runtime.procs.get(port - 30000)
        if proc is None:
            raise ConnectionRefusedError(url)
        n = 10 * (asyncio.get_running_loop().time() - self.t0)
        slow = proc.command.env_dict.get("SLOW") == "1"
        buckets = (0, 0, 0, 10 * n, 10 * n) if slow else (0, 10 * n, 10 * n, 10 * n, 10 * n)
        lines = [f"sglang:num_requests_total {n}", "sglang:num_aborted_requests_total 0"]
        lines.append(f"{ANSWERED_200} {n}")  # SGLang 0.5.20+: the error source (issue 30)
        for le, v in zip(("0.01", "0.02", "0.05", "0.1", "+Inf"), buckets, strict=True):
            lines.append(f'sglang:inter_token_latency_seconds_bucket{{le="{le}"}} {v}')
        lines.append(f"sglang:inter_token_latency_seconds_sum {0.01 * n}")
        return "\n".join(lines) + "\n"


async def _start(f: Farm, m: Metrics) -> None:
    m.runtime = f.runtime
    m.t0 = asyncio.get_running_loop().time()
    await f.until(f.all_ready)
