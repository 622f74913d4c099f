"""I/O: the simulator's own load-to-ready time, with no agent around it.

Spawns `python -m sglang_farm.sim` with the benchmark's SGLANG_SIM_* settings and
times spawn -> port bound -> `/health` 200, polling every 5 ms. The farm's overheads
subtract this measured figure, not the configured SGLANG_SIM_LOAD_SECONDS.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import IO

from bench.farmrun import free_port_block, quiet_port_block, sim_env
from bench.stats import summary


def _bound(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.connect(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _healthy(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def one(port: int) -> tuple[float, float]:
    """(spawn -> port bound, spawn -> /health 200) in seconds, for one simulator start."""
    env = {**os.environ, **sim_env()}
    argv = [
        sys.executable,
        "-m",
        "sglang_farm.sim",
        "--model-path",
        "sim/Qwen3.6-27B",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enable-metrics",
    ]
    t0 = time.monotonic()
    p = subprocess.Popen(
        argv, env=env, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True
    )
    try:
        deadline = t0 + 60
        while not _bound(port):
            if p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"simulator on port {port} never bound (exit {p.returncode})")
            time.sleep(0.005)
        bound = time.monotonic() - t0
        while not _healthy(port):
            if p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"simulator on port {port} never healthy (exit {p.returncode})")
            time.sleep(0.005)
        return bound, time.monotonic() - t0
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def run(reps: int = 5) -> dict[str, object]:
    port = free_port_block(1)
    bound, ready = [], []
    one(port)  # warm-up: fills the byte-code cache and the page cache
    for _ in range(reps):
        b, r = one(port)
        bound.append(b)
        ready.append(r)
    return {
        "spawn_to_bound_s": summary(bound),
        "spawn_to_health_s": summary(ready),
        "configured_s": {
            "load": sim_env()["SGLANG_SIM_LOAD_SECONDS"],
            "warmup": sim_env()["SGLANG_SIM_WARMUP_SECONDS"],
            "health_delay": sim_env()["SGLANG_SIM_HEALTH_DELAY"],
        },
    }


def wave(k: int, reps: int = 3) -> dict[str, object]:
    """k simulators spawned at once (a rollout wave): spawn -> all k answer /health 200, s."""
    xs = []
    for _ in range(reps):
        base = free_port_block(k)
        env = {**os.environ, **sim_env()}
        t0 = time.monotonic()
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "sglang_farm.sim",
                    "--model-path",
                    "sim/Qwen3.6-27B",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(base + i),
                    "--enable-metrics",
                ],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            for i in range(k)
        ]
        try:
            pending = set(range(k))
            deadline = time.monotonic() + 60
            while pending:
                pending = {i for i in pending if not (_bound(base + i) and _healthy(base + i))}
                dead = [i for i in pending if procs[i].poll() is not None]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"simulators {sorted(pending)} never became healthy "
                        f"(exited: {[(i, procs[i].returncode) for i in dead]})"
                    )
                if pending:
                    time.sleep(0.005)
            xs.append(time.monotonic() - t0)
        finally:
            for p in procs:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return {"spawn_to_all_healthy_s": summary(xs)}


def _spawn(port: int, out: IO[bytes]) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "sglang_farm.sim", "--model-path", "sim/Qwen3.6-27B"]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--enable-metrics"]
    return subprocess.Popen(
        argv,
        env={**os.environ, **sim_env()},
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _last_lines(out: IO[bytes]) -> str:
    out.seek(0)
    return " | ".join(out.read().decode("utf-8", "replace").splitlines()[-3:])


def rollout(n: int, parallel: int, poll: float = 0.02) -> dict[str, object]:
    """The farm's start plan with no agent: simulator 0 alone, then the other n-1 with at
    most `parallel` loading at a time, the next spawned as soon as one answers /health 200
    (looked for every `poll` s: a cheap connect first, HTTP only once the port is bound).

    What the simulators' own start-up costs on this machine under the same schedule; the
    farm's rollout minus this is the agent's own share.
    """
    base = quiet_port_block(n)
    procs: dict[int, subprocess.Popen[bytes]] = {}
    # What a failed simulator said; closed below.
    outs = {w: tempfile.TemporaryFile() for w in range(n)}  # noqa: SIM115 -- n files, closed in finally
    t0 = time.monotonic()
    try:
        procs[0] = _spawn(base, outs[0])
        while not (_bound(base) and _healthy(base)):
            time.sleep(poll)
        canary = time.monotonic() - t0
        todo = list(range(1, n))
        loading: set[int] = set()
        deadline = time.monotonic() + 600
        while todo or loading:
            while todo and len(loading) < parallel:
                w = todo.pop(0)
                procs[w] = _spawn(base + w, outs[w])
                loading.add(w)
            time.sleep(poll)
            for w in sorted(loading):
                if procs[w].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"simulator {w} (port {base + w}) exited ({procs[w].returncode}) or "
                        f"never became healthy: {_last_lines(outs[w])}"
                    )
                if _bound(base + w) and _healthy(base + w):
                    loading.discard(w)
        total = time.monotonic() - t0
    finally:
        for p in procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        for f in outs.values():
            f.close()
    return {"workers": n, "parallel": parallel, "canary_s": canary, "total_s": total}
