"""I/O: the connection every verb talks through (`Ctl`, handed down as `ctx.obj`), and the
client's errors as farmctl's messages and exit codes: the agent not answering (with how
to start it), the socket refused, the agent's own refusals.

Apart from the verbs because all of them call through it and its wording of an
unreachable agent is the same whichever verb met it.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import click

from sglang_farm.cli.ctl.exits import BadUsage, Failed, FarmctlError, Unreachable
from sglang_farm.control import wire
from sglang_farm.control.client import Client
from sglang_farm.control.wire import Reply
from sglang_farm.errors import (
    AgentError,
    AgentUnreachable,
    SocketPermissionDenied,
    UntrustedSocket,
)
from sglang_farm.host.paths import DEFAULT_CONFIG_PATH, DEFAULT_SOCKET


def farmctl_version() -> str:
    """farmctl's version, looked up only by the commands that print it (importlib.metadata
    costs ~30 ms, a third of a `farmctl status`)."""
    from sglang_farm import __version__

    return __version__


def start_hint(config: str | None, *, default_socket: bool = False) -> str:
    """How to start the agent that `--config` names: the systemd service runs only the
    packaged /etc/sglang-farm/farm.toml; any other file is a farm run by hand (the demo's
    own script for the shipped demo)."""
    if config is None and default_socket:
        # Issue 31: a farm run by hand (a checkout's demo) is not at the default socket.
        return (
            "is sglang-farm running? (systemctl status sglang-farm); a farm run by hand "
            "is reached through its config: farmctl --config FILE (the demo's: "
            "farmctl --config etc/sglang-farm/demo.toml status)"
        )
    if config is None or os.path.abspath(config) == DEFAULT_CONFIG_PATH:
        return "is sglang-farm running? (systemctl status sglang-farm)"
    import shlex  # only when --config is given

    run = f"sglang-farm run --config {shlex.quote(config)} --runtime process"
    if os.path.basename(config) == "demo.toml":
        return f"is the demo running? start it with ./scripts/demo (or {run})"
    return f"is its farm running? start it with: {run}"


def _unreachable(exc: AgentUnreachable, config: str | None, socket: str) -> FarmctlError:
    return Unreachable(f"{exc}; {start_hint(config, default_socket=socket == DEFAULT_SOCKET)}")


def _denied(exc: SocketPermissionDenied) -> FarmctlError:
    return Failed(
        f"permission denied on {exc.path}: only root and members of the farm's group "
        "(default sglang-farm) may use farmctl; use sudo or ask for 'usermod -aG sglang-farm'"
    )


def _agent_error(cmd: str, exc: AgentError, as_json: bool) -> FarmctlError:
    if as_json:
        click.echo(json.dumps({"ok": False, "error": {"code": exc.code, "message": exc.message}}))
    cls = BadUsage if exc.code in ("unknown_worker", "bad_request") else Failed
    if exc.code == "unknown_command":
        return cls(
            f"the agent does not know {cmd}: it is older than this farmctl ({farmctl_version()}); "
            "upgrade sglang-farm and restart it (systemctl restart sglang-farm)"
        )
    what = {
        "forbidden": f"{cmd} refused",
        "busy": f"{cmd} refused (busy)",
        wire.FAILED: f"{cmd} failed",
        "unknown_worker": f"{cmd}",
    }.get(exc.code, f"{cmd} failed ({exc.code})")
    return cls(f"{what}: {exc.message}")


class Ctl:
    """What the root command hands to its subcommands (`ctx.obj`).

    A plain class: `dataclasses` costs farmctl ~10 ms at import (issue 17).
    """

    __slots__ = ("as_json", "client", "config", "socket")

    def __init__(self, socket: str, as_json: bool, config: str | None = None) -> None:
        self.socket = socket
        self.as_json = as_json
        self.config = config
        self.client = Client(socket)

    def call(
        self, cmd: str, args: Mapping[str, object] | None = None, *, timeout: float | None = None
    ) -> Any:
        with self._errors(cmd):
            return self.client.call(cmd, args, timeout=timeout)

    def query(
        self, cmd: str, args: Mapping[str, object] | None = None, *, timeout: float | None = None
    ) -> Any:
        """`call`, and with --json print the raw result and return None (nothing to format)."""
        res = self.call(cmd, args, timeout=timeout)
        if self.as_json:
            self.emit_json(res)
            return None
        return res

    def stream(
        self, cmd: str, args: Mapping[str, object] | None = None, *, timeout: float | None = None
    ) -> Iterator[Reply]:
        with self._errors(cmd):
            yield from self.client.stream(cmd, args, timeout=timeout)

    @contextlib.contextmanager
    def _errors(self, cmd: str) -> Iterator[None]:
        """The client's errors as farmctl's messages and exit codes."""
        try:
            yield
        except AgentUnreachable as exc:
            raise _unreachable(exc, self.config, self.socket) from None
        except SocketPermissionDenied as exc:
            raise _denied(exc) from None
        except UntrustedSocket as exc:  # its message says what and what to do
            raise Failed(str(exc)) from None
        except AgentError as exc:
            raise _agent_error(cmd, exc, self.as_json) from None

    def emit_json(self, obj: object) -> None:
        click.echo(json.dumps(obj, indent=None if isinstance(obj, dict) and "stream" in obj else 2))


_pass_ctl = click.make_pass_decorator(Ctl)


def _json_after_subcommand(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    # The subcommand's options are parsed after the group's callback made the Ctl.
    ctl = ctx.find_object(Ctl)
    if value and ctl is not None:
        ctl.as_json = True


def pass_ctl(f: Callable[..., Any]) -> Callable[..., Any]:
    """`make_pass_decorator(Ctl)`, plus the subcommand's own `--json`.

    `farmctl status --json` and `farmctl --json status` are the same: the group's
    option is kept for scripts that have it, the subcommand's is how people type it.
    """
    option = click.option(
        "--json",
        is_flag=True,
        expose_value=False,
        callback=_json_after_subcommand,
        help="Print the agent's raw results as JSON (same as farmctl --json).",
    )
    return option(_pass_ctl(f))
