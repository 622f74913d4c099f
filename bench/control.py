"""I/O: control-socket latency, `farmctl status` as a whole process, and farmctl's import time."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from bench.stats import ratio, summary
from sglang_farm.control.client import Client

VENV_BIN = Path(sys.executable).parent


def status_round_trip(path: str, reps: int, *, max_s: float = 1e9) -> dict[str, object]:
    """`status` over the socket (one connection per call, as farmctl does), ms."""
    client = Client(path)
    for _ in range(20):
        client.call("status", {})
    xs = []
    end = time.monotonic() + max_s
    for _ in range(reps):
        if time.monotonic() > end:
            break
        t0 = time.perf_counter()
        client.call("status", {})
        xs.append(time.perf_counter() - t0)
    return {"latency_ms": summary(xs, scale=1000)}


def _timed(argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def farmctl_vs_python(path: str, reps: int) -> dict[str, object]:
    """`farmctl --socket P status` (the venv's script) against `python -c pass`, interleaved."""
    farmctl = [str(VENV_BIN / "farmctl"), "--socket", path, "status"]
    module = [sys.executable, "-m", "sglang_farm.cli.farmctl", "--socket", path, "status"]
    bare = [sys.executable, "-c", "pass"]
    runs: dict[str, list[float]] = {"farmctl": [], "python_m_farmctl": [], "python_c_pass": []}
    for argv in (farmctl, module, bare):
        _timed(argv)  # warm the page cache
    for _ in range(reps):
        runs["farmctl"].append(_timed(farmctl))
        runs["python_m_farmctl"].append(_timed(module))
        runs["python_c_pass"].append(_timed(bare))
    out: dict[str, object] = {k: summary(v, scale=1000) for k, v in runs.items()}
    med = {k: summary(v)["median"] for k, v in runs.items()}
    out["ratio_farmctl_to_python"] = ratio(med["farmctl"], med["python_c_pass"])
    out["ratio_python_m_farmctl_to_python"] = ratio(med["python_m_farmctl"], med["python_c_pass"])
    out["interpreter"] = sys.executable
    return out


_LINE = re.compile(r"import time:\s+(\d+)\s+\|\s+(\d+)\s+\|(\s*)(\S+)")


def importtime(path: str) -> dict[str, object]:
    """`python -X importtime` of `farmctl status`: top-level imports by cumulative time (ms)."""
    argv = [
        sys.executable,
        "-X",
        "importtime",
        "-m",
        "sglang_farm.cli.farmctl",
        "--socket",
        path,
        "status",
    ]
    err = subprocess.run(argv, capture_output=True, text=True, check=True).stderr
    top: dict[str, float] = defaultdict(float)
    total = 0.0
    for m in _LINE.finditer(err):
        cumulative, indent, name = int(m.group(2)), len(m.group(3)), m.group(4)
        if indent == 1:  # a top-level import of the program (nested ones are indented more)
            top[name.split(".")[0]] += cumulative / 1000
            total += cumulative / 1000
    ranked = sorted(top.items(), key=lambda kv: -kv[1])
    return {"total_import_ms": total, "top": [{"package": k, "ms": v} for k, v in ranked[:8]]}
