"""I/O: a managed gateway's admin key that may have reached another process is replaced.

`gateway.listener.ListenerGuard` calls `KeyRotation.exposed` when the gateway's port
changed hands while a request carrying the key ran, or is first found held by another
process, which may have been sent the key before (issue 30, item 3). The key the agent
generated (`<state_dir>/gateway-admin.key`, no `[gateway] admin_key_file`) is then
replaced at once: a new key in the file (`adminkey.rotate_admin_key`), the farm's
client sends it from then on, and smg is restarted (the process runtime's child, or
the systemd unit: smg, and systemd's `LoadCredential=`, read the key only at start).
A key file the operator configured is theirs (Ansible or a vault puts it back): the
agent cannot replace it, and says so in the log (`gateway_admin_key_exposed`) with what
to do.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import structlog

from sglang_farm.errors import FarmError
from sglang_farm.gateway.adminkey import rotate_admin_key

log = structlog.get_logger("sglang_farm.gateway.rotation")


class Restartable(Protocol):
    async def restart(self) -> None: ...


class KeyRotation:
    """Replaces the generated admin key (`generated`: its file, or None when the operator
    configured one) and restarts the gateway that reads it."""

    def __init__(
        self,
        url: str,
        generated: Path | None,
        runner: Restartable,
        set_key: Callable[[str], None],
    ) -> None:
        self._url = url
        self._file = generated
        self._runner = runner
        self._set_key = set_key
        self._running: asyncio.Task[None] | None = None
        self._again = False
        self.rotations = 0  # how many times the key was replaced (tests)

    def exposed(self, why: str) -> None:
        """The key may have reached another process (`why`): replace it, once at a time."""
        # A registration carries the worker's own key ([sglang] api_key), which only the
        # config can change: said, never rotated here.
        also = (
            {
                "worker_key": "a registration (POST /workers) carries the worker's api_key: "
                "change it in the config and reload"
            }
            if "POST /workers" in why
            else {}
        )
        if self._file is None:
            log.error(
                "gateway_admin_key_exposed",
                gateway=self._url,
                why=why,
                **also,
                hint="the admin key may be known to another local user: write a new key "
                "into [gateway] admin_key_file, then restart the agent and the gateway "
                "(systemctl restart sglang-farm sglang-farm-gateway)",
            )
            return
        log.warning(
            "gateway_admin_key_exposed", gateway=self._url, why=why, action="replacing it", **also
        )
        if self._running is not None and not self._running.done():
            self._again = True
            return
        self._running = asyncio.get_running_loop().create_task(
            self._rotate(), name=f"sf-gateway-rotate {self._url}"
        )

    async def _rotate(self) -> None:
        assert self._file is not None
        while True:
            self._again = False
            try:
                key = await asyncio.to_thread(rotate_admin_key, self._file)
            except FarmError as exc:
                log.error("gateway_admin_key_not_rotated", gateway=self._url, error=str(exc))
                return
            self._set_key(key)
            self.rotations += 1
            try:
                await self._runner.restart()
            except FarmError as exc:
                log.error("gateway_not_restarted", gateway=self._url, error=str(exc))
            log.warning(
                "gateway_admin_key_rotated",
                gateway=self._url,
                file=str(self._file),
                what="a new admin key; the gateway restarted to read it",
            )
            if not self._again:
                return

    async def close(self) -> None:
        """The agent is going away: a rotation under way is cancelled (its key file is
        whole either way: written beside it and renamed over it)."""
        if self._running is not None and not self._running.done():
            self._running.cancel()
            await asyncio.gather(self._running, return_exceptions=True)

    async def wait(self) -> None:
        """Until a rotation under way is done (tests, shutdown)."""
        if self._running is not None:
            await asyncio.gather(self._running, return_exceptions=True)
