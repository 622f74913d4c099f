"""The worker pollers send a worker's API key, which SGLang's /v1/loads requires (#4)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Coroutine
from typing import Any

from sglang_farm.config import load_spec
from sglang_farm.metrics.pollers import worker_api_key
from sglang_farm.workers.load import WorkerSample

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
    import dataclasses
    import gc
    import warnings

    from metrics_fixtures import farm
    from sglang_farm.farm_view import Phase
    from sglang_farm.metrics import pollers

    made: list[int] = []

    def poll_worker(*_args: object, worker: int, **_kw: object) -> Coroutine[Any, Any, Any]:
        made.append(worker)

        async def never() -> WorkerSample:
            await asyncio.sleep(3600)
            raise AssertionError("not reached")

        return never()

    view = farm()
    view = dataclasses.replace(
        view, workers=tuple(dataclasses.replace(w, phase=Phase.READY) for w in view.workers)
    )
    spec = load_spec(TOML, source="t.toml")

    async def scenario() -> None:
        polling = pollers.MetricPollers(spec, None, view, poll=poll_worker)
        loop = asyncio.ensure_future(polling._worker_loop())
        await asyncio.sleep(0.05)  # the first poll's turn has come; the others' (0.6 s apart) not
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(scenario())
        gc.collect()
    assert made == [view.workers[0].id]
    assert not [w for w in caught if "never awaited" in str(w.message)]
