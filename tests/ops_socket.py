"""farmctl against a real control socket served (in a thread) over FakeOps: shared by the
farmctl tests of each verb.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from click.testing import CliRunner, Result
from structlog.testing import capture_logs

from fake_ops import FakeOps
from sglang_farm.cli.farmctl import cli
from sglang_farm.control.server import ControlServer
from sglang_farm.farm_view import GatewayStatus

GATEWAY = GatewayStatus("http://127.0.0.1:8000", up=True, members=0, errors=0)


@dataclass
class Agent:
    path: str
    ops: FakeOps
    loop: asyncio.AbstractEventLoop

    def run(self, *args: str, env: dict[str, str] | None = None) -> Result:
        return CliRunner().invoke(cli, ["--socket", self.path, *args], env=env)

    def soon(self, fn: object, *a: object) -> None:
        self.loop.call_soon_threadsafe(fn, *a)  # type: ignore[arg-type]  # untyped *a


@contextlib.contextmanager
def serving(ops: FakeOps) -> Iterator[Agent]:
    """A control socket over `ops`, served by an event loop in a thread."""
    d = tempfile.mkdtemp(prefix="sf")
    path = os.path.join(d, "control.sock")
    loop = asyncio.new_event_loop()
    srv = ControlServer(ops, path, None, version="0.1.0")
    started = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(srv.start())
        started.set()
        loop.run_forever()

    # The server's log lines must not land in CliRunner's captured stdout.
    with capture_logs():
        t = threading.Thread(target=serve, daemon=True)
        t.start()
        assert started.wait(10)
        try:
            yield Agent(path, ops, loop)
        finally:
            asyncio.run_coroutine_threadsafe(srv.close(), loop).result(10)
            asyncio.run_coroutine_threadsafe(ops.aclose(), loop).result(10)
            loop.call_soon_threadsafe(loop.stop)
            t.join(10)
    loop.close()
    shutil.rmtree(d, ignore_errors=True)
