"""Issue 31, items 5 to 8: what the farm says is true and readable (each test failed first).

"Ready" means what users get (the rollout's end and `status`'s header, with a gateway:
ready and routed, or which are not yet); the smaller untruths (endpoints while drained,
`farmctl wait`'s repeated line, check-config's systemd warning on the demo, smg's polls in
the workers' logs, the simulator's OOM text and VRAM); a log a person reads whether or
not it goes to a terminal; and farmctl's hint without `--config`.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import structlog
from structlog.testing import capture_logs

from agent_harness import GATEWAY, farm, farm_toml, urls
from fake_gateway import FakeGateway
from sglang_farm import logsetup
from sglang_farm.workers.supervisor import Rollout
from virtual_time import run_virtual

REPO = Path(__file__).resolve().parent.parent


# ---- item 5: "ready" that users get --------------------------------------------------------


def test_the_rollouts_end_is_said_once_the_gateway_routes_every_worker(tmp: Path) -> None:
    """`rollout_done … 8/8 ready` came before the last wave's `gateway_member` lines (smg
    lists a worker ~3 s after its add): said once users get all eight, and saying so."""
    gw = FakeGateway()
    gw.delay = 3.0  # every call takes 3 s, as smg's queued add

    async def scenario() -> None:
        async with farm(tmp, text=farm_toml(tmp, gateway=GATEWAY), gateway=gw) as f:
            await f.until(lambda: f.gateway.routed() == urls(range(8)), within=120)
            await asyncio.sleep(5)

    with capture_logs() as logs:
        run_virtual(scenario())
    events = [e["event"] for e in logs]
    (done,) = [e for e in logs if e["event"] == "rollout_done"]
    last_member = max(i for i, e in enumerate(events) if e == "gateway_member")
    assert events.index("rollout_done") > last_member, events
    assert events.count("gateway_member") == 8
    assert done["summary"].startswith(f"{done['farm']}: 8/8 ready and routed · front door")
    assert done["not_routed"] == []


def test_the_rollouts_end_names_the_workers_the_gateway_does_not_route(tmp: Path) -> None:
    """A gateway that refuses worker 6: the rollout's end does not say "8/8" as if users
    got them all; it says which one the gateway does not route."""
    gw = FakeGateway()
    gw.fail_add.add("http://127.0.0.1:30006")

    async def scenario() -> None:
        async with farm(tmp, text=farm_toml(tmp, gateway=GATEWAY), gateway=gw) as f:
            await f.until(lambda: f.agent.view().ready_count == 8, within=120)
            await asyncio.sleep(60)

    with capture_logs() as logs:
        run_virtual(scenario())
    (done,) = [e for e in logs if e["event"] == "rollout_done"]
    assert done["not_routed"] == [6]
    assert "8/8 ready, the gateway does not route worker 6 yet · front door" in done["summary"]


def _status(states: dict[int, tuple[str, bool]], **more: object) -> dict[str, object]:
    """A `status` result: worker id -> (state, in the gateway)."""
    ready = [w for w, (state, _) in states.items() if state == "ready"]
    return {
        "farm": "demo",
        "runtime": "process",
        "rollout": "done",
        "now": 1000.0,
        "ready": len(ready),
        "ready_workers": ready,
        "workers": [
            {"id": w, "gpus": [w], "port": 30000 + w, "state": s, "since": 990.0, "in_gateway": i}
            for w, (s, i) in states.items()
        ],
        "gateway": {"url": "http://127.0.0.1:8000", "up": True, "members": 0},
        **more,
    }


def test_the_status_header_says_what_users_get_and_names_who_is_not_ready() -> None:
    """After a `kill -9`, `status` said `8/8 ready` while the gateway routed 7 of 8; and
    `7/8 ready` did not name the failed worker."""
    from sglang_farm.cli.ctl.status import format_status

    def head(st: dict[str, object]) -> str:
        return format_status(st).splitlines()[0]

    every = {w: ("ready", True) for w in range(8)}
    assert head(_status(every)).endswith(" · 8/8 ready and routed")
    back = every | {5: ("ready", False)}  # ready again, not yet listed by the gateway
    assert head(_status(back)).endswith(" · 8/8 ready, the gateway does not route worker 5")
    failed = every | {5: ("failed", False), 6: ("starting", False), 7: ("failed", False)}
    assert head(_status(failed)).endswith(
        " · 5/8 ready (workers 5, 7 failed; worker 6 starting) and routed"
    )
    starting = _status({w: ("starting", False) for w in range(64)}, gateway=None)
    assert head(starting).endswith(
        " · 0/64 ready (workers 0, 1, 2, 3, 4, 5, 6, 7 and 56 more starting)"
    )
    no_gateway = _status({0: ("ready", False), 1: ("backoff", False)}, gateway=None)
    assert head(no_gateway).endswith(" · 1/2 ready (worker 1 backoff)")
    drained = _status({w: ("ready", False) for w in range(2)}, held_out_since=900.0)
    assert " · 2/2 ready · host DRAINED" in head(drained)


# ---- item 6: smaller untruths --------------------------------------------------------------


def test_endpoints_lists_no_worker_while_the_host_is_drained() -> None:
    """`farmctl endpoints` listed every worker while drain-host held the host out: a
    router fed it sent users to a host drained for its reboot."""
    from fake_ops import FakeOps
    from ops_socket import GATEWAY, serving

    with serving(FakeOps(4, gateway=GATEWAY)) as a:
        assert a.run("endpoints").stdout.count("\n") == 4
        assert a.run("drain-host").exit_code == 0
        r = a.run("endpoints")
        assert r.exit_code == 0 and r.stdout == ""
        assert "the host is drained (farmctl drain-host)" in r.stderr
        assert json.loads(a.run("--json", "endpoints").stdout)["endpoints"] == []
        assert a.run("undrain-host").exit_code == 0
        assert a.run("endpoints").stdout.count("\n") == 4


def test_wait_names_the_workers_a_gateway_does_not_route_in_one_line() -> None:
    """After undrain-host, `farmctl wait` printed one line repeating `worker N is ready;
    the gateway … does not route it` once per worker: one line, naming them."""
    from dataclasses import replace

    from fake_ops import FakeOps
    from ops_socket import GATEWAY, serving
    from sglang_farm.cli.ctl.exits import Exit

    with serving(FakeOps(4, gateway=GATEWAY)) as a:
        a.ops.gateway = replace(GATEWAY, routed=(0,), gateways=(replace(GATEWAY, routed=(0,)),))
        r = a.run("wait", "--timeout", "0.2")
    assert r.exit_code == Exit.TIMED_OUT, r.output
    line = f"workers 1, 2, 3 are ready; the gateway at {GATEWAY.url} does not route them"
    assert r.output.count("does not route") == 2, r.output  # "waiting:" and the timeout
    assert f"waiting: {line}\n" in r.output
    assert f"waiting for {line};" in r.output
    with serving(FakeOps(4, gateway=GATEWAY)) as a:  # no gateway said: not confirmed in yet
        for w in (1, 3):
            a.ops.workers[w] = replace(a.ops.workers[w], in_gateway=False)
        r = a.run("wait", "--timeout", "0.2")
    assert "waiting: workers 1, 3 are ready, not yet in the gateway\n" in r.output, r.output


def test_check_config_on_the_demo_warns_of_nothing_the_demo_does_not_do() -> None:
    """`check-config` on the demo warned that the `sglang-farm` group is missing "under
    systemd", while the demo runs plain processes as root: its config names a group
    every host has, and no warning is left."""
    r = subprocess.run(
        [
            str(REPO / ".venv/bin/sglang-farm"),
            "check-config",
            "--config",
            "etc/sglang-farm/demo.toml",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    assert r.stdout.startswith("etc/sglang-farm/demo.toml: OK, 8 workers")


def test_the_demo_workers_logs_hold_no_line_for_the_gateways_load_polls() -> None:
    """`farmctl logs 3` on the demo showed smg's `GET /loads?model=… 404` (smg 1.13 asks
    for /loads and /v1/loads; SGLang 0.5.23 serves only the second): with the demo's own
    flags, neither leaves a line, and a user's request still does."""
    import tomllib

    import httpx

    from simproc import Sim

    demo = tomllib.loads((REPO / "etc/sglang-farm/demo.toml").read_text())
    prefixes = demo["sglang"]["uvicorn_access_log_exclude_prefixes"]
    sim = Sim("--uvicorn-access-log-exclude-prefixes", *prefixes)
    try:
        sim.wait_ready()
        with httpx.Client(base_url=sim.url, timeout=30) as c:
            assert c.get("/loads", params={"model": "sim/Qwen3.6-27B"}).status_code == 404
            loads = c.get("/v1/loads", params={"include": "core,disagg,queues,memory"})
            assert loads.status_code == 200
            assert c.get("/v1/models").status_code == 200  # a user's
        sim.wait_log('"GET /v1/models HTTP/1.1" 200')
        assert "loads" not in sim.log.split("ready to roll!", 1)[1]
    finally:
        sim.close()


def test_the_simulated_oom_figures_fit_the_gpu_they_name() -> None:
    """The simulated OOM said `Tried to allocate 372.53 GiB` on a 139.80 GiB GPU with
    139.29 GiB free: the figures it names add up to the GPU's capacity, and what it
    could not allocate is more than was free and less than the GPU."""
    import re

    from sglang_farm.sim import texts

    gib = {"GiB": 1.0, "MiB": 1 / 1024}

    def size(text: str) -> float:
        number, unit = text.split()
        return float(number) * gib[unit]

    pattern = re.compile(
        r"Tried to allocate (?P<want>\S+ \wiB)\. GPU 3 has a total capacity of "
        r"(?P<total>\S+ \wiB) of which (?P<free>\S+ \wiB) is free\. Including non-PyTorch "
        r"memory, this process has (?P<used>\S+ \wiB) memory in use"
    )
    for text in (texts.runtime_cuda_oom(3), texts.load_failure("cuda_oom", gpu=3, mfs=0.88)):
        m = pattern.search(text)
        assert m, text
        want, total, free, used = (size(m[k]) for k in ("want", "total", "free", "used"))
        assert free < want < total, text
        assert abs(used + free - total) < 0.05, text


def test_the_simulated_vram_follows_the_workers_mem_fraction_static() -> None:
    """The VRAM column did not move when the OOM ladder lowered `--mem-fraction-static`
    (0.88 to 0.80): the simulated GPU holds what the worker's own flag makes it."""
    from sglang_farm.gpus.simulated import DEFAULT_PROCESS_BYTES, FakeGpuPoller, process_bytes_for

    assert process_bytes_for(["-m", "sglang_farm.sim", "--port", "30003"]) == DEFAULT_PROCESS_BYTES
    stepped = process_bytes_for(["--mem-fraction-static", "0.8"])
    assert process_bytes_for(["--mem-fraction-static=0.8"]) == stepped
    total = FakeGpuPoller(1).snapshot().gpus[0].memory_total_bytes
    assert total is not None
    assert abs(DEFAULT_PROCESS_BYTES - stepped - 0.08 * total) < 2  # 0.08 of the GPU less
    poller = FakeGpuPoller(1)
    poller.assign(0, [100])
    assert poller.snapshot().gpus[0].memory_used_bytes == DEFAULT_PROCESS_BYTES
    poller.assign(0, [100], {100: stepped})  # the same process, its step now known
    assert poller.snapshot().gpus[0].memory_used_bytes == stepped


# ---- item 8: farmctl without --config -------------------------------------------------------


def test_farmctl_without_config_names_the_config_a_farm_run_by_hand_needs() -> None:
    """On a machine where only the demo runs, `farmctl status` answered with the systemd
    hint alone; it says how a farm run by hand is reached (`--config`)."""
    from sglang_farm.host.paths import DEFAULT_SOCKET

    if os.path.exists(DEFAULT_SOCKET):
        import pytest

        pytest.skip(f"a packaged farm runs here ({DEFAULT_SOCKET})")
    env = {k: v for k, v in os.environ.items() if k != "FARMCTL_SOCKET"}
    r = subprocess.run(
        [str(REPO / ".venv/bin/farmctl"), "status"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert r.returncode == 4, r.stderr
    assert "(systemctl status sglang-farm)" in r.stderr
    assert "farmctl --config etc/sglang-farm/demo.toml status" in r.stderr
    assert r.stderr.count("\n") == 1


# ---- item 7: readable by a person, on a terminal or not -------------------------------------


def _human(*events: tuple[str, str, dict[str, object]]) -> list[str]:
    """What `--log-format console` writes for `(level, event, fields)`, to a file."""
    out = io.StringIO()
    logsetup.configure("info", stream=out, json=False)
    try:
        log = structlog.get_logger("test")
        for level, event, fields in events:
            getattr(log, level)(event, **fields)
    finally:
        structlog.reset_defaults()
    return out.getvalue().splitlines()


def test_a_persons_log_is_plain_lines_off_a_terminal_too() -> None:
    """Under nohup or into a file the demo printed JSON lines, each launch its whole
    command line, and `8/8 ready \\u00b7 front door`: plain short lines instead, the
    summary as a sentence, and what only the journal needs left out."""
    summary = "demo: 8/8 ready and routed · front door http://127.0.0.1:8000 · try: farmctl status"
    lines = _human(
        ("info", "worker_launching", {"worker": 3, "gpu": 3, "argv": ["python", "-m", "x"]}),
        ("info", "worker_state", {"worker": 3, "gpu": 3, "state": "starting"}),
        ("info", "worker_launched", {"worker": 3, "gpu": 3, "pid": 4242}),
        ("info", "rollout_done", {"ready": 8, "workers": 8, "farm": "demo", "summary": summary}),
        ("warning", "health_failed", {"worker": 5, "gpu": 5, "why": "timed out"}),
        ("warning", "worker_failed", {"worker": 5, "gpu": 5, "summary": "killed by signal 9"}),
    )
    assert len(lines) == 4, lines
    launched, done, warned, failed = lines
    assert failed.endswith("  WARNING  worker_failed  worker 5 (GPU 5)  killed by signal 9")
    assert launched.endswith("  worker_launched  worker 3 (GPU 3)  pid=4242")
    assert done[8:] == f"  {summary}"  # after the time: the sentence, unescaped, alone
    assert '  WARNING  health_failed  worker 5 (GPU 5)  why="timed out"' in warned
    assert not any(ln.lstrip().startswith("{") for ln in lines)


def test_the_journals_json_keeps_every_event_and_plain_utf8() -> None:
    out = io.StringIO()
    logsetup.configure("info", stream=out, json=True)
    try:
        structlog.get_logger("test").info("worker_state", worker=1, state="ready")
        structlog.get_logger("test").info("rollout_done", summary="8/8 ready · front door")
    finally:
        structlog.reset_defaults()
    state, done = (json.loads(ln) for ln in out.getvalue().splitlines())
    assert state["event"] == "worker_state"  # the journal keeps it
    assert "·" in out.getvalue() and done["summary"] == "8/8 ready · front door"


def test_a_managed_gateway_starting_is_no_alarm_at_info(tmp: Path) -> None:
    """`gateway_not_reached_yet … check that the gateway runs` was logged at info during
    every normal demo start (the farm starts its managed gateway itself; its runner warns
    when it exits): not at info for a managed gateway; an external one still says it."""
    gw = FakeGateway()
    gw.down = True
    managed = {"mode": "managed", "listen": "127.0.0.1:8000", "drain_timeout": "30s"}

    async def scenario() -> None:
        async with farm(tmp, text=farm_toml(tmp, gateway=managed), gateway=gw) as f:
            await asyncio.sleep(5)
            gw.down = False
            await f.until(lambda: f.gateway.routed() == urls(range(8)), within=120)

    with capture_logs() as logs:
        run_virtual(scenario())
    said = [e for e in logs if e["event"] == "gateway_not_reached_yet"]
    assert [e["log_level"] for e in said] == ["debug"]
    assert not [e for e in logs if e["log_level"] in ("warning", "error")], logs


def test_the_preflights_count_names_each_warning() -> None:
    """`"warn": 1` in the agent's preflight line said not which: it names each warning."""
    from fake_sglang_env import _demo_with_gateway
    from farmproc import free_port_block
    from sglang_farm.doctor.cache import DoctorReportCache
    from sglang_farm.gpus.simulated import FakeGpuPoller

    verdict = DoctorReportCache(FakeGpuPoller(count=8))
    with capture_logs() as logs:
        asyncio.run(verdict.refresh(_demo_with_gateway(base_port=free_port_block(8))))
    (done,) = [e for e in logs if e["event"] == "preflight_done"]
    assert done["warn"] == len(done["warnings"]) >= 1
    assert any(w.startswith("nvml: the GPUs are simulated") for w in done["warnings"])


def test_systemds_status_line_says_when_ready_is_not_yet_routed() -> None:
    """`systemctl status sglang-farm` showed `8/8 ready` while the gateway routed 7."""
    from dataclasses import replace

    from sglang_farm.farm_view import FarmView, GatewayStatus, Phase, WorkerView
    from sglang_farm.service import status_line

    workers = tuple(
        WorkerView(w, (w,), 30000 + w, f"http://127.0.0.1:{30000 + w}", Phase.READY, 1.0, 100 + w)
        for w in range(8)
    )
    gw = GatewayStatus("http://127.0.0.1:8000", up=True, members=7, errors=0)
    routed = tuple(replace(w, in_gateway=w.id != 5) for w in workers)
    view = FarmView("demo", "systemd", routed, "/etc/x.toml", 0.0, Rollout.DONE, gateway=gw)
    assert status_line(view) == "8/8 ready, 1 not yet routed by the gateway"
    every = replace(view, workers=tuple(replace(w, in_gateway=True) for w in workers))
    assert status_line(every) == "8/8 ready"
    assert status_line(replace(view, gateway=None, workers=workers)) == "8/8 ready"


def test_the_pollers_give_each_simulated_worker_what_its_own_flags_hold() -> None:
    """The agent's GPU poll puts each worker's process on its simulated GPU: with the
    size its command line now (the ladder's step applied) makes it."""
    from sglang_farm.config import load_spec
    from sglang_farm.farm_view import Rollout, build_view
    from sglang_farm.gpus.simulated import DEFAULT_PROCESS_BYTES, FakeGpuPoller, process_bytes_for
    from sglang_farm.metrics.pollers import MetricPollers

    demo = (REPO / "etc/sglang-farm/demo.toml").read_text()
    spec = load_spec(demo, source="demo.toml", agent_python=sys.executable)
    step = ("python", "-m", "sglang_farm.sim", "--mem-fraction-static", "0.8")
    argv = {w: ("python", "-m", "sglang_farm.sim") for w in spec.worker_ids} | {3: step}
    view = build_view(
        spec,
        {},
        runtime="process",
        rollout=Rollout.DONE,
        rollout_reason=None,
        started_at=0.0,
        mono_to_wall=0.0,
        argv=argv,
    )
    gpus = FakeGpuPoller(8)
    MetricPollers(lambda: spec, gpus, view)._assign_fake(
        gpus, {w: frozenset({1000 + w}) for w in spec.worker_ids}
    )
    used = {g.index: g.memory_used_bytes for g in gpus.snapshot().gpus}
    assert used[3] == process_bytes_for(step) < DEFAULT_PROCESS_BYTES
    assert {used[w] for w in spec.worker_ids if w != 3} == {DEFAULT_PROCESS_BYTES}
