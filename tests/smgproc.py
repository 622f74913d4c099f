"""I/O: a real smg gateway (SGLang's) for end-to-end tests and benchmarks, started as an
operator would run an external one: on a free port of 127.0.0.1, its metrics listener on
the next port (smg's default, 0.0.0.0:29000, would clash between two gateways), with a
control-plane admin key (`--control-plane-api-keys`, read from a file by
`sglang_farm.gateway.launch` so that no command line shows it), `round_robin`.
`extra` adds smg flags (the mesh's), `launcher` options of the farm's launcher
(`--scheduler-user-share`). `kill()` is a kill -9 of its process group;
`start()` brings it back on the same ports.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import httpx

from sglang_farm.gateway.managed import ManagedGateway, smg_argv


class Smg:
    def __init__(
        self,
        folder: Path,
        key_file: Path,
        port: int,
        *,
        extra: Sequence[str] = (),
        launcher: Sequence[str] = (),
    ) -> None:
        self.spec = ManagedGateway(
            host="127.0.0.1",
            port=port,
            metrics_port=port + 1,
            policy="round_robin",
            extra_args=tuple(extra),
        )
        self.key = key_file.read_text().strip()
        self._key_file = key_file
        self._launcher = tuple(launcher)
        self._log = folder / f"smg-{port}.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return self.spec.url

    def start(self, within: float = 60.0) -> None:
        launcher = [sys.executable, "-m", "sglang_farm.gateway.launch", *self._launcher]
        argv = smg_argv(self.spec, smg=[*launcher, "--admin-key-file", str(self._key_file)])
        with self._log.open("a") as out:
            # TMPDIR: the launcher's scheduler config goes under the test's folder, so a
            # kill -9 (which skips the launcher's clean-up) leaves nothing in /tmp
            self._proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, "TMPDIR": str(self._log.parent)},
            )
        end = time.monotonic() + within
        while time.monotonic() < end:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.1)
        raise AssertionError(f"smg at {self.url} not up within {within} s; see {self._log}")

    def kill(self) -> None:
        """kill -9 of the gateway and its launcher (their process group)."""
        if self._proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGKILL)
        self._proc.wait(10)
        self._proc = None

    def freeze(self, sig: int = signal.SIGSTOP) -> None:
        """SIGSTOP (or `sig`, e.g. SIGCONT) to the gateway and its launcher: a frozen
        gateway keeps its sockets and its members, and answers nothing."""
        assert self._proc is not None
        os.killpg(self._proc.pid, sig)

    def workers(self) -> list[dict[str, object]]:
        r = httpx.get(
            f"{self.url}/workers", headers={"Authorization": f"Bearer {self.key}"}, timeout=5
        )
        r.raise_for_status()
        found = r.json()["workers"]
        assert isinstance(found, list)
        return found

    def routed(self) -> set[str]:
        """The worker URLs this gateway sends new requests to now (status ready)."""
        return {str(w["url"]) for w in self.workers() if w.get("status", "ready") == "ready"}

    def __enter__(self) -> Smg:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.kill()


def key_file(folder: Path, key: str = "test-admin-key-0123456789") -> Path:
    """A root-only admin key file, as the farm requires it."""
    path = folder / "gateway.key"
    path.write_text(key + "\n")
    path.chmod(0o600)
    return path
