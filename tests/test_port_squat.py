"""Issue 22 §4 end to end: nobody squats a restarting worker's port (process runtime, real smg).

SGLang (and the simulator) binds its port only after loading, so after `farmctl restart 1`
the port is free for the whole load. `nobody` binds it then and answers 200 to everything.
The worker must never be READY on those answers, never be routed to, and `farmctl why 1`
must name `port_taken`, the squatter's PID and user; once the squatter is gone the worker
comes back by itself.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from asuser import popen_as_nobody
from farmproc import Farm, farm_config, free_port_block, marked_pids, new_marker
from frontdoor_farm import ADMIN_KEY, chat, routed, until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("smg") is None,
        reason="smg (SGLang's gateway) is not installed: pip install smg==1.13.0",
    ),
]

# The squatter: answers 200 with a JSON body to every GET and POST, and writes down each
# request line it got (so the test sees what reached it).
SQUATTER = r"""
import http.server, sys
port, log = int(sys.argv[1]), sys.argv[2]
class H(http.server.BaseHTTPRequestHandler):
    def _ok(self):
        with open(log, "a") as f:
            f.write(self.command + " " + self.path + "\n")
        n = int(self.headers.get("Content-Length") or 0)
        if n:
            self.rfile.read(n)
        body = b'{"status": "ok"}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    do_GET = do_POST = _ok
    def log_message(self, *a):
        pass
srv = http.server.ThreadingHTTPServer(("127.0.0.1", port), H)
print("bound", flush=True)
srv.serve_forever()
"""


def test_a_squatter_on_a_restarting_workers_port_never_makes_it_ready(
    short_tmp: Path,
    shared_dir: Path,
) -> None:
    key = short_tmp / "admin.key"
    key.write_text(ADMIN_KEY)
    key.chmod(0o600)
    gw_port = free_port_block(2)
    gw = f"http://127.0.0.1:{gw_port}"
    gateway = (
        f'[gateway]\nmode = "managed"\nadmin_key_file = "{key}"\ndrain_timeout = "5s"\n'
        f'listen = "127.0.0.1:{gw_port}"\nmetrics_listen = "127.0.0.1:{gw_port + 1}"\n'
        'policy = "round_robin"\n'
    )
    marker = new_marker()
    # A 4 s load: the window in which the port is free and the squatter binds it.
    config = farm_config(
        short_tmp, workers=2, parallel=2, load_seconds=4.0, marker=marker, extra=gateway
    )
    import tomllib

    base = tomllib.loads(config.read_text())["workers"]["base_port"]
    urls = [f"http://127.0.0.1:{base + i}" for i in range(2)]
    requests_log = shared_dir / "squatter.log"
    farm = Farm(config, marker)
    squatter = None
    try:
        until(lambda: routed(gw) == set(urls), 90, "both workers routed")
        n = len(farm.snapshot())
        r = farm.farmctl("restart", "1", "--no-wait")
        assert r.returncode == 0, r.stderr
        # The new process is launched and loading: its port is free until it has loaded.
        farm.wait_for(
            lambda e: e.get("event") == "worker_launched" and e.get("worker") == 1,
            30,
            after=n,
        )
        squatter = popen_as_nobody(
            [sys.executable, "-I", "-c", SQUATTER, str(base + 1), str(requests_log)]
        )
        assert squatter.stdout is not None
        line = squatter.stdout.readline().strip()
        assert line == "bound", squatter.stderr.read() if squatter.stderr else line
        failed = farm.wait_for(
            lambda e: (
                e.get("event") == "worker_failed"
                and e.get("worker") == 1
                and e.get("kind") == "port_taken"
            ),
            30,
            after=n,
        )
        assert f"PID {squatter.pid} (user nobody)" in failed["summary"], failed
        why = farm.farmctl("why", "1")
        assert "[port_taken]" in why.stdout, why.stdout
        assert f"port {base + 1} is held by PID {squatter.pid} (user nobody)" in why.stdout
        # Users keep being served, by worker 0 only; the gateway never routes to worker 1.
        for _ in range(6):
            assert chat(gw).status_code == 200
            assert urls[1] not in routed(gw)
        time.sleep(2)  # a few more back-offs and launch attempts against the squatter
        assert urls[1] not in routed(gw)
        assert [e for e in farm.snapshot()[n:] if e.get("event") == "worker_ready"] == []
        seen = requests_log.read_text().splitlines() if requests_log.exists() else []
        assert seen, "the squatter answered the farm's readiness probes"
        # Only the readiness probes (/ready, or /health after a 404) reached it: no prompts.
        assert {line.split()[1] for line in seen} <= {"/ready", "/health"}, seen
        # The squatter leaves: the worker is launched again, as itself, and routed.
        squatter.send_signal(signal.SIGKILL)
        squatter.wait(10)
        farm.wait_for(
            lambda e: e.get("event") == "worker_ready" and e.get("worker") == 1, 90, after=n
        )
        until(lambda: routed(gw) == set(urls), 30, "worker 1 routed again")
    finally:
        if squatter is not None:
            if squatter.poll() is None:
                squatter.kill()
            squatter.communicate(timeout=10)  # reaps it and closes its pipes
        with contextlib.suppress(Exception):
            farm.stop(timeout=60)
        for pid in marked_pids(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
