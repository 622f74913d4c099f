"""I/O: an Ansible connection plugin that runs tasks inside a test container with nsenter.

tests/test_ansible.py drives its systemd containers (tests/sdcontainer.py) with the real
ansible-core. Those containers run no SSH server, and ansible-core ships no connection
that enters another process's namespaces (its own are local, ssh, paramiko_ssh, winrm,
psrp). community.docker's `nsenter` connection does this, but the only way to get it
from PyPI is the `ansible` package, every community collection together (docs/fleet.md
gives its size and install time): this file is the part of it the test needs.

A "host" is a process ID (`ansible_nsenter_pid`, the container's PID 1): each command
runs as `nsenter --target PID --all -- env -i PATH=... /bin/sh -c CMD`, so in the
container's mount, PID, network, IPC and UTS namespaces (its /run, its systemd), with a
clean environment like `SystemdContainer.run`; files go in and out through `cat`. The
controller runs as root (nsenter needs it), and so do the tasks: no become.
"""

from __future__ import annotations

import shlex
import subprocess
from typing import Any

from ansible.errors import (  # type: ignore[import-untyped]  # no type hints shipped
    AnsibleConnectionFailure,
    AnsibleError,
    AnsibleFileNotFound,
)
from ansible.plugins.connection import ConnectionBase  # type: ignore[import-untyped]

DOCUMENTATION = """
    name: nsenter
    short_description: run tasks inside another process's namespaces (a test container)
    description:
        - Runs every command with nsenter in the namespaces of the process ansible_nsenter_pid.
        - For tests/test_ansible.py; the controller must be root.
    author: sglang-farm tests
    options:
        nsenter_pid:
            description: PID of the container's init (its systemd).
            type: int
            required: true
            vars:
                - name: ansible_nsenter_pid
"""

_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_ENV = (f"PATH={_PATH}", "HOME=/root", "LANG=C.UTF-8")


class Connection(ConnectionBase):  # type: ignore[misc]  # ansible-core ships no type hints
    """Commands and files through nsenter into the process `ansible_nsenter_pid`."""

    transport = "nsenter"
    has_pipelining = True

    def _connect(self) -> Connection:
        self._connected = True
        return self

    def _argv(self, script: str) -> list[str]:
        pid = str(self.get_option("nsenter_pid"))
        return [
            "nsenter",
            "--target",
            pid,
            "--all",
            "--",
            "env",
            "-i",
            *_ENV,
            "/bin/sh",
            "-c",
            script,
        ]

    def _run(self, script: str, stdin: Any, what: str) -> tuple[int, bytes, bytes]:
        try:
            p = subprocess.run(self._argv(script), input=stdin, capture_output=True)
        except OSError as exc:
            raise AnsibleConnectionFailure(f"nsenter: cannot run it for {what}: {exc}") from exc
        return p.returncode, p.stdout, p.stderr

    def exec_command(
        self, cmd: str, in_data: bytes | None = None, sudoable: bool = True
    ) -> tuple[int, bytes, bytes]:
        super().exec_command(cmd, in_data=in_data, sudoable=sudoable)
        self._display.vvv(
            f"NSENTER {self.get_option('nsenter_pid')}: {cmd}", host=self._play_context.remote_addr
        )
        return self._run(cmd, in_data if in_data is not None else b"", cmd)

    def put_file(self, in_path: str, out_path: str) -> None:
        super().put_file(in_path, out_path)
        try:
            with open(in_path, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise AnsibleFileNotFound(f"nsenter put_file: cannot read {in_path}: {exc}") from exc
        rc, _out, err = self._run(f"cat > {shlex.quote(out_path)}", data, f"put {out_path}")
        if rc != 0:
            raise AnsibleError(
                f"nsenter put_file {in_path} -> {out_path}: {err.decode(errors='replace')}"
            )

    def fetch_file(self, in_path: str, out_path: str) -> None:
        super().fetch_file(in_path, out_path)
        rc, out, err = self._run(f"cat {shlex.quote(in_path)}", b"", f"fetch {in_path}")
        if rc != 0:
            raise AnsibleError(f"nsenter fetch_file {in_path}: {err.decode(errors='replace')}")
        with open(out_path, "wb") as f:
            f.write(out)

    def close(self) -> None:
        self._connected = False
