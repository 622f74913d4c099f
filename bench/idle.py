"""I/O: the agent's idle CPU at 8 and 64 workers (issue 32, 4.8), old and new in one run.

    .venv/bin/python -m bench idle --baseline COMMIT [--workers 8,64] [--window 60]

Each farm is the bench's (`FarmSetup`: the simulator, the spec's default intervals, no
traffic). With `--baseline` (a commit, unpacked read-only with `git archive`, or an
`agent/` folder) an OLD farm runs that tree beside the NEW farm (the working tree): for
each size both farms are started, both reach `rollout_done`, and then both agents' CPU
time (utime + stime of `/proc/PID/stat`, all threads) is read over the SAME window, so
the two figures share the machine's load. The shared machine's wall load says nothing of
the agent's cost; its load average, the number of processes on the host (every
`/proc` walk reads each of them) and of sockets in its TCP table (what a reading of
`/proc/net/tcp` prints) are recorded with each window. `--apart` runs the two
farms of a size one after the other instead (less memory: two 64-worker farms are about
260 simulator processes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import footprint
from bench.farmrun import Farm, FarmSetup, running_farm, wait_rollout

SETTLE_S = 6.0  # one GPU and worker poll (5 s) after the rollout, as the main bench waits


def host_processes() -> int:
    return sum(1 for e in os.listdir("/proc") if e.isdigit())


def tcp_rows() -> int:
    """Sockets in the host's IPv4 table (TIME-WAIT included): what a reading of it prints."""
    with open("/proc/net/tcp", "rb") as fh:
        return sum(1 for _ in fh) - 1


def window(pids: dict[str, int], seconds: float) -> dict[str, Any]:
    """Each pid's CPU (% of one core) over one shared window, with the machine's state."""
    load0, procs0, rows0 = os.getloadavg(), host_processes(), tcp_rows()
    c0 = {k: footprint.cpu_seconds(p) for k, p in pids.items()}
    t0 = time.monotonic()
    time.sleep(seconds)
    c1 = {k: footprint.cpu_seconds(p) for k, p in pids.items()}
    t1 = time.monotonic()
    return {
        "window_s": t1 - t0,
        "cpu_pct_of_one_core": {k: (c1[k] - c0[k]) / (t1 - t0) * 100 for k in pids},
        "loadavg_start": load0,
        "loadavg_end": os.getloadavg(),
        "host_processes": [procs0, host_processes()],
        "tcp_table_rows": [rows0, tcp_rows()],
    }


@contextlib.contextmanager
def tree(pythonpath: str | None) -> Iterator[None]:
    """Children started meanwhile (agent, simulators) import `pythonpath` first (None: as is)."""
    before = os.environ.get("PYTHONPATH")
    if pythonpath is not None:
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, before) if p)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before


def start(stack: ExitStack, workers: int, pythonpath: str | None) -> Farm:
    with tree(pythonpath):
        return stack.enter_context(running_farm(FarmSetup(workers, parallel=16)))


def measure(workers: int, trees: dict[str, str | None], seconds: float, rounds: int) -> list[Any]:
    """`rounds` shared windows over one farm per tree, all running at once."""
    with ExitStack() as stack:
        farms = {name: start(stack, workers, path) for name, path in trees.items()}
        for farm in farms.values():
            wait_rollout(farm, 600)
        time.sleep(SETTLE_S)
        pids = {name: farm.proc.pid for name, farm in farms.items()}
        out = []
        for _ in range(rounds):
            out.append(window(pids, seconds))
            say(f"  {workers} workers: {out[-1]['cpu_pct_of_one_core']}")
        for name, farm in farms.items():
            restarts = len(farm.named("worker_restarting"))
            out[-1].setdefault("restarts_seen", {})[name] = restarts
        return out


def say(msg: str) -> None:
    print(f"[bench idle {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    from bench.__main__ import RESULTS, baseline_tree, bytecode_env, warm_bytecode

    ap = argparse.ArgumentParser(prog="python -m bench idle", description=__doc__)
    ap.add_argument("--baseline", help="a commit, or an agent/ folder: the OLD farm's code")
    ap.add_argument("--workers", default="8,64", help="farm sizes, comma-separated")
    ap.add_argument("--window", type=float, default=60.0, help="seconds per window")
    ap.add_argument("--rounds", type=int, default=1, help="windows per farm size")
    ap.add_argument("--apart", action="store_true", help="OLD and NEW one after the other")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    bytecode_env()
    warm_bytecode()
    trees: dict[str, str | None] = {"NEW": None}
    if a.baseline:
        old = Path(a.baseline)
        trees = {
            "OLD": str(old.resolve()) if old.is_dir() else baseline_tree(a.baseline),
            "NEW": None,
        }
    results: dict[str, Any] = {
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "baseline": a.baseline,
        "loadavg_start": os.getloadavg(),
        "by_workers": {},
    }
    for n in (int(x) for x in a.workers.split(",")):
        say(f"{n} workers: {', '.join(trees)} {'apart' if a.apart else 'side by side'}")
        if a.apart:
            runs = [measure(n, {k: v}, a.window, a.rounds) for k, v in trees.items()]
            results["by_workers"][str(n)] = [w for r in runs for w in r]
        else:
            results["by_workers"][str(n)] = measure(n, trees, a.window, a.rounds)
    results["loadavg_end"] = os.getloadavg()
    text = json.dumps(results, indent=2)
    out = a.out or RESULTS / f"{datetime.now(UTC):%Y-%m-%d}-idle.json"
    out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
