"""I/O: the keys the farm's own calls to its gateway use, from the files `[gateway]` names.

A managed gateway always has an admin key, or smg leaves its worker API open to every
local user: the configured file, else one generated in the state directory at first
start (root-only; `gateway.adminkey`). The launcher and, under systemd, the unit's
LoadCredential= read that same file. With an external gateway the farm's own calls use
the control-plane key, else the shared one (smg accepts it on /workers when no
control-plane key is set). Every file is read as root reads what it trusts
(`gateway.keyfile`).
"""

from __future__ import annotations

from pathlib import Path

from sglang_farm.gateway.adminkey import ensure_admin_key
from sglang_farm.gateway.keyfile import read_gateway_key
from sglang_farm.gateway.managed import admin_key_path
from sglang_farm.spec import GatewaySpec


def read_key(path: str | None, what: str) -> str | None:
    """A key from a root-only file named in [gateway] (`gateway.keyfile`: refused when
    another user could read or replace it); None when the config names none."""
    if path is None:
        return None
    return read_gateway_key(path, what)


def managed_admin_key(g: GatewaySpec, state_dir: str) -> tuple[str, str | None]:
    """A managed gateway's admin key file and its key: the configured file, else the one
    generated in `state_dir` (made at the first start)."""
    admin_file = admin_key_path(g.admin_key_file, state_dir)
    if g.admin_key_file is None:
        return admin_file, ensure_admin_key(Path(admin_file))
    return admin_file, read_key(g.admin_key_file, "admin_key_file")


def external_key(g: GatewaySpec) -> str | None:
    """The key of the farm's own calls to an external gateway: the control-plane key, else
    the shared one; None when the config names neither."""
    return read_key(g.admin_key_file, "admin_key_file") or read_key(g.api_key_file, "api_key_file")
