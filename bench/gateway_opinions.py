"""I/O: `python -m bench gateway-opinions`: smg 1.13's own routing opinions in front of the
demo (issue 34 §3), measured with the farm's `[gateway]` defaults (smg's own).

The demo's farm (8 simulated workers behind the managed smg, cache_aware; bench/frontfarm.py)
under a steady load of short chat completions through the gateway (`CLIENTS` clients,
half streaming), one scenario per farm:

1. `overload`: worker 3 may run 2 requests at once (`max_running_requests = 2`, its
   override); 12 requests of `FILL_TOKENS` tokens are sent to it directly (past the
   gateway, as another gateway's or a batch's would be), so 10 wait. Measured: when smg's
   worker list first shows its queue at or above `overload_waiting_requests`
   (`smg_sees_s`, from the fill) and when `farmctl status --json` first names it in
   `gateway.overloaded` (`status_says_s`); whether the farm still counts it in the
   gateway (`in_gateway_while_overloaded`); the requests smg routed to it per second
   before and while it was overloaded (smg's own `smg_worker_requests_total`); then
   `farmctl restart 3` while it is overloaded: how long its drain waited (`drain_s`, the
   farm's `worker_drained` or `drain_budget_expired`, bounded by `[gateway]
   drain_timeout`).
2. `wedge`: worker 3's engine wedges (`SGLANG_SIM_WEDGE_AFTER`) under the load: running
   requests make no more tokens while `/health` answers. Measured: the requests smg
   routed to it after the wedge (`routed_after_wedge`; smg's `--worker-wedge-secs` is
   meant to stop them), the load's failures (client timeout `LOAD_TIMEOUT_S`), and when
   the farm's own stall check stopped it (`farm_stop_s`, its `[health] stall_window`).
3. `shed`: every worker may run 1 request and gets 10 sent to it directly (9 wait: all 8
   overloaded); then `PROBES` requests through the gateway, with `overload_shed` off (the
   farm's default: routed to the least loaded, so they wait in a queue) and on (503 with
   Retry-After at once). Two farms.

4. `warmup`: a restarted worker's share of smg's routed requests in its first 45 s back
   in the gateway, every request the same long prompt and every request its own, with
   `warmup_secs` 60 (the default) and 0 (no warm-up slice). Two farms.

Simulator figures, not SGLang's. Prints one line per scenario and writes JSON with
`--out`; `--only overload,wedge,shed,warmup` picks scenarios. About fifteen minutes in
all (the wedge waits out `[health] stall_window`, 120 s; `--stall-window` shortens it);
run it alone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from bench.frontfarm import MODEL, FrontFarm, running
from bench.loadgen import Load, LoadSpec, report

TOKEN_S = 0.05  # the simulators' time per token: a 200-token request takes 10 s
FILL_TOKENS = 200
CLIENTS = 8
LOAD_TOKENS = 8
LOAD_TIMEOUT_S = 30.0
PROBES = 5
WEDGE_AFTER_S = 25.0  # after worker 3 is fired up: the farm is ready and the load runs


def say(msg: str) -> None:
    print(f"[gateway-opinions {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _chat(url: str, max_tokens: int, timeout: float = 300.0) -> tuple[int, float, str | None]:
    """(status, seconds, Retry-After) of one chat completion; status 0: no answer."""
    t = time.monotonic()
    try:
        r = httpx.post(
            f"{url}/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": max_tokens,
            },
            timeout=timeout,
            trust_env=False,
        )
    except httpx.HTTPError:
        return 0, time.monotonic() - t, None
    return r.status_code, time.monotonic() - t, r.headers.get("retry-after")


@contextlib.contextmanager
def filled(url: str, n: int) -> Iterator[None]:
    """`n` long requests sent straight to the worker at `url`, each on its own thread."""
    threads = [
        threading.Thread(target=_chat, args=(url, FILL_TOKENS), daemon=True) for _ in range(n)
    ]
    for t in threads:
        t.start()
    yield  # the threads end with their requests, or with the farm


def smg_entry(ff: FrontFarm, url: str) -> dict[str, Any]:
    try:
        r = ff.http.get(f"{ff.gateway_url}/workers", headers=ff.admin_headers())
        for w in r.json().get("workers", []):
            if str(w.get("url", "")).rstrip("/") == url:
                return dict(w)
    except (httpx.HTTPError, ValueError):
        pass
    return {}


def waiting(entry: dict[str, Any]) -> int:
    loads = (entry.get("engine_load") or {}).get("loads") or []
    return sum(int(x.get("num_waiting_reqs") or 0) for x in loads if isinstance(x, dict))


def status_json(ff: FrontFarm) -> dict[str, Any]:
    res = ff.farm.farmctl("status", "--json", timeout=30)
    try:
        out = json.loads(res.stdout)
    except ValueError:
        return {}
    return out if isinstance(out, dict) else {}


def poll(cond: Callable[[], bool], within: float, every: float = 0.25) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < within:
        if cond():
            return time.monotonic() - t0
        time.sleep(every)
    return None


def _settled(ff: FrontFarm) -> None:
    ff.farm.wait_for(lambda e: e.get("event") == "rollout_done", timeout=240)
    ff.wait_all_in(120)


def _load(ff: FrontFarm, max_s: float) -> Load:
    spec = LoadSpec(
        ff.gateway_url,
        MODEL,
        clients=CLIENTS,
        max_tokens=LOAD_TOKENS,
        max_s=max_s,
        timeout_s=LOAD_TIMEOUT_S,
    )
    return Load(spec).start()


def overload() -> dict[str, Any]:
    def adjust(doc: dict[str, Any]) -> None:
        doc["workers"]["overrides"] = {"3": {"sglang": {"max_running_requests": 2}}}

    out: dict[str, Any] = {}
    with running(TOKEN_S, adjust) as ff:
        _settled(ff)
        w3 = ff.worker_url(3)
        load = _load(ff, 150)
        time.sleep(10)
        r0, t_r0 = ff.gateway_worker_requests().get(w3, 0.0), time.monotonic()
        time.sleep(10)
        before = (ff.gateway_worker_requests().get(w3, 0.0) - r0) / (time.monotonic() - t_r0)
        out["routed_per_s_before"] = round(before, 2)
        t_fill = time.monotonic()
        with filled(w3, 12):
            smg_sees = poll(lambda: waiting(smg_entry(ff, w3)) >= 8, 30, 0.1)
            out["smg_sees_s"] = None if smg_sees is None else round(smg_sees, 2)
            said: dict[str, Any] = {}

            def names_3() -> bool:
                st = status_json(ff)
                over = (st.get("gateway") or {}).get("overloaded") or []
                if any(o.get("worker") == 3 for o in over):
                    said.update(st)
                    return True
                return False

            status_says = poll(names_3, 40, 0.5)
            out["status_says_s"] = (
                None if status_says is None else round(time.monotonic() - t_fill, 2)
            )
            if said:
                w = next(w for w in said.get("workers", []) if w.get("id") == 3)
                out["in_gateway_while_overloaded"] = w.get("in_gateway")
                out["status_overloaded"] = said["gateway"]["overloaded"]
            out["smg_status_while_overloaded"] = smg_entry(ff, w3).get("status")
            r1, t_r1 = ff.gateway_worker_requests().get(w3, 0.0), time.monotonic()
            time.sleep(5)
            during = (ff.gateway_worker_requests().get(w3, 0.0) - r1) / (time.monotonic() - t_r1)
            out["routed_per_s_while_overloaded"] = round(during, 2)
            out["waiting_at_restart"] = waiting(smg_entry(ff, w3))
            n_ev = len(ff.farm.snapshot())
            t_restart = time.monotonic()
            res = ff.farm.farmctl("restart", "3", timeout=240)
            out["restart_s"] = round(time.monotonic() - t_restart, 2)
            out["restart_rc"] = res.returncode
            for ev in ff.farm.snapshot()[n_ev:]:
                if ev.get("event") in ("worker_drained", "drain_budget_expired") and ev.get(
                    "worker"
                ) in (3, None):
                    out["drain_event"] = ev["event"]
                    out["drain_s"] = ev.get("drain_s")
                    break
        outcomes = load.stop()
        out["load"] = _brief(report(outcomes))
    return out


def _brief(rep: dict[str, Any]) -> dict[str, Any]:
    return {k: rep[k] for k in ("requests", "ok", "failed", "reasons", "latency_ms") if k in rep}


def wedge(stall_window: str | None) -> dict[str, Any]:
    def adjust(doc: dict[str, Any]) -> None:
        doc["workers"]["overrides"] = {"3": {"env": {"SGLANG_SIM_WEDGE_AFTER": str(WEDGE_AFTER_S)}}}
        if stall_window is not None:
            doc["health"]["stall_window"] = stall_window

    out: dict[str, Any] = {"stall_window": stall_window or "default (120s)"}
    with running(TOKEN_S, adjust) as ff:
        ff.farm.wait_for(lambda e: e.get("event") == "rollout_done", timeout=240)
        ff.wait_all_in(120)
        w3 = ff.worker_url(3)
        ready3 = ff.farm.wait_for(
            lambda e: (
                e.get("event") == "worker_state"
                and e.get("worker") == 3
                and e.get("state") == "ready"
            ),
            timeout=10,
        )
        wedge_at = ready3["_t"] + WEDGE_AFTER_S  # monotonic; about: "fired up" is earlier
        load = _load(ff, 400)
        left = wedge_at - time.monotonic()
        out["load_before_wedge_s"] = round(max(left, 0.0), 1)
        if left > 0:
            time.sleep(left)
        r_wedge = ff.gateway_worker_requests().get(w3, 0.0)
        n_ev = len(ff.farm.snapshot())
        samples: list[tuple[float, float]] = []

        def stopped() -> bool:
            samples.append(
                (time.monotonic() - wedge_at, ff.gateway_worker_requests().get(w3, 0.0) - r_wedge)
            )
            return any(
                e.get("event") == "worker_state"
                and e.get("worker") == 3
                and e.get("state") in ("stopping", "draining", "failed")
                for e in ff.farm.snapshot()[n_ev:]
            )

        took = poll(stopped, 400, 1.0)
        out["farm_stop_s"] = None if took is None else round(took, 1)
        for e in ff.farm.snapshot()[n_ev:]:
            if e.get("worker") == 3 and "wedged" in json.dumps(e):
                out["farm_stop_event"] = {k: v for k, v in e.items() if not k.startswith("_")}
                break
        # Until the farm stopped it (smg's count starts over when it is registered again).
        out["routed_after_wedge"] = max((n for _, n in samples), default=None)
        out["routed_after_wedge_by_s"] = {
            f"{int(t)}s": n for t, n in samples if int(t) in (1, 3, 5, 10, 20, 30, 60, 90, 120)
        }
        outcomes = load.stop()
        out["load"] = _brief(report(outcomes))
    return out


def shed(on: bool) -> dict[str, Any]:
    def adjust(doc: dict[str, Any]) -> None:
        doc["sglang"]["max_running_requests"] = 1
        doc["gateway"]["overload_shed"] = on
        doc["gateway"]["extra_args"] = ["--load-monitor-interval", "2"]

    out: dict[str, Any] = {"overload_shed": on}
    with running(TOKEN_S, adjust) as ff:
        _settled(ff)
        urls = [ff.worker_url(w) for w in range(8)]
        with contextlib.ExitStack() as stack:
            for u in urls:
                stack.enter_context(filled(u, 10))
            t = poll(lambda: all(waiting(smg_entry(ff, u)) >= 8 for u in urls), 40, 0.25)
            out["all_overloaded_after_s"] = None if t is None else round(t, 2)
            probes = [_chat(ff.gateway_url, 1, timeout=120) for _ in range(PROBES)]
            out["probes"] = [
                {"status": s, "seconds": round(d, 3), "retry_after": ra} for s, d, ra in probes
            ]
    return out


SYSTEM_PROMPT = "You are a careful assistant. " * 40  # one long shared prefix


class Clients:
    """`n` clients sending 8-token chat completions through the gateway without pause:
    every request the same long prompt (`same`), or each its own (a cache miss each)."""

    def __init__(self, url: str, n: int, *, same: bool) -> None:
        self.url, self.same = url, same
        self.stop = threading.Event()
        self.counter = 0
        self.failed = 0
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(n)]

    def _run(self) -> None:
        with httpx.Client(timeout=LOAD_TIMEOUT_S, trust_env=False) as c:
            while not self.stop.is_set():
                with self._lock:
                    self.counter += 1
                    k = self.counter
                text = "count to three" if self.same else f"{k * 7919 % 100_003} count to three"
                body = {
                    "model": MODEL,
                    "messages": [
                        {"role": "system", "content": SYSTEM_PROMPT if self.same else f"{k} "},
                        {"role": "user", "content": text},
                    ],
                    "max_tokens": LOAD_TOKENS,
                }
                try:
                    ok = c.post(f"{self.url}/v1/chat/completions", json=body).status_code == 200
                except httpx.HTTPError:
                    ok = False
                if not ok:
                    with self._lock:
                        self.failed += 1
                    time.sleep(0.05)

    def __enter__(self) -> Clients:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(LOAD_TIMEOUT_S + 5)


WARMUP_WINDOW_S = 45.0


def warmup(warmup_secs: int) -> dict[str, Any]:
    """A restarted worker's share of the traffic in its first `WARMUP_WINDOW_S` in the
    gateway (smg's own routed counts), with every request the same prompt and with every
    request its own; `warmup_secs` 60 (smg's and the farm's default) or 0 (no slice)."""

    def adjust(doc: dict[str, Any]) -> None:
        doc["gateway"]["warmup_secs"] = warmup_secs

    out: dict[str, Any] = {"warmup_secs": warmup_secs}
    with running(TOKEN_S, adjust) as ff:
        _settled(ff)
        w3 = ff.worker_url(3)
        for same in (True, False):
            key = "same_prompt" if same else "own_prompts"
            with Clients(ff.gateway_url, CLIENTS, same=same) as cl:
                time.sleep(15)  # the siblings' caches warm up on this traffic
                res = ff.farm.farmctl("restart", "3", timeout=120)
                if res.returncode != 0:
                    out[key] = {"error": res.stderr[-500:]}
                    continue
                ff.wait_all_in(60)
                before = ff.gateway_worker_requests()
                time.sleep(WARMUP_WINDOW_S)
                after = ff.gateway_worker_requests()
                delta = {u: after.get(u, 0.0) - before.get(u, 0.0) for u in after}
                if delta.get(w3, 0.0) < 0:  # its count started over with its registration
                    delta[w3] = after.get(w3, 0.0)
                total = sum(max(v, 0.0) for v in delta.values())
                out[key] = {
                    "restarted_worker_requests": delta.get(w3, 0.0),
                    "all_requests": total,
                    "restarted_share": round(delta.get(w3, 0.0) / total, 3) if total else None,
                    "fair_share": round(1 / 8, 3),
                    "per_worker": sorted(round(v) for v in delta.values()),
                    "client_failures": cl.failed,
                }
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench gateway-opinions")
    ap.add_argument("--only", default="overload,wedge,shed,warmup")
    ap.add_argument("--stall-window", default=None, help="[health] stall_window for `wedge`")
    ap.add_argument("--out", type=argparse.FileType("w"))
    a = ap.parse_args(argv)
    from importlib.metadata import version

    with open("/proc/loadavg") as f:
        load_before = f.read().split()[:3]
    results: dict[str, Any] = {
        "smg": version("smg"),
        "loadavg_before": load_before,
        "token_s": TOKEN_S,
        "clients": CLIENTS,
    }
    only = set(a.only.split(","))
    scenarios: dict[str, Callable[[], Any]] = {
        "overload": overload,
        "wedge": lambda: wedge(a.stall_window),
        "shed": lambda: {"off": shed(False), "on": shed(True)},
        "warmup": lambda: {"on": warmup(60), "off": warmup(0)},
    }
    for key, fn in scenarios.items():
        if key not in only:
            continue
        say(key)
        try:
            results[key] = fn()
        except Exception as exc:  # one scenario's failure must not lose the others
            say(f"{key} FAILED: {exc!r}")
            results[key] = {"error": repr(exc)}
        print(f"{key}: {json.dumps(results[key])}", flush=True)
    with open("/proc/loadavg") as f:
        results["loadavg_after"] = f.read().split()[:3]
    if a.out:
        a.out.write(json.dumps(results, indent=2) + "\n")
    return 0
