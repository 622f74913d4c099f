"""Issue 30, item 3: a squatter on the managed gateway's port never gets the admin key.

With the agent stopped, `nobody` binds the managed gateway's port and plays smg (200 and
an empty worker list to `GET /workers`). Before the fix the agent's first `GET /workers`
carried `Authorization: Bearer <admin key>` (the key an earlier run generated into
`state/gateway-admin.key`) to it, `farmctl status` said "up", and the key was never
replaced. Now the listener must be held by the farm's own smg before any key is sent:
the squatter gets nothing, the gateway is down with the squatter named, the key it may
have had from an earlier agent is replaced, and once it leaves the farm's smg starts on
the port with the new key (the old one refused) and the workers are routed. Process
runtime, real smg, real nobody.
"""

from __future__ import annotations

import importlib.util
import json
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from asuser import popen_as_nobody
from farmproc import farm_config, free_port_block, new_marker, tmpdir
from frontdoor_farm import running_farm, until, worker_urls
from managed_gateway import managed_section, routed
from sglang_farm.gateway.adminkey import ensure_admin_key
from sglang_farm.gateway.managed import GENERATED_ADMIN_KEY_NAME

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("smg") is None,
        reason="smg (SGLang's gateway) is not installed: pip install smg==1.13.0",
    ),
]

# The squatter: smg's look-alike. Writes down every request line and its Authorization
# header, answers `{"workers": []}` to GET /workers and 202 to the rest.
SQUATTER = r"""
import http.server, json, sys
port, log = int(sys.argv[1]), sys.argv[2]
class H(http.server.BaseHTTPRequestHandler):
    def _answer(self):
        with open(log, "a") as f:
            f.write(json.dumps([self.command, self.path,
                                self.headers.get("Authorization") or ""]) + "\n")
        n = int(self.headers.get("Content-Length") or 0)
        if n:
            self.rfile.read(n)
        if self.command == "GET" and self.path.startswith("/workers"):
            code, body = 200, b'{"workers": []}'
        else:
            code, body = 202, b'{"status": "accepted"}'
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    do_GET = do_POST = do_DELETE = _answer
    def log_message(self, *a):
        pass
srv = http.server.ThreadingHTTPServer(("127.0.0.1", port), H)
print("bound", flush=True)
srv.serve_forever()
"""


def test_a_squatter_on_the_managed_gateways_port_gets_no_key_and_no_up(
    shared_dir: Path,
) -> None:
    tmp = tmpdir()
    port = free_port_block(2)
    gw = f"http://127.0.0.1:{port}"
    log = shared_dir / "squatter.log"
    squatter = popen_as_nobody([sys.executable, "-I", "-c", SQUATTER, str(port), str(log)])
    try:
        assert squatter.stdout is not None
        line = squatter.stdout.readline().strip()
        assert line == "bound", squatter.stderr.read() if squatter.stderr else line
        marker = new_marker()
        config = farm_config(tmp, workers=2, parallel=2, marker=marker, extra=managed_section(port))
        # The key an earlier run of the agent generated (and, before the fix, sent).
        old_key = ensure_admin_key(tmp / "state" / GENERATED_ADMIN_KEY_NAME)
        with running_farm(config, marker) as farm:
            # The farm tries its gateway for a while: at start, and at each retry.
            farm.wait_for(lambda e: e.get("event") == "worker_ready" and e.get("worker") == 1, 90)
            time.sleep(3)
            key = (tmp / "state" / GENERATED_ADMIN_KEY_NAME).read_text().strip()
            status = json.loads(farm.farmctl("--json", "status").stdout)["gateway"]
            assert status["up"] is False, status
            assert f"PID {squatter.pid} (user nobody)" in (status["last_error"] or ""), status
            text = farm.farmctl("status").stdout
            assert "· up" not in text, text
            assert f"port {port} is held by PID {squatter.pid} (user nobody)" in text, text
            seen = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
            assert not [s for s in seen if key in s[2]], f"the squatter got the admin key: {seen}"
            assert not [s for s in seen if s[2]], f"the squatter got a key: {seen}"
            # The key it may have had from an earlier agent is replaced, once.
            assert key != old_key and len(key) >= 40
            rotated = farm.named("gateway_admin_key_rotated")
            assert len(rotated) == 1, rotated
            # The squatter leaves: the farm's own smg starts on the port (its back-off)
            # and the farm routes its workers there, with the key it never gave away.
            squatter.send_signal(signal.SIGKILL)
            squatter.wait(10)
            urls = set(worker_urls(config))
            until(lambda: routed(gw, key) == urls, 120, "both workers routed by the farm's smg")
            status = json.loads(farm.farmctl("--json", "status").stdout)["gateway"]
            assert status["up"] is True, status
            # smg took the new key at its start; the old one is refused.
            old = httpx.get(
                f"{gw}/workers", headers={"Authorization": f"Bearer {old_key}"}, timeout=5
            )
            assert old.status_code == 401, old.text
    finally:
        if squatter.poll() is None:
            squatter.kill()
        squatter.communicate(timeout=10)  # reaps it and closes its pipes
