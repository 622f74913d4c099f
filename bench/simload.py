"""I/O: the simulator's own load-to-ready time, with no agent around it.

Spawns `python -m sglang_farm.sim` with the benchmark's SGLANG_SIM_* settings and
times spawn -> port bound -> `/health` 200, polling every 5 ms. The farm's overheads
subtract this measured figure, not the configured SGLANG_SIM_LOAD_SECONDS.
"""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import time

from bench.farmrun import free_port_block, sim_env
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
