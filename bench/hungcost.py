"""I/O: what one hung worker costs the agent: its CPU and events over a window, healthy
and then with one worker SIGSTOPped, on the 64-worker farm of `--only perf`.

    .venv/bin/python -m bench.hungcost [--out PATH]   # about 1.5 minutes

A scrape never waits on a worker; this says whether a hung one makes the agent busier
(which would show in every scrape's tail), measured in one run.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from bench import footprint
from bench.farmrun import Farm, FarmSetup, running_farm, wait_rollout, worker_pid

WINDOW_S = 15.0


def _window(farm: Farm) -> dict[str, Any]:
    pid = farm.proc.pid
    n0 = len(farm.snapshot())
    c0 = footprint.cpu_seconds(pid)
    time.sleep(WINDOW_S)
    cpu = footprint.cpu_seconds(pid) - c0
    events = collections.Counter(str(e.get("event")) for e in farm.snapshot()[n0:])
    return {"cpu_pct_of_one_core": cpu / WINDOW_S * 100, "events": dict(events)}


def measure(hung_worker: int = 40, settle_s: float = 6.0) -> dict[str, Any]:
    with running_farm(FarmSetup(64, parallel=16)) as farm:
        wait_rollout(farm, 400)
        time.sleep(settle_s)
        out = {"window_s": WINDOW_S, "hung_worker": hung_worker, "healthy": _window(farm)}
        pid = worker_pid(farm, hung_worker)
        os.killpg(pid, signal.SIGSTOP)
        try:
            time.sleep(settle_s)  # as the scrape series does: the polls meet the hang first
            out["hung"] = _window(farm)
        finally:
            os.killpg(pid, signal.SIGCONT)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.hungcost", description=__doc__)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    result = measure()
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
