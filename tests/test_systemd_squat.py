"""Issue 22 §4 under a real systemd: nobody squats `sglang@1`'s port while it loads.

The worker is a unit; the squatter is another local user's process (a transient unit run
as nobody, so it has a cgroup of its own, as any login session would). The agent must
never call the worker ready on the squatter's answers and must name it in `why`: the
listener's holder is outside `sglang@1.service`'s cgroup.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from sdcontainer import SystemdContainer
from sdfarm import AGENT, BASE_PORT, SdFarm, farm_toml, install_farm

pytestmark = [pytest.mark.systemd, pytest.mark.slow]


SQUATTER = r"""
import http.server, sys
port, log = int(sys.argv[1]), sys.argv[2]
class H(http.server.BaseHTTPRequestHandler):
    def _ok(self):
        with open(log, "a") as f:
            f.write(self.command + " " + self.path + "\n")
        body = b'{"status": "ok"}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    do_GET = do_POST = _ok
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""
SQUAT_UNIT = "squatter.service"
SQUAT_LOG = "/var/tmp/squatter.log"


@pytest.fixture(scope="module")
def farm(sd_container: SystemdContainer) -> Iterator[SdFarm]:
    install_farm(sd_container, farm_toml(workers=2, canary=0, parallel=2, load_seconds=4.0))
    yield SdFarm(sd_container)


def test_a_squatter_on_a_loading_units_port_is_named_and_never_ready(
    farm: SdFarm, sd: SystemdContainer
) -> None:
    c = farm.c
    c.run(["systemctl", "start", AGENT], timeout=90)
    farm.wait(
        "both workers ready",
        lambda: (
            (st := farm.status()).keys() == {0, 1}
            and all(w["state"] == "ready" for w in st.values()),
            st,
        ),
        timeout=90,
    )
    before = farm.main_pids([1])[1]
    n = len(farm.agent_events())
    jobs_before = len(farm.unit_jobs([1]))
    farm.farmctl("restart", "1", "--no-wait")
    farm.wait(
        "sglang@1 loading with a new MainPID",
        lambda: (
            (farm.states([1])[1], (p := farm.main_pids([1])[1])) == ("activating", p)
            and p not in (0, before),
            p,
        ),
        timeout=30,
        interval=0.05,
    )
    c.run(
        [
            "systemd-run",
            f"--unit={SQUAT_UNIT}",
            "--uid=65534",
            "--gid=65534",
            "/usr/bin/python3",
            "-I",
            "-c",
            SQUATTER,
            str(BASE_PORT + 1),
            SQUAT_LOG,
        ]
    )
    squatter = int(c.run(["systemctl", "show", "-P", "MainPID", SQUAT_UNIT]).stdout.strip())
    assert squatter > 0

    def failed() -> tuple[bool, list[dict[str, object]]]:
        evs = [
            e
            for e in farm.agent_events("worker_failed", worker=1)[0:]
            if e.get("kind") == "port_taken"
        ]
        return bool(evs), evs

    evs = farm.wait("worker 1 failed as port_taken", failed, timeout=30)
    # The hardened agent (no capabilities) cannot read nobody's descriptors: the socket's
    # owner is named, and the processes of that user (here, the squatter alone).
    named = (
        f"port {BASE_PORT + 1} is held by a process of user nobody (the agent cannot see "
        f"which; that user runs PID {squatter}), not by worker 1"
    )
    assert evs[0]["summary"] == named, evs
    why = farm.farmctl("why", "1").stdout
    assert "[port_taken]" in why and named in why, why
    time.sleep(2)  # back-offs and launch attempts against the squatter
    ready = [e for e in farm.agent_events()[n:] if e["event"] == "worker_ready"]
    assert ready == [], ready
    assert farm.status()[1]["state"] != "ready"
    # systemd never called it started either: its readiness gate refused the squatter.
    jobs = farm.unit_jobs([1])[jobs_before:]
    assert "started" not in [kind for _, kind, _ in jobs], jobs
    seen = c.run(["cat", SQUAT_LOG], check=False).stdout.split("\n")
    assert {line.split()[1] for line in seen if line} <= {"/ready", "/health"}, seen
    # The squatter leaves: the unit is started again and is the worker itself.
    c.run(["systemctl", "stop", SQUAT_UNIT])
    farm.wait(
        "worker 1 ready again",
        lambda: ((s := farm.status()[1])["state"] == "ready", s),
        timeout=90,
    )
