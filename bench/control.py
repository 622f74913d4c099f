"""I/O: control-socket latency, `farmctl status` as a whole process, and farmctl's import time."""

from __future__ import annotations

import json
import os
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


def _timed(argv: list[str], env: dict[str, str] | None = None) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    return time.perf_counter() - t0


def farmctl_vs_python(
    path: str, reps: int, *, old_pythonpath: str | None = None
) -> dict[str, object]:
    """`farmctl --socket P status` (the venv's script) against `python -c pass`, interleaved,
    with the floor click sets (`python -c 'import click'`, and `-I`, which also skips the
    venv's site hooks and the byte-code prefix) and, given `old_pythonpath`, the same
    farmctl run from an older tree (the code before a change), all in one loop."""
    farmctl = [str(VENV_BIN / "farmctl"), "--socket", path, "status"]
    argvs = {
        "farmctl": farmctl,
        "python_m_farmctl": [
            sys.executable,
            "-m",
            "sglang_farm.cli.farmctl",
            "--socket",
            path,
            "status",
        ],
        "python_c_pass": [sys.executable, "-c", "pass"],
        "python_c_import_click": [sys.executable, "-c", "import click"],
        "python_I_c_import_click": [sys.executable, "-I", "-c", "import click"],
        "python_I_c_pass": [sys.executable, "-I", "-c", "pass"],
    }
    envs: dict[str, dict[str, str] | None] = dict.fromkeys(argvs)
    if old_pythonpath:
        argvs["farmctl_old"] = farmctl
        envs["farmctl_old"] = {**os.environ, "PYTHONPATH": old_pythonpath}
    runs: dict[str, list[float]] = {k: [] for k in argvs}
    for k, argv in argvs.items():
        _timed(argv, envs[k])  # warm the page cache
    for _ in range(reps):
        for k, argv in argvs.items():
            runs[k].append(_timed(argv, envs[k]))
    out: dict[str, object] = {k: summary(v, scale=1000) for k, v in runs.items()}
    med = {k: summary(v)["median"] for k, v in runs.items()}
    base = med["python_c_pass"]
    out["ratio_farmctl_to_python"] = ratio(med["farmctl"], base)
    out["ratio_python_m_farmctl_to_python"] = ratio(med["python_m_farmctl"], base)
    out["ratio_import_click_to_python"] = ratio(med["python_c_import_click"], base)
    out["ratio_I_import_click_to_I_pass"] = ratio(
        med["python_I_c_import_click"], med["python_I_c_pass"]
    )
    if old_pythonpath:
        out["ratio_farmctl_old_to_python"] = ratio(med["farmctl_old"], base)
    out["interpreter"] = sys.executable
    return out


_LINE = re.compile(r"import time:\s+(\d+)\s+\|\s+(\d+)\s+\|(\s*)(\S+)")


def importtime(path: str, env: dict[str, str] | None = None) -> dict[str, object]:
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
    err = subprocess.run(argv, capture_output=True, text=True, check=True, env=env).stderr
    top: dict[str, float] = defaultdict(float)
    total = 0.0
    for m in _LINE.finditer(err):
        cumulative, indent, name = int(m.group(2)), len(m.group(3)), m.group(4)
        if indent == 1:  # a top-level import of the program (nested ones are indented more)
            top[name.split(".")[0]] += cumulative / 1000
            total += cumulative / 1000
    ranked = sorted(top.items(), key=lambda kv: -kv[1])
    return {"total_import_ms": total, "top": [{"package": k, "ms": v} for k, v in ranked[:8]]}


# A control server that does no work: asyncio's unix server, one request line in, the
# agent's own last `status` reply (bytes read from a file) out, one connection per call.
# What the same round trip costs on this machine, now, without the agent's work.
_FLOOR_SERVER = r"""
import asyncio, sys
reply = open(sys.argv[2], "rb").read()

async def serve(reader, writer):
    await reader.readuntil(b"\n")
    writer.write(reply)
    await writer.drain()
    writer.close()

async def main():
    server = await asyncio.start_unix_server(serve, sys.argv[1])
    print("ready", flush=True)
    async with server:
        await server.serve_forever()

asyncio.run(main())
"""


def status_vs_floor(path: str, reps: int, tmp: str) -> dict[str, object]:
    """`status` round trips to the agent and to a do-nothing server sending the same reply,
    interleaved (ms): how much of the round trip is the agent's, on this machine now."""
    client = Client(path)
    reply = Path(tmp) / "status-reply.json"
    result = client.call("status", {})
    reply.write_bytes(json.dumps({"id": 1, "ok": True, "result": result}).encode() + b"\n")
    floor_sock = str(Path(tmp) / "floor.sock")
    proc = subprocess.Popen(
        [sys.executable, "-c", _FLOOR_SERVER, floor_sock, str(reply)], stdout=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        proc.stdout.readline()
        floor = Client(floor_sock)
        agent_xs: list[float] = []
        floor_xs: list[float] = []
        for _ in range(20):
            client.call("status", {})
            floor.call("status", {})
        for _ in range(reps):
            for c, xs in ((client, agent_xs), (floor, floor_xs)):
                t0 = time.perf_counter()
                c.call("status", {})
                xs.append(time.perf_counter() - t0)
    finally:
        proc.kill()
        proc.wait()
    a, f = summary(agent_xs, scale=1000), summary(floor_xs, scale=1000)
    return {
        "agent_ms": a,
        "floor_ms": f,
        "reply_bytes": reply.stat().st_size,
        "ratio_p99": ratio(a["p99"], f["p99"]),
        "ratio_median": ratio(a["median"], f["median"]),
    }
