"""I/O: a whole farm (agent + workers) under the real systemd of the throwaway container.

`install_farm(c, toml)` puts farm.toml at /etc/sglang-farm/farm.toml and installs the
three shipped units into /etc/systemd/system (where a package's units in /lib would
be), plus a drop-in for sglang-farm.service whose ExecStart= runs the venv's
`sglang-farm run --runtime systemd` (the venv is bound read-only into the container).
The agent renders the workers' drop-ins itself, into /run/systemd/system.

`SdFarm` reads what the tests assert on:

- systemd's view: `systemctl show` (MainPID, ActiveState, StatusText) and the
  journal's own "Starting/Started" records of each `sglang@N` unit (by MESSAGE_ID);
- the agent's view: its JSON log lines in the journal of `sglang-farm.service`
  (`agent_events`, each with `_pid` = the agent process that logged it and `_t` =
  its structlog timestamp as epoch seconds), and `farmctl --json`.

`wait` polls under a deadline and, when it gives up, fails with the last observation
and the tail of the agent's journal.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from farmtoml import Table, merged, sim_farm, toml_text
from sdcontainer import REPO, VENV_PYTHON, SystemdContainer

T = TypeVar("T")

BIN = Path(VENV_PYTHON).parent
SGLANG_FARM = str(BIN / "sglang-farm")
FARMCTL = str(BIN / "farmctl")
CONFIG = "/etc/sglang-farm/farm.toml"
AGENT = "sglang-farm.service"
TARGET = "sglang-farm.target"
GATEWAY = "sglang-farm-gateway.service"
BASE_PORT = 30000

# systemd's catalog ids (sd-messages.h) for a unit's start job beginning and ending well,
# and for its stop job beginning (logged just before the stop signal is sent).
MSG_UNIT_STARTING = "7d4958e842da4a758f6c1cdc7b36dcc5"
MSG_UNIT_STARTED = "39f53479d3a045ac8e11786248231fbf"
MSG_UNIT_STOPPING = "de5b426a63be47a7b6ac3eaac82e2f6f"


def unit(n: int) -> str:
    return f"sglang@{n}.service"


def farm_toml(
    *,
    workers: int = 6,
    canary: int = 0,
    parallel: int = 2,
    load_seconds: float = 1.5,
    period: float = 0.5,
    timeout: float = 2.0,
    threshold: int = 3,
    backoff_initial: float = 0.5,
    backoff_max: float = 4.0,
    max_failures: int = 3,
    worker_env: dict[int, dict[str, str]] | None = None,
    **tables: Table,
) -> str:
    """A farm.toml for simulator workers on fake GPUs, everything as root
    (`farmtoml.sim_farm`, with `tables` merged over its own)."""
    overrides = {str(wid): {"env": env} for wid, env in (worker_env or {}).items()}
    doc = sim_farm(
        workers,
        VENV_PYTHON,
        farm={
            "name": "sd-farm",
            # The units' default `sglang` user does not exist in the container.
            "user": "root",
            "group": "root",
            "state_dir": "/var/lib/sglang-farm",
            "env": {
                "SGLANG_SIM_LOAD_SECONDS": str(load_seconds),
                "SGLANG_SIM_WARMUP_SECONDS": "0.1",
                "SGLANG_SIM_HEALTH_DELAY": "0.05",
                "SGLANG_SIM_DRAIN_SECONDS": "1",
            },
        },
        workers={
            "base_port": BASE_PORT,
            "nccl_base_port": BASE_PORT + 1000,
            "overrides": overrides or None,
        },
        startup={
            "canary": canary,
            "parallel": parallel,
            "load_timeout": "30s",
            "poll_interval": "0.1s",
        },
        health={"period": f"{period}s", "timeout": f"{timeout}s", "failure_threshold": threshold},
        restart={
            "backoff_initial": f"{backoff_initial}s",
            "backoff_max": f"{backoff_max}s",
            "max_failures": max_failures,
            "stop_timeout": "5s",
        },
        metrics={
            "listen": "127.0.0.1:0",
            "gpu_source": "fake",
            "gpu_poll_interval": "1s",
            "worker_poll_interval": "1s",
        },
        control={"socket": "/run/sglang-farm/control.sock", "group": "root"},
        sglang={"model_path": "sim/Qwen3.6-27B", "enable_metrics": True},
    )
    return toml_text(merged(doc, tables))


def gateway_toml(
    *,
    listen: str = "127.0.0.1:8000",
    metrics_listen: str = "127.0.0.1:29000",
    admin_key_file: str | None = None,
    drain_timeout: str = "5s",
    extra_args: Iterable[str] = ("--shutdown-grace-period-secs", "2"),
) -> str:
    """A `[gateway]` section running smg managed, to append to `farm_toml()`.

    The default extra flag shortens smg's shutdown grace so that stopping it stays quick.
    """
    gateway = {
        "mode": "managed",
        "listen": listen,
        "metrics_listen": metrics_listen,
        "policy": "round_robin",
        "drain_timeout": drain_timeout,
        "extra_args": list(extra_args),
        "admin_key_file": admin_key_file,
    }
    return "\n" + toml_text(merged({}, {"gateway": gateway}))


def open_to_dynamic_users(c: SystemdContainer, paths: Iterable[str | Path]) -> list[str]:
    """Let any user enter the folders above `paths` (and run what is there), inside.

    The managed gateway runs as a DynamicUser= and needs the test venv's interpreter,
    which may live in a folder only root may enter (pyenv under /root, mode 0700). The
    chmod lands in the container's overlay: the host is untouched. Returns the folders
    changed.
    """
    folders: set[str] = set()
    for p in paths:
        real = Path(os.path.realpath(p))
        for d in (real, *real.parents) if real.is_dir() else real.parents:
            if not os.stat(d).st_mode & 0o001:
                folders.add(str(d))
    if folders:
        c.run(["chmod", "o+x", *sorted(folders)])
    return sorted(folders)


def open_test_venv_to_dynamic_users(c: SystemdContainer) -> list[str]:
    """`open_to_dynamic_users` for this venv's interpreter, its base Python and the checkout."""
    return open_to_dynamic_users(c, [VENV_PYTHON, sys.prefix, sys.base_prefix, REPO])


_HTTP_GET = """
import json, sys, urllib.error, urllib.request
url, key = sys.argv[1], sys.argv[2]
req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
try:
    with urllib.request.urlopen(req, timeout=float(sys.argv[3])) as r:
        status, body = r.status, r.read()
except urllib.error.HTTPError as exc:
    status, body = exc.code, exc.read()
except Exception as exc:
    status, body = type(exc).__name__, b""
text = body.decode("utf-8", "replace")
try:
    out = json.loads(text)
except ValueError:
    out = text
print(json.dumps([status, out]))
"""


def http_get(
    c: SystemdContainer, url: str, key: str | None = None, timeout: float = 3.0
) -> tuple[int | str, Any]:
    """GET `url` from inside the container: (HTTP status or error name, JSON or text body)."""
    r = c.run([VENV_PYTHON, "-c", _HTTP_GET, url, key or "", str(timeout)], check=False)
    try:
        status, body = json.loads(r.stdout)
    except ValueError:
        return f"no answer: {r.stderr.strip()[-300:]}", None
    return status, body


def install_farm(c: SystemdContainer, toml: str) -> None:
    """Config in /etc/sglang-farm, the shipped units + the agent's dev drop-in in /etc/systemd."""
    from sglang_farm.runtime.units import render_agent_dropin, static_unit

    c.write_file(CONFIG, toml)
    for name in ("sglang@.service", "sglang-farm.service", "sglang-farm.target"):
        c.write_file(f"/etc/systemd/system/{name}", static_unit(name))
    c.write_file(
        "/etc/systemd/system/sglang-farm.service.d/50-farm.conf",
        render_agent_dropin(agent_bin=SGLANG_FARM, config_path=CONFIG),
    )
    c.run(["systemctl", "daemon-reload"])


def _message(entry: dict[str, Any]) -> str:
    msg = entry.get("MESSAGE", "")
    if isinstance(msg, list):  # journald stores non-UTF-8 text as a byte array
        return bytes(msg).decode("utf-8", "replace")
    return str(msg)


def _epoch(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


class SdFarm:
    """The container's farm, seen through systemctl, the journal and farmctl."""

    def __init__(self, c: SystemdContainer) -> None:
        self.c = c

    # -- systemd ----------------------------------------------------------------------

    def show(
        self, units: Iterable[str], props: str = "Id,MainPID,ActiveState"
    ) -> dict[str, dict[str, str]]:
        """`systemctl show -p PROPS UNITS`, by unit name."""
        names = list(units)
        r = self.c.run(["systemctl", "show", "-p", props, *names], check=False)
        out: dict[str, dict[str, str]] = {}
        for name, block in zip(names, r.stdout.split("\n\n"), strict=False):
            d = dict(ln.split("=", 1) for ln in block.splitlines() if "=" in ln)
            out[name] = d
        return out

    def main_pids(self, ids: Iterable[int]) -> dict[int, int]:
        ids = list(ids)
        got = self.show([unit(n) for n in ids], "MainPID")
        return {n: int(got[unit(n)].get("MainPID", "0") or 0) for n in ids}

    def states(self, ids: Iterable[int]) -> dict[int, str]:
        ids = list(ids)
        got = self.show([unit(n) for n in ids], "ActiveState")
        return {n: got[unit(n)].get("ActiveState", "?") for n in ids}

    def agent_pid(self) -> int:
        return int(self.show([AGENT], "MainPID")[AGENT].get("MainPID", "0") or 0)

    def status_text(self) -> str:
        return self.show([AGENT], "StatusText")[AGENT].get("StatusText", "")

    def is_active(self, name: str) -> str:
        return self.c.run(["systemctl", "is-active", name], check=False).stdout.strip()

    def kill(self, pid: int, sig: str) -> None:
        assert pid > 1, f"refusing to signal pid {pid}"
        self.c.run(["kill", f"-{sig}", str(pid)])

    # -- journal ----------------------------------------------------------------------

    def journal_json(self, *args: str) -> list[dict[str, Any]]:
        r = self.c.run(["journalctl", "--no-pager", "-o", "json", *args], check=False, timeout=30)
        out = []
        for ln in r.stdout.splitlines():
            try:
                out.append(json.loads(ln))
            except ValueError:
                continue
        return out

    def agent_events(self, event: str | None = None, **fields: Any) -> list[dict[str, Any]]:
        """The agent's JSON log lines (all of its runs), filtered by event name and fields."""
        out = []
        for e in self.journal_json("-u", AGENT):
            try:
                ev = json.loads(_message(e))
            except ValueError:
                continue
            if not isinstance(ev, dict) or "event" not in ev:
                continue
            ev["_pid"] = int(e.get("_PID", 0))
            ev["_t"] = (
                _epoch(ev["timestamp"])
                if "timestamp" in ev
                else (int(e["__REALTIME_TIMESTAMP"]) / 1e6)
            )
            if event is not None and ev["event"] != event:
                continue
            if all(ev.get(k) == v for k, v in fields.items()):
                out.append(ev)
        return out

    def unit_jobs(self, ids: Iterable[int]) -> list[tuple[float, str, int]]:
        """systemd's own records: (epoch seconds, "starting"|"started"|"stopping", worker),
        in order."""
        kinds = {
            MSG_UNIT_STARTING: "starting",
            MSG_UNIT_STARTED: "started",
            MSG_UNIT_STOPPING: "stopping",
        }
        args: list[str] = []
        for n in ids:
            args += ["-u", unit(n)]
        out = []
        for e in self.journal_json(*args):
            kind = kinds.get(e.get("MESSAGE_ID", ""))
            name = e.get("UNIT", "")
            if kind and name.startswith("sglang@"):
                out.append((int(e["__REALTIME_TIMESTAMP"]) / 1e6, kind, int(name[7:-8])))
        return sorted(out)

    def agent_log_tail(self, lines: int = 60) -> str:
        return self.c.journal(AGENT, lines=lines)

    # -- farmctl ----------------------------------------------------------------------

    def farmctl(self, *args: str, check: bool = True, timeout: float = 60.0) -> Any:
        """Run farmctl inside; `--json` output is parsed, anything else returned as text."""
        r = self.c.run([FARMCTL, "--config", CONFIG, *args], check=False, timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(
                f"farmctl {' '.join(args)} exited {r.returncode}:\n{r.stdout}\n{r.stderr}\n"
                f"--- agent journal\n{self.agent_log_tail()}"
            )
        if "--json" in args and r.returncode == 0:
            return json.loads(r.stdout)
        return r

    def status(self) -> dict[int, dict[str, Any]]:
        """`farmctl --json status`'s workers, by id."""
        st = self.farmctl("--json", "status")
        return {w["id"]: w for w in st["workers"]}

    def health(self, ids: Iterable[int]) -> dict[int, int | str]:
        """HTTP status of each worker's /health (or the error), probed from inside."""
        code = (
            "import json, sys, urllib.request as u\n"
            "out = {}\n"
            "for n in sys.argv[1:]:\n"
            "    try:\n"
            f"        out[n] = u.urlopen(f'http://127.0.0.1:{{{BASE_PORT} + int(n)}}/health',"
            " timeout=2).status\n"
            "    except Exception as exc:\n"
            "        out[n] = type(exc).__name__\n"
            "print(json.dumps(out))\n"
        )
        r = self.c.run([VENV_PYTHON, "-c", code, *map(str, ids)], check=False)
        return {int(k): v for k, v in json.loads(r.stdout or "{}").items()}

    # -- waiting ----------------------------------------------------------------------

    def wait(
        self,
        what: str,
        probe: Callable[[], tuple[bool, T]],
        timeout: float = 30.0,
        interval: float = 0.1,
    ) -> T:
        """Poll `probe` (-> (done, observation)) until done; fail with the last observation."""
        deadline = time.monotonic() + timeout
        while True:
            done, seen = probe()
            if done:
                return seen
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{what}: not within {timeout:g} s; last seen: {seen!r}\n"
                    f"--- agent journal\n{self.agent_log_tail()}"
                )
            time.sleep(interval)
