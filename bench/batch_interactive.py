"""I/O: issue 33's interactive figure (docs/benchmarks.md, "Batch jobs: users first"),
simulator figures.

    python -m bench.batch_interactive --requests 80                      # the farm's config
    python -m bench.batch_interactive --requests 80 --policy least_load
    python -m bench.batch_interactive --requests 80 --no-scheduler

The demo's farm (tests/batchfarm.DemoFarm: 8 simulator workers behind the managed smg, the
batch service run by the agent), each worker at 8 running requests (`max_running_requests`,
which the simulator enforces, queueing the rest, as SGLang does), with smg's priority
scheduler on (`[gateway] priority_scheduler = true`) and the farm's admission config for it
(`[gateway] priority_user_share`, `--user-share`: the share of the slots held for users'
`default` class, 1/4 unless told; gateway.scheduler); `--no-scheduler` leaves it off.
(smg's built-in class defaults, measured on 2026-12-02 with an earlier version of this
bench, cannot be had through the farm any more: it always writes its config.) An
interactive client (the `openai` package, streaming chat, one
request at a time, no priority header: smg's `default` class) measures its time to the
first token (TTFT) through the same front door:

1. idle: no batch;
2. a saturating batch (the runner keeps every slot full) sent without a class
   (`[batch] priority = "none"`): its requests and the user's are one queue;
3. the same batch at `bulk` (`[batch] priority = "bulk"`, the service restarted on it).

Goal: phase 3's p99 <= 1.5x phase 1's. smg's own admission counters by class
(`smg_scheduler_admit_total`) are read after each phase, to show what class it saw.

`SF_BENCH_TMP` names the folder the farm's own temporary folder is made in (default: the
system's).

The simulator is not SGLang and these are not SGLang's figures; on a shared machine every
figure is as noisy as the machine (the load average is printed with them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "tests") not in sys.path:  # the demo farm's harness, shared with the tests
    sys.path.append(str(ROOT / "tests"))

from batchfarm import DemoFarm, wait_for  # noqa: E402 -- after sys.path
from farmtoml import rewritten  # noqa: E402

MAX_RUNNING = 8  # each worker's slots: 64 for the farm


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def ttfts(front_door: str, model: str, n: int) -> list[float]:
    """n streaming chat requests one after the other; each one's seconds to its first
    content token."""
    import openai

    c = openai.OpenAI(base_url=front_door + "/v1", api_key="none", max_retries=0, timeout=120)
    out: list[float] = []
    for i in range(n):
        t0 = time.monotonic()
        stream = c.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"an interactive question {i}"}],
            max_tokens=8,
            stream=True,
        )
        first: float | None = None
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.monotonic() - t0
        assert first is not None, "no token came"
        out.append(first)
        time.sleep(0.05)
    c.close()
    return out


def admits(metrics_url: str, prefix: str = "smg_scheduler_admit_total") -> dict[str, float]:
    """smg's own series under `prefix` (its admissions by class; or, with
    "smg_scheduler_inflight", what it runs now by class, sampled every 5 s)."""
    try:
        text = httpx.get(metrics_url, timeout=10).text
    except httpx.HTTPError:
        return {}
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            series, _, value = line.rpartition(" ")
            found[series] = float(value)
    return found


def summary(xs: list[float]) -> dict[str, float]:
    return {
        "n": len(xs),
        "p50_ms": 1000 * statistics.median(xs),
        "p90_ms": 1000 * pct(xs, 0.90),
        "p99_ms": 1000 * pct(xs, 0.99),
        "max_ms": 1000 * max(xs),
    }


def run(
    n: int,
    batch_n: int,
    token_s: float,
    extra_smg: list[str],
    *,
    scheduler_on: bool = True,
    user_share: float = 0.25,
    policy: str | None = None,
) -> dict[str, Any]:
    gateway: dict[str, Any] = {"priority_scheduler": scheduler_on}
    if policy is not None:
        gateway["policy"] = policy
    if scheduler_on:
        gateway["priority_user_share"] = user_share
    tmp = Path(tempfile.mkdtemp(prefix="sfbi", dir=os.environ.get("SF_BENCH_TMP")))
    slots = 8 * MAX_RUNNING
    demo = DemoFarm(
        tmp,
        env={"SGLANG_SIM_LOAD_SECONDS": "1", "SGLANG_SIM_TOKEN_SECONDS": str(token_s)},
        sglang={"max_running_requests": MAX_RUNNING},
        gateway={**gateway, "extra_args": list(extra_smg)},
        batch={"priority": "none"},
    )
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    doc = tomllib.loads(demo.config.read_text())
    model = doc["sglang"]["model_path"]
    metrics_url = f"http://{doc['gateway']['metrics_listen']}/metrics"
    phases: dict[str, Any] = {}
    try:
        with demo:
            demo.wait_serving(300)
            ttfts(demo.gateway_url, model, 10)  # warm: connections, smg's first routes
            load = os.getloadavg()[0]
            phases["idle"] = {
                **summary(ttfts(demo.gateway_url, model, n)),
                "load_avg": load,
                "load_avg_end": os.getloadavg()[0],
            }
            phases["idle"]["admits"] = admits(metrics_url)
            print(json.dumps({"idle": phases["idle"]}), flush=True)

            path = tmp / "in.jsonl"
            with open(path, "w") as f:
                subprocess.run(
                    [sys.executable, "scripts/batch_example.py", "--count", str(batch_n)],
                    cwd=ROOT,
                    stdout=f,
                    check=True,
                )
            r = demo.farmctl("batch", "submit", str(path), timeout=600)
            assert r.returncode == 0, r.stdout + r.stderr
            bid = r.stdout.split()[0]
            for label, priority in (("batch, no class", "none"), ("batch, bulk class", "bulk")):
                if priority != "none":
                    demo.config.write_text(
                        rewritten(demo.config.read_text(), batch={"priority": priority})
                    )
                    pid = demo.service_pid()
                    assert pid is not None
                    os.kill(pid, signal.SIGKILL)  # the agent starts it again on the new config

                    def again(pid: int = pid) -> tuple[bool, int | None]:
                        now = demo.service_pid()
                        return now not in (None, pid), now

                    wait_for("the batch service again", again, 60)
                seen = {"n": 0}

                def full(seen: dict[str, int] = seen) -> tuple[bool, Any]:
                    """The runner keeps every slot busy (its in-flight gauge at the farm's
                    slots) for a few readings in a row."""
                    try:
                        m = httpx.get(demo.batch_url + "/metrics", timeout=10).text
                    except httpx.HTTPError:
                        return False, "the service not answering yet"
                    v = next(
                        (
                            float(x.split()[1])
                            for x in m.splitlines()
                            if x.startswith("sglang_farm_batch_in_flight ")
                        ),
                        0.0,
                    )
                    seen["n"] = seen["n"] + 1 if v >= slots - 8 else 0
                    return seen["n"] >= 3, v

                wait_for("the batch filling every slot", full, 120)
                before = admits(metrics_url)
                done0 = demo.done()
                load = os.getloadavg()[0]
                t0 = time.monotonic()
                got = ttfts(demo.gateway_url, model, n)
                seconds = time.monotonic() - t0
                after = admits(metrics_url)
                inflight = admits(metrics_url, "smg_scheduler_inflight")
                done1 = demo.done()
                assert done1 < batch_n, "the batch ended during the phase: make it longer"
                phases[label] = {
                    **summary(got),
                    "load_avg": load,
                    "batch_results_during": done1 - done0,
                    "phase_seconds": seconds,
                    "load_avg_end": os.getloadavg()[0],
                    "batch_requests_per_s": (done1 - done0) / seconds,
                    "admits_during": {k: after[k] - before.get(k, 0.0) for k in after},
                    "smg_inflight_end": inflight,
                }
                print(json.dumps({label: phases[label]}), flush=True)
            demo.farmctl("batch", "cancel", bid)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    idle = phases["idle"]["p99_ms"]
    return {
        "interactive_requests": n,
        "token_s": token_s,
        "max_running_requests": MAX_RUNNING,
        "gateway": gateway,
        "smg_extra_args": list(extra_smg),
        "started_utc": started,
        "phases": phases,
        "p99_over_idle": {k: v["p99_ms"] / idle for k, v in phases.items()},
        "cpus": os.cpu_count(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.batch_interactive", description=__doc__)
    p.add_argument("--requests", type=int, default=200, help="interactive requests a phase")
    p.add_argument("--batch", type=int, default=40_000, help="the batch's requests")
    p.add_argument("--token-s", type=float, default=0.01, help="simulator seconds per token")
    p.add_argument("--smg-arg", action="append", default=[], help="another smg flag (repeat it)")
    p.add_argument(
        "--no-scheduler",
        action="store_true",
        help="smg's priority scheduler off (the header is then ignored)",
    )
    p.add_argument(
        "--user-share",
        type=float,
        default=0.25,
        help="[gateway] priority_user_share: the slots' share held for users (default 1/4)",
    )
    p.add_argument("--policy", default=None, help="[gateway] policy (default: the demo's)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    result = run(
        args.requests,
        args.batch,
        args.token_s,
        args.smg_arg,
        scheduler_on=not args.no_scheduler,
        user_share=args.user_share,
        policy=args.policy,
    )
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
