"""I/O: the front door under load (issue 13): planned restarts, reload, crash, gateway cost.

One farm (bench/frontfarm.py: the demo's 8 simulated workers behind a managed smg),
one run, the load generator (bench/loadgen.py) on for the whole of each scenario:

- `farmctl restart all` with drain, then `farmctl restart all --no-drain`; each is
  repeated until the requests in flight during the restarts number at least
  `min_requests` (or `max_rounds` is reached);
- `farmctl reload` after a flag change for every worker (`[sglang]
  max_running_requests` toggled), likewise repeated;
- `kill -9` of one worker's main process, for several workers in turn: failed
  requests, and the delay from the farm's `worker_exited` record to the gateway no
  longer listing the worker ready (`GET /workers`, polled every `WATCH_S`) and to the
  last request smg routed to it (`smg_worker_requests_total` for its URL);
- light load (one streaming and one plain client), through the gateway and straight
  to worker 0, in alternating blocks: the gateway's added latency as a ratio.

A scenario's window runs from the command to the moment the gateway lists all 8
workers ready again; its requests are those in flight at any time in it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from bench.farmrun import event_time, worker_pid
from bench.frontfarm import MODEL, FrontFarm, nodelay_sim, running
from bench.loadgen import Load, LoadSpec, Outcome, report, window
from bench.stats import ratio, summary

TOKEN_S = 0.002  # SGLANG_SIM_TOKEN_SECONDS: 8 tokens = 16 ms of generation per request
MAX_TOKENS = 8
CLIENTS = 16
WATCH_S = 0.025
ROUND_TIMEOUT_S = 240.0


@dataclass(frozen=True, slots=True)
class Sample:
    t: float  # wall clock
    ready: frozenset[str]
    routed: dict[str, float]  # smg_worker_requests_total per worker URL


class Watch:
    """Polls the gateway's worker list and per-worker request counters on a thread."""

    def __init__(self, ff: FrontFarm, every_s: float = WATCH_S) -> None:
        self.ff = ff
        self.every_s = every_s
        self.samples: list[Sample] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gateway-watch", daemon=True)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.time()
            ready = frozenset(self.ff.ready_members())
            routed = self.ff.gateway_worker_requests()
            with self._lock:
                self.samples.append(Sample(t, ready, routed))
            self._stop.wait(self.every_s)

    def between(self, t0: float, t1: float) -> list[Sample]:
        with self._lock:
            return [s for s in self.samples if t0 <= s.t <= t1]


def _load(ff: FrontFarm, max_s: float, clients: int = CLIENTS, url: str | None = None) -> Load:
    return Load(
        LoadSpec(url or ff.gateway_url, MODEL, clients=clients, max_tokens=MAX_TOKENS, max_s=max_s)
    )


def _in_windows(
    outcomes: Sequence[Outcome], windows: Sequence[tuple[float, float]]
) -> list[Outcome]:
    seen: dict[int, Outcome] = {}
    for t0, t1 in windows:
        for o in window(outcomes, t0, t1):
            seen[id(o)] = o
    return sorted(seen.values(), key=lambda o: o.started)


def _drain_events(ff: FrontFarm, n: int) -> dict[str, Any]:
    evs = ff.farm.snapshot()[n:]
    out: dict[str, Any] = {}
    for name in ("worker_drained", "drain_skipped", "drain_budget_expired"):
        xs = [float(e["drain_s"]) for e in evs if e.get("event") == name and "drain_s" in e]
        if xs:
            out[name] = summary(xs)
    out["gateway_change_failed"] = sum(1 for e in evs if e.get("event") == "gateway_change_failed")
    out["worker_stop_timeout"] = sum(1 for e in evs if e.get("event") == "worker_stop_timeout")
    return out


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The farm-wide counters that grew between two `gateway_counters()` readings.

    Per-worker series are left out: smg starts them over when a worker is registered again.
    """
    return {
        k: v - before.get(k, 0.0)
        for k, v in after.items()
        if v != before.get(k, 0.0) and 'worker="' not in k
    }


def retries(delta: dict[str, float]) -> int:
    """Requests smg sent again to another worker (`smg_worker_retries_total`, all endpoints)."""
    return int(sum(v for k, v in delta.items() if k.startswith("smg_worker_retries_total")))


def rolling(
    ff: FrontFarm,
    action: Callable[[], None],
    *,
    min_requests: int,
    max_rounds: int,
    say: Callable[[str], None],
) -> dict[str, Any]:
    """`action` under load, repeated until its windows held `min_requests` requests."""
    n_workers = len(ff.doc["workers"]["gpus"])
    windows: list[tuple[float, float]] = []
    n0 = len(ff.farm.snapshot())
    load = _load(ff, max_s=max_rounds * ROUND_TIMEOUT_S)
    c0 = ff.gateway_counters()
    with Watch(ff) as watch, load:
        time.sleep(1.0)  # the clients are up to speed before the command
        for r in range(max_rounds):
            t0 = time.time()
            action()
            t1 = ff.wait_all_in(ROUND_TIMEOUT_S)
            windows.append((t0, t1))
            got = len(_in_windows(load.snapshot(), windows))
            say(f"    round {r + 1}: {t1 - t0:.1f} s, {got} requests so far")
            if got >= min_requests:
                break
            time.sleep(0.5)
        time.sleep(0.5)
    if load.error is not None:
        raise RuntimeError(f"load generator failed: {load.error!r}")
    outs = _in_windows(load.snapshot(), windows)
    span = sum(t1 - t0 for t0, t1 in windows)
    samples = [s for t0, t1 in windows for s in watch.between(t0, t1)]
    res = report(outs, span)
    res.update(
        rounds=len(windows),
        round_s=[round(t1 - t0, 2) for t0, t1 in windows],
        min_ready_in_gateway=min((len(s.ready) for s in samples), default=None),
        workers=n_workers,
        parallel=int(ff.doc["startup"]["parallel"]),
        drain=_drain_events(ff, n0),
        gateway_counters=counter_delta(c0, ff.gateway_counters()),
    )
    res["gateway_retries"] = retries(res["gateway_counters"])
    return res


def restart_all(ff: FrontFarm, drain: bool) -> Callable[[], None]:
    def act() -> None:
        args = ["restart", "all"] if drain else ["restart", "all", "--no-drain"]
        p = ff.farm.farmctl(*args, timeout=ROUND_TIMEOUT_S)
        if p.returncode != 0:
            raise RuntimeError(f"farmctl {' '.join(args)}: exit {p.returncode}: {p.stderr.strip()}")

    return act


def reload_flag(ff: FrontFarm) -> Callable[[], None]:
    """Toggle `[sglang] max_running_requests` (512 <-> 1024) and `farmctl reload`; wait for all."""

    def act() -> None:
        doc = ff.doc
        cur = doc["sglang"].get("max_running_requests")
        doc["sglang"]["max_running_requests"] = 1024 if cur == 512 else 512
        ff.rewrite(doc)
        n = len(ff.farm.snapshot())
        p = ff.farm.farmctl("--json", "reload", "--no-wait", timeout=60)
        try:
            res = json.loads(p.stdout)
        except ValueError:
            res = {}
        if p.returncode != 0 or not res.get("applied"):
            raise RuntimeError(f"farmctl reload: exit {p.returncode}: {p.stdout} {p.stderr}")
        want = set(range(len(doc["workers"]["gpus"])))
        if set(res.get("restarted", [])) != want:
            raise RuntimeError(f"farmctl reload restarted {res.get('restarted')}, not every worker")
        end = time.monotonic() + ROUND_TIMEOUT_S
        while not want <= {
            e.get("worker") for e in ff.farm.snapshot()[n:] if e.get("event") == "worker_ready"
        }:
            if time.monotonic() > end:
                raise RuntimeError(f"not every worker ready {ROUND_TIMEOUT_S:g} s after the reload")
            time.sleep(0.05)

    return act


def _event(ff: FrontFarm, name: str, worker: int, after: int, timeout: float) -> dict[str, Any]:
    return ff.farm.wait_for(
        lambda e: e.get("event") == name and e.get("worker") == worker, timeout=timeout, after=after
    )


def kills(ff: FrontFarm, workers: Sequence[int], say: Callable[[str], None]) -> dict[str, Any]:
    """kill -9 of each worker's main process in turn, under load; each back in the gateway."""
    per: list[dict[str, Any]] = []
    windows: list[tuple[float, float]] = []
    load = _load(ff, max_s=len(workers) * 60 + 30)
    c0 = ff.gateway_counters()
    with Watch(ff) as watch, load:
        time.sleep(1.5)
        for w in workers:
            url = ff.worker_url(w)
            pid = worker_pid(ff.farm, w)
            n = len(ff.farm.snapshot())
            t_kill = time.time()
            os.kill(pid, signal.SIGKILL)
            exited = _event(ff, "worker_exited", w, n, 30)
            relaunch = _event(ff, "worker_launching", w, n, 60)
            _event(ff, "gateway_member", w, n, 60)
            t_back = ff.wait_all_in(60)
            windows.append((t_kill, t_back))
            removed = [
                e
                for e in ff.farm.snapshot()[n:]
                if e.get("event") == "gateway_removed" and e.get("worker") == w
            ]
            t_rec, t_relaunch = event_time(exited), event_time(relaunch)
            ss = watch.between(t_kill - 1.0, t_relaunch)
            before = [s for s in ss if s.t < t_kill]
            after = [s for s in ss if s.t >= t_kill]
            out_at = next((s.t for s in after if url not in s.ready), None)
            # The last sample at which smg's count of requests routed to the worker grew.
            last_routed: float | None = None
            prev = before[-1].routed.get(url) if before else None
            for s in after:
                c = s.routed.get(url)
                if c is not None and prev is not None and c > prev:
                    last_routed = s.t
                if c is not None:
                    prev = c
            per.append(
                {
                    "worker": w,
                    "kill_to_recorded_s": t_rec - t_kill,
                    "recorded_to_not_ready_in_gateway_s": (out_at - t_rec) if out_at else None,
                    "recorded_to_gateway_removed_event_s": (event_time(removed[0]) - t_rec)
                    if removed
                    else None,
                    "recorded_to_last_routed_s": (last_routed - t_rec) if last_routed else None,
                    "routed_after_kill": (prev or 0.0)
                    - (before[-1].routed.get(url, 0.0) if before else 0.0),
                    "watch_samples_after_kill": len(after),
                    "kill_to_back_in_gateway_s": t_back - t_kill,
                }
            )
            say(f"    worker {w}: {per[-1]}")
            time.sleep(1.0)
        time.sleep(0.5)
    if load.error is not None:
        raise RuntimeError(f"load generator failed: {load.error!r}")
    outs = _in_windows(load.snapshot(), windows)
    res = report(outs, sum(t1 - t0 for t0, t1 in windows))
    res["kills"] = per
    res["gateway_counters"] = counter_delta(c0, ff.gateway_counters())
    res["gateway_retries"] = retries(res["gateway_counters"])

    def figs(key: str) -> dict[str, float]:
        return summary([float(p[key]) for p in per if p[key] is not None])

    res["kill_to_recorded_s"] = figs("kill_to_recorded_s")
    res["recorded_to_not_ready_in_gateway_s"] = figs("recorded_to_not_ready_in_gateway_s")
    res["recorded_to_last_routed_s"] = figs("recorded_to_last_routed_s")
    res["recorded_to_gateway_removed_event_s"] = figs("recorded_to_gateway_removed_event_s")
    return res


def added_latency(ff: FrontFarm, blocks: int, block_s: float) -> dict[str, Any]:
    """Light load (2 clients: 1 streaming, 1 plain): gateway vs straight to worker 0.

    A third series goes to a simulator outside the farm with Nagle's algorithm off
    (`frontfarm.nodelay_sim`): the farm's simulators write a response's head and body
    in two sends without TCP_NODELAY, which costs a client on a kept-alive connection
    a delayed ACK (40 ms on Linux) per request; smg's connections do not pay it.
    """
    targets = {"gateway": ff.gateway_url, "direct": ff.worker_url(0)}
    got: dict[str, list[Outcome]] = {k: [] for k in (*targets, "direct_nodelay")}
    env = {k: str(v) for k, v in ff.doc["farm"]["env"].items()}
    with nodelay_sim(env) as control_url:
        targets["direct_nodelay"] = control_url
        for _ in range(blocks):
            for key, url in targets.items():
                load = _load(ff, max_s=block_s, clients=2, url=url)
                with load:
                    time.sleep(block_s)
                if load.error is not None:
                    raise RuntimeError(f"load generator failed: {load.error!r}")
                got[key] += load.snapshot()[5:]  # the first requests open connections
    out: dict[str, Any] = {k: report(v) for k, v in got.items()}
    gl = out["gateway"]["latency_ms"]
    for key in ("direct", "direct_nodelay"):
        dl = out[key]["latency_ms"]
        out[f"ratio_p50_{key}"] = ratio(gl["median"], dl["median"])
        out[f"ratio_p99_{key}"] = ratio(gl["p99"], dl["p99"])
    out.update(blocks=blocks, block_s=block_s)
    return out


def run(quick: bool, say: Callable[[str], None]) -> dict[str, Any]:
    """Every front-door scenario on one farm; a failed scenario is recorded, the rest go on."""
    min_req = 500 if quick else 2000
    rounds = 2 if quick else 4
    out: dict[str, Any] = {
        "config": {
            "workers": 8,
            "token_s": TOKEN_S,
            "max_tokens": MAX_TOKENS,
            "clients": CLIENTS,
            "min_requests": min_req,
        }
    }
    say("front door: the demo's 8 simulated workers behind a managed smg")
    with running(TOKEN_S) as ff:
        ff.farm.wait_for(lambda e: e.get("event") == "rollout_done", timeout=180)
        ff.wait_all_in(60)
        out["config"].update(
            parallel=int(ff.doc["startup"]["parallel"]),
            policy=ff.doc["gateway"]["policy"],
            drain_timeout=ff.doc["gateway"]["drain_timeout"],
            health=ff.doc["health"],
        )

        def scenario(key: str, fn: Callable[[], dict[str, Any]]) -> None:
            say(f"  {key}")
            try:
                out[key] = fn()
            except Exception as exc:  # one scenario's failure must not lose the others
                say(f"  {key} FAILED: {exc!r}")
                out[key] = {"error": repr(exc)}
                with contextlib.suppress(Exception):
                    ff.wait_all_in(120)

        scenario("latency", lambda: added_latency(ff, 2 if quick else 3, 4.0 if quick else 6.0))
        scenario(
            "restart_drain",
            lambda: rolling(
                ff, restart_all(ff, True), min_requests=min_req, max_rounds=rounds, say=say
            ),
        )
        scenario(
            "restart_no_drain",
            lambda: rolling(
                ff, restart_all(ff, False), min_requests=min_req, max_rounds=rounds, say=say
            ),
        )
        scenario(
            "reload",
            lambda: rolling(ff, reload_flag(ff), min_requests=min_req, max_rounds=rounds, say=say),
        )
        scenario("kill", lambda: kills(ff, [3] if quick else [3, 5, 6], say))
    return out
