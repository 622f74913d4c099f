"""The `wait-ready` gate against a real local HTTP server (no container)."""

from __future__ import annotations

import http.server
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from sglang_farm.cli.waitready import wait_ready_command
from sglang_farm.runtime.waitready import WaitExit, wait_ready
from sglang_farm.spec import FarmSection, FarmSpec, HealthPolicy, StartupPolicy, WorkerSpec


class _Health(http.server.BaseHTTPRequestHandler):
    """/health: 503 until `ready_at` (monotonic), then 200; other paths 404."""

    ready_at = 0.0
    hits = 0

    def do_GET(self) -> None:
        type(self).hits += 1
        if self.path != "/health":
            self.send_response(404)
        elif time.monotonic() < self.ready_at:
            self.send_response(503)
        else:
            self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def _handler(ready_at: float) -> type[_Health]:
    """A `_Health` subclass of its own, so its `ready_at` and `hits` are this server's."""

    class Handler(_Health):
        pass

    Handler.ready_at = ready_at
    Handler.hits = 0
    return Handler


class _Server:
    def __init__(self, ready_in: float) -> None:
        handler = _handler(time.monotonic() + ready_in)
        self.handler = handler
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server_factory() -> Iterator[type[_Server]]:
    made: list[_Server] = []

    class Factory(_Server):
        def __init__(self, ready_in: float) -> None:
            super().__init__(ready_in)
            made.append(self)

    yield Factory
    for s in made:
        s.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spec(port: int, *, path: str = "/health") -> FarmSpec:
    worker = WorkerSpec(
        id=3, gpus=(3,), host="127.0.0.1", port=port, nccl_port=port + 1, flags={}, env={}
    )
    return FarmSpec(
        source="test.toml",
        farm=FarmSection(),
        workers=(worker,),
        startup=StartupPolicy(poll_interval=0.05),
        health=HealthPolicy(timeout=1.0, path=path),
    )


def test_returns_ready_once_health_answers_200(server_factory: type[_Server]) -> None:
    srv = server_factory(ready_in=0.4)
    t0 = time.monotonic()
    assert wait_ready(_spec(srv.port), 3, deadline=10.0) == WaitExit.READY
    took = time.monotonic() - t0
    assert 0.35 <= took < 3.0
    assert srv.handler.hits >= 2  # it saw 503 first, then 200


def test_waits_through_connection_refused_until_the_port_binds() -> None:
    port = _free_port()
    ready: list[http.server.ThreadingHTTPServer] = []

    def bind_later() -> None:
        time.sleep(0.4)
        handler = _handler(0.0)
        httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
        ready.append(httpd)
        httpd.serve_forever(poll_interval=0.05)

    threading.Thread(target=bind_later, daemon=True).start()
    try:
        assert wait_ready(_spec(port), 3, deadline=10.0) == WaitExit.READY
    finally:
        for h in ready:
            h.shutdown()
            h.server_close()


def test_gives_up_at_the_deadline_when_never_ready(server_factory: type[_Server]) -> None:
    srv = server_factory(ready_in=3600)
    t0 = time.monotonic()
    assert wait_ready(_spec(srv.port), 3, deadline=0.5) == WaitExit.NOT_READY
    took = time.monotonic() - t0
    assert 0.45 <= took < 2.0


def test_uses_the_configured_health_path(server_factory: type[_Server]) -> None:
    srv = server_factory(ready_in=0)
    # /ready is 404 on this server: never ready although /health would be.
    assert wait_ready(_spec(srv.port, path="/ready"), 3, deadline=0.3) == WaitExit.NOT_READY


def test_unknown_worker_is_a_usage_error() -> None:
    assert wait_ready(_spec(_free_port()), 7, deadline=1.0) == WaitExit.USAGE


def _config(tmp_path: Path, port: int) -> Path:
    p = tmp_path / "farm.toml"
    p.write_text(
        "[farm]\n"
        'python = "/usr/bin/python3"\nuser = "root"\ngroup = "root"\n'
        "[workers]\n"
        f'gpus = [0, 1]\nhost = "127.0.0.1"\nbase_port = {port}\nnccl_base_port = {port + 10}\n'
        "[startup]\n"
        'load_timeout = "0.5s"\npoll_interval = "0.05s"\n'
        "[health]\n"
        'timeout = "1s"\n'
        "[sglang]\n"
        f'model_path = "{tmp_path}"\n'
    )
    return p


def test_command_exits_0_when_ready(server_factory: type[_Server], tmp_path: Path) -> None:
    srv = server_factory(ready_in=0.2)
    # Worker 1 listens on base_port + 1.
    cfg = _config(tmp_path, srv.port - 1)
    r = CliRunner().invoke(wait_ready_command, ["--config", str(cfg), "1"])
    assert r.exit_code == 0, r.output


def test_command_exits_1_after_load_timeout(tmp_path: Path) -> None:
    cfg = _config(tmp_path, _free_port())
    t0 = time.monotonic()
    r = CliRunner().invoke(wait_ready_command, ["--config", str(cfg), "0"])
    assert r.exit_code == WaitExit.NOT_READY, r.output
    assert time.monotonic() - t0 < 3.0


def test_command_exits_2_for_unknown_worker_and_names_the_workers(tmp_path: Path) -> None:
    cfg = _config(tmp_path, _free_port())
    r = CliRunner().invoke(wait_ready_command, ["--config", str(cfg), "5"])
    assert r.exit_code == WaitExit.USAGE
    assert "no worker 5" in r.output and "0, 1" in r.output


def test_command_exits_2_for_a_bad_config(tmp_path: Path) -> None:
    cfg = tmp_path / "farm.toml"
    cfg.write_text("[workers]\ngpus = 'x'\n")
    r = CliRunner().invoke(wait_ready_command, ["--config", str(cfg), "0"])
    assert r.exit_code == WaitExit.USAGE
    assert str(cfg) in r.output


def test_gives_up_at_once_when_the_main_process_is_gone(server_factory: type[_Server]) -> None:
    srv = server_factory(ready_in=3600)
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()
    t0 = time.monotonic()
    assert wait_ready(_spec(srv.port), 3, deadline=30.0, main_pid=dead.pid) == WaitExit.NOT_READY
    assert time.monotonic() - t0 < 5.0  # not the 30 s deadline


def test_a_200_from_the_main_processes_own_listener_is_ready(server_factory: type[_Server]) -> None:
    import os

    srv = server_factory(ready_in=0)  # served by this process: the "main process" here
    spec = _spec(srv.port)
    assert wait_ready(spec, 3, deadline=10.0, main_pid=os.getpid()) == WaitExit.READY


def test_a_200_from_a_listener_outside_the_workers_tree_is_never_ready(
    server_factory: type[_Server],
) -> None:
    import subprocess

    # The worker's main process (loading: no port yet) in a session of its own; what
    # answers 200 on its port is this test process, outside that tree (a squatter).
    srv = server_factory(ready_in=0)
    worker = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        got = wait_ready(_spec(srv.port), 3, deadline=1.5, main_pid=worker.pid)
    finally:
        worker.kill()
        worker.wait()
    assert got == WaitExit.NOT_READY
    assert srv.handler.hits > 0  # it did answer


# --- the gate as the rendered drop-in runs it: everything on its command line ---------


def _gate_argv(spec: FarmSpec, worker: int, *, agent_bin: str, config_path: str) -> list[str]:
    """The rendered ExecStartPost= of `worker`, as systemd would pass it (no specifiers
    or quoting in it here), with $MAINPID and %i filled in."""
    from sglang_farm.runtime.units import dropin_path, render

    text = render(spec, agent_bin=agent_bin, config_path=config_path, static=False)[
        dropin_path(worker)
    ]
    line = next(x for x in text.splitlines() if x.startswith("ExecStartPost="))
    words = line.removeprefix("ExecStartPost=").split()
    return [str(worker) if w == "%i" else w for w in words if w not in ("--main-pid", "$MAINPID")]


def test_rendered_gate_runs_isolated_in_the_agents_interpreter() -> None:
    srv_port = _free_port()
    argv = _gate_argv(
        _spec(srv_port), 3, agent_bin="/opt/venv/bin/sglang-farm", config_path="/x/farm.toml"
    )
    assert argv[:5] == ["/opt/venv/bin/python3", "-I", "-m", "sglang_farm.cli.main", "wait-ready"]
    # The packaged agent: the private venv's interpreter.
    packaged = _gate_argv(
        _spec(srv_port), 3, agent_bin="/usr/bin/sglang-farm", config_path="/x/farm.toml"
    )
    assert packaged[0] == "/usr/lib/sglang-farm/venv/bin/python3" and packaged[1] == "-I"


def test_rendered_gate_reads_no_config_so_a_half_edited_file_cannot_break_a_start(
    server_factory: type[_Server], tmp_path: Path
) -> None:
    srv = server_factory(ready_in=0.2)
    cfg = tmp_path / "farm.toml"
    spec = _spec(srv.port, path="/health")
    argv = _gate_argv(spec, 3, agent_bin="/opt/venv/bin/sglang-farm", config_path=str(cfg))
    assert "--config" not in argv and str(cfg) not in argv
    # The live file is mid-edit: it no longer parses, and names another port.
    cfg.write_text(f"[workers]\nbase_port = {srv.port + 7}\ngpus = [\n")
    args = argv[argv.index("wait-ready") + 1 :]
    r = CliRunner().invoke(wait_ready_command, args)
    assert r.exit_code == WaitExit.READY, r.output


def test_rendered_gate_carries_the_health_path_and_timeouts(server_factory: type[_Server]) -> None:
    srv = server_factory(ready_in=0)
    spec = _spec(srv.port, path="/ready")  # 404 on this server: never ready
    spec = FarmSpec(
        source=spec.source,
        farm=spec.farm,
        workers=spec.workers,
        startup=StartupPolicy(poll_interval=0.05, load_timeout=0.4),
        health=spec.health,
    )
    argv = _gate_argv(spec, 3, agent_bin="/opt/venv/bin/sglang-farm", config_path="/x.toml")
    assert f"http://127.0.0.1:{srv.port}/ready" in argv
    t0 = time.monotonic()
    r = CliRunner().invoke(wait_ready_command, argv[argv.index("wait-ready") + 1 :])
    assert r.exit_code == WaitExit.NOT_READY, r.output
    assert time.monotonic() - t0 < 3.0  # the load_timeout from the drop-in: 0.4 s


def test_command_with_url_needs_its_deadline() -> None:
    r = CliRunner().invoke(wait_ready_command, ["--url", "http://127.0.0.1:1/health", "3"])
    assert r.exit_code == WaitExit.USAGE
    assert "--timeout" in r.output
