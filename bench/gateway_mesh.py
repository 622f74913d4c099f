"""I/O: `python -m bench gateway-mesh`: several gateways, every gateway or an smg mesh (issue 26).

Two questions, measured with the real smg on this machine and the farm's simulators:

1. The farm's way (`[gateway] urls`): a farm of 8 workers registered with two independent
   gateways; one is killed (kill -9) and started again, empty: how long until it routes
   to all 8 again (`refill_s`, the issue's goal: 15 s)? The farm notices at its next
   reconcile of that gateway (every 10 s) and adds each worker (about 0.3 s each, all at
   once).
2. An smg mesh (`--enable-mesh --mesh-peer-urls`), two nodes, the farm registering with
   one node and letting the mesh replicate:
   - `propagate_s`: a worker added on node 1, until node 2 routes to it;
   - `removal_propagate_s`: a worker deleted on its owner (node 1), until node 2 stops
     routing to it (what a drain would have to wait for);
   - `delete_via_peer_converges`: a worker deleted through node 2 (not its owner): is it
     gone from node 1 within 10 s?
   - `owner_restart_reimport_s`: node 1 killed and started again: until it routes to the
     worker again (imported from node 2), and whether node 1's later deletes and adds
     still reach node 2 (`after_owner_restart_stale`: cycles where node 2 still holds
     the old registration);
   - `cross_node_inconsistent`: the rolling-restart pattern of smg-project/smg#1661: a
     worker deleted on one node and registered again on the other, 3 s to settle: cycles
     that end with a node not routing to it;
   - `every_node_inconsistent`: the farm's own way on a mesh: the worker deleted on both
     nodes and registered on both again (as `[gateway] urls` naming both nodes would do);
     `every_node_gone_s`: from the deletes until neither node routes to it;
     `every_node_entries_max`: the most entries one node lists for the worker.

Prints one line per figure and writes JSON with `--out`. `--cycles N` (default 10).
Takes about three minutes; run it alone on a quiet machine (numbers on a busy 2-core
machine are upper bounds).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from farmproc import Farm, farm_config, free_port_block, marked_pids, new_marker, tmpdir
from smgproc import Smg, key_file

MODEL = "sim/Qwen3.6-27B"


def say(msg: str) -> None:
    print(f"[gateway-mesh {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def wait(cond: Callable[[], bool], within: float) -> float | None:
    """Seconds until `cond` held (polled every 50 ms), None if not within `within`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within:
        with contextlib.suppress(httpx.HTTPError, KeyError):
            if cond():
                return round(time.monotonic() - t0, 2)
        time.sleep(0.05)
    return None


# --- 1. the farm's way: independent gateways ------------------------------------------


def refill(trials: int) -> list[float | None]:
    """A farm of 8 in two gateways; one gateway killed and restarted `trials` times."""
    tmp = tmpdir()
    key = key_file(tmp)
    port = free_port_block(4)
    marker = new_marker()
    out: list[float | None] = []
    with Smg(tmp, key, port) as g1, Smg(tmp, key, port + 2) as g2:
        urls = ", ".join(f'"{u}"' for u in (g1.url, g2.url))
        config = farm_config(
            tmp,
            workers=8,
            marker=marker,
            extra=f'[gateway]\nmode = "external"\nurls = [{urls}]\nadmin_key_file = "{key}"\n',
        )
        farm = Farm(config, marker)
        try:
            import tomllib

            base = tomllib.loads(config.read_text())["workers"]["base_port"]
            every = {f"http://127.0.0.1:{base + i}" for i in range(8)}
            if wait(lambda: g1.routed() == g2.routed() == every, 180) is None:
                raise RuntimeError("the farm did not join both gateways within 180 s")
            for i in range(trials):
                g1.kill()
                time.sleep(i * 3.3 % 10)  # the restart lands anywhere in a reconcile period
                g1.start()
                took = wait(lambda: g1.routed() == every, 60)
                say(f"refill trial {i}: {took} s")
                out.append(took)
        finally:
            with contextlib.suppress(Exception):
                farm.stop(timeout=60)
            for pid in marked_pids(marker):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    return out


# --- 2. an smg mesh -------------------------------------------------------------------


class Mesh:
    """Two smg mesh nodes on this machine, and one simulated worker."""

    def __init__(self, tmp: Path) -> None:
        key = key_file(tmp)
        base = free_port_block(8)
        self.worker = f"http://127.0.0.1:{base}"
        m1, m2 = base + 5, base + 6

        def node(port: int, mesh: int, peer: int, name: str) -> Smg:
            return Smg(
                tmp,
                key,
                port,
                extra=[
                    "--enable-mesh",
                    "--mesh-host",
                    "127.0.0.1",
                    "--mesh-port",
                    str(mesh),
                    "--mesh-server-name",
                    name,
                    "--mesh-peer-urls",
                    f"127.0.0.1:{peer}",
                ],
            )

        self.n1, self.n2 = node(base + 1, m1, m2, "n1"), node(base + 3, m2, m1, "n2")
        self._headers = {"Authorization": f"Bearer {self.n1.key}"}
        env = {**os.environ, "SGLANG_SIM_LOAD_SECONDS": "0.2", "SGLANG_SIM_HEALTH_DELAY": "0.05"}
        self._sim = subprocess.Popen(
            [sys.executable, "-m", "sglang_farm.sim", "--model-path", MODEL, "--port", str(base)],
            env=env,
            stdout=(tmp / "sim.log").open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @contextlib.contextmanager
    def running(self) -> Iterator[Mesh]:
        try:
            self.n1.start()
            self.n2.start()
            up = wait(lambda: httpx.get(f"{self.worker}/health", timeout=1).status_code == 200, 60)
            if up is None:
                raise RuntimeError("the simulated worker did not come up")
            time.sleep(2)  # the mesh's first sync
            yield self
        finally:
            self.n1.kill()
            self.n2.kill()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._sim.pid, signal.SIGKILL)

    def ids(self, node: Smg) -> list[tuple[str, str]]:
        found = [w for w in node.workers() if w["url"] == self.worker]
        return [(str(w["id"]), str(w.get("status"))) for w in found]

    def routes(self, node: Smg) -> bool:
        return self.worker in node.routed()

    def add(self, node: Smg) -> None:
        body = {"url": self.worker, "health": {"drain_settle_secs": 0}}
        httpx.post(f"{node.url}/workers", json=body, headers=self._headers, timeout=5)

    def delete(self, node: Smg) -> None:
        for wid, _ in self.ids(node):
            httpx.delete(f"{node.url}/workers/{wid}", headers=self._headers, timeout=5)

    def clear(self) -> None:
        for node in (self.n1, self.n2):
            self.delete(node)
        wait(lambda: not self.ids(self.n1) and not self.ids(self.n2), 10)
        time.sleep(2)


def mesh(cycles: int) -> dict[str, Any]:
    m = Mesh(tmpdir())
    r: dict[str, Any] = {"propagate_s": [], "removal_propagate_s": []}
    with m.running():
        n1, n2 = m.n1, m.n2
        for _ in range(min(cycles, 5)):
            m.add(n1)
            wait(lambda: m.routes(n1), 10)
            r["propagate_s"].append(wait(lambda: m.routes(n2), 20))
            m.delete(n1)
            r["removal_propagate_s"].append(wait(lambda: not m.routes(n2), 20))
            m.clear()
        say(f"propagate {r['propagate_s']}, removal {r['removal_propagate_s']}")

        m.add(n1)
        wait(lambda: m.routes(n2), 20)
        m.delete(n2)
        r["delete_via_peer_converges"] = wait(lambda: not m.routes(n1), 10) is not None
        say(f"delete via the peer converges: {r['delete_via_peer_converges']}")
        m.clear()

        def cycles_of(step: Callable[[int], None]) -> str:
            bad = 0
            for i in range(cycles):
                step(i)
                time.sleep(3)
                if not (m.routes(n1) and m.routes(n2)):
                    bad += 1
            m.clear()
            return f"{bad}/{cycles}"

        def cross(i: int) -> None:
            src, dst = (n1, n2) if i % 2 == 0 else (n2, n1)
            m.delete(src)
            wait(lambda: not m.routes(src), 5)
            m.add(dst)
            wait(lambda: m.routes(dst), 10)

        gone: list[float | None] = []
        entries: list[int] = []

        def every(_i: int) -> None:
            for node in (n1, n2):
                m.delete(node)
            gone.append(wait(lambda: not m.routes(n1) and not m.routes(n2), 5))
            for node in (n1, n2):
                m.add(node)
            wait(lambda: m.routes(n1) and m.routes(n2), 10)
            time.sleep(3)
            entries.extend(len(m.ids(node)) for node in (n1, n2))

        m.add(n1)
        wait(lambda: m.routes(n2), 20)
        r["cross_node_inconsistent"] = cycles_of(cross)
        say(f"cross-node (#1661 pattern): {r['cross_node_inconsistent']} inconsistent")
        r["every_node_inconsistent"] = cycles_of(every)
        say(f"every node registered: {r['every_node_inconsistent']} inconsistent")
        r["every_node_gone_s"] = gone
        most = r["every_node_entries_max"] = max(entries, default=0)
        say(f"every node: gone from both {gone}; entries per node at most {most}")

        # Last: it leaves the mesh's records in a state the cycles above would inherit.
        m.add(n1)
        wait(lambda: m.routes(n2), 20)
        n1.kill()
        time.sleep(5)
        r["peer_routes_5s_after_owner_killed"] = m.routes(n2)
        n1.start()
        r["owner_restart_reimport_s"] = wait(lambda: m.routes(n1), 20)
        stale = 0
        for _ in range(min(cycles, 5)):
            before = {i for i, _ in m.ids(n2)}
            m.delete(n1)
            wait(lambda: not m.routes(n1), 5)
            m.add(n1)
            wait(lambda: m.routes(n1), 10)
            time.sleep(3)
            if {i for i, _ in m.ids(n2)} == before or {i for i, _ in m.ids(n1)} != {
                i for i, _ in m.ids(n2)
            }:
                stale += 1
        r["after_owner_restart_stale"] = f"{stale}/{min(cycles, 5)}"
        say(f"owner restart: re-import {r['owner_restart_reimport_s']} s, stale {stale}")
        m.clear()

    return r


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench gateway-mesh")
    ap.add_argument("--cycles", type=int, default=10)
    ap.add_argument("--refill-trials", type=int, default=3)
    ap.add_argument("--skip-refill", action="store_true")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    results: dict[str, Any] = {"smg": smg_version()}
    if not a.skip_refill:
        results["refill_s"] = refill(a.refill_trials)
    results["mesh"] = mesh(a.cycles)
    for k, v in results.items():
        print(f"{k}: {v}")
    if a.out:
        a.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


def smg_version() -> str:
    from importlib.metadata import version

    return version("smg")
