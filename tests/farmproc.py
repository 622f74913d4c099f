"""Test helper: run `sglang-farm run --runtime process` on a generated config, read its JSON log.

Every process the farm starts inherits a unique marker in its environment, so a test
can find all of them in /proc (the simulators and their scheduler children) and prove
that nothing is left after shutdown.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from farmtoml import Table, merged, sim_farm, toml_text

ROOT = Path(__file__).resolve().parent.parent
SGLANG_FARM = [sys.executable, "-m", "sglang_farm.cli.main"]


def block_is_free(base: int, n: int) -> bool:
    """Every loopback port in base .. base+n-1 can be bound now."""
    for p in range(base, base + n):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                return False
    return True


# Blocks handed out by this process: free now is not free later, when a test builds two
# farms before starting either (their blocks must not overlap).
_GIVEN: list[range] = []


# The fixed ports the README's demo uses (8000, 9840, 29000, 30000-30007, 31000-31007): a
# block handed out here never overlaps them, since a walkthrough may run beside the test.
_DEMO_PORTS = range(8000, 31100)
_TOP = 65000


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> range:
    """The kernel's ephemeral (client) ports: every outgoing connection takes one, and
    thousands stay in TIME-WAIT on a busy machine."""
    try:
        lo, hi = (int(x) for x in Path(path).read_text().split())
    except (OSError, ValueError):
        lo, hi = 32768, 60999  # Linux's default
    return range(lo, hi + 1)


def port_candidates(n: int, ephemeral: range) -> list[int]:
    """Block bases of n ports that miss the ephemeral range and the demo's ports: above
    the ephemeral range (Linux's default leaves 61000-65000), else below it."""
    bases = [b for b in range(ephemeral.stop, _TOP - n, n)]
    bases += [
        b
        for b in range(1024, ephemeral.start - n, n)
        if not (b < _DEMO_PORTS.stop and _DEMO_PORTS.start < b + n)
    ]
    return bases


def free_port_block(n: int) -> int:
    """A base port with n consecutive ports free on 127.0.0.1 and not handed out before
    by this process, outside the ephemeral range (`ephemeral_range`: ports taken by the
    machine's own connections, in TIME-WAIT by the thousand while the suite runs, are never
    chosen; scanning them is what ran out of blocks on a busy machine). Several pytest-xdist
    workers start their scans at different places (by PID); the bind test settles the rest."""
    bases = port_candidates(n, ephemeral_range())
    if not bases:
        raise RuntimeError(f"no room for a block of {n} ports outside the ephemeral range")
    start = (os.getpid() * 7919) % len(bases)
    for base in bases[start:] + bases[:start]:
        block = range(base, base + n)
        if any(b.start < block.stop and block.start < b.stop for b in _GIVEN):
            continue
        if block_is_free(base, n):
            _GIVEN.append(block)
            return base
    raise RuntimeError(f"no free block of {n} ports outside the ephemeral range")


def farm_config(
    tmp: Path,
    *,
    workers: int = 8,
    parallel: int = 4,
    load_seconds: float = 1.0,
    marker: str,
    extra: str = "",
    worker_env: dict[int, dict[str, str]] | None = None,
    **tables: Table,
) -> Path:
    """tmp/farm.toml: `farmtoml.sim_farm` on a free block of ports, every process marked,
    with `tables` merged over its own (`health={...}`); `extra`: whole tables to append
    (a `[gateway]` section)."""
    base = free_port_block(workers * 2)
    env = {
        "SGLANG_SIM_LOAD_SECONDS": str(load_seconds),
        "SGLANG_SIM_HEALTH_DELAY": "0.05",
        "SGLANG_SIM_WARMUP_SECONDS": "0.1",
        "SGLANG_FARM_TEST_MARKER": marker,
    }
    overrides = {str(wid): {"env": env} for wid, env in (worker_env or {}).items()}
    doc = sim_farm(
        workers,
        sys.executable,
        farm={"user": "root", "group": "root", "state_dir": f"{tmp}/state", "env": env},
        workers={
            "base_port": base,
            "nccl_base_port": base + workers,
            "overrides": overrides or None,
        },
        startup={"parallel": parallel, "load_timeout": "60s", "poll_interval": "0.1s"},
        health={"period": "0.5s", "timeout": "2s", "failure_threshold": 3},
        restart={
            "backoff_initial": "0.5s",
            "backoff_max": "5s",
            "max_failures": 5,
            "stop_timeout": "5s",
        },
        metrics={
            "listen": "127.0.0.1:0",
            "gpu_source": "fake",
            "gpu_poll_interval": "1s",
            "worker_poll_interval": "1s",
        },
        control={"socket": f"{tmp}/control.sock", "group": "root"},
        sglang={"model_path": "sim/Qwen3.6-27B", "enable_metrics": True},
    )
    path = tmp / "farm.toml"
    path.write_text(toml_text(merged(doc, tables)) + extra)
    return path


def marked_pids(marker: str) -> list[int]:
    """Live processes whose environment carries the marker."""
    needle = f"SGLANG_FARM_TEST_MARKER={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes()
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if needle in env.split(b"\0") and ") Z " not in stat:
            found.append(int(entry))
    return found


class Farm:
    """A running `sglang-farm run`; `events` are its parsed JSON log lines."""

    def __init__(self, config: Path, marker: str, *, runtime: str = "process") -> None:
        self.config = config
        self.marker = marker
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [
                *SGLANG_FARM,
                "run",
                "--config",
                str(config),
                "--runtime",
                runtime,
                "--log-format",
                "json",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
            cwd=ROOT,
        )
        self.events: list[dict[str, Any]] = []
        self.raw: list[str] = []
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            with self._lock:
                self.raw.append(line)
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                if isinstance(ev, dict):
                    ev["_t"] = time.monotonic()
                    self.events.append(ev)

    def snapshot(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.events)

    def wait_for(
        self, pred: Callable[[dict[str, Any]], bool], timeout: float = 60.0, *, after: int = 0
    ) -> dict[str, Any]:
        """The first event (from index `after`) matching `pred`; fails with the log tail."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for ev in self.snapshot()[after:]:
                if pred(ev):
                    return ev
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        tail = "\n".join(self.raw[-40:])
        raise AssertionError(f"no matching event within {timeout} s; agent log tail:\n{tail}")

    def named(self, event: str, **fields: Any) -> list[dict[str, Any]]:
        return [
            e
            for e in self.snapshot()
            if e.get("event") == event and all(e.get(k) == v for k, v in fields.items())
        ]

    def stop(self, sig: int = signal.SIGINT, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        finally:
            self._reader.join(5)
            if self.proc.stderr is not None:
                self.proc.stderr.close()

    def farmctl(self, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "sglang_farm.cli.farmctl", "--config", str(self.config), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
        )


def new_marker() -> str:
    return uuid.uuid4().hex


def tmpdir() -> Path:
    """A new folder under the system's temporary folder, its path short (the `short_tmp`
    fixture's, conftest.py): the control socket path must stay under 107 bytes."""
    return Path(tempfile.mkdtemp(prefix="sf"))
