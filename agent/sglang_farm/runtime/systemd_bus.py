"""I/O: the blocking pystemd calls the systemd runtime and its watcher share.

Property reads (`get_all`, `read_state`: reading a unit's object path loads it if
needed), the worker units' listing (`list_units`), D-Bus names and an error's text.
Each call runs on the thread that owns `bus` (sd-bus connections are not thread-safe):
the runtime's command thread or the watcher's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pystemd.dbuslib import apply_signature, path_encode
from pystemd.systemd1 import Manager

from sglang_farm.runtime.unit_state import UnitState, unit_state_from

DEST = b"org.freedesktop.systemd1"
MANAGER_PATH = b"/org/freedesktop/systemd1"
MANAGER_IFACE = b"org.freedesktop.systemd1.Manager"
UNIT_PREFIX_PATH = b"/org/freedesktop/systemd1/unit"
PROPS_IFACE = b"org.freedesktop.DBus.Properties"
UNIT_IFACE = b"org.freedesktop.systemd1.Unit"
SERVICE_IFACE = b"org.freedesktop.systemd1.Service"


def unit_path(unit: str) -> bytes:
    return bytes(path_encode(UNIT_PREFIX_PATH, unit.encode()))


def _decode_keys(d: Any) -> dict[str, Any]:
    if not isinstance(d, dict):
        return {}
    return {(k.decode() if isinstance(k, bytes) else str(k)): v for k, v in d.items()}


def get_all(bus: Any, unit: str, iface: bytes) -> dict[str, Any]:
    # Reading a unit's object path loads the unit if needed (systemd's bus_unit_find),
    # so this works for units not loaded yet: they read as inactive/dead.
    reply = bus.call_method(
        DEST, unit_path(unit), PROPS_IFACE, b"GetAll", apply_signature(b"s", [iface])
    )
    return _decode_keys(reply.body)


def read_state(bus: Any, unit: str) -> UnitState:
    return unit_state_from(get_all(bus, unit, UNIT_IFACE), get_all(bus, unit, SERVICE_IFACE))


def list_units(bus: Any, prefix: str, states: Iterable[str] = ()) -> list[str]:
    manager = Manager(bus=bus)
    manager.load()
    rows = manager.Manager.ListUnitsByPatterns(
        [s.encode() for s in states], [f"{prefix}@*.service".encode()]
    )
    return [r[0].decode() if isinstance(r[0], bytes) else str(r[0]) for r in rows]


def dbus_error_text(exc: BaseException) -> str:
    return str(exc).strip() or exc.__class__.__name__
