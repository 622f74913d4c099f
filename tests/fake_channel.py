"""A fake stream channel of the control socket: records what a handler streams, and plays
the client hanging up. Shared by the handlers' tests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping


class Channel:
    """Records stream messages; `leave()` plays the client hanging up."""

    def __init__(self) -> None:
        self.streamed: list[tuple[str, dict[str, object]]] = []
        self._gone = asyncio.Event()

    async def stream(self, kind: str, payload: Mapping[str, object]) -> None:
        self.streamed.append((kind, dict(payload)))

    async def hangup(self) -> None:
        await self._gone.wait()

    def leave(self) -> None:
        self._gone.set()
