"""I/O: run a simulator farm for a benchmark (config writer, agent process, its JSON log).

Builds on `tests/farmproc.py` (the `Farm` process wrapper and the process marker);
the config here takes the spec's defaults unless a benchmark overrides a section.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
if str(ROOT / "tests") not in sys.path:  # tests.farmproc imports its sibling farmtoml
    sys.path.append(str(ROOT / "tests"))

from farmproc import Farm, block_is_free, free_port_block, marked_pids, new_marker, tmpdir  # noqa: E402 -- after sys.path

__all__ = [
    "Farm",
    "FarmSetup",
    "event_time",
    "free_port_block",
    "quiet_port_block",
    "running_farm",
    "sim_env",
]


def quiet_port_block(n: int) -> int:
    """A base port with n consecutive ports free, below the kernel's ephemeral range.

    Ports from `free_port_block` lie in that range, where any outgoing connection (the
    bench's own polls, the agent's, other work on the machine) may take one as its source
    port between the check and the bind: a 64-simulator start then failed now and then
    with EADDRINUSE.
    """
    lo = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(200):
        base = random.randrange(10_000, lo - n)
        if block_is_free(base, n):
            return base
    raise RuntimeError(f"no block of {n} free ports below {lo}")


LOAD_S = 1.0  # SGLANG_SIM_LOAD_SECONDS of every benchmark worker
WARMUP_S = 0.1
HEALTH_DELAY_S = 0.05


def sim_env(marker: str = "") -> dict[str, str]:
    env = {
        "SGLANG_SIM_LOAD_SECONDS": str(LOAD_S),
        "SGLANG_SIM_WARMUP_SECONDS": str(WARMUP_S),
        "SGLANG_SIM_HEALTH_DELAY": str(HEALTH_DELAY_S),
    }
    if marker:
        env["SGLANG_FARM_TEST_MARKER"] = marker
    return env


class FarmSetup:
    """A config: `sections` maps "[startup]"-style names to extra TOML lines (else defaults)."""

    def __init__(self, workers: int, *, parallel: int = 4, **sections: str) -> None:
        self.workers = workers
        self.parallel = parallel
        self.sections = sections

    def write(self, tmp: Path, marker: str) -> Path:
        base = quiet_port_block(self.workers * 2)
        env = ", ".join(f'{k} = "{v}"' for k, v in sim_env(marker).items())
        sec = self.sections
        text = f"""
[farm]
name = "bench-farm"
python = "{sys.executable}"
module = "sglang_farm.sim"
user = "root"
group = "root"
state_dir = "{tmp}/state"
env = {{ {env} }}

[workers]
gpus = {list(range(self.workers))}
host = "127.0.0.1"
base_port = {base}
nccl_base_port = {base + self.workers}

[startup]
canary = 0
parallel = {self.parallel}
{sec.get("startup", "")}

[health]
{sec.get("health", "")}

[restart]
{sec.get("restart", "")}

[metrics]
listen = "127.0.0.1:0"
gpu_source = "fake"
{sec.get("metrics", "")}

[control]
socket = "{tmp}/control.sock"
group = "root"

[sglang]
model_path = "sim/Qwen3.6-27B"
enable_metrics = true
"""
        path = tmp / "farm.toml"
        path.write_text(text)
        return path


@contextmanager
def running_farm(setup: FarmSetup) -> Iterator[Farm]:
    """A started farm (not yet ready); stopped and checked for leftovers on exit."""
    tmp = tmpdir()
    marker = new_marker()
    config = setup.write(tmp, marker)
    t0 = time.time()
    farm = Farm(config, marker)
    farm.tmp = tmp  # type: ignore[attr-defined]  # bench-only attributes on Farm
    farm.spawned_at = t0  # type: ignore[attr-defined]  # ditto
    try:
        yield farm
    finally:
        try:
            farm.stop(signal.SIGINT, timeout=120)
        finally:
            deadline = time.monotonic() + 15
            while marked_pids(marker) and time.monotonic() < deadline:
                time.sleep(0.2)
            for pid in marked_pids(marker):  # our own simulators only (marked env)
                os.kill(pid, signal.SIGKILL)
            shutil.rmtree(tmp, ignore_errors=True)


def event_time(ev: dict[str, Any]) -> float:
    """The wall-clock time (epoch seconds) of a JSON log event's ISO UTC "timestamp"."""
    return datetime.fromisoformat(str(ev["timestamp"])).timestamp()


def metrics_url(farm: Farm) -> tuple[str, int]:
    ev = farm.wait_for(lambda e: e.get("event") == "metrics_listening", timeout=30)
    host, _, port = str(ev["address"]).rpartition(":")
    return host, int(port)


def socket_path(farm: Farm) -> str:
    return str(farm.tmp / "control.sock")  # type: ignore[attr-defined]  # set above


def worker_pid(farm: Farm, worker: int) -> int:
    return int(farm.named("worker_launched", worker=worker)[-1]["pid"])


def wait_rollout(farm: Farm, timeout: float) -> dict[str, Any]:
    return farm.wait_for(lambda e: e.get("event") == "rollout_done", timeout=timeout)


def startup(farm: Farm, own_load_s: float, poll_interval_s: float) -> dict[str, Any]:
    """Start-up overhead from the log: first launch -> rollout_done, minus the loads' own time."""
    done = wait_rollout(farm, 300)
    first = next(e for e in farm.snapshot() if e.get("event") == "worker_launching")
    total = event_time(done) - event_time(first)
    return {
        "first_launch_to_done_s": total,
        "own_load_s": own_load_s,
        "overhead_s": total - own_load_s,
        "agent_start_to_first_launch_s": event_time(first) - farm.spawned_at,  # type: ignore[attr-defined]  # set above
        "poll_interval_s": poll_interval_s,
        "load_s_by_worker": {e["worker"]: e.get("load_s") for e in farm.named("worker_ready")},
    }
