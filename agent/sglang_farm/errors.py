"""Pure: the farm's error tree. Adapters translate foreign errors into these with `raise ... from`.

FarmError
├── ConfigError        a config file that does not validate (all problems at once)
├── ProtocolError      a control-socket request or reply that does not parse
├── RuntimeFailure     systemd or a child process refused an operation
├── ProbeError         the doctor's environment probe could not run or gave no result
├── ControlSocketError the control socket could not be created
├── ClientError        farmctl's client: AgentUnreachable, SocketPermissionDenied, AgentError
├── AgentCrashed       a task the farm cannot run without failed: the agent stopped
└── GatewayError       the gateway refused or did not answer (gateway/)

(`control.codec.RequestError` is a ProtocolError that carries the codec's typed error code.)
"""

from __future__ import annotations

import enum
from collections.abc import Sequence


class FarmError(Exception):
    """Base of every error the farm raises on purpose."""


class ConfigError(FarmError):
    """A config that does not validate. `problems` are complete, user-facing lines."""

    def __init__(self, source: str, problems: Sequence[str]) -> None:
        self.source = source
        self.problems = tuple(problems)
        n = len(self.problems)
        head = f"{source}: {n} problem{'s' if n != 1 else ''}"
        super().__init__("\n".join([head, *(f"  {p}" for p in self.problems)]))


class ProtocolError(FarmError):
    """A bad control-socket message; `code` is one of the protocol's error codes."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(f"{code}: {message}")


class RuntimeFailure(FarmError):
    """Starting, stopping or observing a worker failed in the runtime (systemd or process)."""


class ProbeError(FarmError):
    """The environment probe could not run or gave no result (the message says why)."""


class ControlSocketError(FarmError):
    """The control socket could not be created (path in use by a live agent, not a socket...)."""


class AgentCrashed(FarmError):
    """A task the farm cannot run without (the event pump, the ticker, a worker's watcher,
    the state writer) raised: the agent stopped rather than go on supervising nothing; the
    message names the task, the error and what happens next."""


class UntrustedFolder(FarmError):
    """A folder the agent would keep its state or socket in, or the config it would run
    from, could be another user's (`securepath`); the message names it, its owner and
    mode, and the fix."""


class ClientError(FarmError):
    """Base of what the client raises."""


class AgentUnreachable(ClientError):
    """No agent answers at the socket path (missing, refused, timed out, hung up)."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"cannot reach the agent at {path}: {reason}")


class SocketPermissionDenied(ClientError):
    """The socket file exists but this user may not open it (not in the group)."""

    def __init__(self, path: str) -> None:
        self.path = path
        super().__init__(f"permission denied on {path}")


class UntrustedSocket(ClientError):
    """The socket, or a folder on its way, could have been put there by another user."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(reason)


class AgentError(ClientError):
    """The agent answered with an error reply."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(f"{code}: {message}")


class GatewayErrorCode(enum.StrEnum):
    UNREACHABLE = "unreachable"  # no connection, or no answer in time
    UNAUTHORIZED = "unauthorized"  # 401/403: the farm's key is missing or wrong
    REFUSED = "refused"  # any other error status for a membership change
    TIMEOUT = "timeout"  # accepted, but not confirmed within the bound
    PROTOCOL = "protocol"  # an answer this adapter cannot read


class GatewayError(FarmError):
    """The gateway could not be reached, refused a change, or did not confirm it in time.

    `gateway` is the gateway's base URL; the message says what happened there and what
    to do. It never contains a credential.
    """

    def __init__(self, gateway: str, code: GatewayErrorCode, message: str) -> None:
        self.gateway = gateway
        self.code = code
        self.message = message
        super().__init__(f"gateway {gateway}: {message}")
