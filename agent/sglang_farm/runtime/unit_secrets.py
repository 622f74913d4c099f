"""Pure: the workers' secret files: the config's environment and the API key, rendered
for root-only files beside the state (what the drop-ins' `EnvironmentFile=` and
`LoadCredential=` name), never into a world-readable unit. `runtime.unit_files` writes them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import PurePosixPath

from sglang_farm.runtime.unit_syntax import HEADER_PREFIX
from sglang_farm.sglang.argv import Command, build_command
from sglang_farm.spec import FarmSpec

CREDENTIALS_SUBDIR = "credentials"


def credentials_dir(spec: FarmSpec) -> PurePosixPath:
    """The root-only folder of the workers' secret files: `<state_dir>/credentials`.

    Under the state directory, not /run: a worker restarted by hand (`systemctl restart
    sglang@3`) while the agent is stopped still finds them (the agent's runtime
    directory is removed when it stops).
    """
    return PurePosixPath(spec.farm.state_dir) / CREDENTIALS_SUBDIR


def env_file_path(spec: FarmSpec, worker_id: int) -> PurePosixPath:
    """The worker's `EnvironmentFile=`: the config's environment variables, mode 0600."""
    return credentials_dir(spec) / f"sglang@{worker_id}.env"


def key_file_path(spec: FarmSpec, worker_id: int) -> PurePosixPath:
    """The worker's API key (its `LoadCredential=` source), mode 0600."""
    return credentials_dir(spec) / f"sglang@{worker_id}.api-key"


def env_file_text(pairs: Iterable[tuple[str, str]]) -> str:
    """An `EnvironmentFile=` text that sets each pair exactly.

    Every value is double-quoted, with `\\`, `"`, `$` and backtick escaped by a
    backslash (systemd's env-file parser takes those escapes inside double quotes, and
    a newline there literally). Raises ValueError for a NUL, or a name systemd would
    not read back.
    """
    out = [f"{HEADER_PREFIX}, do not edit: the agent rewrites it from the config."]
    for key, value in pairs:
        plain = all(ch.isascii() and (ch.isalnum() or ch == "_") for ch in key)
        if not key or not plain or key[0].isdigit():
            raise ValueError(f"bad environment variable name {key!r}")
        if "\0" in value:
            raise ValueError(f"{key}: a NUL byte cannot be passed to a process by systemd")
        escaped = "".join("\\" + ch if ch in '\\"$`' else ch for ch in value)
        out.append(f'{key}="{escaped}"')
    return "\n".join(out) + "\n"


def render_secrets(
    spec: FarmSpec, commands: Mapping[int, Command] | None = None
) -> dict[str, bytes]:
    """The workers' secret files, by name inside `credentials_dir(spec)`: for each worker
    with config environment its env file, with an API key its key file (the key exactly,
    no newline). What the drop-ins' EnvironmentFile=/LoadCredential= name. `commands`:
    what each worker runs (`worker_commands`); a worker absent runs its configured flags."""
    files: dict[str, bytes] = {}
    runs = commands or {}
    for worker in spec.workers:
        cmd = runs.get(worker.id) or build_command(spec.farm, worker)
        if cmd.private_env:  # the command's own config variables (`Command.public_env`)
            files[env_file_path(spec, worker.id).name] = env_file_text(cmd.private_env).encode()
        if cmd.api_key is not None:
            files[key_file_path(spec, worker.id).name] = cmd.api_key.encode()
    return dict(sorted(files.items()))
