"""I/O: a throwaway systemd container for tests (docs/reference/machines.md §2);
conftest.py's `sd_container` and `sd` fixtures boot one per test module.

The container boots a real systemd (with D-Bus and journald) over an overlay whose
lower layer is the host's root, so the host's packages, this checkout and its
virtualenv are all there, and nothing written inside reaches the host:

    tmpfs R ── R/u (upper), R/w (work), R/m = overlay(lowerdir=/)
    setsid systemd-nspawn -D R/m -b --private-network ... (its own session)
    nsenter -t <container PID 1> -m -u -i -n -p -- CMD    (how commands run inside)

NEVER boot systemd against the host's root: its boot clears /tmp and more. Only
this overlay is ever booted.

On a cgroup v1 host (or a hybrid one, v1 plus /sys/fs/cgroup/unified), nspawn (with
--keep-unit and no systemd on the host) puts the container's cgroups below its own:
two containers started from the same cgroup would share
`/payload/system.slice/sglang@0.service`, and one container's systemd would signal
the other's processes (PID 0 seen from inside: the caller's whole process group). So
each container's nspawn starts in cgroups of its own, `<name>` under name=systemd and
under the unified hierarchy, and containers can run side by side (scripts/test runs
test modules in parallel).

Teardown always runs (context exit, `weakref.finalize` at interpreter exit, or an
explicit `close()`): poweroff, wait, SIGKILL the container's PID 1 and nspawn if
they linger, then unmount the overlay and the tmpfs and remove the cgroup.

`skip_reason()` names what this machine lacks (root, CAP_SYS_ADMIN, systemd-nspawn,
nsenter, systemd); tests skip with it, unless SF_REQUIRE_SYSTEMD_CONTAINER=1 (set it
on CI) turns the skip into a failure.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# The checkout this harness lives in (CI clones elsewhere: never hard-code /work/main).
REPO = Path(__file__).resolve().parent.parent
# The interpreter running the tests: its venv holds pystemd, httpx and the project.
VENV_PYTHON = str(Path(sys.prefix) / "bin" / "python")

_CAP_SYS_ADMIN = 21
# Folders the container mounts its own tmpfs over: host paths under them are hidden inside.
_MASKED = ("/tmp", "/run", "/var/tmp", "/dev/shm")
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Where systemd (the container's too) tracks processes on a cgroup v1 or hybrid host.
_V1_SYSTEMD_CGROUP = Path("/sys/fs/cgroup/systemd")
_HYBRID_UNIFIED_CGROUP = Path("/sys/fs/cgroup/unified")


def skip_reason() -> str | None:
    """Why this machine cannot boot the container, or None when it can."""
    if sys.platform != "linux":
        return "systemd container: needs Linux"
    if os.geteuid() != 0:
        return "systemd container: needs root (mount, systemd-nspawn)"
    try:
        status = Path("/proc/self/status").read_text()
        cap_eff = int(
            next(ln for ln in status.splitlines() if ln.startswith("CapEff:")).split()[1], 16
        )
    except (OSError, StopIteration, ValueError):
        return "systemd container: cannot read CapEff from /proc/self/status"
    if not cap_eff & (1 << _CAP_SYS_ADMIN):
        return "systemd container: needs CAP_SYS_ADMIN (mount, namespaces)"
    for tool in ("systemd-nspawn", "nsenter", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"systemd container: `{tool}` not found (apt-get install systemd-container)"
    if not Path("/usr/lib/systemd/systemd").exists():
        return "systemd container: /usr/lib/systemd/systemd not found (apt-get install systemd)"
    return None


def require_or_skip() -> None:
    """Skip the calling test/fixture with the reason, or fail when CI demands the container."""
    reason = skip_reason()
    if reason is None:
        return
    if os.environ.get("SF_REQUIRE_SYSTEMD_CONTAINER") == "1":
        pytest.fail(f"{reason} (SF_REQUIRE_SYSTEMD_CONTAINER=1: this machine must run it)")
    print(f"skipping: {reason}", file=sys.stderr)
    pytest.skip(reason)


class ContainerError(RuntimeError):
    """The container did not boot, or a command in it failed."""


@dataclass(slots=True)
class _State:
    """What teardown needs; shared with the finalizer, so no reference to the container."""

    root: str | None = None
    mounted: list[str] = field(default_factory=list)  # innermost last
    nspawn: subprocess.Popen[bytes] | None = None
    pid1: int | None = None
    log_path: str | None = None
    cgroups: list[Path] = field(default_factory=list)  # the container's own, removed last


def _nsenter(pid1: int) -> list[str]:
    return ["nsenter", "-t", str(pid1), "-m", "-u", "-i", "-n", "-p", "--"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _teardown(state: _State) -> None:
    """Stop the container and unmount everything; idempotent, never raises."""
    nspawn, pid1 = state.nspawn, state.pid1
    if nspawn is not None and nspawn.poll() is None:
        if pid1 is not None and _alive(pid1):
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                subprocess.run(
                    [*_nsenter(pid1), "systemctl", "poweroff", "--no-block"],
                    capture_output=True,
                    timeout=10,
                )
        try:
            nspawn.wait(timeout=15)
        except subprocess.TimeoutExpired:
            # SIGKILL of a PID namespace's init kills every process in that namespace.
            if pid1 is not None and _alive(pid1):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid1, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                nspawn.wait(timeout=5)
            if nspawn.poll() is None:
                nspawn.kill()
                nspawn.wait(timeout=5)
    state.nspawn = None
    state.pid1 = None
    while state.mounted:
        target = state.mounted[-1]
        r = subprocess.run(["umount", target], capture_output=True, text=True)
        if r.returncode != 0:
            # Something (a lingering process) still holds it: detach lazily so it goes away.
            subprocess.run(["umount", "-l", target], capture_output=True, text=True)
        state.mounted.pop()
    if state.root is not None:
        with contextlib.suppress(OSError):
            os.rmdir(state.root)
        state.root = None
    while state.cgroups:
        _remove_cgroup(state.cgroups.pop())


def _own_cgroups(name: str) -> list[Path]:
    """New cgroups for one container on a v1 or hybrid host; none on a pure v2 host."""
    if not (_V1_SYSTEMD_CGROUP / "cgroup.procs").exists():
        return []
    roots = [
        r for r in (_V1_SYSTEMD_CGROUP, _HYBRID_UNIFIED_CGROUP) if (r / "cgroup.procs").exists()
    ]
    made: list[Path] = []
    for root in roots:
        try:
            (root / name).mkdir()
        except OSError as exc:  # a read-only cgroupfs: run as before, one container at a time
            print(
                f"container {name}: no cgroup of its own ({exc}); run containers one at a time",
                file=sys.stderr,
            )
            break
        made.append(root / name)
    else:
        return made
    for path in made:
        _remove_cgroup(path)
    return []


def _remove_cgroup(path: Path) -> None:
    """Remove a container's cgroup and what its systemd made below it (deepest first)."""
    for sub, _dirs, _files in sorted(os.walk(path), key=lambda w: -w[0].count("/")):
        with contextlib.suppress(OSError):
            os.rmdir(sub)


class SystemdContainer:
    """A booted systemd container over an overlay of the host's root.

    Use as a context manager. `run` executes a command inside (as root, in all its
    namespaces, clean environment), `write_file`/`copy_in` put files in, `journal`
    reads journald. It boots to basic.target (D-Bus, journald; in about 0.5 s instead
    of 3-4 s for multi-user.target, which starts every service installed on the host);
    pass `init_args=()` for the full boot. `binds_ro` are host folders bound read-only
    at the same path; this checkout and the running venv are always bound (they may
    live under /tmp on CI, which the container masks with its own tmpfs).
    `private_network=False` shares this machine's network namespace (loopback included)
    instead of a loopback of its own: for a test whose servers on this machine must reach
    the container's (tests/test_ansible.py: one gateway, workers in two containers), each
    container then on ports of its own.
    """

    def __init__(
        self,
        *,
        name: str | None = None,
        binds_ro: Sequence[str | Path] = (),
        boot_timeout: float = 60.0,
        init_args: Sequence[str] = ("systemd.unit=basic.target",),
        private_network: bool = True,
    ) -> None:
        self.name = name or f"sf-test-{uuid.uuid4().hex[:8]}"
        binds = [str(REPO), sys.prefix, *(str(b) for b in binds_ro)]
        if any(sys.base_prefix.startswith(m + "/") for m in _MASKED):
            binds.append(sys.base_prefix)
        self.binds_ro = list(dict.fromkeys(binds))
        self.boot_timeout = boot_timeout
        self.init_args = list(init_args)
        self.private_network = private_network
        self.boot_seconds: float | None = None
        self._state = _State()
        self._finalizer = weakref.finalize(self, _teardown, self._state)

    # -- lifecycle ---------------------------------------------------------------

    def __enter__(self) -> SystemdContainer:
        try:
            self.boot()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pid1(self) -> int:
        if self._state.pid1 is None:
            raise ContainerError("container not booted")
        return self._state.pid1

    def boot(self) -> None:
        """Mount, start nspawn in its own session, wait for `is-system-running`."""
        t0 = time.monotonic()
        st = self._state
        st.root = tempfile.mkdtemp(prefix="sf-sdc-")
        self._mount(["-t", "tmpfs", "-o", "mode=0755", "tmpfs", st.root])
        for sub in ("u", "w", "m"):
            os.mkdir(os.path.join(st.root, sub))
        merged = os.path.join(st.root, "m")
        opts = f"lowerdir=/,upperdir={st.root}/u,workdir={st.root}/w"
        self._mount(["-t", "overlay", "overlay", "-o", opts, merged])
        st.log_path = os.path.join(st.root, "nspawn.log")
        cmd = [
            "systemd-nspawn",
            "-D",
            merged,
            f"--machine={self.name}",
            "-b",
            "--console=passive",
            "--register=no",
            "--keep-unit",
            "--link-journal=no",
            *(["--private-network"] if self.private_network else []),
            *(f"--bind-ro={b}" for b in self.binds_ro),
            # Arguments after the options go to the container's systemd.
            *self.init_args,
        ]
        st.cgroups = _own_cgroups(self.name)
        if st.cgroups:
            # nspawn starts in the container's own cgroups (see the module's docstring).
            enter = 'for d in $CGS; do echo $$ > "$d/cgroup.procs" || exit 1; done; exec "$@"'
            cmd = ["env", f"CGS={' '.join(map(str, st.cgroups))}", "sh", "-c", enter, "sh", *cmd]
        with open(st.log_path, "wb") as log:
            st.nspawn = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = t0 + self.boot_timeout
        st.pid1 = self._find_pid1(deadline)
        self._wait_running(deadline)
        self.boot_seconds = time.monotonic() - t0

    def close(self) -> None:
        """Tear down; safe to call twice."""
        self._finalizer()

    def _mount(self, args: list[str]) -> None:
        target = args[-1]
        r = subprocess.run(["mount", *args], capture_output=True, text=True)
        if r.returncode != 0:
            raise ContainerError(f"mount {' '.join(args)} failed: {r.stderr.strip()}")
        self._state.mounted.append(target)

    def _nspawn_log(self) -> str:
        if self._state.log_path is None:
            return ""
        try:
            return Path(self._state.log_path).read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def _find_pid1(self, deadline: float) -> int:
        """The container's init: the child of nspawn whose executable is systemd."""
        nspawn = self._state.nspawn
        assert nspawn is not None
        while time.monotonic() < deadline:
            if nspawn.poll() is not None:
                raise ContainerError(
                    f"systemd-nspawn exited with {nspawn.returncode}:\n{self._nspawn_log()}"
                )
            for entry in os.listdir("/proc"):
                if not entry.isdigit():
                    continue
                try:
                    status = Path(f"/proc/{entry}/status").read_text()
                    exe = os.readlink(f"/proc/{entry}/exe")
                except OSError:
                    continue
                ppid = next(
                    (ln.split()[1] for ln in status.splitlines() if ln.startswith("PPid:")), ""
                )
                if ppid == str(nspawn.pid) and exe.endswith("/systemd/systemd"):
                    return int(entry)
            time.sleep(0.05)
        raise ContainerError(f"no container PID 1 within the boot timeout:\n{self._nspawn_log()}")

    def _wait_running(self, deadline: float) -> None:
        last = ""
        while time.monotonic() < deadline:
            left = max(1.0, deadline - time.monotonic())
            r = self.run(["systemctl", "is-system-running", "--wait"], check=False, timeout=left)
            state = r.stdout.strip()
            if state in ("running", "degraded"):
                if state == "degraded":
                    failed = self.run(
                        ["systemctl", "--failed", "--no-legend", "--plain"], check=False
                    )
                    print(
                        f"container {self.name} degraded; failed units:\n{failed.stdout}",
                        file=sys.stderr,
                    )
                return
            last = f"state={state!r} stderr={r.stderr.strip()!r}"
            time.sleep(0.1)  # the bus may not be up yet: systemctl fails at once then
        raise ContainerError(
            f"container {self.name} did not finish booting: {last}\n{self._nspawn_log()}"
        )

    # -- inside ------------------------------------------------------------------

    def run(
        self,
        cmd: Sequence[str],
        *,
        check: bool = True,
        timeout: float = 60.0,
        input: str | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run `cmd` inside the container as root, with a clean environment (+ `env`).

        Raises ContainerError when `check` and it exits non-zero (output in the message).
        """
        envs = {"PATH": _PATH, "HOME": "/root", "LANG": "C.UTF-8", **(env or {})}
        full = [
            *_nsenter(self.pid1),
            "/usr/bin/env",
            "-i",
            *(f"{k}={v}" for k, v in envs.items()),
            *cmd,
        ]
        try:
            r = subprocess.run(full, capture_output=True, text=True, timeout=timeout, input=input)
        except subprocess.TimeoutExpired as exc:
            raise ContainerError(
                f"timed out after {timeout}s in {self.name}: {shlex.join(cmd)}"
            ) from exc
        if check and r.returncode != 0:
            raise ContainerError(
                f"exit {r.returncode} in {self.name}: {shlex.join(cmd)}\n"
                f"--- stdout\n{r.stdout}--- stderr\n{r.stderr}"
            )
        return r

    def sh(self, script: str, **kw: object) -> subprocess.CompletedProcess[str]:
        """Run a shell script inside (`sh -c`)."""
        return self.run(["sh", "-c", script], **kw)  # type: ignore[arg-type]  # run()'s kwargs

    def write_file(self, path: str, text: str, mode: int = 0o644) -> None:
        """Write a file inside the container (through its own mount namespace, so /run works)."""
        self.run(
            [
                "sh",
                "-c",
                'mkdir -p "$(dirname "$1")" && cat > "$1" && chmod "$2" "$1"',
                "sh",
                path,
                oct(mode)[2:],
            ],
            input=text,
        )

    def copy_in(self, host_path: str | Path, path: str) -> None:
        """Copy a host file or folder (recursively) to `path` inside the container."""
        src = Path(host_path)
        if src.is_dir():
            tar = subprocess.run(
                ["tar", "-C", str(src), "-cf", "-", "."], capture_output=True, check=True
            )
            r = subprocess.run(
                [
                    *_nsenter(self.pid1),
                    "sh",
                    "-c",
                    'mkdir -p "$1" && tar -C "$1" -xf -',
                    "sh",
                    path,
                ],
                input=tar.stdout,
                capture_output=True,
            )
            if r.returncode != 0:
                raise ContainerError(
                    f"copy_in {src} -> {path}: {r.stderr.decode(errors='replace')}"
                )
        else:
            self.write_file(path, src.read_text(), mode=src.stat().st_mode & 0o777)

    def journal(self, unit: str | None = None, lines: int | None = None) -> str:
        """journald's text inside the container (all of it, or one unit's)."""
        cmd = ["journalctl", "--no-pager", "-o", "short-precise"]
        if unit:
            cmd += ["-u", unit]
        if lines:
            cmd += ["-n", str(lines)]
        r = self.run(cmd, check=False, timeout=30)
        return r.stdout + r.stderr


@contextlib.contextmanager
def booted(**kw: object) -> Iterator[SystemdContainer]:
    """Boot a container (skipping when the machine cannot) and always tear it down."""
    require_or_skip()
    with SystemdContainer(**kw) as c:  # type: ignore[arg-type]  # the fixture's kwargs
        print(f"container {c.name} booted in {c.boot_seconds:.2f}s", file=sys.stderr)
        yield c
