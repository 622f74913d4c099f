"""A give-up bound for async tests: wait until a condition holds on the running loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def wait_until(pred: Callable[[], bool], timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "timed out waiting"
        await asyncio.sleep(0.02)
