"""End to end under a real systemd: `systemctl start sglang-farm`, workers as `sglang@N` units.

One throwaway container (tests/sdcontainer.py) for the whole module; the tests run
in order and share one farm, each leaving it in a known state for the next:
6 simulator workers (canary 0, parallel 2, a model load of 1.5 s), health period
0.5 s / threshold 3, back-off 0.5 s doubling, crash-loop limit 3. The agent runs
as the shipped `sglang-farm.service` (Type=notify, Restart=always) with its
ExecStart= pointed at this venv's `sglang-farm run --runtime systemd`.

What is asserted comes from systemd itself (MainPID, ActiveState, StatusText, the
journal's "Starting"/"Started" records of each unit), from the agent's own JSON
events in its journal, and from `farmctl --json`.

The farm is stopped with `systemctl stop sglang-farm.target`: the agent and every
worker are PartOf= the target (stopping only sglang-farm.service leaves the workers
serving, on purpose: that is how the agent is restarted or upgraded).
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from sdcontainer import SystemdContainer
from sdfarm import (
    AGENT,
    BASE_PORT,
    CONFIG,
    GATEWAY,
    TARGET,
    SdFarm,
    farm_toml,
    gateway_toml,
    http_get,
    install_farm,
    open_test_venv_to_dynamic_users,
    unit,
)

pytestmark = [pytest.mark.systemd, pytest.mark.slow]

N = 6
IDS = range(N)
CANARY, PARALLEL = 0, 2
PERIOD, THRESHOLD = 0.5, 3
BACKOFF, MAX_FAILURES = 0.5, 3
TICK = 0.25  # the agent's tick (agent.TICK_S): back-off ends are seen at most this late
# The 2-core CI machine runs 6 simulators, the agent and the tests at once.
MARGIN = 3.0

T_MODULE = time.monotonic()


def log(msg: str) -> None:
    print(msg, file=sys.stderr)


@pytest.fixture(scope="module")
def farm(sd_container: SystemdContainer) -> Iterator[SdFarm]:
    """The farm installed (not started); the module's wall time is printed at the end."""
    t0 = time.monotonic()
    install_farm(sd_container, farm_toml(workers=N, canary=CANARY, parallel=PARALLEL))
    yield SdFarm(sd_container)
    log(f"test_systemd_farm: {time.monotonic() - t0:.1f} s with the farm installed")


def _all(states: dict[int, str], want: str, ids: Any = IDS) -> bool:
    return all(states[n] == want for n in ids)


def _intervals(
    marks: list[tuple[float, str, int]], begin: str, end: set[str]
) -> dict[int, list[tuple[float, float]]]:
    """Per worker, (begin, end) spans from time-ordered (t, kind, worker) marks."""
    out: dict[int, list[tuple[float, float]]] = {}
    open_: dict[int, float] = {}
    for t, kind, w in sorted(marks):
        if kind == begin:
            open_[w] = t
        elif kind in end and w in open_:
            out.setdefault(w, []).append((open_.pop(w), t))
    for w, t in open_.items():
        out.setdefault(w, []).append((t, float("inf")))
    return out


def _max_overlap(spans: dict[int, list[tuple[float, float]]]) -> tuple[int, float]:
    flat = [s for ss in spans.values() for s in ss]
    best = (0, 0.0)
    for t, _ in flat:
        n = sum(1 for a, b in flat if a <= t < b)
        best = max(best, (n, t))
    return best


def _agent_marks(farm: SdFarm, pid: int | None = None) -> list[tuple[float, str, int]]:
    marks = []
    for ev in farm.agent_events():
        if ev["event"] in ("worker_launching", "worker_ready", "worker_exited") and (
            pid is None or ev["_pid"] == pid
        ):
            marks.append((ev["_t"], ev["event"], ev["worker"]))
    return marks


# -- bring-up ------------------------------------------------------------------------


def test_systemctl_start_brings_all_workers_up_and_status_shows_them(
    farm: SdFarm, sd: SystemdContainer
) -> None:
    t0 = time.monotonic()
    # Type=notify: returns at READY=1, once the rollout has begun.
    farm.c.run(["systemctl", "start", AGENT], timeout=90)
    seen: dict[int, list[str]] = {n: [] for n in IDS}

    def all_active() -> tuple[bool, dict[int, str]]:
        states = farm.states(IDS)
        for n, s in states.items():
            if not seen[n] or seen[n][-1] != s:
                seen[n].append(s)
        return _all(states, "active"), states

    farm.wait("every worker active", all_active, timeout=90, interval=0.05)
    log(f"all {N} workers active {time.monotonic() - t0:.1f} s after systemctl start")
    # Each worker was `activating` while it loaded and turned `active` when ready.
    for n in IDS:
        assert "activating" in seen[n], (n, seen[n])
        assert seen[n][-2:] == ["activating", "active"], (n, seen[n])
    # STATUS= is kept current: `systemctl status sglang-farm` shows it.
    farm.wait(
        "STATUS=6/6 ready",
        lambda: ((t := farm.status_text()) == f"{N}/{N} ready", t),
        timeout=10,
    )
    shown = farm.c.run(["systemctl", "status", "--no-pager", AGENT], check=False).stdout
    assert f'Status: "{N}/{N} ready"' in shown, shown
    st = farm.status()
    assert [st[n]["state"] for n in IDS] == ["ready"] * N
    pids = farm.main_pids(IDS)
    assert [st[n]["pid"] for n in IDS] == [pids[n] for n in IDS]
    assert all(farm.health(IDS)[n] == 200 for n in IDS)


def test_canary_ready_before_others_and_waves_within_parallel_per_agent(farm: SdFarm) -> None:
    spans = _intervals(_agent_marks(farm), "worker_launching", {"worker_ready", "worker_exited"})
    assert sorted(spans) == list(IDS)
    canary_ready = spans[CANARY][0][1]
    others = [spans[n][0][0] for n in IDS if n != CANARY]
    assert canary_ready < min(others), (canary_ready, others)
    most, at = _max_overlap(spans)
    log(
        f"agent's view: canary ready {min(others) - canary_ready:+.3f} s before the next launch;"
        f" at most {most} loading at once"
    )
    assert most <= PARALLEL, f"{most} workers loading at once at {at}"


def test_canary_ready_before_others_and_waves_within_parallel_per_systemd(farm: SdFarm) -> None:
    # systemd's own journal: "Starting" when the start job begins, "Started" when the
    # ExecStartPost= readiness gate passed (activating -> active).
    jobs = farm.unit_jobs(IDS)
    spans = _intervals(jobs, "starting", {"started"})
    assert sorted(spans) == list(IDS)
    canary_active = spans[CANARY][0][1]
    first_other = min(spans[n][0][0] for n in IDS if n != CANARY)
    most, at = _max_overlap(spans)
    log(
        f"systemd's view: sglang@{CANARY} active {first_other - canary_active:+.3f} s before"
        f" the next unit started; at most {most} activating at once"
    )
    assert canary_active < first_other, (
        f"sglang@{CANARY} became active at {canary_active:.3f}, after another unit began "
        f"starting at {first_other:.3f}: {jobs}"
    )
    assert most <= PARALLEL, f"{most} units activating at once at {at}: {jobs}"


# -- one worker ------------------------------------------------------------------------


def test_farmctl_restart_restarts_only_that_unit_activating_then_active(farm: SdFarm) -> None:
    before = farm.main_pids(IDS)
    farm.farmctl("restart", "3", "--no-wait")
    seen: list[tuple[str, int]] = []

    def new_pid_active() -> tuple[bool, list[tuple[str, int]]]:
        state, pid = farm.states([3])[3], farm.main_pids([3])[3]
        if not seen or seen[-1] != (state, pid):
            seen.append((state, pid))
        return state == "active" and pid not in (0, before[3]), seen

    farm.wait("sglang@3 active with a new MainPID", new_pid_active, timeout=30, interval=0.05)
    new = seen[-1][1]
    # While the new process loaded the unit was `activating`; once ready, `active`.
    assert ("activating", new) in seen, seen
    assert farm.health([3])[3] == 200
    after = farm.main_pids(IDS)
    assert {n: after[n] for n in IDS if n != 3} == {n: before[n] for n in IDS if n != 3}
    farm.wait("agent sees worker 3 ready", lambda: ((s := farm.status()[3])["state"] == "ready", s))
    assert farm.status()[3]["restarts_by_reason"] == {"manual": 1}


def test_sigkilled_worker_comes_back_with_reason_crash(farm: SdFarm) -> None:
    before = farm.main_pids(IDS)
    farm.kill(before[1], "KILL")

    def back() -> tuple[bool, tuple[str, int]]:
        state, pid = farm.states([1])[1], farm.main_pids([1])[1]
        return state == "active" and pid not in (0, before[1]), (state, pid)

    farm.wait("sglang@1 active again with a new MainPID", back, timeout=30)
    w = farm.wait(
        "agent sees worker 1 ready again",
        lambda: ((s := farm.status()[1])["state"] == "ready", s),
    )
    assert w["restarts_by_reason"] == {"crash": 1}
    assert w["last_failure"]["kind"] == "crash"
    assert "signal 9" in w["last_failure"]["summary"]
    exited = farm.agent_events("worker_exited", worker=1)
    assert exited[-1]["status"] == -9
    after = farm.main_pids(IDS)
    assert {n: after[n] for n in IDS if n != 1} == {n: before[n] for n in IDS if n != 1}


def test_repeated_crashes_back_off_then_worker_failed_others_untouched(farm: SdFarm) -> None:
    victim = 4
    others = [n for n in IDS if n != victim]
    before = farm.main_pids(IDS)
    pid = before[victim]
    for i in range(MAX_FAILURES + 1):
        farm.kill(pid, "KILL")
        if i == MAX_FAILURES:
            break

        def relaunched(old: int = pid) -> tuple[bool, tuple[str, int]]:
            state, p = farm.states([victim])[victim], farm.main_pids([victim])[victim]
            return state == "active" and p not in (0, old), (state, p)

        pid = farm.wait(f"sglang@{victim} back after crash {i + 1}", relaunched, timeout=30)[1]

    w = farm.wait(
        f"worker {victim} failed",
        lambda: ((s := farm.status()[victim])["state"] == "failed", s["state"]),
        timeout=20,
    )
    assert w == "failed"
    assert farm.states([victim])[victim] in ("failed", "inactive")
    # Back-off: the delay between an exit and the next launch doubles each time.
    events = [
        e
        for e in farm.agent_events()
        if e.get("worker") == victim and e["event"] in ("worker_exited", "worker_launching")
    ]
    gaps = [
        b["_t"] - a["_t"]
        for a, b in itertools.pairwise(events)
        if a["event"] == "worker_exited" and b["event"] == "worker_launching"
    ]
    log(f"back-off gaps of worker {victim}: {[round(g, 2) for g in gaps]}")
    assert len(gaps) == MAX_FAILURES, gaps
    for k, gap in enumerate(gaps):
        want = BACKOFF * 2**k
        assert want - 0.05 <= gap <= want + TICK + MARGIN, (k, gaps)
    assert farm.agent_events("worker_gave_up", worker=victim)
    why = farm.farmctl("why", str(victim)).stdout
    assert "gave up" in why and "crash" in why, why
    st = farm.status()[victim]
    assert st["restarts_by_reason"] == {"crash": MAX_FAILURES}
    # Nobody else was touched.
    after = farm.main_pids(IDS)
    assert {n: after[n] for n in others} == {n: before[n] for n in others}
    assert _all(farm.states(others), "active", others)
    farm.wait(
        "STATUS shows the failed worker",
        lambda: ((t := farm.status_text()) == f"{N - 1}/{N} ready, 1 failed", t),
        timeout=10,
    )


def test_sigstopped_worker_is_restarted_for_hang(farm: SdFarm) -> None:
    victim = 2
    before = farm.main_pids(IDS)
    t_stop = time.time()
    farm.kill(before[victim], "STOP")
    try:
        term = farm.wait(
            "worker_terminating (hang)",
            lambda: (
                bool(ev := farm.agent_events("worker_terminating", worker=victim, kind="hang")),
                ev,
            ),
            timeout=20,
            interval=0.2,
        )[-1]
    finally:
        # Never leave a stopped process behind if the agent did not act.
        farm.c.run(["kill", "-CONT", str(before[victim])], check=False)
    detected = term["_t"] - t_stop
    bound = THRESHOLD * PERIOD + PERIOD
    log(f"hang of worker {victim} detected {detected:.2f} s after SIGSTOP (bound {bound:g} s)")
    assert (THRESHOLD - 1) * PERIOD * 0.9 <= detected <= bound + MARGIN

    def back() -> tuple[bool, tuple[str, int]]:
        state, pid = farm.states([victim])[victim], farm.main_pids([victim])[victim]
        return state == "active" and pid not in (0, before[victim]), (state, pid)

    farm.wait(f"sglang@{victim} active with a new MainPID", back, timeout=30)
    log(f"worker {victim} serving again {time.time() - t_stop:.2f} s after SIGSTOP")
    w = farm.wait(
        f"agent sees worker {victim} ready",
        lambda: ((s := farm.status()[victim])["state"] == "ready", s),
    )
    assert w["restarts_by_reason"] == {"hang": 1}
    assert w["last_failure"]["kind"] == "hang"
    others = [n for n in IDS if n not in (victim, 4)]
    after = farm.main_pids(IDS)
    assert {n: after[n] for n in others} == {n: before[n] for n in others}


# -- the agent -----------------------------------------------------------------------


def test_sigkilled_agent_is_restarted_and_adopts_workers_without_restarting_any(
    farm: SdFarm,
) -> None:
    serving = [n for n in IDS if n != 4]  # 4 gave up after its crash loop
    before_status = farm.status()
    before_pids = farm.main_pids(IDS)
    old_agent = farm.agent_pid()
    farm.kill(old_agent, "KILL")
    # While no agent runs, every worker keeps serving.
    health_seen: list[dict[int, Any]] = []

    def agent_back() -> tuple[bool, int]:
        health_seen.append(farm.health(serving))
        pid = farm.agent_pid()
        return pid not in (0, old_agent) and farm.is_active(AGENT) == "active", pid

    new_agent = farm.wait("a new agent (Restart=always)", agent_back, timeout=30, interval=0.2)
    assert all(h == dict.fromkeys(serving, 200) for h in health_seen), health_seen

    def adopted_ready() -> tuple[bool, dict[int, str]]:
        states = {n: s["state"] for n, s in farm.status().items()}
        return all(states[n] == "ready" for n in serving), states

    farm.wait("the new agent sees the adopted workers ready", adopted_ready, timeout=20)
    adopted = farm.agent_events("worker_adopted")
    assert sorted(e["worker"] for e in adopted if e["_pid"] == new_agent) == serving
    # Not one worker was restarted: same MainPIDs, and the new agent launched nothing.
    time.sleep(1.0)
    after_pids = farm.main_pids(IDS)
    assert {n: after_pids[n] for n in serving} == {n: before_pids[n] for n in serving}
    launched = [e for e in farm.agent_events("worker_launching") if e["_pid"] == new_agent]
    assert launched == []
    # What it must not forget came back from /var/lib/sglang-farm.
    after_status = farm.status()
    for n in IDS:
        assert after_status[n]["restarts_by_reason"] == before_status[n]["restarts_by_reason"], n
        assert [r["reason"] for r in after_status[n]["restarts"]] == [
            r["reason"] for r in before_status[n]["restarts"]
        ], n
        assert (after_status[n]["last_failure"] or {}).get("kind") == (
            before_status[n]["last_failure"] or {}
        ).get("kind"), n
    # The crash-looped worker stays failed: a new agent does not start it again.
    assert after_status[4]["state"] == "failed"
    assert farm.status_text() == f"{N - 1}/{N} ready, 1 failed"


def test_farmctl_stop_all_then_start_all(farm: SdFarm) -> None:
    farm.farmctl("stop", "all", timeout=60)
    states = farm.states(IDS)
    assert all(s in ("inactive", "failed") for s in states.values()), states
    assert farm.c.run(["pgrep", "-f", "sglang_farm.sim"], check=False).stdout == ""
    assert [s["state"] for s in farm.status().values()] == ["stopped"] * N
    farm.farmctl("start", "all")
    farm.wait(
        "every worker active after start all",
        lambda: (_all(st := farm.states(IDS), "active"), st),
        timeout=60,
    )
    farm.wait(
        "STATUS=6/6 ready again",
        lambda: ((t := farm.status_text()) == f"{N}/{N} ready", t),
        timeout=15,
    )


def test_cuda_oom_worker_is_reported_as_such(farm: SdFarm) -> None:
    victim = 5
    toml = farm_toml(
        workers=N,
        canary=CANARY,
        parallel=PARALLEL,
        worker_env={victim: {"SGLANG_SIM_FAIL": "cuda_oom"}},
    )
    farm.c.write_file(CONFIG, toml)
    res = farm.farmctl("--json", "reload", "--no-wait")
    assert res["restarted"] == [victim], res
    w = farm.wait(
        f"worker {victim}'s CUDA OOM recorded",
        lambda: (
            ((s := farm.status()[victim])["last_failure"] or {}).get("kind") == "cuda_oom_load",
            s,
        ),
        timeout=30,
    )
    assert w["oom_events_by_kind"].get("cuda", 0) >= 1, w
    # The override reaches the worker through the root-only EnvironmentFile= the agent
    # wrote (docs/security.md); the world-readable drop-in only names it.
    dropin = farm.c.run(["systemctl", "cat", unit(victim)]).stdout
    assert "SGLANG_SIM_FAIL" in dropin and "cuda_oom" not in dropin, dropin
    env_file = f"/var/lib/sglang-farm/credentials/sglang@{victim}.env"
    assert 'SGLANG_SIM_FAIL="cuda_oom"' in farm.c.run(["cat", env_file]).stdout
    mode = farm.c.run(["stat", "-c", "%a %U", env_file]).stdout.split()
    assert mode == ["600", "root"], mode
    why = farm.farmctl("why", str(victim)).stdout
    assert "cuda_oom" in why and "out of memory" in why.lower(), why
    # The classifier quoted the journal's own lines.
    assert any("CUDA out of memory" in ln for ln in w["last_failure"]["lines"]), w


def test_worker_dying_while_loading_is_started_again_after_backoff(farm: SdFarm) -> None:
    # Worker 5 (SGLANG_SIM_FAIL=cuda_oom since the reload) dies during every load, while
    # its unit's ExecStartPost= gate still waits: the next launch must be a new process.
    victim = 5
    first = farm.main_pids([victim])[victim]

    def failed_twice() -> tuple[bool, dict[str, Any]]:
        s = farm.status()[victim]
        return s["oom_events_by_kind"].get("cuda", 0) >= 2 or s["state"] == "failed", s

    w = farm.wait(f"worker {victim} relaunched and failing again", failed_twice, timeout=20)
    assert w["oom_events_by_kind"].get("cuda", 0) >= 2, (w, farm.agent_log_tail(80))
    assert w["restarts_by_reason"].get("oom", 0) >= 1, w
    starts = [j for j in farm.unit_jobs([victim]) if j[1] == "starting"]
    log(f"sglang@{victim}: {len(starts)} start jobs; MainPID {first} at the first check")


# -- the end ---------------------------------------------------------------------------


def test_stopping_the_target_leaves_no_process_and_no_port(farm: SdFarm) -> None:
    farm.c.run(["systemctl", "stop", TARGET], timeout=60)
    names = [AGENT, *(unit(n) for n in IDS)]

    def all_down() -> tuple[bool, dict[str, str]]:
        got = farm.show(names, "ActiveState")
        states = {k: v.get("ActiveState", "?") for k, v in got.items()}
        return all(s in ("inactive", "failed") for s in states.values()), states

    farm.wait("agent and workers down", all_down, timeout=30)
    procs = farm.c.run(["pgrep", "-af", "sglang"], check=False).stdout
    assert procs == "", procs
    listening = farm.c.run(["ss", "-Htln"]).stdout
    ports = {BASE_PORT + n for n in IDS}
    busy = [ln for ln in listening.splitlines() if any(f":{p} " in ln for p in ports)]
    assert busy == [], listening


# -- the managed gateway (a farm of its own, after the one above stopped) --------------

GW_IDS = range(2)
GW_LISTEN = "127.0.0.1:8000"
ADMIN_KEY_FILE = "/etc/sglang-farm/gateway-admin.key"


def _gateway_members(farm: SdFarm, key: str) -> tuple[int | str, dict[str, str]]:
    """(HTTP status, {worker URL: smg's status}) of the gateway's GET /workers."""
    status, body = http_get(farm.c, f"http://{GW_LISTEN}/workers", key=key)
    if status != 200 or not isinstance(body, dict):
        return status, {}
    return status, {w["url"].rstrip("/"): w["status"] for w in body["workers"]}


def test_managed_gateway_unit_follows_readiness_drains_before_sigterm_outlives_agent(
    farm: SdFarm, sd: SystemdContainer
) -> None:
    t0 = time.monotonic()
    c = farm.c
    key = os.urandom(16).hex()
    # docs/install.md's step: a root-only key file, then [gateway] in farm.toml.
    c.sh(f"install -m 600 /dev/null {ADMIN_KEY_FILE} && printf %s {key} > {ADMIN_KEY_FILE}")
    c.write_file(
        CONFIG,
        farm_toml(workers=len(GW_IDS), canary=0, parallel=2)
        + gateway_toml(listen=GW_LISTEN, admin_key_file=ADMIN_KEY_FILE),
    )
    c.run(["rm", "-f", "/var/lib/sglang-farm/state.json"])  # a new farm, not the one above
    # The gateway's DynamicUser= must reach this venv's interpreter (it has smg).
    open_test_venv_to_dynamic_users(c)
    c.run(["systemctl", "start", AGENT], timeout=90)
    farm.wait(f"{GATEWAY} active", lambda: ((s := farm.is_active(GATEWAY)) == "active", s))
    urls = {n: f"http://127.0.0.1:{BASE_PORT + n}" for n in GW_IDS}

    def members_are(want: dict[str, str]) -> tuple[bool, object]:
        status, got = _gateway_members(farm, key)
        return status == 200 and got == want, (status, got)

    farm.wait(
        "every worker ready in the gateway",
        lambda: members_are({u: "ready" for u in urls.values()}),
        timeout=45,
        interval=0.2,
    )
    log(f"gateway: both workers routed {time.monotonic() - t0:.1f} s after systemctl start")

    # A planned stop: out of the gateway first, then the stop (SIGTERM) systemd sends.
    t_stop = time.time()
    farm.farmctl("stop", "1", timeout=60)
    status, after_stop = _gateway_members(farm, key)
    assert status == 200 and after_stop.get(urls[1]) in (None, "draining"), after_stop
    assert after_stop.get(urls[0]) == "ready", after_stop
    removed = [e["_t"] for e in farm.agent_events("gateway_removed", worker=1) if e["_t"] >= t_stop]
    stopping = [t for t, kind, w in farm.unit_jobs([1]) if kind == "stopping" and t >= t_stop]
    assert removed and stopping, (removed, stopping)
    log(f"gateway: worker 1 removed {stopping[0] - removed[0]:.3f} s before systemd stopped it")
    assert removed[0] < stopping[0], (removed, stopping)

    # The agent restarts; the gateway unit does not, and the new agent keeps its members.
    gw_pid = farm.show([GATEWAY], "MainPID")[GATEWAY]["MainPID"]
    old_agent = farm.agent_pid()
    c.run(["systemctl", "restart", AGENT], timeout=90)
    assert farm.agent_pid() not in (0, old_agent)
    farm.wait(
        "worker 0 ready for the new agent", lambda: ((s := farm.status()[0])["state"] == "ready", s)
    )
    assert farm.is_active(GATEWAY) == "active"
    assert farm.show([GATEWAY], "MainPID")[GATEWAY]["MainPID"] == gw_pid
    farm.wait("worker 0 still in the gateway", lambda: members_are({urls[0]: "ready"}))
    # ...and adds a worker once it is ready again.
    farm.farmctl("start", "1")
    farm.wait(
        "worker 1 back in the gateway",
        lambda: members_are({u: "ready" for u in urls.values()}),
        timeout=30,
        interval=0.2,
    )

    # Stopping the farm's target stops the gateway too (PartOf=).
    c.run(["systemctl", "stop", TARGET], timeout=60)
    farm.wait(
        f"{GATEWAY} stopped with the target",
        lambda: ((s := farm.is_active(GATEWAY)) in ("inactive", "failed"), s),
        timeout=30,
    )
    took = time.monotonic() - t0
    log(f"test_managed_gateway...: {took:.1f} s")
    assert took < 90, took
    log(f"test_systemd_farm module: {time.monotonic() - T_MODULE:.1f} s since import")
