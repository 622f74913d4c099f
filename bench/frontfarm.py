"""I/O: the front-door farm: etc/sglang-farm/demo.toml on free ports in a temp dir, and its gateway.

The config is the demo's (8 simulated workers behind a managed smg, cache_aware policy,
drain on planned stops, the demo's health and restart settings) with what a benchmark
must change: every port free (workers, NCCL, the gateway's listen and metrics ports,
the farm's /metrics on port 0), the state directory and control socket in a temp
dir, the process runtime as root, and the simulator's timings (`sim_env`): a 1 s
load like every benchmark farm and `token_s` per generated token, so that requests
are short and many. Everything else stays as the demo sets it, among it the
simulator's /health delay (1 s, as SGLang's).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.farmrun import ROOT, Farm, free_port_block, sim_env
from farmproc import marked_pids, new_marker, tmpdir
from sglang_farm.gateway.managed import GENERATED_ADMIN_KEY_NAME

DEMO = ROOT / "etc" / "sglang-farm" / "demo.toml"
MODEL = "sim/Qwen3.6-27B"


def _toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, Mapping):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"no TOML for {v!r}")


def toml_dumps(doc: Mapping[str, Any], prefix: str = "") -> str:
    """Pure: a TOML document of tables, scalars, lists and inline tables (what demo.toml uses)."""
    lines: list[str] = []
    tables = {k: v for k, v in doc.items() if isinstance(v, dict) and prefix == ""}
    for k, v in doc.items():
        if k not in tables:
            lines.append(f"{k} = {_toml_value(v)}")
    for k, v in tables.items():
        lines.append(f"\n[{k}]")
        lines += [f"{kk} = {_toml_value(vv)}" for kk, vv in v.items()]
    return "\n".join(lines).lstrip("\n") + "\n"


@dataclass(frozen=True, slots=True)
class FrontPorts:
    workers: int  # base of the workers' HTTP ports
    nccl: int
    gateway: int
    gateway_metrics: int


def derive(
    tmp: Path, marker: str, token_s: float, n_workers: int = 8
) -> tuple[dict[str, Any], FrontPorts]:
    """The demo's config with the benchmark's changes (above), as a TOML document."""
    doc: dict[str, Any] = tomllib.loads(DEMO.read_text())
    if len(doc["workers"]["gpus"]) != n_workers:
        raise RuntimeError(f"{DEMO}: expected {n_workers} workers, got {doc['workers']['gpus']}")
    base = free_port_block(2 * n_workers + 2)
    ports = FrontPorts(base, base + n_workers, base + 2 * n_workers, base + 2 * n_workers + 1)
    farm = doc["farm"]
    farm["state_dir"] = f"{tmp}/state"
    farm["user"] = "root"
    farm["group"] = "root"
    farm["env"] = {
        **farm.get("env", {}),
        **sim_env(marker),
        "SGLANG_SIM_TOKEN_SECONDS": str(token_s),
    }
    farm["env"].pop("SGLANG_SIM_HEALTH_DELAY", None)  # keep the demo's (the simulator's 1 s)
    doc["workers"]["base_port"] = ports.workers
    doc["workers"]["nccl_base_port"] = ports.nccl
    doc["metrics"]["listen"] = "127.0.0.1:0"
    doc["control"]["socket"] = f"{tmp}/control.sock"
    doc["control"]["group"] = "root"
    gw = doc["gateway"]
    if gw.get("mode") != "managed":
        raise RuntimeError(f'{DEMO}: expected [gateway] mode = "managed", got {gw.get("mode")!r}')
    gw["listen"] = f"127.0.0.1:{ports.gateway}"
    gw["metrics_listen"] = f"127.0.0.1:{ports.gateway_metrics}"
    return doc, ports


class FrontFarm:
    """A running front-door farm: the agent (`farm`), its config, and the gateway's URLs."""

    def __init__(self, farm: Farm, doc: dict[str, Any], ports: FrontPorts, config: Path) -> None:
        self.farm = farm
        self.doc = doc
        self.ports = ports
        self.config = config
        self.gateway_url = f"http://127.0.0.1:{ports.gateway}"
        self.gateway_metrics_url = f"http://127.0.0.1:{ports.gateway_metrics}/metrics"
        self.http = httpx.Client(timeout=5.0, trust_env=False)

    def worker_url(self, wid: int) -> str:
        return f"http://127.0.0.1:{self.ports.workers + wid}"

    @property
    def socket(self) -> str:
        return str(self.doc["control"]["socket"])

    def rewrite(self, doc: dict[str, Any]) -> None:
        """Replace the config file (for a reload)."""
        self.doc = doc
        tmp = self.config.with_suffix(".tmp")
        tmp.write_text(toml_dumps(doc))
        os.replace(tmp, self.config)

    def admin_headers(self) -> dict[str, str]:
        """The managed gateway's worker API needs its admin key: the one the agent
        generated in its state directory (the demo names no admin_key_file)."""
        path = Path(self.doc["farm"]["state_dir"]) / GENERATED_ADMIN_KEY_NAME
        try:
            return {"Authorization": f"Bearer {path.read_text().strip()}"}
        except OSError:
            return {}  # not made yet: the agent is still starting

    def members(self) -> dict[str, str]:
        """The gateway's worker list, url -> status ({} when it does not answer)."""
        try:
            r = self.http.get(f"{self.gateway_url}/workers", headers=self.admin_headers())
            body = r.json()
        except (httpx.HTTPError, ValueError):
            return {}
        if r.status_code != 200 or not isinstance(body, dict):
            return {}
        return {
            str(w.get("url", "")).rstrip("/"): str(w.get("status", ""))
            for w in body.get("workers", [])
            if isinstance(w, dict)
        }

    def ready_members(self) -> set[str]:
        return {u for u, s in self.members().items() if s == "ready"}

    def wait_all_in(self, timeout: float) -> float:
        """Wait until the gateway lists every worker ready; the wall-clock time it did."""
        want = {self.worker_url(w) for w in range(len(self.doc["workers"]["gpus"]))}
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if want <= self.ready_members():
                return time.time()
            time.sleep(0.05)
        raise AssertionError(
            f"gateway {self.gateway_url} lists {sorted(self.ready_members())} ready, "
            f"not all of {sorted(want)}, after {timeout:g} s"
        )

    def gateway_counters(self) -> dict[str, float]:
        """smg's counters of retries, breaker outcomes and chat responses (series -> value)."""
        try:
            text = self.http.get(self.gateway_metrics_url).text
        except httpx.HTTPError:
            return {}
        out: dict[str, float] = {}
        for line in text.splitlines():
            name = line.partition("{")[0].partition(" ")[0]
            if line.startswith("#") or not name.endswith("_total"):
                continue
            if (
                "retr" in name
                or "cb_outcomes" in name
                or (name == "smg_http_responses_total" and "/v1/chat/completions" in line)
            ):
                series, _, value = line.rpartition(" ")
                with contextlib.suppress(ValueError):
                    out[series] = float(value)
        return out

    def gateway_worker_requests(self) -> dict[str, float]:
        """smg's `smg_worker_requests_total` per worker label (its own count of routed requests)."""
        try:
            text = self.http.get(self.gateway_metrics_url).text
        except httpx.HTTPError:
            return {}
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line.startswith("smg_worker_requests_total{"):
                continue
            labels, _, value = line.rpartition(" ")
            for part in labels[labels.index("{") + 1 : -1].split(","):
                k, _, v = part.partition("=")
                if k.strip() in ("worker", "url", "worker_url"):
                    url = v.strip('"').rstrip("/")
                    out[url] = out.get(url, 0.0) + float(value)
        return out


# The simulator with Nagle's algorithm off on its sockets (socketserver's own switch),
# as uvicorn, SGLang's server, has it: a control for the direct latency (see frontdoor).
NODELAY_SIM = (
    "import runpy, socketserver, sys\n"
    "socketserver.StreamRequestHandler.disable_nagle_algorithm = True\n"
    "sys.argv[0] = 'sglang_farm.sim'\n"
    "runpy.run_module('sglang_farm.sim', run_name='__main__', alter_sys=True)\n"
)


@contextlib.contextmanager
def nodelay_sim(env: Mapping[str, str]) -> Iterator[str]:
    """One simulator outside the farm, Nagle off, same environment; yields its URL once healthy."""
    port = free_port_block(1)
    argv = [sys.executable, "-c", NODELAY_SIM, "--model-path", MODEL, "--host", "127.0.0.1"]
    proc = subprocess.Popen(
        [*argv, "--port", str(port), "--skip-server-warmup"],
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=5, trust_env=False).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"the Nagle-free simulator never answered (exit {proc.poll()})")
            time.sleep(0.1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _is_gateway(pid: int) -> bool:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"smg" in cmd or b"sglang_farm.gateway" in cmd


@contextlib.contextmanager
def running(
    token_s: float, adjust: Callable[[dict[str, Any]], None] | None = None
) -> Iterator[FrontFarm]:
    """A started front-door farm (not yet ready); stopped and checked for leftovers on exit.

    `adjust` edits the derived config document before it is written (another bench's
    own changes: fewer workers, a `[rollout]` section, no gateway)."""
    tmp = tmpdir()
    marker = new_marker()
    doc, ports = derive(tmp, marker, token_s)
    if adjust is not None:
        adjust(doc)
    config = tmp / "farm.toml"
    config.write_text(toml_dumps(doc))
    farm = Farm(config, marker)
    ff = FrontFarm(farm, doc, ports, config)
    try:
        yield ff
    finally:
        ff.http.close()
        gateway_pids = [int(e["pid"]) for e in farm.named("gateway_started") if "pid" in e]
        try:
            farm.stop(signal.SIGINT, timeout=120)
        finally:
            deadline = time.monotonic() + 15
            while marked_pids(marker) and time.monotonic() < deadline:
                time.sleep(0.2)
            for pid in marked_pids(marker):  # our own simulators only (marked env)
                os.kill(pid, signal.SIGKILL)
            for pid in gateway_pids:  # the gateway the agent started, if it outlived it
                if _is_gateway(pid):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(pid, signal.SIGKILL)
            shutil.rmtree(tmp, ignore_errors=True)
