"""I/O: reaction times under systemd: a crash and a hang of a worker unit, in the container.

One throwaway systemd container (`tests/sdcontainer.py`, booted over an overlay of
this machine's root, never the host's systemd) and one farm in it (`tests/sdfarm.py`):
the shipped units, `sglang-farm run --runtime systemd`, 4 simulator workers as
`sglang@N` units, health period 1 s x threshold 3, back-off 1 s, the bench's
simulator settings (`farmrun.sim_env`).

- crash: SIGKILL of a unit's MainPID -> the agent's `worker_exited`, systemd's own
  "Main process exited" journal record, `worker_launching`, systemd's "Started"
  record of the unit (its ExecStartPost= readiness gate passed), `worker_ready`;
- hang: SIGSTOP of every process in the unit's cgroup -> `worker_terminating kind=hang`.

Every signal is sent by a small script inside the container, which takes
`time.time()` just before `kill()`; the agent's figures are its JSON log's
`timestamp` (same kernel clock). The simulator's own load time is measured in the
container too (`simload.run`, no agent). Nothing asserts on time.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.farmrun import LOAD_S
from bench.stats import summary

if TYPE_CHECKING:
    from sdfarm import SdFarm

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"

WORKERS = 4
PERIOD_S = 1.0
THRESHOLD = 3
BACKOFF_S = 1.0
EXIT_GRACE_S = 2.0  # service.py: agent.exit_grace under the systemd runtime

# Signals pids inside the container: argv = SIGNAME MAINPID CONTROL_GROUP ("-": MainPID only).
# Prints the pids signalled and time.time() taken just before the first kill().
_SIGNAL = """\
import json, os, signal, sys, time
sig, main, cg = getattr(signal, sys.argv[1]), int(sys.argv[2]), sys.argv[3]
pids, where = [main], "MainPID"
if cg != "-":
    for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified", "/sys/fs/cgroup/systemd"):
        try:
            with open(root + cg + "/cgroup.procs") as f:
                got = [int(x) for x in f.read().split()]
        except OSError:
            continue
        if got:
            pids, where = got, root + cg
            break
t = time.time()
for p in pids:
    os.kill(p, sig)
print(json.dumps({"t": t, "pids": pids, "where": where}))
"""

# The simulator alone, in the container, as simload measures it outside.
_SIMLOAD = (
    "import json, sys; from bench import simload; print(json.dumps(simload.run(int(sys.argv[1]))))"
)


def _tests_on_path() -> None:
    """tests/sdcontainer.py and tests/sdfarm.py are plain modules on tests/, not a package."""
    if str(TESTS) not in sys.path:
        sys.path.append(str(TESTS))


def _signal(farm: SdFarm, py: str, sig: str, worker: int, *, cgroup: bool) -> dict[str, Any]:
    unit = f"sglang@{worker}.service"
    show = farm.show([unit], "MainPID,ControlGroup")[unit]
    pid = int(show.get("MainPID", "0") or 0)
    if pid <= 1:
        raise RuntimeError(f"{unit} has no main process to signal (MainPID={pid})")
    cg = show.get("ControlGroup", "") if cgroup else ""
    r = farm.c.run([py, "-c", _SIGNAL, sig, str(pid), cg or "-"])
    out: dict[str, Any] = json.loads(r.stdout)
    return out


def _event(farm: SdFarm, event: str, worker: int, after: float, timeout: float, **f: Any) -> Any:
    """The agent's first `event` for `worker` logged at or after epoch `after`."""

    def probe() -> tuple[bool, Any]:
        evs = [e for e in farm.agent_events(event, worker=worker, **f) if e["_t"] >= after]
        return bool(evs), (evs[0] if evs else None)

    return farm.wait(f"{event} of worker {worker}", probe, timeout=timeout, interval=0.1)


def _exit_record(farm: SdFarm, worker: int, after: float) -> float | None:
    """Epoch of systemd's "Main process exited" journal record for the unit, at/after `after`."""
    for e in farm.journal_json("-u", f"sglang@{worker}.service", "--since", f"@{int(after) - 1}"):
        msg = e.get("MESSAGE", "")
        if isinstance(msg, list):
            msg = bytes(msg).decode("utf-8", "replace")
        t = int(e.get("__REALTIME_TIMESTAMP", 0)) / 1e6
        if "Main process exited" in str(msg) and t >= after:
            return t
    return None


def crashes(farm: SdFarm, py: str, workers: list[int], sim_load_s: float) -> dict[str, Any]:
    """SIGKILL each unit's MainPID in turn; wait until it is ready again before the next."""
    recorded, sd_record, sd_to_agent, relaunch, ready_again = [], [], [], [], []
    launch_to_ready, unit_started_to_ready = [], []
    for w in workers:
        t_kill = _signal(farm, py, "SIGKILL", w, cgroup=False)["t"]
        exited = _event(farm, "worker_exited", w, t_kill, 30)
        launching = _event(farm, "worker_launching", w, t_kill, 60)
        ready = _event(farm, "worker_ready", w, t_kill, 60)
        recorded.append(exited["_t"] - t_kill)
        relaunch.append(launching["_t"] - t_kill)
        ready_again.append(ready["_t"] - t_kill)
        launch_to_ready.append(ready["_t"] - launching["_t"])
        started = [t for t, kind, _ in farm.unit_jobs([w]) if kind == "started" and t >= t_kill]
        if started:
            unit_started_to_ready.append(ready["_t"] - started[0])
        t_sd = _exit_record(farm, w, t_kill)
        if t_sd is not None:
            sd_record.append(t_sd - t_kill)
            sd_to_agent.append(exited["_t"] - t_sd)
        time.sleep(0.5)
    return {
        "kill_to_recorded_s": summary(recorded),
        "kill_to_systemd_exit_record_s": summary(sd_record),
        "systemd_exit_record_to_recorded_s": summary(sd_to_agent),
        "kill_to_relaunch_s": summary(relaunch),
        "kill_to_ready_s": summary(ready_again),
        "launch_to_ready_s": summary(launch_to_ready),
        "launch_to_ready_minus_sim_load_s": summary([r - sim_load_s for r in launch_to_ready]),
        "unit_started_to_ready_s": summary(unit_started_to_ready),
        "ready_minus_sim_load_s": summary([r - sim_load_s for r in ready_again]),
        "ready_minus_sim_load_minus_backoff_s": summary(
            [r - sim_load_s - BACKOFF_S for r in ready_again]
        ),
        "backoff_initial_s": BACKOFF_S,
        "sim_load_s": sim_load_s,
        "exit_grace_s": EXIT_GRACE_S,
    }


def hangs(farm: SdFarm, py: str, workers: list[int]) -> dict[str, Any]:
    """SIGSTOP every process of each unit's cgroup; time until the agent issues the hang restart."""
    issued, signalled = [], []
    for w in workers:
        sent = _signal(farm, py, "SIGSTOP", w, cgroup=True)
        signalled.append({"worker": w, "pids": sent["pids"], "where": sent["where"]})
        try:
            term = _event(
                farm, "worker_terminating", w, sent["t"], THRESHOLD * PERIOD_S + 30, kind="hang"
            )
            issued.append(term["_t"] - sent["t"])
            _event(farm, "worker_ready", w, term["_t"], 60)
        finally:
            # systemd sends SIGCONT after its stop signal; this covers a missed restart.
            farm.c.run(["systemctl", "kill", "-s", "SIGCONT", f"sglang@{w}.service"], check=False)
        time.sleep(0.5)
    return {
        "stop_to_restart_issued_s": summary(issued),
        "threshold_x_period_s": THRESHOLD * PERIOD_S,
        "target_s": (THRESHOLD + 1) * PERIOD_S,
        "period_s": PERIOD_S,
        "failure_threshold": THRESHOLD,
        "signalled": signalled,
    }


def _all(states: dict[int, str], want: str) -> tuple[bool, dict[int, str]]:
    return all(s == want for s in states.values()), states


def run(quick: bool = False, say: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Boot the container, start the farm, measure; {"not_measured": why} when it cannot."""
    t0 = time.monotonic()
    tell = say or (lambda _msg: None)
    _tests_on_path()
    try:
        import sdcontainer as sdc
        import sdfarm as sdf
    except ImportError as exc:  # pytest (a dev dependency) missing, or the tests/ folder
        return {"not_measured": f"the systemd container harness (tests/) cannot load: {exc}"}
    reason = sdc.skip_reason()
    if reason is not None:
        return {"not_measured": reason}
    py = sdc.VENV_PYTHON
    out: dict[str, Any] = {"workers": WORKERS, "period_s": PERIOD_S, "failure_threshold": THRESHOLD}
    try:
        c = sdc.SystemdContainer()
        c.__enter__()
    except sdc.ContainerError as exc:
        return {"not_measured": f"the systemd container did not boot: {str(exc).splitlines()[0]}"}
    try:
        out["container_boot_s"] = c.boot_seconds
        tell(f"  systemd container {c.name} booted in {c.boot_seconds:.2f} s; simulator alone")
        sim = c.run([py, "-c", _SIMLOAD, "3" if quick else "5"], env={"PYTHONPATH": str(REPO)})
        out["sim_load"] = json.loads(sim.stdout)
        sim_load_s = out["sim_load"]["spawn_to_health_s"]["median"]
        toml = sdf.farm_toml(
            workers=WORKERS,
            canary=0,
            parallel=WORKERS,
            load_seconds=LOAD_S,
            period=PERIOD_S,
            threshold=THRESHOLD,
            backoff_initial=BACKOFF_S,
            max_failures=10,
        )
        sdf.install_farm(c, toml)
        farm = sdf.SdFarm(c)
        ids = range(WORKERS)
        t_start = time.time()
        c.run(["systemctl", "start", sdf.AGENT], timeout=90)
        farm.wait("every worker unit active", lambda: _all(farm.states(ids), "active"), 90)
        farm.wait(
            "the agent sees every worker ready",
            lambda: _all({n: w["state"] for n, w in farm.status().items()}, "ready"),
            30,
        )
        done = [e for e in farm.agent_events("rollout_done") if e["_t"] >= t_start]
        out["start_to_rollout_done_s"] = done[0]["_t"] - t_start if done else None
        time.sleep(1.0)
        tell("  systemd: crashes")
        out["crash"] = crashes(farm, py, [0, 1] if quick else [0, 1, 2, 3], sim_load_s)
        tell("  systemd: hangs")
        out["hang"] = hangs(farm, py, [3] if quick else [3, 2, 1])
        out["restarts"] = {n: w["restarts_by_reason"] for n, w in farm.status().items()}
    finally:
        with contextlib.suppress(Exception):
            c.run(["systemctl", "stop", sdf.TARGET], check=False, timeout=30)
        c.close()
    out["duration_s"] = time.monotonic() - t0
    return out
