"""I/O: the agent's `status` over its control socket, read-only (the one command the
batch service sends): which workers serve now, for `capacity`. The agent being down or
the socket unreadable is not an error here: the runner keeps the last figure it had.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from sglang_farm.control.client import Client
from sglang_farm.errors import ClientError


class FarmStatus:
    def __init__(self, socket_path: str, *, timeout: float = 5.0) -> None:
        self._client = Client(socket_path, timeout=timeout)
        self.last_error: str | None = None

    def _read(self) -> Mapping[str, object] | None:
        try:
            got = self._client.call("status")
        except (ClientError, OSError) as exc:
            self.last_error = str(exc)
            return None
        self.last_error = None
        return got if isinstance(got, dict) else None

    async def read(self) -> Mapping[str, object] | None:
        """The status answer, or None (the reason in `last_error`)."""
        return await asyncio.to_thread(self._read)
