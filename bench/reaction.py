"""I/O: how fast the agent reacts to a crash (SIGKILL) and a hang (SIGSTOP) of a worker.

Times are wall clock: `time.time()` just before the signal, against the agent's JSON
log "timestamp" (ISO UTC) of the event that shows the reaction.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Any

from bench.farmrun import Farm, event_time, worker_pid
from bench.stats import summary


def _after(farm: Farm, n: int, event: str, worker: int, timeout: float, **fields: Any) -> Any:
    return farm.wait_for(
        lambda e: (
            e.get("event") == event
            and e.get("worker") == worker
            and all(e.get(k) == v for k, v in fields.items())
        ),
        after=n,
        timeout=timeout,
    )


def crashes(farm: Farm, workers: list[int], sim_load_s: float, backoff_s: float) -> dict[str, Any]:
    """SIGKILL each worker's main pid in turn; wait until it is ready again before the next."""
    recorded, ready_again, restarted = [], [], []
    for w in workers:
        pid = worker_pid(farm, w)
        n = len(farm.snapshot())
        t_kill = time.time()
        os.kill(pid, signal.SIGKILL)
        exited = _after(farm, n, "worker_exited", w, 30)
        launching = _after(farm, n, "worker_launching", w, 60)
        ready = _after(farm, n, "worker_ready", w, 60)
        recorded.append(event_time(exited) - t_kill)
        restarted.append(event_time(launching) - t_kill)
        ready_again.append(event_time(ready) - t_kill)
        time.sleep(0.5)
    return {
        "kill_to_recorded_s": summary(recorded),
        "kill_to_relaunch_s": summary(restarted),
        "kill_to_ready_s": summary(ready_again),
        "ready_minus_sim_load_s": summary([r - sim_load_s for r in ready_again]),
        "ready_minus_sim_load_minus_backoff_s": summary(
            [r - sim_load_s - backoff_s for r in ready_again]
        ),
        "backoff_initial_s": backoff_s,
        "sim_load_s": sim_load_s,
    }


def hangs(farm: Farm, workers: list[int], period: float, threshold: int) -> dict[str, Any]:
    """SIGSTOP each worker's process group; time until the agent issues the hang restart."""
    issued = []
    for w in workers:
        pid = worker_pid(farm, w)
        n = len(farm.snapshot())
        t_stop = time.time()
        os.killpg(pid, signal.SIGSTOP)
        try:
            term = _after(farm, n, "worker_terminating", w, threshold * period + 30, kind="hang")
            issued.append(event_time(term) - t_stop)
            _after(farm, n, "worker_ready", w, 90)
        finally:
            # The runtime sends SIGCONT with its SIGTERM; this covers a missed restart.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGCONT)
        time.sleep(0.5)
    return {
        "stop_to_restart_issued_s": summary(issued),
        "threshold_x_period_s": threshold * period,
        "target_s": (threshold + 1) * period,
        "period_s": period,
        "failure_threshold": threshold,
    }
