"""I/O: issue 33's fault figure (docs/benchmarks.md, "Batch jobs: faults"), simulator figures.

    python -m bench.batch_faults                          # 50,000 requests, 20 kill -9s
    python -m bench.batch_faults --requests 5000 --kills 6 --no-extras   # a short trial

The demo's farm (tests/batchfarm.DemoFarm: 8 simulator workers behind the managed smg, the
batch service run by the agent with its embedded SQLite store) runs one batch of the
shipped example (`scripts/batch_example.py`). While it runs, at progress spread evenly
over the batch, come `--kills` `kill -9`s in turn of the batch service, a worker and the
agent (a new agent is then started on the same config, as systemd would; in the process
runtime the agent's children die with it), and, unless `--no-extras`, a
`farmctl restart all`, a canary rollback (a reload whose change crashes the canary 3 s
into serving: `SGLANG_SIM_FAIL_AFTER`) and `farmctl drain-host` then `undrain-host`.

Counted at the end, from the batch's output and error files: results lost (a custom_id of
the input in neither) and duplicated (one in them twice), goal 0/0. For each `kill -9` of
the batch service, the time to resume: from the kill to the next result the store holds
(its batches' counters, read from the SQLite file itself 20 times a second), goal <= 5 s;
and where those seconds went: the agent seeing the exit, its restart delay, the new
process up to its own `batch_service_started` line, and from there to the first result.

`SF_BENCH_TMP` names the folder the farm's own temporary folder is made in (default: the
system's).

The simulator is not SGLang and these are not SGLang's figures; on a shared machine every
figure is as noisy as the machine (the load average is printed with them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "tests") not in sys.path:  # the demo farm's harness, shared with the tests
    sys.path.append(str(ROOT / "tests"))

from batchfarm import DemoFarm, wait_for  # noqa: E402 -- after sys.path

MODEL = "sim/Qwen3.6-27B"


@dataclass(slots=True)
class Event:
    kind: str
    at_done: int  # results in the store when it was done
    t: float  # time.time() of the fault
    seconds: float = 0.0  # how long the fault's own command ran
    resume_s: float | None = None  # kill -> the next result in the store
    phases: dict[str, float] = field(default_factory=dict)
    note: str = ""


class DoneWatch:
    """The store's result count, read on a thread 20 times a second; the first time it
    exceeds a given count."""

    def __init__(self, demo: DemoFarm) -> None:
        self.demo = demo
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            n = self.demo.done()
            if n >= 0:
                with self._lock:
                    self.samples.append((time.time(), n))
            self._stop.wait(0.05)

    def now(self) -> int:
        with self._lock:
            return self.samples[-1][1] if self.samples else 0

    def first_above(self, count: int, after: float) -> float | None:
        with self._lock:
            for t, n in self.samples:
                if t >= after and n > count:
                    return t
        return None

    def __enter__(self) -> DoneWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def service_log_started(demo: DemoFarm, after: float) -> float | None:
    """The wall time of the service's own first `batch_service_started` line after `after`."""
    path = Path(demo.tmp) / "state" / "batch.log"
    with contextlib.suppress(OSError):
        for raw in path.read_text(errors="replace").splitlines():
            if '"batch_service_started"' not in raw:
                continue
            with contextlib.suppress(ValueError, KeyError):
                t = datetime.fromisoformat(json.loads(raw)["timestamp"]).timestamp()
                if t > after:
                    return t
    return None


def agent_event_after(demo: DemoFarm, name: str, after_mono: float) -> float | None:
    """The monotonic time the agent logged `name` after `after_mono`."""
    assert demo.farm is not None
    for e in demo.farm.snapshot():
        if e.get("event") == name and e["_t"] >= after_mono:
            return float(e["_t"])
    return None


def fresh_done(demo: DemoFarm) -> int:
    """The store's result count read now (again while it is mid-commit)."""
    while (n := demo.done()) < 0:
        time.sleep(0.01)
    return n


def settled(demo: DemoFarm) -> tuple[bool, Any]:
    """Every worker ready and in the gateway, the host not held out (the agent's status)."""
    st = demo.farmctl_json("status")
    if not st:
        return False, None
    workers = st.get("workers") or []
    ok = (
        len(workers) == 8
        and all(w.get("state") == "ready" and w.get("in_gateway") for w in workers)
        and st.get("held_out_since") is None
    )
    return ok, [(w.get("id"), w.get("state"), w.get("in_gateway")) for w in workers]


def kill_service(demo: DemoFarm, watch: DoneWatch) -> Event:
    pid = demo.service_pid()
    assert pid is not None, "no batch service runs"
    before = fresh_done(demo)  # read now: the watch's last reading may be 50 ms old
    mono, t = time.monotonic(), time.time()
    os.kill(pid, signal.SIGKILL)
    ev = Event("kill -9 batch service", before, t)
    resumed = wait_for(
        "a result after the batch service's kill",
        lambda: (watch.first_above(before, t) is not None, watch.now()),
        300,
    )
    del resumed
    first = watch.first_above(before, t)
    assert first is not None
    ev.resume_s = first - t
    exited = agent_event_after(demo, "batch_service_exited", mono)
    started = agent_event_after(demo, "batch_service_started", mono)
    own = service_log_started(demo, t)
    if exited is not None:
        ev.phases["agent_sees_exit_s"] = exited - mono
    if exited is not None and started is not None:
        ev.phases["restart_delay_s"] = started - exited
    if own is not None and started is not None:
        ev.phases["process_start_s"] = own - (t + (started - mono))
    if own is not None:
        ev.phases["start_to_first_result_s"] = first - own
    return ev


def kill_worker(demo: DemoFarm, watch: DoneWatch, wid: int) -> Event:
    pid = demo.worker_pid(wid)
    ev = Event(f"kill -9 worker {wid}", watch.now(), time.time())
    os.kill(pid, signal.SIGKILL)
    return ev


def kill_agent(demo: DemoFarm, watch: DoneWatch) -> Event:
    ev = Event("kill -9 agent", fresh_done(demo), time.time())
    demo.kill_agent()
    demo.start()
    demo.wait_serving(300)
    first = wait_for(
        "a result after the agent's kill",
        lambda: (watch.first_above(ev.at_done, ev.t) is not None, watch.now()),
        300,
    )
    del first
    got = watch.first_above(ev.at_done, ev.t)
    assert got is not None
    ev.resume_s = got - ev.t
    ev.note = "the agent's children die with it: every worker and the service start again"
    return ev


def farmctl_event(demo: DemoFarm, watch: DoneWatch, kind: str, *args: str) -> Event:
    ev = Event(kind, watch.now(), time.time())
    r = demo.farmctl(*args, timeout=900)
    ev.seconds = time.time() - ev.t
    ev.note = f"exit {r.returncode}: {(r.stdout + r.stderr).strip().splitlines()[-1:]}"
    return ev


def canary_rollback(demo: DemoFarm, watch: DoneWatch) -> Event:
    """A reload whose change crashes the canary 3 s into serving; the config put back."""
    import tomllib

    from farmtoml import rewritten

    original = demo.config.read_text()
    env = tomllib.loads(original)["farm"]["env"]
    bad = rewritten(original, farm={"env": {**env, "SGLANG_SIM_FAIL_AFTER": "3"}})
    demo.config.write_text(bad)
    try:
        ev = farmctl_event(demo, watch, "canary rollback (reload)", "reload")
    finally:
        demo.config.write_text(original)
    ev.kind = "canary rollback (reload, exit 5 = rolled back)"
    return ev


def schedule(kills: int, extras: bool) -> list[str]:
    """The faults in order: kill -9s of the service, a worker and the agent in turn
    (service, worker, service, worker, agent, ...), the extras spread among them."""
    cycle = ["service", "worker", "service", "worker", "agent"]
    out = [cycle[i % len(cycle)] for i in range(kills)]
    if extras:
        for k, name in enumerate(("restart-all", "rollback", "drain-host")):
            out.insert((k + 1) * len(out) // 4 + k, name)
    return out


def run(n: int, plan: list[str], token_s: float) -> dict[str, Any]:
    """The batch of `n` requests with the faults of `plan` at progress spread evenly over
    its first 80 % (the faults that block, an agent's restart, a restart all, a canary's
    verdict, take their time while the batch runs on)."""
    tmp = Path(tempfile.mkdtemp(prefix="sfbf", dir=os.environ.get("SF_BENCH_TMP")))
    events: list[Event] = []
    demo = DemoFarm(
        tmp,
        env={"SGLANG_SIM_LOAD_SECONDS": "1", "SGLANG_SIM_TOKEN_SECONDS": str(token_s)},
        rollout={"analysis_window": "10s"},
    )
    load0 = load_avg()
    t0 = time.time()
    try:
        with demo, DoneWatch(demo) as watch:
            demo.wait_serving(300)
            path = tmp / "in.jsonl"
            with open(path, "w") as f:
                subprocess.run(
                    [sys.executable, "scripts/batch_example.py", "--count", str(n)],
                    cwd=ROOT,
                    stdout=f,
                    check=True,
                )
            ids = [json.loads(x)["custom_id"] for x in path.read_text().splitlines()]
            r = demo.farmctl("batch", "submit", str(path), timeout=600)
            assert r.returncode == 0, r.stdout + r.stderr
            bid = r.stdout.split()[0]
            started = time.time()
            for i, what in enumerate(plan):
                at = int(0.8 * n * (i + 1) / (len(plan) + 1))

                def reached(at: int = at) -> tuple[bool, int]:
                    return watch.now() >= at, watch.now()

                wait_for(f"{at} results", reached, 900)
                if watch.now() >= n:
                    break
                # Each fault on a settled farm (every worker ready and routed): a fault's
                # resume is its own, not the last one's (a kill of the service just after
                # an undrain-host would count the workers' return too).
                # (Not `farmctl wait`: after the canary's rollback it says "not settled"
                # for as long as the rolled-back change is on record.)
                wait_for("every worker ready and routed", lambda: settled(demo), 300)
                if what == "service":
                    ev = kill_service(demo, watch)
                elif what == "worker":
                    ev = kill_worker(demo, watch, 1 + i % 7)
                elif what == "agent":
                    ev = kill_agent(demo, watch)
                elif what == "restart-all":
                    ev = farmctl_event(demo, watch, "farmctl restart all", "restart", "all")
                elif what == "rollback":
                    ev = canary_rollback(demo, watch)
                else:
                    ev = farmctl_event(demo, watch, "farmctl drain-host", "drain-host")
                    events.append(ev)
                    print(json.dumps(asdict(ev)), flush=True)
                    ev = farmctl_event(demo, watch, "farmctl undrain-host", "undrain-host")
                events.append(ev)
                print(json.dumps(asdict(ev)), flush=True)
            w = demo.farmctl("batch", "wait", bid, "--timeout", "1800", timeout=1900)
            ended = time.time()
            assert w.returncode == 0, w.stdout + w.stderr
            key = demo.api_key
            with httpx.Client(
                base_url=demo.batch_url, headers={"Authorization": f"Bearer {key}"}, timeout=600
            ) as http:
                b = http.get(f"/v1/batches/{bid}").json()
                seen: Counter[str] = Counter()
                for fid in (b["output_file_id"], b["error_file_id"]):
                    for raw in http.get(f"/v1/files/{fid}/content").text.splitlines():
                        if raw.strip():
                            seen[json.loads(raw)["custom_id"]] += 1
            import sqlite3

            with contextlib.closing(
                sqlite3.connect(f"file:{demo.batch_state / 'batch.db'}?mode=ro", uri=True)
            ) as db:
                sent_again = db.execute(
                    "SELECT count(*) FROM (SELECT line FROM attempts WHERE batch_id = ? "
                    "GROUP BY line HAVING count(*) > 1)",
                    (bid,),
                ).fetchone()[0]
                reasons = dict(
                    db.execute(
                        "SELECT COALESCE(reason, outcome), count(*) FROM attempts "
                        "WHERE batch_id = ? GROUP BY 1",
                        (bid,),
                    ).fetchall()
                )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    resumes = [e.resume_s for e in events if e.kind.endswith("batch service") and e.resume_s]
    return {
        "requests": n,
        "token_s": token_s,
        "plan": plan,
        "faults_done": len(events),
        "events": [asdict(e) for e in events],
        "lost": sum(1 for i in ids if seen[i] == 0),
        "duplicated": sum(1 for v in seen.values() if v > 1),
        "not_in_input": len(set(seen) - set(ids)),
        "counts": b["request_counts"],
        "status": b["status"],
        "batch_seconds": ended - started,
        "requests_with_several_recorded_attempts": sent_again,
        "attempt_outcomes": reasons,
        "service_resume_s": {
            "n": len(resumes),
            "median": statistics.median(resumes) if resumes else None,
            "max": max(resumes) if resumes else None,
            "all": resumes,
        },
        "load_avg_before": load0,
        "load_avg_after": load_avg(),
        "cpus": os.cpu_count(),
        "seconds": time.time() - t0,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.batch_faults", description=__doc__)
    p.add_argument("--requests", type=int, default=50_000)
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--no-extras", action="store_true", help="kill -9s only")
    p.add_argument("--token-s", type=float, default=0.002, help="simulator seconds per token")
    p.add_argument(
        "--plan",
        default="",
        help="the faults in order instead (service,worker,agent,"
        "restart-all,rollback,drain-host), comma-separated",
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    plan = args.plan.split(",") if args.plan else schedule(args.kills, not args.no_extras)
    result = run(args.requests, plan, args.token_s)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0 if result["lost"] == 0 and result["duplicated"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
