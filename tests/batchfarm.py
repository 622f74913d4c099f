"""Test and bench helper: the demo farm (etc/sglang-farm/demo.toml: 8 simulator workers
behind the managed smg, the batch service run by the agent with its embedded SQLite
store) on ports and folders of its own, run as `./scripts/demo` runs it, with what a
batch fault scenario does to it: `kill -9` of a worker, of the batch service and of the
agent (then a new agent on the same config, as systemd's `Restart=` would start one),
`farmctl` commands, and the batch service's store read directly.

Every process it starts carries a marker in its environment (`SGLANG_FARM_TEST_MARKER`),
so that a killed agent's children are known gone before the next one starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from farmproc import Farm, free_port_block, marked_pids, new_marker
from farmtoml import rewritten

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "etc/sglang-farm/demo.toml"
FARMCTL = REPO / ".venv/bin/farmctl"


def wait_for(what: str, probe: Callable[[], tuple[bool, Any]], timeout: float) -> Any:
    """Poll `probe` until it holds (a give-up bound, never a timing assertion); what it saw."""
    deadline = time.monotonic() + timeout
    while True:
        ok, seen = probe()
        if ok:
            return seen
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s; last seen: {seen!r}")
        time.sleep(0.2)


def batch_service_pid(config: Path) -> int | None:
    """The batch service run on `config` (`-m sglang_farm.batch --config <config>`)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"sglang_farm.batch" in argv and os.fsencode(str(config)) in argv:
            return int(entry)
    return None


class DemoFarm:
    """demo.toml with its own ports and folders under `tmp`; `env` is added to the
    workers' environment (the simulator's timings), `tables` merged over the demo's own
    (`sglang={"context_length": 4096}`, `batch={...}`)."""

    def __init__(
        self,
        tmp: Path,
        *,
        env: Mapping[str, str] | None = None,
        **tables: Mapping[str, Any],
    ) -> None:
        self.tmp = tmp
        self.marker = new_marker()
        base = free_port_block(20)
        self.gateway_url = f"http://127.0.0.1:{base + 17}"
        self.batch_url = f"http://127.0.0.1:{base + 19}"
        self.key_path = tmp / "batch-api.key"
        self.batch_state = tmp / "batch"
        import tomllib

        demo_env = tomllib.loads(DEMO.read_text())["farm"].get("env", {})
        own: dict[str, Mapping[str, Any]] = {
            "farm": {
                "state_dir": f"{tmp}/state",
                "env": {**demo_env, "SGLANG_FARM_TEST_MARKER": self.marker, **(env or {})},
            },
            "workers": {"base_port": base, "nccl_base_port": base + 8},
            "metrics": {"listen": f"127.0.0.1:{base + 16}"},
            "control": {"socket": f"{tmp}/control.sock"},
            "gateway": {
                "listen": f"127.0.0.1:{base + 17}",
                "metrics_listen": f"127.0.0.1:{base + 18}",
            },
            "batch": {
                "listen": f"127.0.0.1:{base + 19}",
                "api_key_file": str(self.key_path),
                "state_dir": str(self.batch_state),
            },
        }
        for name, table in tables.items():
            own[name] = {**own.get(name, {}), **table}
        self.config = tmp / "demo.toml"
        self.config.write_text(rewritten(DEMO.read_text(), **own))
        self.farm: Farm | None = None

    # -- the agent ------------------------------------------------------------------------

    def start(self) -> None:
        self.farm = Farm(self.config, self.marker)

    def kill_agent(self, within: float = 60) -> None:
        """`kill -9` of the agent; returns once its children (workers, gateway, batch
        service: each dies with it) are gone."""
        assert self.farm is not None
        self.farm.proc.send_signal(signal.SIGKILL)
        self.farm.proc.wait(30)
        self.farm.stop()  # reaps its log reader
        self.farm = None
        wait_for(
            "the killed agent's children gone",
            lambda: (
                not marked_pids(self.marker) and batch_service_pid(self.config) is None,
                (marked_pids(self.marker), batch_service_pid(self.config)),
            ),
            within,
        )

    def stop(self) -> None:
        if self.farm is not None:
            self.farm.stop(signal.SIGINT, timeout=60)
            self.farm = None

    def __enter__(self) -> DemoFarm:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.stop()
        for pid in marked_pids(self.marker):  # whatever a failed test left behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    # -- farmctl ---------------------------------------------------------------------------

    def farmctl(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(FARMCTL), "--config", str(self.config), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO,
        )

    def farmctl_json(self, *args: str) -> Any:
        """`farmctl --json ARGS`'s answer, None when it fails."""
        try:
            r = self.farmctl("--json", *args, timeout=60)
        except subprocess.TimeoutExpired:
            return None
        if r.returncode != 0:
            return None
        with contextlib.suppress(ValueError):
            return json.loads(r.stdout)
        return None

    def ready(self) -> int:
        st = self.farmctl_json("status")
        return sum(w["state"] == "ready" for w in st["workers"]) if st else 0

    def worker_pid(self, wid: int) -> int:
        st = self.farmctl_json("status")
        assert st is not None, "farmctl status failed"
        pid = next(w["pid"] for w in st["workers"] if w["id"] == wid)
        assert isinstance(pid, int), st
        return pid

    def wait_serving(self, within: float = 180) -> None:
        """Every worker ready and the batch service answering."""

        def probe() -> tuple[bool, Any]:
            n = self.ready()
            answers = self.farmctl_json("batch", "list") is not None
            return n == 8 and answers, (n, answers)

        wait_for("8/8 ready and the batch service answering", probe, within)

    @property
    def api_key(self) -> str:
        return self.key_path.read_text().strip()

    def service_pid(self) -> int | None:
        return batch_service_pid(self.config)

    # -- the store, read directly -----------------------------------------------------------

    def done(self) -> int:
        """Requests with their result (completed or failed) in every batch, read from the
        store itself (read-only, beside the service), 0 before it exists."""
        path = self.batch_state / "batch.db"
        if not path.exists():
            return 0
        try:
            with contextlib.closing(
                sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
            ) as db:
                row = db.execute(
                    "SELECT COALESCE(SUM(completed + failed), 0) FROM batches"
                ).fetchone()
        except sqlite3.Error:
            return -1  # locked or mid-checkpoint: the caller reads again
        return int(row[0])
