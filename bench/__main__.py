"""I/O: `python -m bench`: every benchmark in one run.

Prints the table and writes bench/results/<date>.json.

Options: `--quick` (short windows, fewer repetitions: a smoke run, not for the docs),
`--no-64` (skip the 64-worker farm), `--only perf` (issue 17's figures: the 64-worker
farm and `farmctl status`; with `--baseline COMMIT` the same figures for the code as of
COMMIT, measured in the same run), `--only systemd` (just the reaction times under
systemd, in the throwaway container), `--only frontdoor` or `python -m bench frontdoor`
(just the front door: the gateway under load), `--only canary` or `python -m bench canary`
(the canary statistics' simulation: false and missed rollbacks of each method),
`python -m bench canary-matrix` (issue 23's matrix of changes on a live farm of simulators:
`--window 30s`, `--repeat 3`, `--reduced`; bench/canary_matrix.py), `--out PATH`.
`python -m bench mutants`: mutation testing of the pure core (bench/mutants.py).
`python -m bench idle --baseline COMMIT`: the agent's idle CPU at 8 and 64 workers, old
and new side by side (bench/idle.py).
`python -m bench gateway-mesh`: several gateways, independent or an smg mesh (issue 26:
bench/gateway_mesh.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import (
    canary_matrix,
    canary_stats,
    control,
    farmrun,
    footprint,
    frontdoor,
    reaction,
    scrape,
    sdreaction,
    simload,
    synthetic,
)
from bench.farmrun import FarmSetup, running_farm
from bench.stats import ratio, summary
from bench.table import markdown, rows
from sglang_farm.metrics.exposition import PROMETHEUS_ACCEPT
from sglang_farm.spec import StartupPolicy

RESULTS = Path(__file__).resolve().parent / "results"


def say(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def machine() -> dict[str, Any]:
    model = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    mem = Path("/proc/meminfo").read_text().splitlines()[0].split()[1]
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "mem_gib": round(int(mem) / 2**20, 1),
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "interpreter": sys.executable,
        "loadavg_start": os.getloadavg(),
    }


def bytecode_env() -> str:
    """Let every child cache byte code (as an installed package does), in a private folder.

    Some environments set PYTHONDONTWRITEBYTECODE=1, which makes every process compile
    every module it imports; a deployed agent (and farmctl) never pays that.
    """
    cache = Path(tempfile.gettempdir()) / "sglang-farm-bench-pyc"
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ["PYTHONPYCACHEPREFIX"] = str(cache)
    return str(cache)


def warm_bytecode() -> None:
    """Import every agent module once in a child, so that timed processes load cached byte code."""
    code = (
        "import importlib, pkgutil, sglang_farm\n"
        "for m in pkgutil.walk_packages(sglang_farm.__path__, 'sglang_farm.'):\n"
        "    try: importlib.import_module(m.name)\n"
        "    except Exception: pass\n"
        "import httpx, structlog, prometheus_client, click"
    )
    subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def scrape_with_hang(
    farm: farmrun.Farm, reps: int, hung_worker: int, settle: float, budget: float
) -> dict[str, Any]:
    """Scrapes while healthy, then with one worker's process group SIGSTOPped.

    `budget` bounds each series in seconds: the hung one must end before the agent
    restarts the worker (failure_threshold x period after the SIGSTOP).
    """
    host, port = farmrun.metrics_url(farm)
    healthy = scrape.measure(host, port, reps, max_s=budget)
    pid = farmrun.worker_pid(farm, hung_worker)
    n = len(farm.snapshot())
    os.killpg(pid, signal.SIGSTOP)
    try:
        # Let the worker poller run into the hung worker first (interval + timeout).
        time.sleep(settle)
        hung = scrape.measure(host, port, reps, max_s=budget)
        status_hung = control.status_round_trip(farmrun.socket_path(farm), 200, max_s=budget / 2)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGCONT)
    h, g = healthy["latency_ms"], hung["latency_ms"]
    restarted = [e for e in farm.snapshot()[n:] if e.get("event") == "worker_terminating"]
    return {
        "healthy": healthy,
        "hung": hung,
        "hung_worker": hung_worker,
        "settle_s": settle,
        "restarted_while_measuring": bool(restarted),
        "ratio_hung_to_healthy_p99": ratio(g["p99"], h["p99"]),  # type: ignore[index]  # dicts of floats
        "ratio_hung_to_healthy_median": ratio(g["median"], h["median"]),  # type: ignore[index]  # ditto
        "status_hung": status_hung,
    }


def section(results: dict[str, Any], key: str, fn: Callable[[], Any]) -> None:
    """Run one benchmark; a failure is recorded in the results, and the run goes on."""
    try:
        results[key] = fn()
    except Exception as exc:  # a benchmark's failure must not lose the others' figures
        say(f"{key} FAILED: {exc!r}")
        results[key] = {"error": repr(exc), "traceback": traceback.format_exc()}


def farm8(quick: bool, own_load: float) -> dict[str, Any]:
    say("farm of 8 workers at the spec's default intervals")
    out: dict[str, Any] = {}
    with running_farm(FarmSetup(8, parallel=4)) as farm:
        out["startup"] = farmrun.startup(
            farm, own_load, poll_interval_s=StartupPolicy().poll_interval
        )
        say(f"  ready; start-up overhead {out['startup']['overhead_s']:.2f} s; idle footprint")
        time.sleep(6)  # one GPU and worker poll (5 s) after the rollout
        out["footprint"] = footprint.watch(farm.proc.pid, 15 if quick else 60)
        host, port = farmrun.metrics_url(farm)
        out["poll_health"] = scrape.health_lines(host, port)
        say("  scrape (healthy, then worker 3 SIGSTOPped)")
        reps = 200 if quick else 1000
        sc = scrape_with_hang(farm, reps, 3, settle=7.5, budget=15)
        out["control"] = {"status_hung": sc.pop("status_hung")}
        out["scrape"] = sc
        time.sleep(2)
        say("  control socket and farmctl")
        sock = farmrun.socket_path(farm)
        out["control"]["status"] = control.status_round_trip(sock, 1000 if not quick else 300)
        out["control"]["farmctl"] = control.farmctl_vs_python(sock, 8 if quick else 20)
        out["control"]["importtime"] = control.importtime(sock)
        cache = os.environ.pop("PYTHONPYCACHEPREFIX")
        os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
        try:
            out["control"]["farmctl_no_bytecode"] = control.farmctl_vs_python(
                sock, 5 if quick else 10
            )
        finally:
            os.environ.pop("PYTHONDONTWRITEBYTECODE")
            os.environ["PYTHONPYCACHEPREFIX"] = cache
        out["restarts_seen"] = len(farm.named("worker_restarting"))
    return out


def reactions(quick: bool, sim_load: float, own_load: float) -> dict[str, Any]:
    period, threshold, backoff, poll = 1.0, 3, 1.0, 0.1
    say(f"reaction farm: 8 workers, health {period:g} s x {threshold}, back-off {backoff:g} s")
    setup = FarmSetup(
        8,
        parallel=4,
        startup=f'poll_interval = "{poll}s"',
        health=f'period = "{period}s"\ntimeout = "2s"\nfailure_threshold = {threshold}',
        restart=f'backoff_initial = "{backoff}s"\nstop_timeout = "5s"',
    )
    out: dict[str, Any] = {}
    with running_farm(setup) as farm:
        out["startup"] = farmrun.startup(farm, own_load, poll_interval_s=poll)
        time.sleep(2)
        say("  crashes")
        out["crash"] = reaction.crashes(
            farm, [1, 2, 3] if quick else [1, 2, 3, 4, 5, 6], sim_load, backoff
        )
        say("  hangs")
        out["hang"] = reaction.hangs(farm, [7] if quick else [7, 5, 2], period, threshold)
    return out


def farm64(
    quick: bool, *, farmctl: bool = False, old_pythonpath: str | None = None
) -> dict[str, Any]:
    """The 64-worker farm; `farmctl`: also time `farmctl status` against it (the old tree's
    farmctl too, given `old_pythonpath`)."""
    out: dict[str, Any] = {}
    say("  the simulators alone under the farm's start plan (64, canary then 16 at a time)")
    out["sims_alone"] = simload.rollout(64, 16)
    say(f"  simulators alone: {out['sims_alone']['total_s']:.1f} s")
    say("farm of 64 workers (128+ simulator processes) at default intervals, parallel 16")
    with running_farm(FarmSetup(64, parallel=16)) as farm:
        farmrun.wait_rollout(farm, 400)
        done = farm.named("rollout_done")[-1]
        first = next(e for e in farm.snapshot() if e.get("event") == "worker_launching")
        out["agent_cpu_to_rollout_s"] = footprint.cpu_seconds(farm.proc.pid)
        out["rollout_s"] = farmrun.event_time(done) - farmrun.event_time(first)
        out["launch_s"] = launch_costs(farm)
        say(f"  ready in {out['rollout_s']:.1f} s; idle footprint")
        time.sleep(6)
        out["footprint"] = footprint.watch(farm.proc.pid, 15 if quick else 60)
        host, port = farmrun.metrics_url(farm)
        out["poll_health"] = scrape.health_lines(host, port)
        say("  scrape")
        # 1000 scrapes a series: the p99 of 200 is their second worst, one re-format's luck.
        sc = scrape_with_hang(farm, 50 if quick else 1000, 40, settle=6, budget=10)
        out["control"] = {"status_hung": sc.pop("status_hung")}
        out["scrape"] = sc
        say("  scrape with the Accept header Prometheus sends (OpenMetrics first)")
        out["scrape_prometheus"] = scrape.measure(
            host, port, 50 if quick else 300, accept=PROMETHEUS_ACCEPT, max_s=60
        )
        sock = farmrun.socket_path(farm)
        out["control"]["status"] = control.status_round_trip(sock, 1000 if not quick else 300)
        out["control"]["status_floor"] = control.status_vs_floor(
            sock,
            300 if quick else 1000,
            str(farm.tmp),  # type: ignore[attr-defined]  # set by running_farm
        )
        if farmctl:
            say("  farmctl status against it (15 interleaved runs)")
            out["control"]["farmctl"] = control.farmctl_vs_python(
                sock, 5 if quick else 15, old_pythonpath=old_pythonpath
            )
            out["control"]["importtime"] = control.importtime(sock)
            if old_pythonpath:
                out["control"]["importtime_old"] = control.importtime(
                    sock, {**os.environ, "PYTHONPATH": old_pythonpath}
                )
        out["restarts_seen"] = len(farm.named("worker_restarting"))
    say("  the simulators alone again, after the farm (the machine's load drifts)")
    out["sims_alone_after"] = simload.rollout(64, 16)
    alone = (out["sims_alone"]["total_s"] + out["sims_alone_after"]["total_s"]) / 2
    out["agent_share_s"] = out["rollout_s"] - alone
    return out


def launch_costs(farm: farmrun.Farm) -> dict[str, Any]:
    """`worker_launching` -> `worker_launched` per worker (the agent's fork and exec), s."""
    t: dict[int, float] = {}
    xs = []
    for e in farm.snapshot():
        if e.get("event") == "worker_launching":
            t[e["worker"]] = farmrun.event_time(e)
        elif e.get("event") == "worker_launched" and e.get("worker") in t:
            xs.append(farmrun.event_time(e) - t.pop(e["worker"]))
    return {"each": summary(xs), "sum": sum(xs)}


def baseline_tree(commit: str) -> str:
    """`agent/` as of `commit`, unpacked in a temp folder (read-only use of git); its path."""
    root = Path(tempfile.mkdtemp(prefix="sglang-farm-bench-baseline-"))
    archive = subprocess.run(
        ["git", "archive", commit, "agent"],
        cwd=RESULTS.parent.parent,
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    return str(root / "agent")


@contextlib.contextmanager
def old_code(pythonpath: str) -> Iterator[None]:
    """Every child started meanwhile (agent, simulators, farmctl) runs the baseline tree."""
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = pythonpath
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = before


def format_costs(results: dict[str, Any], quick: bool) -> None:
    say("in-process /metrics formatting on hand-built states of 8 and 64 workers")
    results["format"] = {
        "8": synthetic.format_cost(8, 100 if quick else 500),
        "64": synthetic.format_cost(64, 30 if quick else 100),
    }


def perf(results: dict[str, Any], quick: bool, baseline: str | None) -> None:
    """Issue 17's figures: the 64-worker farm and farmctl, old code and new in one run."""
    format_costs(results, quick)
    old = None
    if baseline:
        # A commit (git archive), or an `agent/` folder where there is no git history.
        old = str(Path(baseline).resolve()) if Path(baseline).is_dir() else baseline_tree(baseline)
    if old is not None and baseline is not None:
        results["baseline_commit"] = baseline
        say(f"64-worker farm on the baseline {baseline} ({old})")
        with old_code(old):
            warm_bytecode()
            section(results, "farm64_old", lambda: farm64(quick))
    section(results, "farm64", lambda: farm64(quick, farmctl=True, old_pythonpath=old))


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-64", dest="no64", action="store_true")
    ap.add_argument("--only", choices=["systemd", "frontdoor", "perf", "canary", "canary-matrix"])
    ap.add_argument(
        "what",
        nargs="?",
        choices=["frontdoor", "systemd", "perf", "canary", "canary-matrix"],
        help="same as --only",
    )
    ap.add_argument("--window", default="30s", help="canary-matrix: [rollout] analysis_window")
    ap.add_argument("--repeat", type=int, default=3, help="canary-matrix: trials per change")
    ap.add_argument(
        "--reduced",
        action="store_true",
        help="canary-matrix: one repeat of harmless, ITL 5x, crash",
    )
    ap.add_argument(
        "--baseline",
        metavar="COMMIT",
        help="with perf: also measure the 64-worker farm and farmctl as of COMMIT (git archive), "
        "or of an agent/ folder (a copy without git history)",
    )
    ap.add_argument(
        "--prompts",
        choices=["distinct", "same", "system"],
        default="distinct",
        help="canary-matrix: the load's prompts: each its own, all the same, or most sharing a "
        "long system prompt (prefix-heavy; the simulators' prefill then costs per uncached token)",
    )
    ap.add_argument(
        "--probes", type=int, default=0, help="canary-matrix: [rollout] probe_concurrency"
    )
    ap.add_argument("--workers", type=int, default=8, help="canary-matrix: workers")
    ap.add_argument(
        "--changes", default="", help="canary-matrix: only these change keys, comma-separated"
    )
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    a.only = a.only or a.what
    t0 = time.monotonic()
    results: dict[str, Any] = {"started": datetime.now(UTC).isoformat(), "quick": a.quick}
    results["machine"] = machine()
    results["bytecode_cache"] = bytecode_env()
    say("warming the byte-code cache (agent, farmctl, simulator)")
    warm_bytecode()
    if a.only == "systemd":
        systemd_reactions(results, a.quick)
        return finish(a, results, t0, suffix="-systemd")
    if a.only == "perf":
        perf(results, a.quick, a.baseline)
        return finish(a, results, t0, suffix="-perf")
    if a.only == "canary":
        section(results, "canary_stats", lambda: canary_stats.run(a.quick, say))
        print(canary_stats.table(results["canary_stats"]))
        return finish(a, results, t0, suffix="-canary")
    if a.only == "canary-matrix":
        repeat = 1 if a.reduced else a.repeat
        section(
            results,
            "canary_matrix",
            lambda: canary_matrix.run(
                say,
                reduced=a.reduced,
                repeat=repeat,
                window=a.window,
                workers=a.workers,
                only=[c for c in a.changes.split(",") if c],
                prompts=a.prompts,
                probes=a.probes,
            ),
        )
        if "summary" in results["canary_matrix"]:
            print(canary_matrix.table(results["canary_matrix"]))
        suffix = "-canary-matrix" + ("-reduced" if a.reduced else "")
        return finish(a, results, t0, suffix=suffix)
    if a.only == "frontdoor":
        section(results, "frontdoor", lambda: frontdoor.run(a.quick, say))
        return finish(a, results, t0, suffix="-frontdoor")
    if a.no64:  # else perf() measures them with the 64-worker farm
        format_costs(results, a.quick)
    say("simulator alone (load-to-ready), and waves of 4 and 3")
    results["sim_load"] = {
        "single": simload.run(3 if a.quick else 5),
        "wave4": simload.wave(4, 2 if a.quick else 3),
        "wave3": simload.wave(3, 2 if a.quick else 3),
    }
    sl = results["sim_load"]
    sim_one = sl["single"]["spawn_to_health_s"]["median"]
    own = (
        sim_one
        + sl["wave4"]["spawn_to_all_healthy_s"]["median"]
        + sl["wave3"]["spawn_to_all_healthy_s"]["median"]
    )
    section(results, "farm8", lambda: farm8(a.quick, own))
    section(results, "reaction", lambda: reactions(a.quick, sim_one, own))
    systemd_reactions(results, a.quick)
    if not a.no64:
        perf(results, a.quick, a.baseline)
    section(results, "frontdoor", lambda: frontdoor.run(a.quick, say))
    return finish(a, results, t0)


def systemd_reactions(results: dict[str, Any], quick: bool) -> None:
    say("reaction times under systemd: a throwaway container, 4 worker units")
    section(results, "reaction_systemd", lambda: sdreaction.run(quick, say))
    why = results["reaction_systemd"].get("not_measured")
    if why:
        say(f"  not measured: {why}")


def finish(a: argparse.Namespace, results: dict[str, Any], t0: float, suffix: str = "") -> int:
    """Print the table and write the JSON."""
    results["machine"]["loadavg_end"] = os.getloadavg()
    results["duration_s"] = time.monotonic() - t0
    table = rows(results)
    results["table"] = [asdict(r) for r in table]
    md = markdown(table)
    print(md)
    out = (
        a.out
        or RESULTS
        / f"{datetime.now(UTC).strftime('%Y-%m-%d')}{'-quick' if a.quick else ''}{suffix}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    say(f"wrote {out} ({results['duration_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["mutants"]:  # mutation testing of the pure core: bench/mutants.py
        from bench import mutants

        raise SystemExit(mutants.main(sys.argv[2:]))
    if sys.argv[1:2] == ["idle"]:  # issue 32, 4.8: idle CPU at 8 and 64 workers, old and new
        from bench import idle

        raise SystemExit(idle.main(sys.argv[2:]))
    if sys.argv[1:2] == ["gateway-opinions"]:  # issue 34 §3: smg's routing opinions
        from bench import gateway_opinions

        raise SystemExit(gateway_opinions.main(sys.argv[2:]))
    if sys.argv[1:2] == ["gateway-mesh"]:  # issue 26: every gateway, or a mesh
        from bench import gateway_mesh

        raise SystemExit(gateway_mesh.main(sys.argv[2:]))
    raise SystemExit(main())
