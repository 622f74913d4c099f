"""I/O: the managed gateway as its own systemd unit (the systemd runtime's counterpart
of `gateway_child`): started over D-Bus, run and restarted by systemd.
"""

from __future__ import annotations

import asyncio

from pystemd.dbusexc import DBusBaseError
from pystemd.dbuslib import DBus
from pystemd.systemd1 import Manager

from sglang_farm.errors import RuntimeFailure
from sglang_farm.runtime.systemd_bus import dbus_error_text, read_state
from sglang_farm.runtime.unit_procs import unit_pids
from sglang_farm.runtime.unit_syntax import GATEWAY_UNIT


class UnitGateway:
    """The managed gateway as its own unit, `sglang-farm-gateway.service` (rendered into
    /run/systemd/system with the workers' drop-ins): systemd runs and restarts it, and it
    outlives the agent like the workers do."""

    def __init__(self, unit: str = GATEWAY_UNIT) -> None:
        self.unit = unit

    async def start(self) -> None:
        await asyncio.to_thread(self._start)

    def _start(self) -> None:
        try:
            with Manager() as m:
                m.Manager.StartUnit(self.unit.encode(), b"replace")
        except DBusBaseError as exc:
            raise RuntimeFailure(
                f"cannot start {self.unit}: {dbus_error_text(exc)}; "
                f"see `systemctl status {self.unit}`"
            ) from exc

    async def restart(self) -> None:
        """Restart the unit (a rotated admin key: systemd's LoadCredential= reads the
        file at the unit's start, and smg reads its key only at its start)."""
        await asyncio.to_thread(self._restart)

    def _restart(self) -> None:
        try:
            with Manager() as m:
                m.Manager.RestartUnit(self.unit.encode(), b"replace")
        except DBusBaseError as exc:
            raise RuntimeFailure(
                f"cannot restart {self.unit}: {dbus_error_text(exc)}; "
                f"see `systemctl status {self.unit}`"
            ) from exc

    async def pids(self) -> frozenset[int]:
        """The processes of the unit's cgroup (empty when it does not run), whose sockets
        alone may be sent the admin key (`gateway.listener`)."""
        return await asyncio.to_thread(self._pids)

    def _pids(self) -> frozenset[int]:
        try:
            with DBus() as bus:
                state = read_state(bus, self.unit)
        except DBusBaseError:
            return frozenset()
        if not state.running:
            return frozenset()
        return unit_pids(state.main_pid, self.unit)

    async def close(self) -> None:
        """Nothing: the unit keeps routing while the agent restarts."""
