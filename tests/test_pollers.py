"""The worker pollers send a worker's API key, which SGLang's /v1/loads requires (#4)."""

from __future__ import annotations

import asyncio
import contextlib
import sys

from sglang_farm.config import load_spec
from sglang_farm.pollers import worker_api_key
from sglang_farm.workerstats import WorkerSample

TOML = f"""
[farm]
python = "{sys.executable}"
module = "sglang_farm.sim"
[workers]
gpus = [0, 1]
host = "127.0.0.1"
base_port = 30000
[workers.overrides.1]
sglang = {{ api_key = "k-worker-1" }}
[metrics]
gpu_source = "none"
[sglang]
model_path = "sim/model"
"""


def test_the_poller_sends_the_key_a_worker_was_started_with() -> None:
    spec = load_spec(TOML, source="t.toml")
    assert worker_api_key(spec, 1) == "k-worker-1"
    assert worker_api_key(spec, 0) is None
    assert worker_api_key(spec, 7) is None  # not (or no longer) a worker of this farm


def test_a_poll_loop_cancelled_while_polls_wait_their_turn_leaves_no_unawaited_poll() -> None:
    """Polls are spread over the interval; the agent stopping meanwhile cancels the wait.
    A poll made before its turn would be a coroutine never awaited (a RuntimeWarning at
    garbage collection, blamed on whatever runs then)."""
    import gc
    import warnings

    from sglang_farm.pollers import _after

    made: list[int] = []

    async def poll() -> WorkerSample:
        made.append(1)
        raise AssertionError("not reached")

    async def scenario() -> None:
        task = asyncio.ensure_future(_after(30.0, poll))
        await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(scenario())
        gc.collect()
    assert made == []
    assert not [w for w in caught if "never awaited" in str(w.message)]
